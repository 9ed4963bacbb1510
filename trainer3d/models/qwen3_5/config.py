"""Qwen3.5's shape: a hybrid stack whose every `full_attention_interval`-th block is gated full attention (Qwen3's
attention with an output gate, rotary positions on a share of each head, zero-centred norms) and every other block a
Gated DeltaNet (linear attention: a fixed-size state per value head, models/qwen3_5/delta_rule.py).

The formulas count the linear blocks by their chunked form (chunks of 64): per token and value head the intra-chunk
products (q·kᵀ and k_β·kᵀ over the chunk, the triangular solve, the chunk's attention over v), the state read and
update (three dk×dv products): linear in the length where attention's count grows with it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.interface import LayerActivations
from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.moe import MoESpec
from trainer3d.models.qwen3_5.delta_rule import CHUNK


@dataclass(frozen=True)
class Qwen35Config(LlamaConfig):
    partial_rotary_factor: float = 0.25  # rotary positions on this share of each full-attention head's dims
    full_attention_interval: int = 4  # block i is full attention iff (i + 1) % interval == 0 (transformers' rule)
    linear_conv_kernel: int = 4
    linear_key_heads: int = 16
    linear_value_heads: int = 32  # each key head serves value_heads / key_heads value heads
    linear_key_head_dim: int = 128
    linear_value_head_dim: int = 128
    # the experts (n_experts 0: dense): softmax top-k over routed experts plus a shared expert on every token, scaled
    # by sigmoid(shared_expert_gate(x)); every block's MLP is an MoE
    n_experts: int = 0
    top_k: int = 8
    moe_ffn_hidden: int = 512
    shared_expert_hidden: int = 512

    family: ClassVar[str] = "qwen3_5"
    qk_norm: ClassVar[bool] = True

    def is_linear(self, layer: int) -> bool:
        return (layer + 1) % self.full_attention_interval != 0

    def block_kind(self, layer: int) -> tuple[bool, bool]:
        """What makes two blocks' parameters alike (parallel/param_counts.py): their mixer and their MLP."""
        return self.is_linear(layer), self.is_moe_layer(layer)

    @property
    def rotary_dim(self) -> int:
        return int(self.head_dim * self.partial_rotary_factor)

    @property
    def key_width(self) -> int:
        return self.linear_key_heads * self.linear_key_head_dim

    @property
    def value_width(self) -> int:
        return self.linear_value_heads * self.linear_value_head_dim

    @property
    def conv_width(self) -> int:  # the convolution's channels: q | k | v
        return 2 * self.key_width + self.value_width

    @property
    def moe(self) -> MoESpec | None:
        if not self.n_experts:
            return None
        return MoESpec(self.n_experts, self.top_k, self.moe_ffn_hidden, renormalize=True,
                       shared_hidden=self.shared_expert_hidden, shared_gate=True)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_experts)

    # ---- formulas ----------------------------------------------------------------------------------------------
    def attention_params(self, layer: int = -1) -> int:
        """A full-attention block's q|gate, k, v, o and q/k norms; a linear block's projections (q|k|v, z, b, a),
        convolution, A_log and dt_bias, gated norm and out_proj."""
        d = self.n_embd
        if layer >= 0 and self.is_linear(layer):
            hv = self.linear_value_heads
            proj = d * (self.conv_width + self.value_width + 2 * hv) + self.value_width * d
            return proj + self.conv_width * self.linear_conv_kernel + 2 * hv + self.linear_value_head_dim
        return d * (2 * self.q_width + 2 * self.kv_width) + self.q_width * d + 2 * self.head_dim

    def mlp_params(self, layer: int, active: bool = False) -> int:
        params = super().mlp_params(layer, active)
        return params + self.n_embd if self.n_experts else params  # + the shared expert's gate

    def block_params(self, layer: int | None = None, active: bool = False) -> int:
        if layer is None:
            return round(sum(self.block_params(i, active) for i in range(self.n_layer)) / self.n_layer)
        return self.attention_params(layer) + self.mlp_params(layer, active) + 2 * self.n_embd

    def mixer_flops(self, layer: int, seq_len: int) -> float:
        """Forward FLOPs per token outside the matmuls with parameters: attention's QKᵀ and AV over the causal half
        (4·T/2·Hq·hd), or the chunked delta rule's."""
        if not self.is_linear(layer):
            return 2 * seq_len * self.q_width
        C, dk, dv = min(CHUNK, seq_len), self.linear_key_head_dim, self.linear_value_head_dim
        per_head = C * (2 * dk + 2 * dk + (dk + dv) + 2 * dv) + 6 * dk * dv
        return self.linear_value_heads * per_head

    def block_flops(self, layer: int, seq_len: int) -> float:
        """One block's forward FLOPs per token: 2 per matmul parameter a token uses, and its mixer's."""
        return 2 * (self.block_params(layer, active=True) - 2 * self.n_embd) + self.mixer_flops(layer, seq_len)

    def layer_flops(self, seq_len: int) -> float:
        return sum(self.block_flops(i, seq_len) for i in range(self.n_layer)) / self.n_layer

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: three times the forward's, the head included."""
        return 3.0 * (self.n_layer * self.layer_flops(seq_len) + self.head_flops())

    def layer_activations(self) -> LayerActivations:
        """The mean over blocks: a full-attention block as Llama's (q doubled by its gate), a linear block's saved
        inputs of its projections and convolution, q, k, v after it, g and β, the chunk system's solutions (u, w:
        dv and dk per value head), the output, z and the gated norm's output (out_proj's input)."""
        base = super().layer_activations()
        linear = sum(self.is_linear(i) for i in range(self.n_layer)) / self.n_layer
        hv, dk, dv = self.linear_value_heads, self.linear_key_head_dim, self.linear_value_head_dim
        gdn = 2 * self.conv_width + hv * (dk + dv) + 3 * self.value_width + 2 * hv
        attention = 2 * self.q_width + 2 * self.q_width + 2 * self.kv_width
        sharded = base.sharded_matmul + round(linear * (gdn - attention) + (1 - linear) * self.q_width)
        return LayerActivations(resid=base.resid, matmul=base.matmul, sharded_matmul=sharded, fp32=base.fp32,
                                sharded_fp32=base.sharded_fp32 + round(linear * 2 * hv))
