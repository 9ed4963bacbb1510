"""Checkpoints that survive anything: layout-free on disk, atomic, safe to load, saved on SLURM's signals.

On-disk format (one directory per checkpoint, `<out-dir>/checkpoints/step_000123/`):

    meta.json                  step, format version, full config, model family and shape, layout saved under, loader state,
                               loss-scale state, and for every file: its size, sha256 and tensor names
    model-pp{k}.safetensors    the FULL (tp-unsharded, vocab-unpadded) parameters of pipeline rank k's stages,
                               under their canonical names (models.canonical_name); a tied embedding once, as the
                               embedding's weight (a last stage's head copy loads from it)
    optim-pp{k}.safetensors    the optimizer state of the same parameters, full, as `<name>.exp_avg`,
                               `<name>.exp_avg_sq`, `<name>.step` (AdamW)
    rng-rank{r}.safetensors    every rank's RNG states (uint8 tensors): restored when the layout is unchanged,
                               re-derived from (seed, step) otherwise

Every data-parallel engine (parallel/engine.py: `param_value`, `optimizer_state_of`, `load_param_states`)
hands over the fp32 master value and Adam moments from their dp partitions and scatter them back on load, so the
files are the same whatever engine owned the dp axis.

Because every tensor is stored whole under a layout-free name, any (dp, tp, pp, schedule) loads any checkpoint:
each rank opens the files lazily (`safe_open`) and reads and shards only the tensors of its own stages. Writes are
parallel over pipeline ranks ((dp 0, tp 0) of each writes its stages' files) and no rank holds the whole model.

Atomicity: every rank writes into `step_000123.tmp-<random>/`; then rank 0 checks that every expected file is
there with the size its writer reported, writes meta.json, fsyncs, renames the directory to `step_000123` and
replaces the small text file `checkpoints/latest` (temp file + os.replace). A crash or kill at any point leaves
the previous checkpoint loadable and `latest` naming a complete one; leftover `.tmp-*` directories are ignored
and removed by the next successful save, which is also when `--keep-last` prunes older checkpoints.

Loading reads JSON and safetensors only: nothing is ever unpickled. Every problem (missing path, no meta.json,
missing or truncated or corrupted file, missing tensor, another model shape) raises a CheckpointError whose
message is one sentence naming the file and why, on every rank alike, before anything is trained or written.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from trainer3d.errors import CheckpointError, first_line
from trainer3d.models import FAMILIES, canonical_name, canonical_shapes, config_from_dict, shape_diffs
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG

FORMAT = "trainer3d-checkpoint"
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"  # under --out-dir
LATEST = "latest"
META = "meta.json"


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def model_file(pp_rank: int) -> str:
    return f"model-pp{pp_rank}.safetensors"


def optim_file(pp_rank: int) -> str:
    return f"optim-pp{pp_rank}.safetensors"


def rng_file(rank: int) -> str:
    return f"rng-rank{rank:05d}.safetensors"


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
        attention = m.parallel_plan().attention
        for block in m.blocks.values():
            rng = getattr(block.get_submodule(attention), "sharded_rng", None)
            rng = getattr(rng, "inner", rng)
            if isinstance(rng, ShardedDropoutRNG) and all(rng is not r for r in out):
                out.append(rng)
    return out


def layout_record(trainer) -> dict:
    L = trainer.topo.layout
    return {
        "dp": L.dp, "tp": L.tp, "pp": L.pp, "world_size": L.world_size, "schedule": trainer.cfg.schedule,
        "virtual_stages": trainer.cfg.virtual_stages, "device": trainer.device.type,
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
        self._handles: dict[str, Any] = {}
        self.model_index = {t: f for f, info in files.items() if f.startswith("model-") for t in info["tensors"]}
        self.optim_index = {t: f for f, info in files.items() if f.startswith("optim-") for t in info["tensors"]}
        if check:
            for name, info in files.items():
                self._check_file(name, info)
            self._check_model()

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

    def _check_model(self) -> None:
        expected = canonical_shapes(self.model_config)
        missing = sorted(set(expected) - set(self.model_index))
        if missing:
            raise CheckpointError(
                f"{self.path} holds no tensor {missing[0]!r} in any model-pp*.safetensors; the checkpoint is "
                "incomplete."
            )
        for name, shape in expected.items():
            f = self.model_index[name]
            got = tuple(self._handle(f).get_slice(name).get_shape())
            if got != tuple(shape):
                raise CheckpointError(
                    f"{self.path / f}: tensor {name!r} has shape {got} but the model in meta.json needs {tuple(shape)}."
                )
        if self.meta.get("has_optimizer_state"):
            for name in expected:
                for key in ("exp_avg", "exp_avg_sq"):
                    if f"{name}.{key}" not in self.optim_index:
                        raise CheckpointError(
                            f"{self.path} holds no optimizer tensor '{name}.{key}' in any optim-pp*.safetensors; the "
                            "checkpoint is incomplete."
                        )

    def verify_files(self, names: list[str] | None = None) -> None:
        """Check the sha256 of the given files (default: all) against meta.json."""
        for name in self.meta["files"] if names is None else names:
            path = self.path / name
            self._handle(name)  # present, of the recorded size, a safetensors header
            if sha256_of(path) != self.meta["files"][name].get("sha256"):
                raise CheckpointError(f"{path} does not match the sha256 in meta.json; the file is corrupted.")

    def tensor(self, file: str, name: str) -> torch.Tensor:
        handle = self._handle(file)
        try:
            return handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.path / file}: cannot read tensor {name!r} ({first_line(e)}).") from None

    def model_tensor(self, name: str) -> torch.Tensor:
        return self.tensor(self.model_index[name], name)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole canonical state dict (for export; a trainer reads only its own tensors)."""
        return {name: self.model_tensor(name) for name in sorted(self.model_index)}

    def check_model_matches(self, mcfg) -> None:
        saved, now = self.model_config, mcfg
        diffs = shape_diffs(saved, now)
        if diffs:
            raise CheckpointError(
                f"{self.path} holds a different model shape: {', '.join(diffs)}; pass the model flags it was saved "
                "with (--model/--n-layer/--n-head/--n-embd/--vocab-size/...) or start a fresh run."
            )

    def full_value(self, mcfg) -> Callable[[str, tuple], torch.Tensor]:
        """The `full_value(name, shape)` hook of build_parallel_model: reads one full tensor at a time."""

        def value(name: str, shape: tuple) -> torch.Tensor:
            canon = canonical_name(mcfg, name)
            if canon not in self.model_index:
                raise CheckpointError(f"{self.path} holds no tensor {canon!r}; the checkpoint is incomplete.")
            t = self.model_tensor(canon)
            if tuple(t.shape) != tuple(shape):
                raise CheckpointError(
                    f"{self.path / self.model_index[canon]}: tensor {canon!r} has shape {tuple(t.shape)}, the model "
                    f"needs {tuple(shape)}."
                )
            return t.float()

        return value

    def close(self) -> None:
        self._handles.clear()
