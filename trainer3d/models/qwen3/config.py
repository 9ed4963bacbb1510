"""Qwen3's shape: Llama's parts with an RMSNorm over head_dim on q and on k before the rotation, an explicit head_dim,
no rotary rescaling; the MoE models (Qwen3-MoE) replace the MLP of most blocks by a mixture of experts. Published sizes
from the Hugging Face config.json files, plus tiny ones for CPU runs."""

from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.moe import MoESpec


@dataclass(frozen=True)
class Qwen3Config(LlamaConfig):
    # the experts (n_experts 0: a dense Qwen3). Block i is MoE iff i is not in mlp_only_layers and
    # (i + 1) % decoder_sparse_step == 0 (transformers' rule); the others keep a dense SwiGLU of ffn_hidden.
    n_experts: int = 0
    top_k: int = 8
    moe_ffn_hidden: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = True  # renormalize the top-k weights (true in every published Qwen3-MoE)

    family: ClassVar[str] = "qwen3"
    qk_norm: ClassVar[bool] = True

    @property
    def moe(self) -> MoESpec | None:
        if not self.n_experts:
            return None
        return MoESpec(self.n_experts, self.top_k, self.moe_ffn_hidden, renormalize=self.norm_topk_prob)

    def is_moe_layer(self, layer: int) -> bool:
        return bool(self.n_experts) and layer not in self.mlp_only_layers and (layer + 1) % self.decoder_sparse_step == 0
