"""Hugging Face interop for every model family: read and write `save_pretrained` directories through the family's
adapter (models/<family>/hf.py: config mapping, names, fused weights, transposes).

    HFDirectory(path)            config.json -> the family and our config; its tensors indexed, read lazily
      .check()                   every tensor our model needs is there with its shape, nothing unexpected (headers only)
      .tensor(name)              one canonical tensor, read from the files that hold its parts
      .shard(name, spec, ...)    a tp rank's shard of one, reading only the byte ranges it overlaps
    load_hf_checkpoint(path)     (config, canonical state dict), checked
Writing such a directory: hf_save.py.

Weights come from model.safetensors, a sharded model.safetensors.index.json (each tensor read from its shard alone,
`safe_open`), or a legacy pytorch_model.bin (read with `torch.load(weights_only=True)`); nothing is ever unpickled.
`transformers` is imported lazily, only to write config.json.
"""

from __future__ import annotations

import dataclasses
import json
import os
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.fp8_blocks import BlockScales, block_size
from trainer3d.checkpoint.pieces import Piece, read_local, tp_boxes
from trainer3d.models import FAMILIES, canonical_shapes, canonical_tables, family_for_hf, family_of

CONFIG_NAME = "config.json"
GENERATION_CONFIG_NAME = "generation_config.json"
SAFE_WEIGHTS_NAME = "model.safetensors"
SAFE_WEIGHTS_INDEX_NAME = "model.safetensors.index.json"
PT_WEIGHTS_NAME = "pytorch_model.bin"
PT_WEIGHTS_INDEX_NAME = "pytorch_model.bin.index.json"
# bytes per element of each safetensors dtype (the header's spelling)
_SAFETENSORS_BYTES = {"F64": 8, "I64": 8, "U64": 8, "F32": 4, "I32": 4, "U32": 4, "F16": 2, "BF16": 2, "I16": 2,
                      "U16": 2, "F8_E4M3": 1, "F8_E5M2": 1, "I8": 1, "U8": 1, "BOOL": 1}
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
    block = block_size(raw)  # FP8 weights with block scales: read dequantized (fp8_blocks.py), the family sees bf16's
    raw = {k: v for k, v in raw.items() if k != "quantization_config"} if block else raw
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
        fp8 = [f"FP8 weights with {block[0]}x{block[1]} block scales, dequantized as they are read"] if block else []
        notes.extend(f"{root}: {note}" for note in fp8 + family.hf.import_notes(raw) + fitted)
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
        # FP8 weights with block scales: the scales taken out of the index, each weight read as what it stands for
        block = block_size(json.loads((self.root / CONFIG_NAME).read_text()))
        self.scales = BlockScales(block, self.index, self._read_slice, self._stored_shape)

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
        """A whole stored tensor (FP8 with block scales: the values it stands for, in fp32)."""
        file, key = self.index[hf_name]
        try:
            t = self._bin(file)[key] if file.suffix == ".bin" else self._safe(file).get_tensor(key)
        except Exception as e:  # noqa: BLE001
            raise KeyError(f"{file}: tensor {key!r} listed in {self.source.name} is missing ({e})") from None
        return self.scales.values(hf_name, t, *(slice(0, n) for n in t.shape)) if hf_name in self.scales else t

    def _stored_shape(self, file: Path, key: str) -> tuple[int, ...]:
        if file.suffix == ".bin":
            return tuple(self._bin(file)[key].shape)
        try:
            return tuple(self._safe(file).get_slice(key).get_shape())
        except Exception as e:  # noqa: BLE001
            raise KeyError(f"{file}: tensor {key!r} listed in {self.source.name} is missing ({e})") from None

    def stored_itemsize(self, hf_name: str) -> int:
        """Bytes per element of a stored tensor, from its file's header (a .bin: loaded)."""
        file, key = self.index[hf_name]
        if file.suffix == ".bin":
            return self._bin(file)[key].element_size()
        return _SAFETENSORS_BYTES[self._safe(file).get_slice(key).get_dtype()]

    def _hf_shape(self, hf_name: str) -> tuple[int, ...]:
        return self._stored_shape(*self.index[hf_name])

    def _read_slice(self, file: Path, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        """Those bytes of a stored tensor (counted in bytes_read)."""
        t = self._bin(file)[key][slices] if file.suffix == ".bin" else self._safe(file).get_slice(key)[slices]
        self.bytes_read += t.numel() * t.element_size()
        return t

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
        extra = [n for n in self.index if n not in used and not self.adapter.passthrough(n)]
        unexpected = sorted(n for n in extra if not self.adapter.ignored(self.cfg, n))
        if missing or unexpected:
            problems = ([f"missing tensors {abbrev(missing)}"] if missing else []) + \
                       ([f"unexpected tensors {abbrev(unexpected)}"] if unexpected else [])
            raise ValueError(f"{self.source}: " + "; ".join(problems))
        for hf_name, shape in expected.items():
            got = self._hf_shape(hf_name)
            if got != shape:
                raise ValueError(f"{self.source}: tensor {hf_name!r} has shape {got}, expected {shape} for the config")
        self.scales.check(expected, self.source)
        for hf_name in extra:
            self.adapter.check_extra(self.cfg, hf_name, self.hf_tensor(hf_name), self.tensor)

    def passthrough(self) -> dict[str, tuple[int, ...]]:
        """The tensors an export copies unchanged from here (HFAdapter.passthrough), by stored name, with shapes."""
        return {self.index[n][1]: self._hf_shape(n) for n in sorted(self.index) if self.adapter.passthrough(n)}

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
        t = self._read_slice(file, key, slices)
        if hf_name in self.scales:  # FP8 with block scales (a Linear's [out, in], never a transposed Conv1D)
            t = self.scales.values(hf_name, t, *slices)
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


def abbrev(names: list[str], limit: int = 8) -> str:
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
