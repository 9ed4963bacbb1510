"""Checkpoints that survive anything: layout-free on disk, written in parallel by every rank, atomic, safe to load,
saved on SLURM's signals.

On-disk format 2 (one directory per checkpoint, `<out-dir>/checkpoints/step_000123/`):

    meta.json                    step, format version, full config, model family and shape, layout saved under, loader
                                 state, loss-scale state, Adam's step, and for every file: its size, sha256 and keys
    shard-rank{r}.safetensors    rank r's pieces: for each parameter (canonical name: models.canonical_name; a tied
                                 embedding once, as the embedding) its fp32 value and AdamW moments, as
                                 `param/<name>@<offsets>+<sizes>`, `exp_avg/...`, `exp_avg_sq/...`: the block of the
                                 full, tp-unsharded, vocab-unpadded tensor at those global offsets (pieces.py); and the
                                 rank's RNG states (`rng.cpu`, `rng.sharded0`, ...)

Which pieces a rank writes: of its tp shard of each tensor, where the engine holds it whole on every dp×cp rank (DDP),
a 1/(dp·cp) slice along dim 0 (a tensor replicated over tp too is sliced over dp×cp×tp); where ZeRO partitions it,
its partition as it lies (parallel/engine.py: `partition_of`), as the boxes of the full tensor its flat range spans.
So every element is written once, by one rank, and each rank writes about 1/world of the state, in parallel with the
others; the files' keys are boxes of the full tensors whatever engine owned the dp axis.

Any (dp, tp, pp, cp, schedule, engine) loads any checkpoint: a rank computes where its own shard lies in each full
tensor and reads only the pieces, and within them only the byte ranges (safetensors slices), that overlap it.

Format 1 (whole tensors in `model-pp{k}` / `optim-pp{k}.safetensors`, RNG states in `rng-rank{r}.safetensors`) is
still loaded: each of its tensors is read as one piece that covers it all.

Atomicity: every rank writes into `step_000123.tmp-<random>/`; then rank 0 checks that every expected file is
there with the size its writer reported, writes meta.json, fsyncs, renames the directory to `step_000123` and
replaces the small text file `checkpoints/latest` (temp file + os.replace). A crash or kill at any point leaves
the previous checkpoint loadable and `latest` naming a complete one; leftover `.tmp-*` directories are ignored
and removed by the next successful save, which is also when `--keep-last` prunes older checkpoints.

Loading reads JSON and safetensors only: nothing is ever unpickled. Every problem (missing path, no meta.json,
missing or truncated or corrupted file, missing piece, another model shape) raises a CheckpointError whose
message is one sentence naming the file and why, on every rank alike, before anything is trained or written.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
from pathlib import Path
from typing import Any

import torch

from trainer3d.checkpoint.lora_base import Base, merged, spec_of
from trainer3d.checkpoint.pieces import KINDS, MOMENTS, Piece, parse_key, read_local, tp_boxes
from trainer3d.errors import CheckpointError, first_line
from trainer3d.models import (
    FAMILIES, canonical_name, canonical_shapes, canonical_tables, config_from_dict, shape_diffs,
)
from trainer3d.parallel.lora import adapter_shapes, with_adapters
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG
from trainer3d.rundir import CHECKPOINTS

FORMAT = "trainer3d-checkpoint"
FORMAT_VERSION = 2
RNG_PREFIX = "rng."  # a shard file's RNG-state keys
LATEST = "latest"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def shard_file(rank: int) -> str:
    return f"shard-rank{rank:05d}.safetensors"


def v1_rng_file(rank: int) -> str:  # format 1
    return f"rng-rank{rank:05d}.safetensors"


def _label(kind: str, name: str) -> str:
    """How messages name a saved tensor: a parameter by its canonical name, an Adam moment as `<name>.<kind>`."""
    return name if kind == "param" else f"{name}.{kind}"


def checkpoints_root(out_dir: str | os.PathLike) -> Path:
    return Path(out_dir) / CHECKPOINTS


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def sharded_rngs(pm) -> list[ShardedDropoutRNG]:
    out = []
    for m in pm.stages:
        plan = m.parallel_plan()
        for block in m.blocks.values():
            rng = getattr(plan.mixer(block), "sharded_rng", None)
            if isinstance(rng, ShardedDropoutRNG) and all(rng is not r for r in out):
                out.append(rng)
    return out


def layout_record(trainer) -> dict:
    L = trainer.topo.layout
    return {
        "dp": L.dp, "tp": L.tp, "pp": L.pp, "cp": L.cp, "ep": L.ep, "world_size": L.world_size,
        "schedule": trainer.cfg.schedule, "virtual_stages": trainer.cfg.virtual_stages, "device": trainer.device.type,
    }


def complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    out = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / META).is_file():
                out.append((int(d.name[5:]), d))
    return sorted(out)


# ---- finding and checking a checkpoint (no process group needed) ------------------------------------------------
def _latest_in(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or (if that file is missing or names something incomplete) the complete
    checkpoint of the highest step under `root`; None if there is none."""
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if name and (root / name / META).is_file():
            return root / name
    complete = complete_checkpoints(root)
    return complete[-1][1] if complete else None


