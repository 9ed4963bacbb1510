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


_SHARED = dict(vocab_size=151936, n_positions=40960, rope_theta=1000000.0, rope_factor=None, norm_eps=1e-6,
               explicit_head_dim=128)
PRESETS: dict[str, Qwen3Config] = {
    # CPU runs and tests: q/k norms with head_dim != d/heads; the MoE one with a dense first block (mlp_only_layers)
    "qwen3-tiny": Qwen3Config(**{**_SHARED, "explicit_head_dim": 48}, n_embd=128, n_layer=4, n_head=4, n_kv_heads=2,
                              ffn_hidden=384, tie_embeddings=True),
    "qwen3-moe-tiny": Qwen3Config(**{**_SHARED, "explicit_head_dim": 48}, n_embd=128, n_layer=4, n_head=4,
                                  n_kv_heads=2, ffn_hidden=384, n_experts=8, top_k=2, moe_ffn_hidden=96,
                                  mlp_only_layers=(0,)),
    "qwen3-0.6b": Qwen3Config(**_SHARED, n_embd=1024, n_layer=28, n_head=16, n_kv_heads=8, ffn_hidden=3072,
                              tie_embeddings=True),
    "qwen3-8b": Qwen3Config(**_SHARED, n_embd=4096, n_layer=36, n_head=32, n_kv_heads=8, ffn_hidden=12288),
    "qwen3-30b-a3b": Qwen3Config(**_SHARED, n_embd=2048, n_layer=48, n_head=32, n_kv_heads=4, ffn_hidden=6144,
                                 n_experts=128, top_k=8, moe_ffn_hidden=768),
    "qwen3-235b-a22b": Qwen3Config(**_SHARED, n_embd=4096, n_layer=94, n_head=64, n_kv_heads=4, ffn_hidden=12288,
                                   n_experts=128, top_k=8, moe_ffn_hidden=1536),
}
