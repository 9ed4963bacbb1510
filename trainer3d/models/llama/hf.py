"""Llama <-> Hugging Face LlamaForCausalLM: names gain `model.` (the head excepted), the fused q|k|v and gate|up weights
are split into q_proj, k_proj, v_proj and gate_proj, up_proj. config.json comes in two spellings, both read:
transformers 4's `rope_theta` + `rope_scaling` (the published Llama 3.1/3.2 files) and transformers 5's
`rope_parameters`."""

from __future__ import annotations

from typing import Any

import torch

from trainer3d.models.interface import HFAdapter, HFPart
from trainer3d.models.llama.config import LlamaConfig

_QKV, _GATE_UP = "self_attn.qkv_proj.weight", "mlp.gate_up_proj.weight"
_DROPPED_BUFFER_SUFFIXES = ("rotary_emb.inv_freq",)  # written by transformers 4.3x and earlier


def rope_settings(raw: dict) -> dict:
    """rope_type and its numbers from either spelling."""
    params = dict(raw.get("rope_parameters") or raw.get("rope_scaling") or {})
    params.setdefault("rope_theta", raw.get("rope_theta", 10000.0))
    params.setdefault("rope_type", params.pop("type", "default"))
    return params


class LlamaAdapter(HFAdapter):
    model_types = ("llama",)
    architecture = "LlamaForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> LlamaConfig:
        problems: list[str] = []
        fields = self.decoder_fields(raw, dropout, problems)
        if problems:
            raise ValueError("unsupported Llama config: " + "; ".join(problems))
        return LlamaConfig(**fields)

    def decoder_fields(self, raw: dict, dropout: float | None, problems: list[str]) -> dict:
        """The fields every Llama-like family shares (attention, rotary positions, norms, the dense MLP's width),
        from config.json; what none of them can represent goes to `problems`."""
        if raw.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={raw['hidden_act']!r}: our MLP is SwiGLU (silu)")
        for key in ("attention_bias", "mlp_bias"):
            if raw.get(key):
                problems.append(f"{key}=True: our Llama has no biases")
        if raw.get("use_sliding_window") or raw.get("sliding_window"):
            problems.append("sliding-window attention: ours attends to the whole causal context")
        rope = rope_settings(raw)
        if rope["rope_type"] not in ("default", "llama3"):
            problems.append(f"rope_type={rope['rope_type']!r}: supported are 'default' and 'llama3'")
        d, heads = int(raw.get("hidden_size", 4096)), int(raw.get("num_attention_heads", 32))
        kv = int(raw.get("num_key_value_heads") or heads)
        if heads % kv:
            problems.append(f"num_attention_heads={heads} is not a multiple of num_key_value_heads={kv}")
        head_dim = raw.get("head_dim")
        if head_dim is None and d % heads:
            problems.append(f"hidden_size={d} is not divisible by num_attention_heads={heads}")
        scaled = rope["rope_type"] == "llama3"
        return dict(
            vocab_size=int(raw.get("vocab_size", 32000)), n_positions=int(raw.get("max_position_embeddings", 2048)),
            n_embd=d, n_layer=int(raw.get("num_hidden_layers", 32)), n_head=heads,
            dropout=float(raw.get("attention_dropout", 0.0) if dropout is None else dropout),
            n_kv_heads=kv, ffn_hidden=int(raw.get("intermediate_size", 11008)),
            explicit_head_dim=int(head_dim) if head_dim is not None and int(head_dim) != d // heads else None,
            norm_eps=float(raw.get("rms_norm_eps", 1e-6)), rope_theta=float(rope["rope_theta"]),
            rope_factor=float(rope["factor"]) if scaled else None,
            rope_low_freq_factor=float(rope.get("low_freq_factor", 1.0)),
            rope_high_freq_factor=float(rope.get("high_freq_factor", 4.0)),
            rope_original_context=int(rope.get("original_max_position_embeddings", 8192)),
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)),
        )

    def hf_config(self, cfg: LlamaConfig, dtype: torch.dtype | None = None, eos_token_id: int | None = None,
                  bos_token_id: int | None = None):
        from transformers import LlamaConfig as HFLlamaConfig

        return HFLlamaConfig(**self.decoder_kwargs(cfg, dtype, eos_token_id, bos_token_id), mlp_bias=False,
                             architectures=[self.architecture])

    @staticmethod
    def decoder_kwargs(cfg: LlamaConfig, dtype, eos_token_id, bos_token_id) -> dict[str, Any]:
        """The transformers config arguments of the fields every Llama-like family shares."""
        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_factor is not None:
            rope.update(rope_type="llama3", factor=cfg.rope_factor, low_freq_factor=cfg.rope_low_freq_factor,
                        high_freq_factor=cfg.rope_high_freq_factor,
                        original_max_position_embeddings=cfg.rope_original_context)
        kwargs: dict[str, Any] = {}
        if dtype is not None:
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        return dict(
            vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
            num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head, num_key_value_heads=cfg.n_kv_heads,
            head_dim=cfg.head_dim, hidden_act="silu", max_position_embeddings=cfg.n_positions,
            rms_norm_eps=cfg.norm_eps, rope_parameters=rope, attention_bias=False, attention_dropout=cfg.dropout,
            tie_word_embeddings=cfg.tie_embeddings, bos_token_id=bos_token_id, eos_token_id=eos_token_id, **kwargs,
        )

    @staticmethod
    def _split(cfg: LlamaConfig, name: str) -> tuple[list[str], list[int]] | None:
        """The HF tensors a fused weight is made of, and their rows."""
        if name.endswith(_QKV):
            base = "model." + name.removesuffix(_QKV) + "self_attn."
            return [base + p for p in ("q_proj.weight", "k_proj.weight", "v_proj.weight")], \
                [cfg.q_width, cfg.kv_width, cfg.kv_width]
        if name.endswith(_GATE_UP):
            base = "model." + name.removesuffix(_GATE_UP) + "mlp."
            return [base + "gate_proj.weight", base + "up_proj.weight"], [cfg.ffn_hidden, cfg.ffn_hidden]
        return None

    def parts(self, cfg: LlamaConfig, name: str) -> list[HFPart]:
        split = self._split(cfg, name)
        if split is not None:
            return [HFPart(n, rows) for n, rows in zip(*split)]
        return [HFPart(name if name == "lm_head.weight" else "model." + name)]

    def experts_module(self, cfg, name: str) -> str:
        """transformers 5 holds every Llama-like family's experts stacked at `model.<ours>` (Mixtral's checkpoint
        files still say block_sparse_moe.experts.N.w1)."""
        return f"model.{name}"

    def ignored(self, cfg: LlamaConfig, hf_name: str) -> bool:
        return (hf_name == "lm_head.weight" and cfg.tie_embeddings) or hf_name.endswith(_DROPPED_BUFFER_SUFFIXES)

    def check_extra(self, cfg, hf_name, tensor, canonical) -> None:
        if hf_name == "lm_head.weight":
            embedding = canonical("embed_tokens.weight")
            if tensor.shape != embedding.shape or not torch.equal(tensor.to(embedding.dtype), embedding):
                raise ValueError("'lm_head.weight' differs from 'model.embed_tokens.weight' but config.json sets "
                                 "tie_word_embeddings")
