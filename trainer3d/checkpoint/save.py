"""Saving a checkpoint: every rank writes its part into a temporary directory (parallel over pipeline ranks: the
(dp 0, tp 0) rank of each writes its stages' files, gathered over tp; no rank holds the whole model), then rank 0
verifies every file, writes meta.json and renames the directory into place. A crash at any point leaves the previous
checkpoint and `latest` intact (format.py describes the files)."""

from __future__ import annotations

import dataclasses
import json
import os
import secrets
import shutil
import time
from pathlib import Path

import torch

from trainer3d import test_hooks
from trainer3d.checkpoint.format import (
    FORMAT, FORMAT_VERSION, LATEST, META, checkpoints_root, complete_checkpoints, layout_record, model_file, optim_file,
    rng_file, sha256_of, sharded_rngs, step_dir_name,
)
from trainer3d.distributed.collectives import all_gather_object, broadcast_object
from trainer3d.errors import CheckpointError, first_line
from trainer3d.fsio import fsync_path, write_text_atomic
from trainer3d.optim import lr_at
from trainer3d.models import config_to_dict
from trainer3d.parallel.parallelize import named_full_params
from trainer3d.parallel.tensor_parallel import gather_full


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict:
    from safetensors.torch import save_file

    save_file({k: v.detach().to("cpu").contiguous() for k, v in tensors.items()}, str(path), metadata=metadata)
    fsync_path(path)
    return {"bytes": path.stat().st_size, "sha256": sha256_of(path), "tensors": sorted(tensors)}


def _write_rank_files(trainer, tmp: Path, step: int) -> dict:
    """This rank's part of a save; returns {file name: {bytes, sha256, tensors}} for the files it wrote.
    Collective over the tp group (gathers) on dp replica 0; every rank asks the trainer for its optimizer state
    in the same order (a ZeRO engine gathers over dp there)."""
    topo = trainer.topo
    gather = topo.dp_rank == 0
    writer = gather and topo.tp_rank == 0
    model_t: dict[str, torch.Tensor] = {}
    optim_t: dict[str, torch.Tensor] = {}
    for name, (p, spec) in named_full_params(trainer.pm).items():
        local = trainer.engine.param_value(p)  # (collective over dp under ZeRO, as is the optimizer state)
        state = trainer.engine.optimizer_state_of(p)
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
        test_hooks.pause_mid_save(step, tmp)
        report[optim_file(topo.pp_rank)] = _save_safetensors(optim_t, tmp / optim_file(topo.pp_rank), meta)
    rng = {"cpu": torch.get_rng_state()}
    if trainer.device.type == "cuda":
        rng["cuda"] = torch.cuda.get_rng_state(trainer.device)
    for i, r in enumerate(sharded_rngs(trainer.pm)):
        rng[f"sharded{i}"] = r.state.clone().cpu()
    report[rng_file(topo.rank)] = _save_safetensors(rng, tmp / rng_file(topo.rank), meta)
    return report




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
        error = f"rank {topo.rank} could not write its files into {tmp} ({type(e).__name__}: {first_line(e)})"
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
            status = f"could not complete checkpoint {final} ({type(e).__name__}: {first_line(e)})"
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

    meta = {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "lr": lr_at(trainer.step, trainer.cfg),
        "model_family": trainer.mcfg.family,
        "model": config_to_dict(trainer.mcfg),
        "config": dataclasses.asdict(trainer.cfg),
        "layout": layout_record(trainer),
        "data_parallel": trainer.engine.describe(),
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
    fsync_path(tmp)
    root = final.parent
    aside = None
    if final.exists():  # a checkpoint of the same step from an earlier (abandoned) trajectory
        aside = root / f"{final.name}.old-{secrets.token_hex(4)}"
        os.replace(final, aside)
    os.replace(tmp, final)
    fsync_path(root)
    write_text_atomic(root / LATEST, final.name + "\n")
    if aside is not None:
        shutil.rmtree(aside, ignore_errors=True)
    _prune(root, final, keep_last)


def _json_default(obj):
    """Config values JSON has no type for: sets as sorted lists, anything else (paths, ...) as its string."""
    if isinstance(obj, (set, frozenset)):
        return sorted(obj, key=str)
    return str(obj)




def _prune(root: Path, newest: Path, keep_last: int) -> None:
    for d in root.iterdir():  # leftovers of saves that crashed or were killed
        if ".tmp-" in d.name or ".old-" in d.name:
            shutil.rmtree(d, ignore_errors=True) if d.is_dir() else d.unlink(missing_ok=True)
    if keep_last > 0:
        others = [d for _, d in complete_checkpoints(root) if d != newest]
        for d in others[: max(0, len(others) - (keep_last - 1))]:
            shutil.rmtree(d, ignore_errors=True)


