"""Writing a Hugging Face `save_pretrained` directory for every model family, through its adapter (hf.py reads
them): `save_hf_checkpoint(cfg, state, out_dir, tokenizer_dir=None, ..., max_shard_size="5GB")`, loadable by the
family's `from_pretrained`, written one size-limited file at a time, atomically. `transformers` is imported lazily,
only to write config.json."""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.hf import (
    CONFIG_NAME, GENERATION_CONFIG_NAME, SAFE_WEIGHTS_INDEX_NAME, SAFE_WEIGHTS_NAME, abbrev, hf_tables, hf_tensors,
)
from trainer3d.fsio import fsync_path
from trainer3d.models import canonical_shapes, family_of


def _checked_keys(state: Mapping[str, torch.Tensor], cfg) -> dict[str, torch.Size]:
    """The canonical names of `state` (a tied head equal to the embedding dropped: our module's own state_dict), in
    the model's order, with the shapes the config gives them, the tables the family's format holds last (hf_tables);
    ValueError naming what is missing or unexpected. Reads no tensor but a tied head."""
    family = family_of(cfg)
    expected = {**canonical_shapes(cfg), **{name: shape for name, (_, shape) in hf_tables(cfg).items()}}
    names = set(state)
    head, embedding = f"{family.model_cls.HEAD}.weight", f"{family.model_cls.EMBEDDING}.weight"
    if cfg.tie_embeddings and head in names:
        tied = state[head]
        if embedding in names and (tied.shape != state[embedding].shape or not torch.equal(tied, state[embedding])):
            raise ValueError(f"state dict: {head!r} differs from {embedding!r}; the config ties them")
        names.discard(head)
    missing, unexpected = sorted(set(expected) - names), sorted(names - set(expected))
    if missing or unexpected:
        parts = ([f"missing tensors {abbrev(missing)}"] if missing else []) + \
                ([f"unexpected tensors {abbrev(unexpected)}"] if unexpected else [])
        raise ValueError("state dict: " + "; ".join(parts))
    return {n: shape for n, shape in expected.items() if n in names}


def to_hf(cfg, name: str, tensor: torch.Tensor, dtype: torch.dtype, shape,
           tables: Mapping) -> dict[str, torch.Tensor]:
    """One canonical tensor as its Hugging Face tensors, checked against the `shape` the config gives it (`tables`:
    hf_tables(cfg), which keep fp32)."""
    expected = tuple(shape)
    if tuple(tensor.shape) != expected:
        raise ValueError(f"state dict: tensor {name!r} has shape {tuple(tensor.shape)}, expected {expected} for the "
                         "config")
    if not tensor.is_floating_point():
        raise TypeError(f"state dict: tensor {name!r} has dtype {tensor.dtype}, expected a float dtype")
    tensor = tensor.detach().to(device="cpu", dtype=torch.float32 if name in tables else dtype)
    # (contiguous clones: safetensors refuses tensors that share storage)
    return {k: v.contiguous().clone() for k, v in hf_tensors(cfg, name, tensor, tables).items()}


def canonical_to_hf(state: Mapping[str, torch.Tensor], cfg, dtype: torch.dtype = torch.float32) -> dict:
    """The HF state dict (tied head omitted) from a canonical one, or from our module's own state_dict."""
    out, tables = {}, hf_tables(cfg)
    for name, shape in _checked_keys(state, cfg).items():
        out.update(to_hf(cfg, name, state[name], dtype, shape, tables))
    return out


