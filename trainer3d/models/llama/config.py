"""Llama 3's shape and formulas (also the dense Qwen/Mistral/DeepSeek shape that shares its parts), and the published
Llama 3.1/3.2 sizes (Grattafiori et al. 2024; the Hugging Face config.json files), plus a tiny one for CPU runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.interface import LayerActivations
from trainer3d.models.moe import MoESpec


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int = 128256
    n_positions: int = 131072  # the context (rotary positions have no table; the check on --seq-len reads it)
    n_embd: int = 4096
    n_layer: int = 32
    n_head: int = 32
    dropout: float = 0.0  # on the attention probabilities (HF's attention_dropout); Llama has no other dropout
    n_kv_heads: int = 8  # grouped-query attention: query heads share n_head / n_kv_heads key/value heads
    ffn_hidden: int = 14336  # SwiGLU's width
    explicit_head_dim: int | None = None  # HF's head_dim where it is not n_embd // n_head (None in Llama 3)
    norm_eps: float = 1e-5
    rope_theta: float = 500000.0
    # Llama 3.1's rescaling of the rotary frequencies (rope_type "llama3"); rope_factor None: plain RoPE
    rope_factor: float | None = 8.0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_original_context: int = 8192
    tie_embeddings: bool = False

    family: ClassVar[str] = "llama"
    qk_norm: ClassVar[bool] = False  # an RMSNorm over head_dim on q and on k, before the rotation (Qwen3)

    @property
    def head_dim(self) -> int:
        return self.explicit_head_dim or self.n_embd // self.n_head

    @property
    def rotary_dim(self) -> int:
        """The leading dims of each head that rotary positions rotate (all of them; Qwen3.5 rotates a share)."""
        return self.head_dim

    @property
    def q_width(self) -> int:
        return self.n_head * self.head_dim

    @property
    def kv_width(self) -> int:
        return self.n_kv_heads * self.head_dim

    @property
    def moe(self) -> MoESpec | None:
        """The MoE layers' shape and routing (families with experts: qwen3, mixtral); None: every MLP is dense."""
        return None

    def is_moe_layer(self, layer: int) -> bool:
        return False

    @property
    def moe_layers(self) -> list[int]:
        return [i for i in range(self.n_layer) if self.is_moe_layer(i)]

    # ---- formulas: parameters and FLOPs per block (an MoE block counts all its experts, or the k a token uses) ----
    def attention_params(self) -> int:
        d = self.n_embd
        return d * (self.q_width + 2 * self.kv_width) + self.q_width * d + (2 * self.head_dim if self.qk_norm else 0)

    def mlp_params(self, layer: int, active: bool = False) -> int:
        d, spec = self.n_embd, self.moe
        if not self.is_moe_layer(layer):
            return 3 * d * self.ffn_hidden
        experts = spec.top_k if active else spec.n_experts
        return spec.n_experts * d + experts * 3 * d * spec.expert_hidden + 3 * d * spec.shared_hidden

    def block_params(self, layer: int | None = None, active: bool = False) -> int:
        """One block's parameters (`layer` None: the mean over the blocks, rounded); `active`: a token's (k experts)."""
        if layer is None:
            return round(sum(self.block_params(i, active) for i in range(self.n_layer)) / self.n_layer)
        return self.attention_params() + self.mlp_params(layer, active) + 2 * self.n_embd

    def num_params(self, include_embedding: bool = True, active: bool = False) -> int:
        d, V = self.n_embd, self.vocab_size
        n = sum(self.block_params(i, active) for i in range(self.n_layer)) + d  # + final RMSNorm
        if include_embedding:
            n += V * d * (1 if self.tie_embeddings else 2)
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per matmul parameter a token uses (the head included, the embedding lookup
        excluded; an MoE layer's router and its k experts) plus attention's QK^T and AV over the query heads,
        12·L·(Hq·hd)·T (the Llama 3 paper's and Megatron's count)."""
        matmul_params = sum(self.block_params(i, active=True) for i in range(self.n_layer)) + self.vocab_size * self.n_embd
        return 6.0 * matmul_params + 12.0 * self.n_layer * self.q_width * seq_len

    def layer_flops(self, seq_len: int) -> float:
        return 2 * (self.block_params(active=True) - 2 * self.n_embd) + 4 * seq_len * self.q_width

    def head_flops(self) -> float:
        return 2 * self.n_embd * self.vocab_size

    def layer_activations(self) -> LayerActivations:
        """Two RMSNorms' inputs (residual dtype) and outputs (matmul inputs) and rstd; SDPA's q and k (after the
        rotation), v and output, o_proj's input, gate and up, silu(gate) and the product (down's input): by head or by
        column; the log-sum-exp per query head. An MoE block (the mean over blocks), as its saved tensors measure
        (tests/test_plan.py): the router's input (the second norm's output, fp32, in place of the MLP's matmul-dtype
        input) and scores, the top-k weights and their sum (fp32), four int64 indices per choice (two fp32 each), and
        each token's k copies through the experts (their input and gate|up, which models/moe._SwiGLUExperts saves,
        their output and weight, which the weighting saves); a rank's tokens are split over tp there, so they count as
        sharded."""
        h = self.n_embd
        attention = 2 * self.q_width + 2 * self.kv_width + self.q_width
        spec, share = self.moe, len(self.moe_layers) / self.n_layer
        mlp, matmul, fp32 = 4 * self.ffn_hidden * (1 - share), 2 * h, 0
        if spec is not None:
            k = spec.top_k
            matmul -= share * h
            mlp += share * k * (2 * h + 2 * spec.expert_hidden + 1)
            mlp += share * (h + 4 * spec.shared_hidden) if spec.shared_hidden else 0
            fp32 = share * (h + spec.n_experts + 1 + 9 * k)
        return LayerActivations(resid=2 * h, matmul=round(matmul), sharded_matmul=round(attention + mlp), fp32=2,
                                sharded_fp32=round(self.n_head + fp32))
