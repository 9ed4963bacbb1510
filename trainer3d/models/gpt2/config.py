"""GPT-2's shape and formulas, and the published GPT-2 and GPT-3 sizes (a tiny one for CPU runs and tests)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.interface import LayerActivations


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    family: ClassVar[str] = "gpt2"
    tie_embeddings: ClassVar[bool] = True  # GPT-2's lm_head is wte
    moe: ClassVar[None] = None  # no mixture of experts (models/moe.py's MoESpec where a family has one)

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    @property
    def ffn_hidden(self) -> int:
        return 4 * self.n_embd

    @property
    def kv_width(self) -> int:
        """Width of the keys (and of the values) of a token: multi-head attention has as many as queries."""
        return self.n_embd

    def block_params(self) -> int:
        return 12 * self.n_embd**2 + 13 * self.n_embd  # qkv, proj, fc, proj weights and biases + 2 LayerNorms

    def num_params(self, include_embedding: bool = True) -> int:
        d, V, P = self.n_embd, self.vocab_size, self.n_positions
        n = self.n_layer * self.block_params() + 2 * d  # + final LayerNorm
        if include_embedding:
            n += V * d + P * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter touched by a token (all matmuls, the LM head included, the
        embedding lookups excluded) plus attention's QK^T and AV, 12·L·d·T (PaLM appendix B / Megatron)."""
        matmul_params = self.num_params(include_embedding=False) + self.vocab_size * self.n_embd
        return 6.0 * matmul_params + 12.0 * self.n_layer * self.n_embd * seq_len

    def layer_flops(self, seq_len: int) -> float:
        """Forward FLOPs per token of one block: its four matmuls and attention's two products."""
        return 24 * self.n_embd**2 + 4 * seq_len * self.n_embd

    def head_flops(self) -> float:
        return 2 * self.n_embd * self.vocab_size

    def layer_activations(self) -> LayerActivations:
        """Two LayerNorms' inputs (residual dtype) and outputs (matmul inputs), their mean and rstd; q, k, v, the
        attention output, the projection's input, the fc output and GELU's output (12h, by head or by column); the
        log-sum-exp per head. No s×s scores (SDPA never stores them), no dropout masks (dropout 0)."""
        h = self.n_embd
        return LayerActivations(resid=2 * h, matmul=2 * h, sharded_matmul=12 * h, fp32=4, sharded_fp32=self.n_head)


# The published GPT-2 family (Radford et al. 2019), a tiny one for CPU runs and tests, and the GPT-3 family.
PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_positions=256, n_embd=128, n_layer=4, n_head=4),
    "gpt2": GPTConfig(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": GPTConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPTConfig(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPTConfig(n_embd=1600, n_layer=48, n_head=25),
    # GPT-3 (Brown et al. 2020, Table 2.1), context 2048. Where the paper's heads do not divide d_model we keep its
    # d_head of 128 and choose the heads: 1.3B has 16 (paper: 24 heads of 128 on d_model 2048), 13B d_model 5120
    # (paper: 5140, not a multiple of its 40 heads).
    "gpt3-125m": GPTConfig(n_positions=2048, n_embd=768, n_layer=12, n_head=12),
    "gpt3-350m": GPTConfig(n_positions=2048, n_embd=1024, n_layer=24, n_head=16),
    "gpt3-760m": GPTConfig(n_positions=2048, n_embd=1536, n_layer=24, n_head=16),
    "gpt3-1.3b": GPTConfig(n_positions=2048, n_embd=2048, n_layer=24, n_head=16),
    "gpt3-2.7b": GPTConfig(n_positions=2048, n_embd=2560, n_layer=32, n_head=32),
    "gpt3-6.7b": GPTConfig(n_positions=2048, n_embd=4096, n_layer=32, n_head=32),
    "gpt3-13b": GPTConfig(n_positions=2048, n_embd=5120, n_layer=40, n_head=40),
    "gpt3-175b": GPTConfig(n_positions=2048, n_embd=12288, n_layer=96, n_head=96),
    # Megatron-LM's 1T model (Narayanan et al. 2021, Table 1)
    "megatron-1t": GPTConfig(n_positions=2048, n_embd=25600, n_layer=128, n_head=160),
}
