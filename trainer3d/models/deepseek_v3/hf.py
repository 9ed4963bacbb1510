"""DeepSeek-V3 <-> Hugging Face DeepseekV3ForCausalLM (also Kimi K2's `kimi_k2` and Moonlight's directories, whose
config.json and tensors are DeepSeek-V3's): names gain `model.` (the head excepted); the dense MLP's and the shared
experts' fused gate|up are split into gate_proj and up_proj; the experts are one tensor per expert on disk
(`mlp.experts.{j}.gate_proj/up_proj/down_proj.weight`), stacked here; the router's selection bias is the table
`mlp.gate.expert_bias`, `mlp.gate.e_score_correction_bias` in the files (kept in fp32, as transformers keeps it).

Multi-token prediction: DeepSeek's files hold MTP module k as layer n_layer + k - 1 (`model.layers.{i}.`: a block's
tensors, `enorm`, `hnorm`, `eh_proj`, `shared_head.norm`, and copies of the embedding and the head as
`embed_tokens` and `shared_head.head`); trainer3d's modules are `mtp.{i}.*`. Export writes them so, copies included,
with num_nextn_predict_layers; transformers' DeepseekV3ForCausalLM ignores them on load (it builds no MTP). A config
that declares modules whose weights the files lack (transformers' own save_pretrained drops them) is read without
them, with a note."""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable

import torch

from trainer3d.models.deepseek_v3.config import DeepseekV3Config
from trainer3d.models.interface import HFPart
from trainer3d.models.llama.hf import LlamaAdapter, rope_settings
from trainer3d.models.qwen3.hf import expert_parts

_LAYER = re.compile(r"model\.layers\.(\d+)\.")
_BIAS = ".mlp.gate.expert_bias"


def mtp_layers(raw: dict) -> int:
    return int(raw.get("num_nextn_predict_layers", raw.get("num_mtp_layers")) or 0)


# DeepSeek Sparse Attention's two formats: the transformers config class, and whether the indexer's rope pairs are
# interleaved (GLM-5's) or half-split (DeepSeek-V3.2's)
DSA_FORMATS = {"deepseek_v32": ("DeepseekV32Config", False), "glm_moe_dsa": ("GlmMoeDsaConfig", True)}


def dsa_fields(raw: dict) -> dict:
    """config.json's DSA entries, completed by transformers' own config class (its defaults differ by model type, and
    GLM-5's shared layers may come as a pattern or a frequency and offset), as our config's fields."""
    import transformers

    class_name, interleaved = DSA_FORMATS[raw["model_type"]]
    known = {k: v for k, v in raw.items() if k not in ("model_type", "architectures", "transformers_version")}
    full = getattr(transformers, class_name)(**known).to_dict()
    dense = full["mlp_layer_types"] == ["dense"] * full["first_k_dense_replace"] + ["sparse"] * (
        full["num_hidden_layers"] - full["first_k_dense_replace"])
    if not dense:
        raise ValueError(f"unsupported {raw['model_type']} config: mlp_layer_types={full['mlp_layer_types']} (ours: "
                         "first_k_dense_replace dense blocks, then mixtures)")
    shared = tuple(t == "shared" for t in full.get("indexer_types") or ())
    return {**full, "rope_interleave": True, "index_rope_interleave": interleaved,
            "index_shared": shared if any(shared) else ()}


