"""Qwen3 <-> Hugging Face Qwen3ForCausalLM (dense) and Qwen3MoeForCausalLM: Llama's names and fusions, the q/k norms
under their own names, and the experts as transformers 5 keeps them on disk, one tensor per expert
(`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`), stacked here into [E, 2·I, H] and [E, H, I]. A Qwen3-MoE
config.json names the expert count `num_experts` (the published files) or `num_local_experts` (transformers 5.24's
save_pretrained): both are read."""

from __future__ import annotations

import torch

from trainer3d.models.interface import HFPart
from trainer3d.models.llama.hf import LlamaAdapter
from trainer3d.models.qwen3.config import Qwen3Config

EXPERTS = ".mlp.experts."


def expert_parts(cfg, name: str, prefix: str, gate: str, up: str, down: str) -> list[HFPart] | None:
    """The per-expert HF tensors of a stacked expert weight `name` (None: not one), `prefix` + `{j}.` + gate/up/down
    (each a family's own names)."""
    spec = cfg.moe
    if name.endswith("experts.gate_up_proj"):
        return [HFPart(f"{prefix}{j}.{w}", rows=spec.expert_hidden, expert=j)
                for j in range(spec.n_experts) for w in (gate, up)]
    if name.endswith("experts.down_proj"):
        return [HFPart(f"{prefix}{j}.{down}", expert=j) for j in range(spec.n_experts)]
    return None


class Qwen3Adapter(LlamaAdapter):
    model_types = ("qwen3", "qwen3_moe")
    architecture = "Qwen3ForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> Qwen3Config:
        problems: list[str] = []
        fields = self.decoder_fields(raw, dropout, problems)
        if raw.get("model_type") == "qwen3_moe":
            experts = raw.get("num_experts", raw.get("num_local_experts"))
            if not experts:
                problems.append("a Qwen3-MoE config without num_experts")
            if raw.get("shared_expert_intermediate_size"):
                problems.append("a shared expert: Qwen3-MoE has none")
            fields.update(n_experts=int(experts or 0), top_k=int(raw.get("num_experts_per_tok", 8)),
                          moe_ffn_hidden=int(raw.get("moe_intermediate_size", 768)),
                          decoder_sparse_step=int(raw.get("decoder_sparse_step", 1)),
                          mlp_only_layers=tuple(int(i) for i in raw.get("mlp_only_layers") or ()),
                          norm_topk_prob=bool(raw.get("norm_topk_prob", False)))
        if problems:
            raise ValueError("unsupported Qwen3 config: " + "; ".join(problems))
        return Qwen3Config(**fields)

    def hf_config(self, cfg: Qwen3Config, dtype: torch.dtype | None = None, eos_token_id: int | None = None,
                  bos_token_id: int | None = None):
        kwargs = self.decoder_kwargs(cfg, dtype, eos_token_id, bos_token_id)
        if not cfg.n_experts:
            from transformers import Qwen3Config as HFQwen3Config

            return HFQwen3Config(**kwargs, use_sliding_window=False, architectures=["Qwen3ForCausalLM"])
        from transformers import Qwen3MoeConfig

        return Qwen3MoeConfig(**kwargs, num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                              moe_intermediate_size=cfg.moe_ffn_hidden, decoder_sparse_step=cfg.decoder_sparse_step,
                              mlp_only_layers=list(cfg.mlp_only_layers), norm_topk_prob=cfg.norm_topk_prob,
                              use_sliding_window=False, architectures=["Qwen3MoeForCausalLM"])

    def parts(self, cfg: Qwen3Config, name: str) -> list[HFPart]:
        layer = name.partition(".mlp.")[0]
        experts = expert_parts(cfg, name, f"model.{layer}{EXPERTS}", "gate_proj.weight", "up_proj.weight",
                               "down_proj.weight")
        return experts if experts is not None else super().parts(cfg, name)
