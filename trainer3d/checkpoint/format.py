"""Checkpoints that survive anything: layout-free on disk, atomic, safe to load, saved on SLURM's signals.

On-disk format (one directory per checkpoint, `<out-dir>/checkpoints/step_000123/`):

    meta.json                  step, format version, full config, model shape, layout saved under, loader state,
                               loss-scale state, and for every file: its size, sha256 and tensor names
    model-pp{k}.safetensors    the FULL (tp-unsharded, vocab-unpadded) parameters of pipeline rank k's stages,
                               under their canonical names (model.canonical_name); the tied embedding once, as
                               `wte.weight` (a last stage's lm_head copy loads from it)
    optim-pp{k}.safetensors    the optimizer state of the same parameters, full, as `<name>.exp_avg`,
                               `<name>.exp_avg_sq`, `<name>.step` (AdamW)
    rng-rank{r}.safetensors    every rank's RNG states (uint8 tensors): restored when the layout is unchanged,
                               re-derived from (seed, step) otherwise

Under DeepSpeed ZeRO the trainer's hooks (`param_value`, `optimizer_state_of`, `load_param_states`; zero_state.py)
assemble the fp32 master value and Adam moments from their dp partitions and scatter them back on load, so the
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

import dataclasses
import hashlib
import json
import os
import secrets
import shutil
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer3d.errors import CheckpointError
from trainer3d.model import GPTConfig, canonical_name
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG, gather_full, group_size

FORMAT = "trainer3d-checkpoint"
FORMAT_VERSION = 1
CHECKPOINTS = "checkpoints"  # under --out-dir
LATEST = "latest"
META = "meta.json"
MODEL_SHAPE_FIELDS = ("vocab_size", "n_positions", "n_embd", "n_layer", "n_head", "layer_norm_eps")
# Test hook (tests/test_checkpoint.py): when saving this step, writer ranks stop after their model file, create
# `PAUSED` in the temporary directory and sleep, so a test can SIGKILL the job in the middle of a save.
PAUSE_ENV = "TRAINER3D_TEST_PAUSE_SAVE_AT_STEP"


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


# ---- small helpers -------------------------------------------------------------------------------------------
def _fsync_path(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:  # some filesystems refuse fsync on directories
        pass
    finally:
        os.close(fd)


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            h.update(chunk)
    return h.hexdigest()


def write_text_atomic(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{secrets.token_hex(4)}")
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    _fsync_path(path.parent)


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    _fsync_path(path)
    return {"bytes": path.stat().st_size, "sha256": _sha256(path), "tensors": sorted(tensors)}


def group_world_size(group) -> int:
    return group_size(group) if dist.is_initialized() else 1


def all_gather_object(obj, group) -> list:
    if group_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src_global_rank: int, group):
    if group_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src_global_rank, group=group)
    return box[0]


def raise_first(errors: list) -> None:
    """Raise the first rank's error on every rank (all ranks call this with the same gathered list)."""
    for e in errors:
        if e:
            raise CheckpointError(e)


