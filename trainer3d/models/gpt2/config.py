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
