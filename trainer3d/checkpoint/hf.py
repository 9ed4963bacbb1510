"""Hugging Face interop for every model family: read and write `save_pretrained` directories through the family's
adapter (models/<family>/hf.py: config mapping, names, fused weights, transposes).

    HFDirectory(path)            config.json -> the family and our config; its tensors indexed, read lazily
      .check()                   every tensor our model needs is there with its shape, nothing unexpected (headers only)
      .tensor(name)              one canonical tensor, read from the files that hold its parts
      .shard(name, spec, ...)    a tp rank's shard of one, reading only the byte ranges it overlaps
    load_hf_checkpoint(path)     (config, canonical state dict), checked
    save_hf_checkpoint(cfg, state, out_dir, tokenizer_dir=None, ..., max_shard_size="5GB")   loadable by the
                                 family's `from_pretrained`; written one size-limited file at a time

Weights come from model.safetensors, a sharded model.safetensors.index.json (each tensor read from its shard alone,
`safe_open`), or a legacy pytorch_model.bin (read with `torch.load(weights_only=True)`); nothing is ever unpickled.
`transformers` is imported lazily, only to write config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.pieces import Piece, read_local, tp_boxes
from trainer3d.fsio import fsync_path
from trainer3d.models import FAMILIES, canonical_shapes, canonical_tables, family_for_hf, family_of

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PT_WEIGHTS_NAME = "pytorch_model.bin"
PT_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
WEIGHT_FILES = (SAFE_WEIGHTS_NAME, SAFE_WEIGHTS_INDEX_NAME, PT_WEIGHTS_NAME, PT_WEIGHTS_INDEX_NAME)


def read_hf_config(path: str | os.PathLike, dropout: float | None = None, notes: list[str] | None = None):
    """(family, our config) from a directory's config.json; FileNotFoundError / ValueError naming the problem.
    `notes`: extended with the family's notes on what the config declares and trainer3d leaves out."""
    root = Path(path)
    if not root.exists():
        raise FileNotFoundError(f"checkpoint directory {root} does not exist")
    if not root.is_dir():
        raise NotADirectoryError(f"checkpoint path {root} is not a directory (expected a save_pretrained dir)")
    config_file = root / CONFIG_NAME
    if not config_file.is_file():
        raise FileNotFoundError(f"checkpoint directory {root} has no {CONFIG_NAME}")
    try:
        raw = json.loads(config_file.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"{config_file}: invalid JSON: {e}") from e
    model_type = raw.get("model_type", "gpt2")  # GPT-2 files from before model_type was written
    family = family_for_hf(model_type)
    if family is None:
        known = ", ".join(repr(t) for f in FAMILIES.values() for t in f.hf.model_types)
        raise ValueError(f"{config_file}: model_type {model_type!r} is no family trainer3d trains (known: {known})")
    try:
        cfg = family.hf.config_from_hf(raw, dropout)
    except ValueError as e:
        raise ValueError(f"{config_file}: {e}") from e
    cfg, fitted = family.hf.fit_to_weights(cfg, lambda: weight_names(root))
    if notes is not None:
        notes.extend(f"{root}: {note}" for note in family.hf.import_notes(raw) + fitted)
    return family, cfg


def weight_names(root: Path) -> set[str]:
    """Every tensor name a directory's weight files hold (its index, or its one file's header; a .bin is loaded)."""
    source = next((root / n for n in WEIGHT_FILES if (root / n).is_file()), None)
    if source is None or source.name.endswith(".index.json"):
        return set(json.loads(source.read_text()).get("weight_map", {})) if source else set()
    if source.suffix == ".bin":
        return set(torch.load(str(source), map_location="cpu", weights_only=True))
    from safetensors import safe_open

    with safe_open(str(source), framework="pt", device="cpu") as f:
        return set(f.keys())


def hf_tables(cfg) -> dict[str, tuple[str, torch.Size]]:
    """The model's tables (canonical_tables) that the family's Hugging Face format holds: name -> (HF name, shape)."""
    adapter = family_of(cfg).hf
    named = {name: (adapter.table_name(cfg, name), shape) for name, shape in canonical_tables(cfg).items()}
    return {name: (hf, shape) for name, (hf, shape) in named.items() if hf is not None}


