"""GPT-2 <-> Hugging Face GPT2LMHeadModel: names gain `transformer.`, Conv1D weights ([in, out]) are our nn.Linear
weights transposed, the tied lm_head is not stored (or must equal wte)."""

from __future__ import annotations

from typing import Any

import torch

from trainer3d.models.gpt2.config import GPTConfig
from trainer3d.models.interface import HFAdapter, HFPart

# Activations that are GELU with the tanh approximation, i.e. what MLP.forward computes.
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh")

# GPT2Config's defaults, for config.json files (or dicts) that leave keys out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257, "n_positions": 1024, "n_embd": 768, "n_layer": 12, "n_head": 12, "n_inner": None,
    "activation_function": "gelu_new", "resid_pdrop": 0.1, "embd_pdrop": 0.1, "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5, "scale_attn_weights": True, "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False, "add_cross_attention": False, "tie_word_embeddings": True,
}
_HF_ALIASES = {  # GPT2Config.attribute_map
    "hidden_size": "n_embd", "max_position_embeddings": "n_positions", "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}
# Weights that are Conv1D ([in, out]) in Hugging Face and nn.Linear ([out, in]) here.
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Non-parameter buffers older transformers versions wrote into checkpoints (causal mask, -1e4 constant).
_DROPPED_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


def _last(ids: int | list[int] | None) -> int | None:
    """GPT-2's start of text is its end of text: of the ids that end a reply ([end of turn, eos]), the eos."""
    return ids[-1] if isinstance(ids, list) else ids


def _hf_config_dict(raw: dict) -> dict[str, Any]:
    out = dict(_HF_DEFAULTS)
    for key, value in raw.items():
        out[_HF_ALIASES.get(key, key)] = value
    return out


class GPT2Adapter(HFAdapter):
    model_types = ("gpt2",)
    architecture = "GPT2LMHeadModel"

    def config_from_hf(self, raw: dict, dropout: float | None = None) -> GPTConfig:
        """Raises ValueError for what our model cannot represent. Our model has a single dropout rate: the HF config's
        resid/embd/attn_pdrop must agree unless `dropout` is given, which then overrides all three."""
        c = _hf_config_dict(raw)
        problems = []
        act = c["activation_function"]
        if act not in SUPPORTED_ACTIVATIONS:
            problems.append(f"activation_function={act!r}: our MLP computes GELU with the tanh approximation "
                            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})")
        if not c["scale_attn_weights"]:
            problems.append("scale_attn_weights=False: our attention always scales by 1/sqrt(head_dim)")
        if c["scale_attn_by_inverse_layer_idx"]:
            problems.append("scale_attn_by_inverse_layer_idx=True is not supported")
        if c["reorder_and_upcast_attn"]:
            problems.append("reorder_and_upcast_attn=True is not supported")
        if c["add_cross_attention"]:
            problems.append("add_cross_attention=True is not supported (decoder-only model)")
        if not c["tie_word_embeddings"]:
            problems.append("tie_word_embeddings=False: our lm_head is tied to wte")
        n_embd, n_head = int(c["n_embd"]), int(c["n_head"])
        if c["n_inner"] is not None and int(c["n_inner"]) != 4 * n_embd:
            problems.append(f"n_inner={c['n_inner']}: our MLP width is 4 * n_embd = {4 * n_embd}")
        if n_head <= 0 or n_embd % n_head:
            problems.append(f"n_embd={n_embd} is not divisible by n_head={n_head}")
        if dropout is None:
            rates = {k: float(c[k]) for k in ("resid_pdrop", "embd_pdrop", "attn_pdrop")}
            if len(set(rates.values())) > 1:
                problems.append(f"dropout rates differ ({', '.join(f'{k}={v}' for k, v in rates.items())}): our "
                                "model has one dropout rate; pass dropout= to override")
            dropout = rates["resid_pdrop"]
        if problems:
            raise ValueError("unsupported GPT-2 config: " + "; ".join(problems))
        return GPTConfig(vocab_size=int(c["vocab_size"]), n_positions=int(c["n_positions"]), n_embd=n_embd,
                         n_layer=int(c["n_layer"]), n_head=n_head, dropout=float(dropout),
                         layer_norm_eps=float(c["layer_norm_epsilon"]))

    def hf_config(self, cfg: GPTConfig, dtype: torch.dtype | None = None, eos_token_id: int | list[int] | None = None,
                  bos_token_id: int | None = None):
        from transformers import GPT2Config

        if eos_token_id is None:  # GPT-2's <|endoftext|> is token 50256; a smaller (custom) vocabulary has no such token
            eos_token_id = 50256 if cfg.vocab_size > 50256 else None
        kwargs: dict[str, Any] = {}
        if dtype is not None:
            kwargs["dtype"] = str(dtype).removeprefix("torch.")
        return GPT2Config(
            vocab_size=cfg.vocab_size, n_positions=cfg.n_positions, n_embd=cfg.n_embd, n_layer=cfg.n_layer,
            n_head=cfg.n_head, n_inner=None, activation_function="gelu_new", resid_pdrop=cfg.dropout,
            embd_pdrop=cfg.dropout, attn_pdrop=cfg.dropout, layer_norm_epsilon=cfg.layer_norm_eps,
            scale_attn_weights=True, scale_attn_by_inverse_layer_idx=False, reorder_and_upcast_attn=False,
            add_cross_attention=False, tie_word_embeddings=True, bos_token_id=bos_token_id if bos_token_id is not None
            else _last(eos_token_id), eos_token_id=eos_token_id, architectures=[self.architecture], **kwargs,
        )

    def parts(self, cfg: GPTConfig, name: str) -> list[HFPart]:
        return [HFPart("transformer." + name, transposed=name.endswith(_CONV1D_SUFFIXES))]

    def normalize(self, hf_name: str) -> str:
        """Older hub checkpoints are saved from GPT2Model: no `transformer.` prefix."""
        if hf_name == "lm_head.weight" or hf_name.startswith("transformer."):
            return hf_name
        return "transformer." + hf_name

    def ignored(self, cfg: GPTConfig, hf_name: str) -> bool:
        return hf_name == "lm_head.weight" or hf_name.endswith(_DROPPED_BUFFER_SUFFIXES)

    def check_extra(self, cfg, hf_name, tensor, canonical) -> None:
        if hf_name == "lm_head.weight":
            wte = canonical("wte.weight")
            if tensor.shape != wte.shape or not torch.equal(tensor.to(wte.dtype), wte):
                raise ValueError("'lm_head.weight' differs from 'transformer.wte.weight'; our model needs tied "
                                 "input/output embeddings")