def describe_error(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return text[0] if text else type(e).__name__


def sharded_rngs(pm) -> list[ShardedDropoutRNG]:
    out = []
    for m in pm.plain_modules():
        for block in m.h.values():
            rng = getattr(block.attn, "sharded_rng", None)
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


def _data_parallel_record(trainer) -> dict:
    """What owned the dp axis (informational: any engine loads any checkpoint)."""
    if trainer.zero is None:
        return {"engine": "ddp"}
    spec = trainer.zero.spec
    return {"engine": "deepspeed", "zero_stage": spec.stage, "offload_optimizer": spec.offload_optimizer,
            "offload_param": spec.offload_param}


# ---- saving ----------------------------------------------------------------------------------------------------
def _write_rank_files(trainer, tmp: Path, step: int) -> dict:
    """This rank's part of a save; returns {file name: {bytes, sha256, tensors}} for the files it wrote.
    Collective over the tp group (gathers) on dp replica 0; every rank asks the trainer for its optimizer state
    in the same order (a ZeRO engine gathers over dp there)."""
    topo = trainer.topo
    gather = topo.dp_rank == 0
    writer = gather and topo.tp_rank == 0
    model_t: dict[str, torch.Tensor] = {}
    optim_t: dict[str, torch.Tensor] = {}
    for name, (p, spec) in _named_full_params(trainer.pm).items():
        local = trainer.param_value(p)  # (collective over dp under ZeRO, as is the optimizer state)
        state = trainer.optimizer_state_of(p)
        if not gather:
            continue
        full = gather_full(local, spec, topo.tp_group)
        if writer:
            model_t[name] = full.cpu()
        for key in sorted(state):
            value = state[key]
            sharded_like_param = spec is not None and tuple(value.shape) == tuple(local.shape)
            full = gather_full(value, spec, topo.tp_group) if sharded_like_param else value.detach().clone()
            if writer:
                optim_t[f"{name}.{key}"] = full.cpu()
    report = {}
    meta = {"format": "pt", "trainer3d": FORMAT, "step": str(step)}
    if writer:
        report[model_file(topo.pp_rank)] = _save_safetensors(model_t, tmp / model_file(topo.pp_rank), meta)
        del model_t
        if os.environ.get(PAUSE_ENV) == str(step):  # test hook: be killed in the middle of a save
            (tmp / "PAUSED").touch()
            while True:
                time.sleep(1)
        report[optim_file(topo.pp_rank)] = _save_safetensors(optim_t, tmp / optim_file(topo.pp_rank), meta)
    rng = {"cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    for i, r in enumerate(sharded_rngs(trainer.pm)):
        rng[f"sharded{i}"] = r.state.clone().cpu()
    report[rng_file(topo.rank)] = _save_safetensors(rng, tmp / rng_file(topo.rank), meta)
    return report


def _named_full_params(pm):
    from trainer3d.parallel.parallelize import named_full_params

    return named_full_params(pm)


def save_checkpoint(trainer, out_dir: str | os.PathLike, loader=None, keep_last: int = 0) -> Path:
    """Save `trainer` (and the data loader's position) as `<out_dir>/checkpoints/step_<step>`; collective over the
    trainer's world group. Returns the checkpoint directory. Raises CheckpointError on every rank if any rank
    failed, leaving the previous checkpoints and `latest` untouched."""
    topo = trainer.topo
    group = topo.world_group
    root0 = topo.global_rank(0, 0, 0)
    step = trainer.step
    root = checkpoints_root(out_dir)
    final = root / step_dir_name(step)
    tmp_name = broadcast_object(f"{final.name}.tmp-{secrets.token_hex(4)}" if topo.rank == 0 else None, root0, group)
    tmp = root / tmp_name

    report, error = {}, None
    try:
        tmp.mkdir(parents=True, exist_ok=True)
        report = _write_rank_files(trainer, tmp, step)
    except Exception as e:  # noqa: BLE001 - gathered so every rank raises, none hangs
        error = f"rank {topo.rank} could not write its files into {tmp} ({type(e).__name__}: {describe_error(e)})"
    gathered = all_gather_object((report, error), group)
    errors = [e for _, e in gathered if e]
    status = None
    if topo.rank == 0:
        try:
            if errors:
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                files = {}
                for r, _ in gathered:
                    files.update(r)
                _commit(trainer, tmp, final, files, loader, keep_last)
        except Exception as e:  # noqa: BLE001
            status = f"could not complete checkpoint {final} ({type(e).__name__}: {describe_error(e)})"
    if errors:
        raise CheckpointError(f"Saving checkpoint {final} failed: {errors[0]}; the previous checkpoint is untouched.")
    status = broadcast_object(status, root0, group)
    if status:
        raise CheckpointError(f"Saving failed: {status}; the previous checkpoint is untouched.")
    return final


def _commit(trainer, tmp: Path, final: Path, files: dict, loader, keep_last: int) -> None:
    """Rank 0: verify, write meta.json, rename into place, point `latest` at it, prune."""
    L = trainer.topo.layout
    expected = [f(k) for k in range(L.pp) for f in (model_file, optim_file)]
    expected += [rng_file(r) for r in range(L.world_size)]
    for name in expected:
        path = tmp / name
        if name not in files or not path.is_file() or path.stat().st_size != files[name]["bytes"]:
            raise CheckpointError(f"{path} is missing or incomplete after every rank reported success")
    ls = trainer.loss_scale
    from trainer3d.train.trainer import lr_at  # the LR is a pure function of the step; recorded for people reading meta.json

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "lr": lr_at(trainer.step, trainer.cfg),
        "model": dataclasses.asdict(trainer.mcfg),
        "config": dataclasses.asdict(trainer.cfg),
        "layout": layout_record(trainer),
        "data_parallel": _data_parallel_record(trainer),
        "precision": trainer.precision,
        "loader": loader.state_dict() if loader is not None else None,
        "loss_scale": None if ls is None else {k: v for k, v in vars(ls).items()},
        "has_optimizer_state": any(files[optim_file(k)]["tensors"] for k in range(L.pp)),
        "files": {name: files[name] for name in expected},
        "torch_version": torch.__version__,
        "saved_at": time.time(),
    }
    with open(tmp / META, "w") as f:
        json.dump(meta, f, indent=1, default=_json_default)
        f.flush()
        os.fsync(f.fileno())
    os.chmod(tmp, 0o755)
    _fsync_path(tmp)
    root = final.parent
    aside = None
    if final.exists():  # a checkpoint of the same step from an earlier (abandoned) trajectory
        aside = root / f"{final.name}.old-{secrets.token_hex(4)}"
        os.replace(final, aside)
    os.replace(tmp, final)
    _fsync_path(root)
    write_text_atomic(root / LATEST, final.name + "\n")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _prune(root, final, keep_last)


def _json_default(obj):
    """Config values JSON has no type for: sets as sorted lists, anything else (paths, ...) as its string."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)


def _complete_checkpoints(root: Path) -> list[tuple[int, Path]]:
    out = []
    if root.is_dir():
        for d in root.iterdir():
            if d.is_dir() and d.name.startswith("step_") and d.name[5:].isdigit() and (d / META).is_file():
                out.append((int(d.name[5:]), d))
    return sorted(out)


def _prune(root: Path, newest: Path, keep_last: int) -> None:
    for d in root.iterdir():  # leftovers of saves that crashed or were killed
        if ".tmp-" in d.name or ".old-" in d.name:
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
    if keep_last > 0:
        others = [d for _, d in _complete_checkpoints(root) if d != newest]
        for d in others[: max(0, len(others) - (keep_last - 1))]:
            shutil.rmtree(d, ignore_errors=True)


# ---- finding and checking a checkpoint (no process group needed) ------------------------------------------------
def _latest_in(root: Path) -> Path | None:
    """The checkpoint `root/latest` names, or (if that file is missing or names something incomplete) the complete
    checkpoint of the highest step under `root`; None if there is none."""
    pointer = root / LATEST
    if pointer.is_file():
        name = pointer.read_text().strip()
        if name and (root / name / META).is_file():
            return root / name
    complete = _complete_checkpoints(root)
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
                f"{meta_path} is not valid JSON ({describe_error(e)}); the checkpoint is corrupted."
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
        try:
            self.model_config = GPTConfig(**meta["model"])
        except TypeError as e:
            raise CheckpointError(f"{meta_path} has an unreadable model config ({describe_error(e)}).") from None
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
                f"{path} cannot be read as safetensors ({describe_error(e)}); the file is corrupted."
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
        from trainer3d.checkpoint.hf import expected_shapes

        expected = expected_shapes(self.model_config)
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
            if _sha256(path) != self.meta["files"][name].get("sha256"):
                raise CheckpointError(f"{path} does not match the sha256 in meta.json; the file is corrupted.")

    def tensor(self, file: str, name: str) -> torch.Tensor:
        handle = self._handle(file)
        try:
            return handle.get_tensor(name)
        except Exception as e:  # noqa: BLE001
            raise CheckpointError(f"{self.path / file}: cannot read tensor {name!r} ({describe_error(e)}).") from None

    def model_tensor(self, name: str) -> torch.Tensor:
        return self.tensor(self.model_index[name], name)

    def model_state(self) -> dict[str, torch.Tensor]:
        """The whole canonical state dict (for export; a trainer reads only its own tensors)."""
        return {name: self.model_tensor(name) for name in sorted(self.model_index)}

    def check_model_matches(self, mcfg: GPTConfig) -> None:
        saved, now = self.model_config, mcfg
        diffs = shape_diffs(saved, now)
        if diffs:
            raise CheckpointError(
                f"{self.path} holds a different model shape: {', '.join(diffs)}; pass the model flags it was saved "
                "with (--model/--n-layer/--n-head/--n-embd/--vocab-size) or start a fresh run."
            )

    def full_value(self, mcfg: GPTConfig) -> Callable[[str, tuple], torch.Tensor]:
        """The `full_value(name, shape)` hook of build_parallel_model: reads one full tensor at a time."""

        def value(name: str, shape: tuple) -> torch.Tensor:
            canon = canonical_name(name)
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


def shape_diffs(stored: GPTConfig, now: GPTConfig) -> list[str]:
    """The model-shape fields where weights on disk and this run disagree, as 'field=stored (this run: now)'."""
    return [
        f"{k}={getattr(stored, k)} (this run: {getattr(now, k)})"
        for k in MODEL_SHAPE_FIELDS
        if getattr(stored, k) != getattr(now, k)
    ]
