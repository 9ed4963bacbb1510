"""Mixtral's shape: Llama's attention (grouped-query, plain rotary positions), every block's MLP a mixture of experts
whose top-k weights are always renormalized and kept in fp32; `ffn_hidden` is each expert's width. Published sizes
from the Hugging Face config.json files, plus a tiny one for CPU runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.moe import MoESpec


@dataclass(frozen=True)
class MixtralConfig(LlamaConfig):
    n_experts: int = 8
    top_k: int = 2

    family: ClassVar[str] = "mixtral"

    @property
    def moe(self) -> MoESpec:
        return MoESpec(self.n_experts, self.top_k, self.ffn_hidden, renormalize=True, weights_fp32=True)

    def is_moe_layer(self, layer: int) -> bool:
        return True


_SHARED = dict(rope_theta=1000000.0, rope_factor=None, norm_eps=1e-5)
PRESETS: dict[str, MixtralConfig] = {
    "mixtral-tiny": MixtralConfig(**_SHARED, vocab_size=32000, n_positions=32768, n_embd=128, n_layer=4, n_head=4,
                                  n_kv_heads=2, ffn_hidden=96, n_experts=4, top_k=2),
    "mixtral-8x7b": MixtralConfig(**_SHARED, vocab_size=32000, n_positions=32768, n_embd=4096, n_layer=32, n_head=32,
                                  n_kv_heads=8, ffn_hidden=14336),
    "mixtral-8x22b": MixtralConfig(**_SHARED, vocab_size=32768, n_positions=65536, n_embd=6144, n_layer=56, n_head=48,
                                   n_kv_heads=8, ffn_hidden=16384),
}