def hf_tensors(cfg, name: str, tensor: torch.Tensor, tables: Mapping) -> dict[str, torch.Tensor]:
    """A canonical parameter or table as the Hugging Face tensors it is stored as (a table: itself, in fp32)."""
    if name in tables:
        return {tables[name][0]: tensor.float()}
    return family_of(cfg).hf.to_hf(cfg, name, tensor)


class HFDirectory:
    """A `save_pretrained` directory, opened: its family and config, and an index of which file holds which tensor.
    Only headers are read until a tensor is asked for."""

    def __init__(self, path: str | os.PathLike, dropout: float | None = None, mtp_layers: int | None = None):
        """`mtp_layers`: the multi-token prediction modules the run builds, where it builds fewer than the files hold
        (--mtp-loss-coef 0); the others are skipped."""
        self.root = Path(path)
        self.notes: list[str] = []  # what the config declares and trainer3d leaves out (the run's log says it)
        self.family, self.cfg = read_hf_config(self.root, dropout, self.notes)
        if mtp_layers is not None and mtp_layers < getattr(self.cfg, "mtp_layers", 0):
            self.notes.append(f"{self.root}: the weights of {self.cfg.mtp_layers - mtp_layers} multi-token-prediction "
                              f"layer(s) past the {mtp_layers} this run builds are skipped (--mtp-layers, or "
                              "--mtp-loss-coef 0)")
            self.cfg = dataclasses.replace(self.cfg, mtp_layers=mtp_layers)
        self.tables = hf_tables(self.cfg)
        self.adapter = self.family.hf
        self.source = next((self.root / n for n in WEIGHT_FILES if (self.root / n).is_file()), None)
        if self.source is None:
            raise FileNotFoundError(f"checkpoint directory {self.root} has no weights: looked for "
                                    f"{', '.join(WEIGHT_FILES)}")
        self._handles: dict[Path, object] = {}
        self._bins: dict[Path, dict] = {}
        self._transposed: dict[str, bool] = {}
        self.bytes_read = 0  # tensor bytes read by shard()
        self.nonfinite: str | None = None  # the first tensor read with nan or inf in it (checkpoint/hf_init.py)
        self._expert_part: dict[str, bool] = {}  # HF name -> one expert's slice of a stacked weight (_pieces)
        self.index = self._build_index()  # HF name (normalized) -> (file, name in the file)

    # -- the files ---------------------------------------------------------------------------------------------------
    def _build_index(self) -> dict[str, tuple[Path, str]]:
        if self.source.name.endswith(".index.json"):
            try:
                weight_map = json.loads(self.source.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ValueError(f"{self.source}: not a valid checkpoint index (needs a 'weight_map'): {e}") from e
            files = {name: self.root / shard for name, shard in weight_map.items()}
            for f in sorted(set(files.values())):
                if not f.is_file():
                    raise FileNotFoundError(f"{self.source}: shard file {f} is missing")
        else:
            files = {name: self.source for name in self._keys(self.source)}
        return {self.adapter.normalize(name): (f, name) for name, f in files.items()}

    def _keys(self, file: Path) -> list[str]:
        return list(self._bin(file)) if file.suffix == ".bin" else list(self._safe(file).keys())

    def _safe(self, file: Path):
        if file not in self._handles:
            from safetensors import safe_open

            try:
                self._handles[file] = safe_open(str(file), framework="pt", device="cpu")
            except Exception as e:  # noqa: BLE001 - corrupt / truncated file
                raise ValueError(f"cannot read safetensors file {file}: {e}") from e
        return self._handles[file]

    def _bin(self, file: Path) -> dict:
        if file not in self._bins:
            try:
                self._bins[file] = torch.load(str(file), map_location="cpu", weights_only=True)
            except Exception as e:  # noqa: BLE001
                raise ValueError(f"cannot read {file} with torch.load(weights_only=True): {e}") from e
            if not isinstance(self._bins[file], Mapping):
                raise ValueError(f"{file}: expected a mapping of tensor names to tensors")
        return self._bins[file]

    def hf_tensor(self, hf_name: str) -> torch.Tensor:
        file, key = self.index[hf_name]
        if file.suffix == ".bin":
            return self._bin(file)[key]
        try:
            return self._safe(file).get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise KeyError(f"{file}: tensor {key!r} listed in {self.source.name} is missing ({e})") from None

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        file, key = self.index[hf_name]
        if file.suffix == ".bin":
            return tuple(self._bin(file)[key].shape)
        try:
            return tuple(self._safe(file).get_slice(key).get_shape())
        except Exception as e:  # noqa: BLE001
            raise KeyError(f"{file}: tensor {key!r} listed in {self.source.name} is missing ({e})") from None

    # -- canonical tensors ----------------------------------------------------------------------------------------------
    def check(self) -> None:
        """Every tensor the model needs is present with its shape, and none is left over (headers only)."""
        expected, missing, used = {}, [], set()
        for name, shape in canonical_shapes(self.cfg).items():
            parts = self.adapter.to_hf(self.cfg, name, torch.empty(shape, device="meta"))
            if any(p not in self.index for p in parts):
                missing.append(name)
            used.update(parts)
            expected.update({p: tuple(t.shape) for p, t in parts.items()})
        for name, (hf_name, shape) in self.tables.items():
            if hf_name not in self.index:
                missing.append(hf_name)
            used.add(hf_name)
            expected[hf_name] = tuple(shape)
        unexpected = sorted(n for n in self.index if n not in used and not self.adapter.ignored(self.cfg, n))
        if missing or unexpected:
            problems = ([f"missing tensors {_abbrev(missing)}"] if missing else []) + \
                       ([f"unexpected tensors {_abbrev(unexpected)}"] if unexpected else [])
            raise ValueError(f"{self.source}: " + "; ".join(problems))
        for hf_name, shape in expected.items():
            got = self._hf_shape(hf_name)
            if got != shape:
                raise ValueError(f"{self.source}: tensor {hf_name!r} has shape {got}, expected {shape} for the config")
        for hf_name in self.index:
            if self.adapter.ignored(self.cfg, hf_name):
                self.adapter.check_extra(self.cfg, hf_name, self.hf_tensor(hf_name), self.tensor)

    def tensor(self, name: str) -> torch.Tensor:
        """The canonical tensor `name`, in the stored dtype."""
        parts = [self.hf_tensor(s) for s in self.adapter.sources(self.cfg, name)]
        return self.adapter.from_hf(self.cfg, name, parts).contiguous()

    # -- a rank's shard of a canonical tensor, reading only its byte ranges -------------------------------------------
    def shard(self, name: str, spec, local_shape: tuple[int, ...], tp_rank: int, tp: int) -> torch.Tensor:
        """This tp rank's shard (TPSpec `spec`; None: whole) of the canonical tensor `name`, in fp32: each HF tensor
        it is made of is a piece of it (checkpoint/pieces.py), and only the blocks the shard overlaps are read."""
        boxes = tp_boxes(spec, tuple(local_shape), tp_rank, tp)
        return read_local(self._pieces(name), boxes, tuple(local_shape), self._read_block)

    def _pieces(self, name: str) -> list[Piece]:
        """Each HF tensor as a piece of the canonical tensor: rows stacked along dim 0, or (per-expert tensors) one
        expert's slice of a stacked weight, its own rows stacked within it."""
        out, row = [], {}
        for part in self.adapter.parts(self.cfg, name):
            shape = self._hf_shape(part.name)
            size = tuple(reversed(shape)) if part.transposed else shape
            self._transposed[part.name] = part.transposed
            self._expert_part[part.name] = part.expert is not None
            at = row.get(part.expert, 0)
            if part.expert is not None:
                out.append(Piece(part.name, part.name, part.origin(at, len(size) + 1), (1, *size)))
            else:
                out.append(Piece(part.name, part.name, part.origin(at, len(size)), size))
            row[part.expert] = at + size[0]
        return out

    def _read_block(self, hf_name: str, _key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        file, key = self.index[hf_name]
        transposed, expert = self._transposed[hf_name], self._expert_part[hf_name]
        if expert:  # the piece's leading dim is the expert's own (size 1): not a dim of the HF tensor
            slices = slices[1:]
        if transposed:
            slices = slices[::-1]
        t = self._bin(file)[key][slices] if file.suffix == ".bin" else self._safe(file).get_slice(key)[slices]
        self.bytes_read += t.numel() * t.element_size()
        t = t.t() if transposed else t
        return t.unsqueeze(0) if expert else t

    def table(self, name: str) -> torch.Tensor | None:
        """The model table `name` in fp32, or None where the family's format has no slot for it."""
        return self.hf_tensor(self.tables[name][0]).float() if name in self.tables else None

    def state(self, dtype: torch.dtype | None = torch.float32) -> dict[str, torch.Tensor]:
        """Every canonical parameter (cast to `dtype`; None: as stored), and the tables the format holds (fp32)."""
        out = {name: self.tensor(name) for name in canonical_shapes(self.cfg)}
        out = out if dtype is None else {k: v.to(dtype) for k, v in out.items()}
        return {**out, **{name: self.table(name) for name in self.tables}}


def _abbrev(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(repr(n) for n in names[:limit])
    return f"[{shown}{', ...' if len(names) > limit else ''}] ({len(names)} in all)"


def load_hf_checkpoint(path: str | os.PathLike, dropout: float | None = None,
                       dtype: torch.dtype | None = torch.float32):
    """(our config, canonical state dict) of a Hugging Face directory of any known family, checked; tensors cast to
    `dtype` (None keeps the stored dtype), the tables the format holds (a router's selection bias) in fp32.
    `dropout` overrides the config's rates."""
    d = HFDirectory(path, dropout)
    d.check()
    return d.cfg, d.state(dtype)


# ------------------------------------------------------------------------------------------------ saving
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
        parts = ([f"missing tensors {_abbrev(missing)}"] if missing else []) + \
                ([f"unexpected tensors {_abbrev(unexpected)}"] if unexpected else [])
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
    shards: list[list[str]] = [[]]
    used = 0
    for name, shape in shapes.items():
        parts = hf_tensors(cfg, name, torch.empty(shape, device="meta", dtype=dtype), tables)
        size = sum(t.numel() * t.element_size() for t in parts.values())
        if shards[-1] and used + size > max_bytes:
            shards.append([])
            used = 0
        shards[-1].append(name)
        used += size
    return shards


def write_hf_weights(cfg, state: Mapping[str, torch.Tensor], shapes: Mapping[str, torch.Size], out: Path,
                     dtype: torch.dtype, max_bytes: int) -> list[str]:
    """The weights of `state` (its checked names and shapes: `_checked_keys`) into `out`, in files of at most
    `max_bytes` (`model.safetensors`, or `model-0000k-of-0000n.safetensors` and `model.safetensors.index.json`): only
    one file's tensors are in memory at a time, read from `state` (which may read them lazily, as a checkpoint
    does). Returns the files written."""
    from safetensors.torch import save_file

    shards = plan_shards(cfg, shapes, dtype, max_bytes)
    files = [SAFE_WEIGHTS_NAME] if len(shards) == 1 else \
        [f"model-{i + 1:05d}-of-{len(shards):05d}.safetensors" for i in range(len(shards))]
    weight_map, total, tables = {}, 0, hf_tables(cfg)
    for file, shard in zip(files, shards):
        tensors = {}
        for name in shard:
            tensors.update(to_hf(cfg, name, state[name], dtype, shapes[name], tables))
        save_file(tensors, str(out / file), metadata={"format": "pt"})
        weight_map.update({k: file for k in tensors})
        total += sum(t.numel() * t.element_size() for t in tensors.values())
        del tensors
    if len(files) > 1:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        (out / SAFE_WEIGHTS_INDEX_NAME).write_text(json.dumps(index, indent=2) + "\n")
        files.append(SAFE_WEIGHTS_INDEX_NAME)
    return files


def save_hf_checkpoint(cfg, state: Mapping[str, torch.Tensor], out_dir: str | os.PathLike,
                       tokenizer_dir: str | os.PathLike | None = None, dtype: torch.dtype = torch.float32,
                       overwrite: bool = False, eos_token_id: int | list[int] | None = None,
                       bos_token_id: int | None = None, max_shard_size: int | str = "5GB",
                       generation: Mapping | None = None) -> Path:
    """Write `out_dir` so that the family's transformers class (`GPT2LMHeadModel`, `LlamaForCausalLM`) loads it with
    `from_pretrained`. `state` is canonical (or our module's state_dict), tensors of any float dtype on any device,
    saved as `dtype`; a lazy mapping is read one file's tensors at a time (write_hf_weights). Every file under
    `tokenizer_dir` is copied alongside; `generation` (GenerationConfig's arguments: the ids that end a reply) is
    written as generation_config.json, which `generate` reads. Built under a temporary name next to `out_dir` and
    renamed into place; an existing `out_dir` is an error unless `overwrite` (replaced, also by rename)."""
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
        hf_config.to_json_file(str(tmp / CONFIG_NAME))
        if generation_config is not None:
            generation_config.to_json_file(str(tmp / GENERATION_CONFIG_NAME))
        write_hf_weights(cfg, state, shapes, tmp, dtype, max_bytes)
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