class DeepseekV3Adapter(LlamaAdapter):
    model_types = ("deepseek_v3", "kimi_k2", *DSA_FORMATS)
    architecture = "DeepseekV3ForCausalLM"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> DeepseekV3Config:
        dsa: dict[str, Any] = {}
        if raw.get("model_type") in DSA_FORMATS:
            raw = dsa_fields(raw)
            dsa = dict(index_n_heads=int(raw["index_n_heads"]), index_head_dim=int(raw["index_head_dim"]),
                       index_topk=int(raw["index_topk"]), index_rope_interleave=raw["index_rope_interleave"],
                       index_shared=raw["index_shared"])
        problems: list[str] = []
        if raw.get("hidden_act", "silu") != "silu":
            problems.append(f"hidden_act={raw['hidden_act']!r}: our MLPs are SwiGLU (silu)")
        if raw.get("attention_bias"):
            problems.append("attention_bias=True: our MLA has no biases")
        if raw.get("quantization_config"):
            problems.append("quantization_config: the weights are quantized (DeepSeek's and Kimi's published files "
                            "are fp8); dequantize them to bf16 first, and where they already are, delete the "
                            "\"quantization_config\" entry from config.json")
        if raw.get("scoring_func", "sigmoid") != "sigmoid":
            problems.append(f"scoring_func={raw['scoring_func']!r}: DeepSeek-V3's router scores with a sigmoid")
        rope = rope_settings(raw)
        if rope["rope_type"] not in ("default", "yarn"):
            problems.append(f"rope_type={rope['rope_type']!r}: supported are 'default' and 'yarn'")
        routing = {k: raw.get(k, default) for k, default in (("n_group", 8), ("topk_group", 4),
                                                             ("num_experts_per_tok", 8), ("first_k_dense_replace", 3))}
        problems += [f"{k}=null" for k, v in routing.items() if v is None]
        if problems:
            raise ValueError("unsupported DeepSeek-V3 config: " + "; ".join(problems))
        n_positions = int(raw.get("max_position_embeddings", 4096))
        yarn: dict[str, Any] = {"rope_factor": None}  # plain RoPE: YaRN's other fields keep their defaults
        if rope["rope_type"] == "yarn":
            original = int(rope.get("original_max_position_embeddings") or n_positions)
            factor = rope.get("factor") or n_positions / original  # (transformers' rule where a file gives none)
            yarn = dict(rope_factor=float(factor), rope_original_context=original,
                        rope_beta_fast=float(rope.get("beta_fast") or 32), rope_beta_slow=float(rope.get("beta_slow") or 1),
                        rope_mscale=float(rope.get("mscale") or 0.0),
                        rope_mscale_all_dim=float(rope.get("mscale_all_dim") or 0.0),
                        rope_attention_factor=None if rope.get("attention_factor") is None
                        else float(rope["attention_factor"]), rope_truncate=bool(rope.get("truncate", True)))
        q_lora = raw.get("q_lora_rank", 1536)
        return DeepseekV3Config(
            vocab_size=int(raw.get("vocab_size", 129280)), n_positions=n_positions,
            n_embd=int(raw.get("hidden_size", 7168)), n_layer=int(raw.get("num_hidden_layers", 61)),
            n_head=int(raw.get("num_attention_heads", 128)),
            dropout=float(raw.get("attention_dropout", 0.0) if dropout is None else dropout),
            ffn_hidden=int(raw.get("intermediate_size", 18432)),
            q_lora_rank=None if q_lora is None else int(q_lora), kv_lora_rank=int(raw.get("kv_lora_rank", 512)),
            qk_nope_head_dim=int(raw.get("qk_nope_head_dim", 128)),
            qk_rope_head_dim=int(raw.get("qk_rope_head_dim", 64)), v_head_dim=int(raw.get("v_head_dim", 128)),
            n_experts=int(raw.get("n_routed_experts", raw.get("num_local_experts", 256))),
            n_shared_experts=int(raw.get("n_shared_experts", 1)), top_k=int(routing["num_experts_per_tok"]),
            moe_ffn_hidden=int(raw.get("moe_intermediate_size", 2048)), n_group=int(routing["n_group"]),
            topk_group=int(routing["topk_group"]), first_k_dense_replace=int(routing["first_k_dense_replace"]),
            routed_scaling_factor=float(raw.get("routed_scaling_factor", 2.5)),
            norm_topk_prob=bool(raw.get("norm_topk_prob", True)), norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope["rope_theta"]), rope_interleave=bool(raw.get("rope_interleave", True)), **yarn,
            tie_embeddings=bool(raw.get("tie_word_embeddings", False)), mtp_layers=mtp_layers(raw), **dsa,
        )

    def fit_to_weights(self, cfg: DeepseekV3Config,
                       names: Callable[[], set[str]]) -> tuple[DeepseekV3Config, list[str]]:
        """The MTP modules whose weights the files hold (the first ones, in order), with a note where config.json
        declares more."""
        if not cfg.mtp_layers:
            return cfg, []
        held = names()
        found = 0
        while found < cfg.mtp_layers and f"model.layers.{cfg.n_layer + found}.eh_proj.weight" in held:
            found += 1
        if found == cfg.mtp_layers:
            return cfg, []
        n = cfg.mtp_layers
        return dataclasses.replace(cfg, mtp_layers=found), [
            f"config.json declares {n} multi-token-prediction layer{'s' * (n > 1)} (num_nextn_predict_layers) but "
            f"the files hold the weights of {found} (transformers' save_pretrained drops them): trained with {found}"]

    def hf_config(self, cfg: DeepseekV3Config, dtype: torch.dtype | None = None, eos_token_id: int | None = None,
                  bos_token_id: int | None = None):
        import transformers

        rope: dict[str, Any] = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        if cfg.rope_factor is not None:
            rope.update(rope_type="yarn", factor=cfg.rope_factor,
                        original_max_position_embeddings=cfg.rope_original_context, beta_fast=cfg.rope_beta_fast,
                        beta_slow=cfg.rope_beta_slow)
            rope.update({k: v for k, v in (("mscale", cfg.rope_mscale), ("mscale_all_dim", cfg.rope_mscale_all_dim),
                                           ("attention_factor", cfg.rope_attention_factor)) if v})
            if not cfg.rope_truncate:
                rope["truncate"] = False
        kwargs: dict[str, Any] = {}
        if dtype is not None:
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        config_class, extra = transformers.DeepseekV3Config, {"rope_interleave": cfg.rope_interleave}
        if cfg.sparse:
            name = next(t for t, (_, interleaved) in DSA_FORMATS.items() if interleaved == cfg.index_rope_interleave)
            config_class = getattr(transformers, DSA_FORMATS[name][0])
            extra = dict(index_n_heads=cfg.index_n_heads, index_head_dim=cfg.index_head_dim, index_topk=cfg.index_topk)
            if cfg.index_rope_interleave:  # GLM-5: which layers reuse an earlier selection
                extra["indexer_types"] = ["full" if cfg.has_indexer(i) else "shared" for i in range(cfg.n_layer)]
        return config_class(
            vocab_size=cfg.vocab_size, hidden_size=cfg.n_embd, intermediate_size=cfg.ffn_hidden,
            moe_intermediate_size=cfg.moe_ffn_hidden, num_hidden_layers=cfg.n_layer, num_attention_heads=cfg.n_head,
            num_key_value_heads=cfg.n_head, n_shared_experts=cfg.n_shared_experts, n_routed_experts=cfg.n_experts,
            routed_scaling_factor=cfg.routed_scaling_factor, kv_lora_rank=cfg.kv_lora_rank, q_lora_rank=cfg.q_lora_rank,
            qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, qk_nope_head_dim=cfg.qk_nope_head_dim,
            n_group=cfg.n_group, topk_group=cfg.topk_group, num_experts_per_tok=cfg.top_k,
            first_k_dense_replace=cfg.first_k_dense_replace, norm_topk_prob=cfg.norm_topk_prob, hidden_act="silu",
            max_position_embeddings=cfg.n_positions, rms_norm_eps=cfg.norm_eps, tie_word_embeddings=cfg.tie_embeddings,
            rope_parameters=rope, attention_bias=False, attention_dropout=cfg.dropout,
            num_mtp_layers=cfg.mtp_layers, bos_token_id=bos_token_id, eos_token_id=eos_token_id,
            architectures=[config_class.__name__.replace("Config", "ForCausalLM")], **extra, **kwargs)

    def parts(self, cfg: DeepseekV3Config, name: str) -> list[HFPart]:
        name = _as_layer(name)
        layer, _, rest = name.partition(".mlp.")
        if rest.startswith("shared_expert."):
            base = f"model.{layer}.mlp.shared_experts."
            if rest == "shared_expert.gate_up_proj.weight":
                rows = cfg.moe.shared_hidden
                return [HFPart(base + "gate_proj.weight", rows), HFPart(base + "up_proj.weight", rows)]
            return [HFPart(base + rest.removeprefix("shared_expert."))]
        experts = expert_parts(cfg, name, f"model.{layer}.mlp.experts.", "gate_proj.weight", "up_proj.weight",
                               "down_proj.weight")
        return experts if experts is not None else super().parts(cfg, name)

    def to_hf(self, cfg: DeepseekV3Config, name: str, tensor: torch.Tensor) -> dict[str, torch.Tensor]:
        """As every family's, and the embedding and the head also as each MTP layer's copy (DeepSeek's files)."""
        out = super().to_hf(cfg, name, tensor)
        copy = {"embed_tokens.weight": "embed_tokens.weight", "lm_head.weight": "shared_head.head.weight"}.get(name)
        if copy is not None and not cfg.tie_embeddings:
            out.update({f"model.layers.{cfg.n_layer + k}.{copy}": tensor for k in range(cfg.mtp_layers)})
        return out

    def table_name(self, cfg: DeepseekV3Config, name: str) -> str | None:
        name = _as_layer(name)
        return f"model.{name.removesuffix(_BIAS)}.mlp.gate.e_score_correction_bias" if name.endswith(_BIAS) else None

    def ignored(self, cfg: DeepseekV3Config, hf_name: str) -> bool:
        """A tied head's duplicate, old buffers, and MTP layers the run does not build (past its last)."""
        layer = _LAYER.match(hf_name)
        return super().ignored(cfg, hf_name) or (layer is not None
                                                 and int(layer.group(1)) >= cfg.n_layer + cfg.mtp_layers)


def _as_layer(name: str) -> str:
    """An MTP module's canonical name (`mtp.{i}.`) as the layer DeepSeek's files store it as (`layers.{i}.`)."""
    return "layers." + name.removeprefix("mtp.") if name.startswith("mtp.") else name
