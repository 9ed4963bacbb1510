"""Qwen3.5 <-> transformers' Qwen3_5ForCausalLM (`qwen3_5_text`) and Qwen3_5MoeForCausalLM (`qwen3_5_moe_text`):
Llama's names and fusions, the full attention's q_proj (each head's q, then its gate) inside the fused q|k|v, the
linear attention's four input projections fused as `in_proj`, and the experts one tensor per expert on disk (as
Qwen3-MoE's) with a gated shared expert.

The published checkpoints are multimodal (Qwen3_5ForConditionalGeneration: the language model under
`model.language_model.`, a vision tower under `model.visual.`, config.json's `text_config`) and hold a multi-token-
prediction module (`mtp.*`) that transformers does not run. Their language model trains; the tower and the module are
neither trained nor dropped: an export of the run copies them unchanged from the directory it started from, under its
config (checkpoint/hf_source.py), and the run's log says so (import_notes)."""

from __future__ import annotations

import torch

from trainer3d.models.interface import HFPart
from trainer3d.models.llama.hf import LlamaAdapter, rope_settings
from trainer3d.models.qwen3.hf import EXPERTS, expert_parts
from trainer3d.models.qwen3_5.config import Qwen35Config

_IN_PROJ, _QKV, _SHARED_UP = "linear_attn.in_proj.weight", "self_attn.qkv_proj.weight", "shared_expert.gate_up_proj.weight"


_WRAPPED, _VISUAL = "model.language_model.", "model.visual."


def language_config(raw: dict) -> dict:
    """The language model's config.json dict: a multimodal directory's `text_config`, a text-only one's own."""
    return raw["text_config"] if isinstance(raw.get("text_config"), dict) else raw