def parse_size(size: int | str) -> int:
    """Bytes from Hugging Face's `max_shard_size` spelling: an int, or "5GB" (10^9), "500MiB" (2^20), "10KB"..."""
    if isinstance(size, int):
        return size
    units = {"B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
             "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}
    text = str(size).strip().upper()
    for unit in sorted(units, key=len, reverse=True):
        if text.endswith(unit) and text[: -len(unit)].strip().replace(".", "", 1).isdigit():
            return int(float(text[: -len(unit)]) * units[unit])
    if text.isdigit():
        return int(text)
    raise ValueError(f"max_shard_size {size!r} is not a size (an int, or a number with B, KB, MB, GB, MiB, GiB)")


def plan_shards(cfg, shapes: Mapping[str, torch.Size], dtype: torch.dtype, max_bytes: int) -> list[list[str]]:
    """Canonical tensors (name -> shape) grouped into files of at most `max_bytes` of Hugging Face tensors each, in
    order (a tensor bigger than that gets a file of its own), as `save_pretrained(max_shard_size=...)` does."""
    tables = hf_tables(cfg)

    def size(name: str) -> int:
        parts = hf_tensors(cfg, name, torch.empty(shapes[name], device="meta", dtype=dtype), tables)
        return sum(t.numel() * t.element_size() for t in parts.values())

    return by_size(list(shapes), size, max_bytes)


def by_size(names: list[str], size, max_bytes: int) -> list[list[str]]:
    """`names` in order, in groups of at most `max_bytes` by `size(name)` (a bigger one alone)."""
    shards: list[list[str]] = [[]]
    used = 0
    for name in names:
        n = size(name)
        if shards[-1] and used + n > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += n
    return shards


def write_hf_weights(cfg, state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], out: Path,
                     dtype: torch.dtype, max_bytes: int, rename=None, source=None) -> list[str]:
    """The weights of `state` (its checked names and shapes: `_checked_keys`) into `out`, in files of at most
    `max_bytes` (`model.safetensors`, or `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`): only
    one file's tensors are in memory at a time, read from `state` (which may read them lazily, as a checkpoint
    does). `rename`: each HF name's stored name (a multimodal wrapper's); `source`: a hf_source.SourceTensors whose
    tensors follow ours unchanged, in files of their own. Returns the files written."""
    from safetensors.torch import save_file

    shards = plan_shards(cfg, shapes, dtype, max_bytes)
    extra = _source_shards(source, max_bytes)
    files = [SAFE_WEIGHTS_NAME] if len(shards) == 1 and not extra else \
        [f"model-{i + 1:05d}-of-{len(shards) + len(extra):05d}.safetensors" for i in range(len(shards) + len(extra))]
    weight_map, total, tables = {}, 0, hf_tables(cfg)
    for i, (file, shard) in enumerate(zip(files, shards + extra)):
        if i < len(shards):
            tensors = {}
            for name in shard:
                tensors.update(to_hf(cfg, name, state[name], dtype, shapes[name], tables))
            tensors = {rename(k) if rename else k: v for k, v in tensors.items()}
        else:  # (the source's tensors, as stored)
            tensors = {name: source.read(name) for name in shard}
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files.append(SAFE_WEIGHTS_INDEX_NAME)
    return files


def _source_shards(source, max_bytes: int) -> list[list[str]]:
    """The source's tensors (by stored name) in files of at most `max_bytes` (their stored dtypes, from the headers)."""
    if source is None:
        return []
    return by_size(list(source.shapes),
                    lambda name: math.prod(source.shapes[name]) * source.directory.stored_itemsize(name), max_bytes)


def save_hf_checkpoint(cfg, state: Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                       tokenizer_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                       overwrite: bool = False, eos_token_id: int | list[int] | None = None,
                       bos_token_id: int | None = None, max_shard_size: int | str = "5GB",
                       generation: Mapping | None = None, source=None) -> Path:
    """Write `out_dir` so that the family's transformers class (`GPT2LMHeadModel`, `LlamaForCausalLM`) loads it with
    `from_pretrained`. `state` is canonical (or our module's state_dict), tensors of any float dtype on any device,
    saved as `dtype`; a lazy mapping is read one file's tensors at a time (write_hf_weights). Every file under
    `tokenizer_dir` is copied alongside; `generation` (GenerationConfig's arguments: the ids that end a reply) is
    written as generation_config.json, which `generate` reads. Built under a temporary name next to `out_dir` and
    renamed into place; an existing `out_dir` is an error unless `overwrite` (replaced, also by rename). `source`
    (checkpoint/hf_source.SourceTensors): the directory the run started from, whose wrapping architecture and
    config (a multimodal model's) the export keeps and whose untrained tensors it copies unchanged."""
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise FileExistsError(f"{out} already exists (pass overwrite=True to replace it)")
    tok = None
    if tokenizer_dir is not None:
        tok = Path(tokenizer_dir)
        if not tok.is_dir():
            raise FileNotFoundError(f"tokenizer directory {tok} does not exist")
        clash = sorted(p.name for p in tok.iterdir() if p.name in (CONFIG_NAME, SAFE_WEIGHTS_NAME,
                                                                   SAFE_WEIGHTS_INDEX_NAME))
        if clash:
            raise ValueError(f"tokenizer directory {tok} contains {clash}, which would clobber the model files")
    if not dtype.is_floating_point:
        raise TypeError(f"dtype must be a float dtype, got {dtype}")
    shapes = _checked_keys(state, cfg)  # before anything touches the disk (each tensor's shape: as it is read)
    max_bytes = parse_size(max_shard_size)
    hf_config = family_of(cfg).hf.hf_config(cfg, dtype, eos_token_id, bos_token_id)
    layout = None if source is None else family_of(cfg).hf.export_layout(source.config, hf_config)
    generation_config = None
    if generation is not None:
        from transformers import GenerationConfig

        generation_config = GenerationConfig(**generation)

    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.tmp-", dir=out.parent))
    old = None
    try:
        if tok is not None:
            shutil.copytree(tok, tmp, dirs_exist_ok=True)
        if layout is None:
            hf_config.to_json_file(str(tmp / CONFIG_NAME))
        else:
            (tmp / CONFIG_NAME).write_text(json.dumps(layout[0], indent=2, sort_keys=True) + "\n")
        if generation_config is not None:
            generation_config.to_json_file(str(tmp / GENERATION_CONFIG_NAME))
        write_hf_weights(cfg, state, shapes, tmp, dtype, max_bytes, rename=layout[1] if layout else None,
                         source=source)
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
    fsync_path(out.parent)  # make the rename durable
    return out
