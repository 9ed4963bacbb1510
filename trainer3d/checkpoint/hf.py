"""Hugging Face GPT-2 interop: read and write `save_pretrained` directories.

Our model (model.py) uses Hugging Face GPT2Model's parameter names without the `transformer.` prefix, but
`nn.Linear` (weight [out, in]) where Hugging Face uses `Conv1D` (weight [in, out]). The canonical state dict
holds the tied embedding once, as `wte.weight` with exactly `vocab_size` rows, and no `lm_head.weight`.

    gpt_config_from_hf(hf_config) -> GPTConfig            refuses what our model cannot represent
    hf_config_from_gpt(cfg) -> transformers.GPT2Config
    load_hf_checkpoint(path) -> (GPTConfig, canonical state dict)
    save_hf_checkpoint(cfg, state, out_dir, tokenizer_dir=None)   loadable by GPT2LMHeadModel.from_pretrained

Tensors are read with `safetensors` (or `torch.load(weights_only=True)` for a legacy pytorch_model.bin);
nothing is ever unpickled. `transformers` is imported lazily, only by `hf_config_from_gpt` and
`save_hf_checkpoint`; loading needs only `safetensors` and `torch`.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch

from trainer3d.fsio import fsync_path
from trainer3d.model import GPT, GPTConfig

CONFIG_NAME = "config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PT_WEIGHTS_NAME = "pytorch_model.bin"
PT_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"

# Activations that are GELU with the tanh approximation, i.e. what MLP.forward computes.
SUPPORTED_ACTIVATIONS = ("gelu_new", "gelu_pytorch_tanh", "gelu_python_tanh")

# GPT2Config's defaults, for config.json files (or dicts) that leave keys out.
_HF_DEFAULTS: dict[str, Any] = {
    "vocab_size": 50257,
    "n_positions": 1024,
    "n_embd": 768,
    "n_layer": 12,
    "n_head": 12,
    "n_inner": None,
    "activation_function": "gelu_new",
    "resid_pdrop": 0.1,
    "embd_pdrop": 0.1,
    "attn_pdrop": 0.1,
    "layer_norm_epsilon": 1e-5,
    "scale_attn_weights": True,
    "scale_attn_by_inverse_layer_idx": False,
    "reorder_and_upcast_attn": False,
    "add_cross_attention": False,
    "tie_word_embeddings": True,
}
_HF_ALIASES = {  # GPT2Config.attribute_map
    "hidden_size": "n_embd",
    "max_position_embeddings": "n_positions",
    "num_attention_heads": "n_head",
    "num_hidden_layers": "n_layer",
}

# Weights that are Conv1D ([in, out]) in Hugging Face and nn.Linear ([out, in]) here.
_CONV1D_SUFFIXES = ("attn.c_attn.weight", "attn.c_proj.weight", "mlp.c_fc.weight", "mlp.c_proj.weight")
# Non-parameter buffers older transformers versions wrote into checkpoints (causal mask, -1e4 constant).
_DROPPED_BUFFER_SUFFIXES = (".attn.bias", ".attn.masked_bias")


# ----------------------------------------------------------------------------------------------- configs


def _hf_config_dict(hf_config: Any) -> dict[str, Any]:
    if isinstance(hf_config, Mapping):
        raw = dict(hf_config)
    elif hasattr(hf_config, "to_dict"):
        raw = hf_config.to_dict()
    else:
        raise TypeError(f"expected a transformers GPT2Config or a dict, got {type(hf_config).__name__}")
    out = dict(_HF_DEFAULTS)
    for key, value in raw.items():
        out[_HF_ALIASES.get(key, key)] = value
    return out


def gpt_config_from_hf(hf_config: Any, dropout: float | None = None) -> GPTConfig:
    """Our GPTConfig for a Hugging Face GPT-2 config (a `GPT2Config` or its config.json as a dict).

    Raises ValueError for what our model cannot represent. Our model has a single dropout rate: the HF
    config's resid/embd/attn_pdrop must agree unless `dropout` is given, which then overrides all three.
    """
    c = _hf_config_dict(hf_config)
    problems = []
    model_type = c.get("model_type", "gpt2")
    if model_type != "gpt2":
        problems.append(f"model_type is {model_type!r}, expected 'gpt2'")
    act = c["activation_function"]
    if act not in SUPPORTED_ACTIVATIONS:
        problems.append(
            f"activation_function={act!r}: our MLP computes GELU with the tanh approximation "
            f"(supported: {', '.join(SUPPORTED_ACTIVATIONS)})"
        )
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
            problems.append(
                f"dropout rates differ ({', '.join(f'{k}={v}' for k, v in rates.items())}): our model has "
                "one dropout rate; pass dropout= to override"
            )
        dropout = rates["resid_pdrop"]
    if problems:
        raise ValueError("unsupported GPT-2 config: " + "; ".join(problems))
    return GPTConfig(
        vocab_size=int(c["vocab_size"]),
        n_positions=int(c["n_positions"]),
        n_embd=n_embd,
        n_layer=int(c["n_layer"]),
        n_head=n_head,
        dropout=float(dropout),
        layer_norm_eps=float(c["layer_norm_epsilon"]),
    )


def hf_config_from_gpt(cfg: GPTConfig, dtype: torch.dtype | None = None):
    """The `transformers.GPT2Config` (for GPT2LMHeadModel) of our config."""
    from transformers import GPT2Config

    # GPT-2's <|endoftext|> is token 50256; a smaller (custom) vocabulary has no such token.
    eot = 50256 if cfg.vocab_size > 50256 else None
    kwargs: dict[str, Any] = {}
    if dtype is not None:
        kwargs["dtype"] = str(dtype).removeprefix("torch.")
    return GPT2Config(
        vocab_size=cfg.vocab_size,
        n_positions=cfg.n_positions,
        n_embd=cfg.n_embd,
        n_layer=cfg.n_layer,
        n_head=cfg.n_head,
        n_inner=None,
        activation_function="gelu_new",
        resid_pdrop=cfg.dropout,
        embd_pdrop=cfg.dropout,
        attn_pdrop=cfg.dropout,
        layer_norm_epsilon=cfg.layer_norm_eps,
        scale_attn_weights=True,
        scale_attn_by_inverse_layer_idx=False,
        reorder_and_upcast_attn=False,
        add_cross_attention=False,
        tie_word_embeddings=True,
        bos_token_id=eot,
        eos_token_id=eot,
        architectures=["GPT2LMHeadModel"],
        **kwargs,
    )


# -------------------------------------------------------------------------------------------- state dicts


def expected_shapes(cfg: GPTConfig) -> dict[str, torch.Size]:
    """Canonical parameter names and shapes for `cfg` (built on the meta device, so free)."""
    with torch.device("meta"):
        model = GPT(cfg)
    shapes = {name: t.shape for name, t in model.state_dict().items()}
    shapes.pop("lm_head.weight", None)
    return shapes


def _check_state(state: Mapping[str, torch.Tensor], cfg: GPTConfig, source: str) -> None:
    expected = expected_shapes(cfg)
    missing = sorted(set(expected) - set(state))
    unexpected = sorted(set(state) - set(expected))
    if missing or unexpected:
        parts = []
        if missing:
            parts.append(f"missing tensors {_abbrev(missing)}")
        if unexpected:
            parts.append(f"unexpected tensors {_abbrev(unexpected)}")
        raise ValueError(f"{source}: " + "; ".join(parts))
    for name, shape in expected.items():
        if state[name].shape != shape:
            raise ValueError(
                f"{source}: tensor {name!r} has shape {tuple(state[name].shape)}, expected {tuple(shape)} "
                "for the config"
            )


def _abbrev(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)} in all)"


def hf_to_canonical(
    hf_state: Mapping[str, torch.Tensor], cfg: GPTConfig, source: str = "checkpoint"
) -> dict[str, torch.Tensor]:
    """Canonical state dict from a Hugging Face GPT-2 state dict (GPT2Model or GPT2LMHeadModel keys)."""
    state: dict[str, torch.Tensor] = {}
    lm_head = None
    for key, tensor in hf_state.items():
        name = key.removeprefix("transformer.")
        if name == "lm_head.weight":
            lm_head = tensor
            continue
        if name.endswith(_DROPPED_BUFFER_SUFFIXES):
            continue
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        state[name] = tensor.contiguous()
    _check_state(state, cfg, source)
    if lm_head is not None:
        wte = state["wte.weight"]
        if lm_head.shape != wte.shape or not torch.equal(lm_head.to(wte.dtype), wte):
            raise ValueError(
                f"{source}: 'lm_head.weight' differs from 'transformer.wte.weight'; our model needs tied "
                "input/output embeddings"
            )
    return state


def canonical_to_hf(state: Mapping[str, torch.Tensor], cfg: GPTConfig, dtype: torch.dtype = torch.float32):
    """GPT2LMHeadModel state dict (without the tied lm_head.weight) from a canonical state dict.

    Also accepts our module's own state_dict: a `lm_head.weight` key is dropped if it equals `wte.weight`.
    """
    state = dict(state)
    lm_head = state.pop("lm_head.weight", None)
    _check_state(state, cfg, "state dict")
    wte = state["wte.weight"]
    if lm_head is not None and (lm_head.shape != wte.shape or not torch.equal(lm_head, wte)):
        raise ValueError("state dict: 'lm_head.weight' differs from 'wte.weight'; GPT-2 ties them")
    out = {}
    for name, tensor in state.items():
        if not tensor.is_floating_point():
            raise TypeError(f"state dict: tensor {name!r} has dtype {tensor.dtype}, expected a float dtype")
        tensor = tensor.detach().to(device="cpu", dtype=dtype)
        if name.endswith(_CONV1D_SUFFIXES):
            tensor = tensor.t()
        # clone: safetensors refuses tensors that share storage (or views of a larger one).
        out["transformer." + name] = tensor.contiguous().clone()
    return out


# ----------------------------------------------------------------------------------------------- loading


def _read_safetensors(file: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    try:
        return load_file(str(file), device="cpu")
    except Exception as e:  # corrupt / truncated file
        raise ValueError(f"cannot read safetensors file {file}: {e}") from e


def _read_torch_bin(file: Path) -> dict[str, torch.Tensor]:
    try:
        return torch.load(str(file), map_location="cpu", weights_only=True)
    except Exception as e:
        raise ValueError(f"cannot read {file} with torch.load(weights_only=True): {e}") from e


def _read_sharded(index_file: Path, reader) -> dict[str, torch.Tensor]:
    try:
        weight_map = json.loads(index_file.read_text())["weight_map"]
    except (json.JSONDecodeError, KeyError, TypeError) as e:
        raise ValueError(f"{index_file}: not a valid checkpoint index (needs a 'weight_map'): {e}") from e
    shards: dict[str, list[str]] = {}
    for key, shard in weight_map.items():
        shards.setdefault(shard, []).append(key)
    out: dict[str, torch.Tensor] = {}
    for shard, keys in shards.items():
        shard_file = index_file.parent / shard
        if not shard_file.is_file():
            raise FileNotFoundError(f"{index_file}: shard file {shard_file} is missing")
        tensors = reader(shard_file)
        for key in keys:
            if key not in tensors:
                raise KeyError(f"{shard_file}: tensor {key!r} listed in {index_file.name} is missing")
            out[key] = tensors[key]
    return out


def load_hf_checkpoint(
    path: str | os.PathLike, dropout: float | None = None, dtype: torch.dtype | None = torch.float32
) -> tuple[GPTConfig, dict[str, torch.Tensor]]:
    """Read a Hugging Face GPT-2 `save_pretrained` directory into (our config, canonical state dict).

    Weights come from model.safetensors, a sharded model.safetensors.index.json, or (legacy, read with
    weights_only=True) pytorch_model.bin / pytorch_model.bin.index.json, in that order of preference.
    Tensors are cast to `dtype` (None keeps the stored dtype). `dropout` overrides the config's rates.
    """
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint path {root} is not a directory (expected a save_pretrained dir)")
    config_file = root / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"checkpoint directory {root} has no {CONFIG_NAME}")
    try:
        hf_cfg = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON: {e}") from e
    try:
        cfg = gpt_config_from_hf(hf_cfg, dropout=dropout)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from e

    if (root / SAFE_WEIGHTS_NAME).is_file():
        source = root / SAFE_WEIGHTS_NAME
        hf_state = _read_safetensors(source)
    elif (root / SAFE_WEIGHTS_INDEX_NAME).is_file():
        source = root / SAFE_WEIGHTS_INDEX_NAME
        hf_state = _read_sharded(source, _read_safetensors)
    elif (root / PT_WEIGHTS_NAME).is_file():
        source = root / PT_WEIGHTS_NAME
        hf_state = _read_torch_bin(source)
    elif (root / PT_WEIGHTS_INDEX_NAME).is_file():
        source = root / PT_WEIGHTS_INDEX_NAME
        hf_state = _read_sharded(source, _read_torch_bin)
    else:
        raise FileNotFoundError(
            f"checkpoint directory {root} has no weights: looked for {SAFE_WEIGHTS_NAME}, "
            f"{SAFE_WEIGHTS_INDEX_NAME}, {PT_WEIGHTS_NAME}, {PT_WEIGHTS_INDEX_NAME}"
        )
    if not isinstance(hf_state, Mapping):
        raise ValueError(f"{source}: expected a mapping of tensor names to tensors")
    state = hf_to_canonical(hf_state, cfg, source=str(source))
    if dtype is not None:
        state = {k: v.to(dtype) for k, v in state.items()}
    return cfg, state


# ------------------------------------------------------------------------------------------------ saving


def save_hf_checkpoint(
    cfg: GPTConfig,
    state: Mapping[str, torch.Tensor],
    out_dir: str | os.PathLike,
    tokenizer_dir: str | os.PathLike | None = None,
    dtype: torch.dtype = torch.float32,
    overwrite: bool = False,
) -> Path:
    """Write `out_dir` so that `transformers.GPT2LMHeadModel.from_pretrained(out_dir)` loads it.

    `state` is canonical (or our module's state_dict, tied lm_head.weight included), tensors of any float
    dtype on any device; they are saved as `dtype`. Every file under `tokenizer_dir` is copied alongside.
    The directory is built under a temporary name next to `out_dir` and renamed into place; an existing
    `out_dir` is an error unless `overwrite` (then it is replaced, also by rename).
    """
    from safetensors.torch import save_file

    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    tok = None
    if tokenizer_dir is not None:
        tok = Path(tokenizer_dir)
        if not tok.is_dir():
            raise FileNotFoundError(f"tokenizer directory {tok} does not exist")
        clash = sorted(p.name for p in tok.iterdir() if p.name in (CONFIG_NAME, SAFE_WEIGHTS_NAME))
        if clash:
            raise ValueError(f"tokenizer directory {tok} contains {clash}, which would clobber the model files")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a float dtype, got {dtype}")

    hf_state = canonical_to_hf(state, cfg, dtype=dtype)  # validates before anything touches the disk
    hf_config = hf_config_from_gpt(cfg, dtype=dtype)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        if tok is not None:
            shutil.copytree(tok, tmp, dirs_exist_ok=True)
        hf_config.to_json_file(str(tmp / CONFIG_NAME))
        save_file(hf_state, str(tmp / SAFE_WEIGHTS_NAME), metadata={"format": "pt"})
        for file in tmp.rglob("*"):
            if file.is_file():
                fsync_path(file)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700
        if out.exists():
            old = Path(tempfile.mkdtemp(prefix=f".{out.name}.old-", dir=out.parent))
            os.replace(out, old / out.name)
        os.replace(tmp, out)
    except BaseException:
        if old is not None and not out.exists():  # put the previous checkpoint back
            os.replace(old / out.name, out)
        shutil.rmtree(tmp, ignore_errors=True)
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    try:  # make the rename durable
        fd = os.open(out.parent, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError:
        pass
    return out