class Qwen35Adapter(LlamaAdapter):
    # the text models, and the published multimodal ones (Qwen3_5ForConditionalGeneration: its language model trains)
    model_types = ("qwen3_5_text", "qwen3_5_moe_text", "qwen3_5", "qwen3_5_moe")
    architecture = "Qwen3_5ForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> Qwen35Config:
        raw = language_config(raw)
        problems: list[str] = []
        fields = self.decoder_fields(raw, dropout, problems)
        rope = rope_settings(raw)
        n = fields["n_layer"]
        interval = int(raw.get("full_attention_interval", 4))
        types = raw.get("layer_types")
        if types is not None:
            full = [i for i, t in enumerate(types) if t == "full_attention"]
            interval = full[0] + 1 if full else n + 1
            pattern = ["linear_attention" if (i + 1) % interval else "full_attention" for i in range(n)]
            if list(types) != pattern:
                problems.append("layer_types is not a full-attention block every k-th (the pattern of every Qwen3.5)")
        fields.update(partial_rotary_factor=float(rope.get("partial_rotary_factor", raw.get("partial_rotary_factor",
                                                                                           0.25))),
                      full_attention_interval=interval,
                      linear_conv_kernel=int(raw.get("linear_conv_kernel_dim", 4)),
                      linear_key_heads=int(raw.get("linear_num_key_heads", 16)),
                      linear_value_heads=int(raw.get("linear_num_value_heads", 32)),
                      linear_key_head_dim=int(raw.get("linear_key_head_dim", 128)),
                      linear_value_head_dim=int(raw.get("linear_value_head_dim", 128)))
        if fields["linear_value_heads"] % fields["linear_key_heads"]:
            problems.append("linear_num_value_heads is not a multiple of linear_num_key_heads")
        if raw.get("model_type") == "qwen3_5_moe_text":
            fields.update(n_experts=int(raw.get("num_experts", 0)), top_k=int(raw.get("num_experts_per_tok", 8)),
                          moe_ffn_hidden=int(raw.get("moe_intermediate_size", 512)),
                          shared_expert_hidden=int(raw.get("shared_expert_intermediate_size", 512)))
        if problems:
            raise ValueError("unsupported Qwen3.5 config: " + "; ".join(problems))
        return Qwen35Config(**fields)

    def import_notes(self, raw: dict) -> list[str]:
        notes = []
        if language_config(raw) is not raw:
            notes.append(f"a multimodal {raw.get('architectures', ['model'])[0]}: its language model trains; the vision "
                         "tower (model.visual.*) is not trained, and an export copies it unchanged with this config")
        depth = language_config(raw).get("mtp_num_hidden_layers") or raw.get("mtp_num_hidden_layers")
        if depth:
            notes.append(f"the multi-token-prediction module (mtp.*, {depth} layer(s)) is not trained (transformers "
                         "does not run it either); an export copies it unchanged")
        return notes

    def normalize(self, hf_name: str) -> str:
        return "model." + hf_name.removeprefix(_WRAPPED) if hf_name.startswith(_WRAPPED) else hf_name

    def passthrough(self, hf_name: str) -> bool:
        return hf_name.startswith(("mtp.", _VISUAL))

    def export_layout(self, raw: dict, hf_config):
        if language_config(raw) is raw:
            return None
        text = {**raw["text_config"], **{k: v for k, v in hf_config.to_dict().items()
                                         if k in raw["text_config"] and k != "architectures"}}
        config = {**raw, "text_config": text, "dtype": text.get("dtype", raw.get("dtype"))}
        return config, lambda name: _WRAPPED + name.removeprefix("model.") if name.startswith("model.") else name

    def hf_config(self, cfg: Qwen35Config, dtype: torch.dtype | None = None, eos_token_id=None, bos_token_id=None):
        kwargs = self.decoder_kwargs(cfg, dtype, eos_token_id, bos_token_id)
        kwargs["rope_parameters"] = {"rope_type": "default", "rope_theta": cfg.rope_theta,
                                     "partial_rotary_factor": cfg.partial_rotary_factor}
        kwargs.update(layer_types=["linear_attention" if cfg.is_linear(i) else "full_attention"
                                   for i in range(cfg.n_layer)],
                      linear_conv_kernel_dim=cfg.linear_conv_kernel, linear_num_key_heads=cfg.linear_key_heads,
                      linear_num_value_heads=cfg.linear_value_heads, linear_key_head_dim=cfg.linear_key_head_dim,
                      linear_value_head_dim=cfg.linear_value_head_dim)
        if not cfg.n_experts:
            from transformers import Qwen3_5TextConfig

            return Qwen3_5TextConfig(**kwargs, architectures=["Qwen3_5ForCausalLM"])
        from transformers import Qwen3_5MoeTextConfig

        return Qwen3_5MoeTextConfig(**kwargs, num_experts=cfg.n_experts, num_experts_per_tok=cfg.top_k,
                                    moe_intermediate_size=cfg.moe_ffn_hidden,
                                    shared_expert_intermediate_size=cfg.shared_expert_hidden,
                                    architectures=["Qwen3_5MoeForCausalLM"])

    def parts(self, cfg: Qwen35Config, name: str) -> list[HFPart]:
        layer, _, rest = name.partition(".mlp.")
        experts = expert_parts(cfg, name, f"model.{layer}{EXPERTS}", "gate_proj.weight", "up_proj.weight",
                               "down_proj.weight")
        if experts is not None:
            return experts
        base = "model." + name.rpartition(".")[0].rpartition(".")[0] + "."
        if name.endswith(_IN_PROJ):
            return [HFPart(base + "in_proj_qkv.weight", cfg.conv_width), HFPart(base + "in_proj_z.weight",
                                                                                cfg.value_width),
                    HFPart(base + "in_proj_b.weight", cfg.linear_value_heads),
                    HFPart(base + "in_proj_a.weight", cfg.linear_value_heads)]
        if name.endswith(_QKV):
            return [HFPart(base + "q_proj.weight", 2 * cfg.q_width), HFPart(base + "k_proj.weight", cfg.kv_width),
                    HFPart(base + "v_proj.weight", cfg.kv_width)]
        if name.endswith(_SHARED_UP):
            return [HFPart(base + "gate_proj.weight", cfg.shared_expert_hidden),
                    HFPart(base + "up_proj.weight", cfg.shared_expert_hidden)]
        return super().parts(cfg, name)

