"""Mixtral <-> Hugging Face MixtralForCausalLM: Llama's names and fusions, the router `block_sparse_moe.gate` and the
experts as transformers 5 keeps them on disk, one tensor per expert (`block_sparse_moe.experts.{j}.w1` the gate,
`.w3` the up projection, `.w2` the down one), stacked here into [E, 2·I, H] and [E, H, I]."""

from __future__ import annotations

import torch

from trainer3d.models.interface import HFPart
from trainer3d.models.llama.hf import LlamaAdapter
from trainer3d.models.mixtral.config import MixtralConfig
from trainer3d.models.qwen3.hf import expert_parts


class MixtralAdapter(LlamaAdapter):
    model_types = ("mixtral",)
    architecture = "MixtralForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> MixtralConfig:
        problems: list[str] = []
        fields = self.decoder_fields(raw, dropout, problems)
        if raw.get("router_jitter_noise"):
            problems.append(f"router_jitter_noise={raw['router_jitter_noise']}: our router adds no noise")
        if problems:
            raise ValueError("unsupported Mixtral config: " + "; ".join(problems))
        return MixtralConfig(**fields, n_experts=int(raw.get("num_local_experts", 8)),
                             top_k=int(raw.get("num_experts_per_tok", 2)))

    def hf_config(self, cfg: MixtralConfig, dtype: torch.dtype | None = None, eos_token_id: int | None = None,
                  bos_token_id: int | None = None):
        from transformers import MixtralConfig as HFMixtralConfig

        kwargs = self.decoder_kwargs(cfg, dtype, eos_token_id, bos_token_id)
        kwargs.pop("attention_bias")
        return HFMixtralConfig(**kwargs, num_local_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                               router_jitter_noise=0.0, sliding_window=None, architectures=[self.architecture])

    def parts(self, cfg: MixtralConfig, name: str) -> list[HFPart]:
        layer, _, rest = name.partition(".mlp.")
        if rest == "gate.weight":
            return [HFPart(f"model.{layer}.block_sparse_moe.gate.weight")]
        experts = expert_parts(cfg, name, f"model.{layer}.block_sparse_moe.experts.", "w1.weight", "w3.weight",
                               "w2.weight")
        return experts if experts is not None else super().parts(cfg, name)