def latest_checkpoint(out_dir: str | os.PathLike) -> Path | None:
    """The newest complete checkpoint of a run (`<out_dir>/checkpoints/latest`), or None."""
    return _latest_in(checkpoints_root(out_dir))


def resolve_checkpoint(path: str | os.PathLike) -> Path:
    """A checkpoint directory from what a user may pass: the step directory itself, a `checkpoints` directory
    (follows `latest`), or a run's --out-dir."""
    p = Path(path)
    if not p.exists():
        raise CheckpointError(f"Checkpoint path {p} does not exist; pass a step_* directory or a run's --out-dir.")
    if not p.is_dir():
        raise CheckpointError(f"Checkpoint path {p} is a file, not a checkpoint directory; pass its step_* directory.")
    if (p / META).is_file():
        return p
    for root in (p, p / CHECKPOINTS):  # a checkpoints directory, or a run's --out-dir
        found = _latest_in(root) if root.is_dir() else None
        if found is not None:
            return found
    raise CheckpointError(
        f"{p / META} does not exist, so {p} is not a complete checkpoint (an interrupted save, or not a "
        "checkpoint); pass a step_* directory that has a meta.json."
    )


class Checkpoint:
    """An opened checkpoint directory. meta.json is always parsed; with `check` (the default) every listed file is
    also checked: present with its recorded size, readable as safetensors, holding the listed tensors, and the model
    tensors complete for the recorded shape (headers only, cheap). Tensors are read lazily, one at a time (`tensor`);
    `verify_files` also checks the recorded sha256 (reads the files). Without `check` (ranks other than the one that
    checked), files are opened when first read."""

    def __init__(self, path: str | os.PathLike, check: bool = True):
        self.path = Path(path)
        meta_path = self.path / META
        if not meta_path.is_file():
            raise CheckpointError(
                f"{meta_path} does not exist, so {self.path} is not a complete checkpoint (an interrupted save, or "
                "not a checkpoint); pass a step_* directory that has a meta.json."
            )
        try:
            meta = json.loads(meta_path.read_text())
            if not isinstance(meta, dict):
                raise ValueError("not a JSON object")
        except (ValueError, UnicodeDecodeError) as e:
            raise CheckpointError(
                f"{meta_path} is not valid JSON ({first_line(e)}); the checkpoint is corrupted."
            ) from None
        if meta.get("format") != FORMAT:
            raise CheckpointError(f"{meta_path} is not a trainer3d checkpoint (format {meta.get('format')!r}).")
        if int(meta.get("format_version", 0)) > FORMAT_VERSION:
            raise CheckpointError(
                f"{meta_path} has format version {meta['format_version']}, newer than this trainer3d's "
                f"{FORMAT_VERSION}; upgrade trainer3d to load it."
            )
        missing_keys = [k for k in ("step", "model", "config", "layout", "files") if k not in meta]
        files = meta.get("files")
        well_formed = isinstance(files, dict) and all(
            isinstance(i, dict) and isinstance(i.get("tensors"), list) and isinstance(i.get("bytes"), int)
            for i in files.values()
        )
        if missing_keys or not well_formed:
            what = ", ".join(missing_keys) if missing_keys else "a well-formed 'files' table"
            raise CheckpointError(f"{meta_path} lacks {what}; the checkpoint is corrupted.")
        self.meta = meta
        self.step = int(meta["step"])
        family = meta.get("model_family", "gpt2")  # (checkpoints from before model families hold GPT-2)
        if family not in FAMILIES:
            raise CheckpointError(f"{meta_path} holds a {family!r} model, a family this trainer3d does not know; "
                                  f"known: {', '.join(FAMILIES)}.")
        try:
            self.model_config = config_from_dict(family, meta["model"])
        except TypeError as e:
            raise CheckpointError(f"{meta_path} has an unreadable model config ({first_line(e)}).") from None
        self.version = int(meta.get("format_version", 1))
        self.shapes = canonical_shapes(self.model_config)  # name -> full shape (building it costs ~1 s at 405B)
        # a LoRA run's: the adapters' settings and its base's identity (lora_base.py); it saves the adapters only
        self.lora = meta.get("lora")
        self.lora_spec = None if self.lora is None else spec_of(self.lora)
        self.saved_shapes = self.shapes if self.lora is None else adapter_shapes(self.model_config, self.lora_spec)
        self._base = None  # (the LoRA base, opened when first read)
        self._handles: dict[str, Any] = {}
        self.bytes_read = 0  # of tensor data, by this process (the benches report it)
        self.pieces = self._index_pieces(files)  # (kind, canonical name) -> its pieces
        if check:
            for name, info in files.items():
                self._check_file(name, info)
            self._check_pieces()

    def _index_pieces(self, files: dict) -> dict[tuple[str, str], list[Piece]]:
        out: dict[tuple[str, str], list[Piece]] = {}
        if self.version >= 2:
            for file, info in files.items():
                for key in info["tensors"]:
                    if key.startswith(RNG_PREFIX):
                        continue
                    try:
                        kind, name, start, size = parse_key(key)
                    except ValueError:
                        raise CheckpointError(f"{self.path / META} lists {key!r} in {file}, which is no piece of a "
                                              "tensor; the checkpoint is corrupted.") from None
                    out.setdefault((kind, name), []).append(Piece(file, key, start, size))
            return out
        shapes = self.shapes  # format 1: whole tensors, one piece each
        self._v1_step = None
        for file, info in files.items():
            for key in info["tensors"]:
                kind, name = "param", key
                if file.startswith("optim-"):
                    name, _, kind = key.rpartition(".")
                if kind in KINDS and name in shapes:
                    out.setdefault((kind, name), []).append(Piece(file, key, (0,) * len(shapes[name]), shapes[name]))
                elif kind == "step":
                    self._v1_step = (file, key)
        return out

    def _open(self, name: str):
        from safetensors import safe_open

        path = self.path / name
        if not path.is_file():
            raise CheckpointError(f"{path} is missing (meta.json lists it); the checkpoint is incomplete.")
        size = path.stat().st_size
        if size != self.meta["files"][name]["bytes"]:
            raise CheckpointError(
                f"{path} has {size} bytes but meta.json records {self.meta['files'][name]['bytes']}; the file is "
                "truncated or was modified."
            )
        try:
            handle = safe_open(str(path), framework="pt", device="cpu")
            handle.keys()
        except Exception as e:  # noqa: BLE001 - SafetensorError, OSError
            raise CheckpointError(
                f"{path} cannot be read as safetensors ({first_line(e)}); the file is corrupted."
            ) from None
        self._handles[name] = handle
        return handle

    def _handle(self, name: str):
        return self._handles.get(name) or self._open(name)

    def _check_file(self, name: str, info: dict) -> None:
        keys = set(self._handle(name).keys())
        missing = [t for t in info["tensors"] if t not in keys]
        if missing:
            path = self.path / name
            raise CheckpointError(f"{path} lacks tensor {missing[0]!r} that meta.json lists; the file is corrupted.")

    def _check_pieces(self) -> None:
        """Every element of every tensor the model needs (and of its Adam moments, if saved) is in exactly one piece,
        and every piece has the shape its key says (headers only)."""
        kinds = ("param", *MOMENTS) if self.meta.get("has_optimizer_state") else ("param",)
        for name, shape in sorted(self.saved_shapes.items()):
            for kind in kinds:
                what = _label(kind, name)
                covered = 0
                for p in self._pieces_of(kind, name):
                    got = tuple(self._handle(p.file).get_slice(p.key).get_shape())
                    inside = len(p.start) == len(shape) and all(
                        0 <= a and a + n <= s for a, n, s in zip(p.start, p.size, shape))
                    if got != p.size or not inside:
                        raise CheckpointError(f"{self.path / p.file}: tensor {p.key!r} has shape {got}, which does not "
                                              f"fit {what!r} of shape {tuple(shape)} in the model in meta.json.")
                    covered += math.prod(p.size)
                if covered != math.prod(shape):
                    raise CheckpointError(f"{self.path}: the pieces of {what!r} hold {covered} of its "
                                          f"{math.prod(shape)} elements; the checkpoint is incomplete.")

    def verify_files(self, names: list[str] | None = None) -> None:
        """Check the sha256 of the given files (default: all) against meta.json."""
        for name in self.meta["files"] if names is None else names:
            path = self.path / name
            self._handle(name)  # present, of the recorded size, a safetensors header
            if sha256_of(path) != self.meta["files"][name].get("sha256"):
                raise CheckpointError(f"{path} does not match the sha256 in meta.json; the file is corrupted.")

    def _read(self, file: str, key: str, slices: tuple[slice, ...]) -> torch.Tensor:
        try:
            t = self._handle(file).get_slice(key)[slices]
        except CheckpointError:
            raise
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.path / file}: cannot read tensor {key!r} ({first_line(e)}).") from None
        self.bytes_read += t.numel() * t.element_size()
        return t

    def _pieces_of(self, kind: str, name: str) -> list[Piece]:
        pieces = self.pieces.get((kind, name))
        if not pieces:
            raise CheckpointError(f"{self.path} holds no tensor {_label(kind, name)!r}; the checkpoint is incomplete.")
        return pieces

    def local_tensor(self, kind: str, name: str, spec, local_shape: tuple[int, ...], tp_rank: int, tp: int,
                     flat: tuple[int, int] | None = None):
        """This tp rank's shard (TPSpec `spec`; None: the whole tensor) of a saved tensor, in fp32, reading only the
        byte ranges it overlaps; `flat` = (start, numel): only that range of the flattened shard."""
        boxes = tp_boxes(spec, tuple(local_shape), tp_rank, tp)
        try:
            return read_local(self._pieces_of(kind, name), boxes, tuple(local_shape), self._read, flat=flat)
        except LookupError as e:
            raise CheckpointError(f"{self.path}: tensor {name!r} is incomplete ({e}).") from None

    def table(self, name: str, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A saved model table (state that is no parameter: models.CausalLM.state_tables), whole, in fp32; None where
        the checkpoint has none (saved before the model had it: the table keeps its initial value)."""
        if ("table", name) not in self.pieces:
            return None
        return self.local_tensor("table", name, None, shape, 0, 1)

    def run_table(self, name: str) -> torch.Tensor | None:
        """A saved run table (save.rank_pieces: the objective's state, one piece in its own dtype), or None."""
        pieces = self.pieces.get(("run", name))
        return None if not pieces else self._handle(pieces[0].file).get_tensor(pieces[0].key)

    def model_tensor(self, name: str) -> torch.Tensor:
        """One whole canonical parameter, in fp32 (of a LoRA run: the base's with the adapters merged in)."""
        if self.lora is None:
            return self.local_tensor("param", name, None, tuple(self.shapes[name]), 0, 1)
        return merged(self.model_config, self.lora_spec, name, self.base.tensor(name, tuple(self.shapes[name])),
                      self.adapter_tensor)

    def adapter_tensor(self, name: str) -> torch.Tensor:
        """One whole saved LoRA adapter parameter, in fp32."""
        return self.local_tensor("param", name, None, tuple(self.saved_shapes[name]), 0, 1)

    @property
    def base(self) -> Base:
        """A LoRA run's frozen base, checked against the fingerprint the checkpoint records."""
        if self._base is None:
            self._base = Base(self.lora, self.model_config, str(self.path))
        return self._base

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole canonical state dict (for small models: sample.py; export.py streams tensor by tensor)."""
        return {name: self.model_tensor(name) for name in self.shapes}

    def model_tables(self) -> dict[str, torch.Tensor]:
        """The saved model tables (routers' selection biases) by name, for plain_model beside model_state."""
        tables = {name: self.table(name, tuple(shape)) for name, shape in canonical_tables(self.model_config).items()}
        return {name: t for name, t in tables.items() if t is not None}

    @property
    def optimizer_step(self) -> int | None:
        """Adam's step count when saved (None: saved before the first step, without optimizer state)."""
        if not self.meta.get("has_optimizer_state"):
            return None
        if self.version >= 2:
            return int(self.meta["optimizer_step"])
        file, key = self._v1_step
        return int(self._handle(file).get_tensor(key).item())

    def rng_state(self, rank: int, key: str) -> torch.Tensor:
        """Rank `rank`'s saved RNG state `key` ("cpu", "cuda", "sharded0", ...)."""
        if self.version >= 2:
            return self._read(shard_file(rank), RNG_PREFIX + key, (slice(None),))
        return self._read(v1_rng_file(rank), key, (slice(None),))

    def check_model_matches(self, mcfg) -> None:
        saved, now = self.model_config, mcfg
        diffs = shape_diffs(saved, now)
        if diffs:
            raise CheckpointError(
                f"{self.path} holds a different model shape: {', '.join(diffs)}; pass the model flags it was saved "
                "with (--model/--n-layer/--n-head/--n-embd/--vocab-size/...) or start a fresh run."
            )

    def shard_value(self, mcfg):
        """The `shard_value` hook of build_parallel_model (parallel/tensor_parallel.materialize): each parameter's tp
        shard, read from the pieces it overlaps."""

        def value(name: str, spec, local_shape: tuple, tp_rank: int, tp: int) -> torch.Tensor:
            return self.local_tensor("param", canonical_name(mcfg, name), spec, local_shape, tp_rank, tp)

        return value if self.lora is None else with_adapters(self.base.shard_value, value)

    def close(self) -> None:
        self._handles.clear()
