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
