"""Saving a checkpoint in two halves: `take_snapshot` copies this rank's share of the state (its pieces: format.py)
to host memory; `write_snapshot` has every rank write its own file into a temporary directory, in parallel, then
rank 0 verifies every file, writes meta.json and renames the directory into place. A crash at any point leaves the
previous checkpoint and `latest` intact. `save_checkpoint` runs both; async_save.py runs the second in the
background."""

from __future__ import annotations

import json
import os
import secrets
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from trainer3d.checkpoint.format import (
    FORMAT, FORMAT_VERSION, LATEST, META, RNG_PREFIX, checkpoints_root, complete_checkpoints, layout_record,
    shard_file, sharded_rngs, step_dir_name,
)
from trainer3d.checkpoint.pieces import MOMENTS, partition_boxes, piece_key, slice_boxes, tp_boxes
from trainer3d.checkpoint.writer import write_safetensors
from trainer3d.distributed.collectives import all_gather_object, broadcast_object
from trainer3d.errors import CheckpointError, first_line
from trainer3d.fsio import fsync_path, write_text_atomic
from trainer3d.optim import lr_at
from trainer3d.models import config_to_dict
from trainer3d.parallel.lora import is_adapter
from trainer3d.parallel.parallelize import named_full_params


def _save_safetensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> dict:
    return write_safetensors(tensors, path, metadata)


def _to_host(t: torch.Tensor, pinned: bool, copy: bool) -> torch.Tensor:
    """`t` in host memory, fp32: from a device, one copy straight into page-locked memory (asynchronous: the caller
    synchronizes once); on the CPU, a copy only if `copy` (a snapshot that training will not change under the
    writer), else `t` itself."""
    if pinned and t.device.type == "cuda":
        out = torch.empty(t.shape, dtype=torch.float32, pin_memory=True)
        out.copy_(t.detach(), non_blocking=True)
        return out
    t = t.detach().to("cpu", torch.float32)
    return t.clone(memory_format=torch.contiguous_format) if copy else t


def rank_pieces(trainer, copy: bool = True) -> tuple[dict[str, torch.Tensor], int | None]:
    """This rank's pieces of every parameter and AdamW moment, and its RNG states, in host memory; and Adam's step
    (None before the first), read once. Which pieces (format.py): where the engine partitions the state over dp
    (ZeRO), this rank's partition as it lies, written as the boxes of the full tensor it spans, without a collective
    (a tp-replicated parameter's by tp rank 0 only, its tp peers holding the same partition); where every dp rank
    holds a parameter whole, the slice of its tp shard its dp rank (and, for a tp-replicated tensor, its tp rank)
    writes. `copy`: copy host tensors (a snapshot written while training goes on); without it, views of the live
    state (a save that finishes before the next step) where it lives on the host already."""
    topo = trainer.topo
    pinned = trainer.device.type == "cuda"
    pieces: dict[str, torch.Tensor] = {}
    adam_step = trainer.engine.adam_step()
    for name, (p, spec) in named_full_params(trainer.parallel_model).items():
        if trainer.lora is not None and not is_adapter(name):  # a LoRA base is saved by reference (lora_base.py)
            continue
        for kind, start, size, data, live in parameter_pieces(trainer, p, spec, adam_step is not None):
            pieces[piece_key(kind, name, start, size)] = _to_host(data, pinned, copy or not live)
    index, count = _writer_slice(None, topo)  # tables: replicated wherever their module is
    for m in trainer.parallel_model.stages:
        for name, t in m.state_tables().items():
            shape = tuple(t.shape)
            for b in slice_boxes(tp_boxes(None, shape, 0, 1), shape, index, count):
                part = t[tuple(slice(o, o + s) for o, s in zip(b.local, b.size))]
                pieces[piece_key("table", name, b.start, b.size)] = _to_host(part, pinned, copy=True)
    if pinned:
        torch.cuda.synchronize(trainer.device)
    if topo.rank == 0 and trainer.objective is not None:  # the same on every rank: written once, whole
        for name, t in trainer.objective.run_tables().items():
            pieces[piece_key("run", name, (0,) * t.dim(), tuple(t.shape))] = t.detach().cpu().clone()
    pieces[RNG_PREFIX + "cpu"] = torch.get_rng_state()
    if trainer.device.type == "cuda":
        pieces[RNG_PREFIX + "cuda"] = torch.cuda.get_rng_state(trainer.device)
    for i, r in enumerate(sharded_rngs(trainer.parallel_model)):
        pieces[f"{RNG_PREFIX}sharded{i}"] = r.state.clone().cpu()
    return pieces, adam_step


def parameter_pieces(trainer, p, spec, moments: bool, kinds: tuple[str, ...] = ("param", *MOMENTS)):
    """(kind, start, size, tensor, live) for each piece of parameter `p` (and, with `moments`, its AdamW moments) that
    this rank writes (rank_pieces' rule), the tensor on the engine's device; `live`: a view of the engine's state."""
    topo = trainer.topo
    part = trainer.engine.partition_of(p, moments=moments)
    if part is not None:
        if (spec is None or spec.axis != "tp") and topo.tp_rank != 0:
            return  # replicated over tp (an expert split over ep is): its tp peers hold the same partition
        for offset, box in partition_boxes(spec, part.shape, *topo.shard_coords(spec), part.start, part.numel):
            for kind, flat in part.tensors.items():
                if kind in kinds:
                    yield kind, box.start, box.size, flat.narrow(0, offset, box.numel).view(box.size), True
        return
    value = trainer.engine.param_value(p)
    state = trainer.engine.optimizer_state_of(p) if moments else {}
    shape = tuple(value.shape)
    index, count = _writer_slice(spec, topo)
    mine = slice_boxes(tp_boxes(spec, shape, *topo.shard_coords(spec)), shape, index, count)
    for kind, t in [("param", value)] + [(k, state[k]) for k in MOMENTS if k in state]:
        if kind in kinds:
            for b in mine:
                yield kind, b.start, b.size, t[tuple(slice(o, o + s) for o, s in zip(b.local, b.size))], False


def _writer_slice(spec, topo) -> tuple[int, int]:
    """(index, count): which 1/count slice of a parameter's local shard this rank writes, the ranks holding the same
    values sharing the writing: a dp×cp line for a tp shard, and its tp peers too for a tensor replicated over tp;
    an expert split over ep is replicated over the edp ranks and over tp."""
    L = topo.layout
    if spec is None:
        return topo.dp_cp_rank * L.tp + topo.tp_rank, L.dp_cp * L.tp
    if spec.axis == "ep":
        return topo.edp_rank * L.tp + topo.tp_rank, L.edp * L.tp
    return topo.dp_cp_rank, L.dp_cp


@dataclass
class Snapshot:
    """A save, taken: this rank's pieces in host memory, and on rank 0 everything meta.json says but the files.
    Writing it (write_snapshot) needs nothing from the trainer, so it can run while training goes on."""

    final: Path
    tmp: Path
    pieces: dict[str, torch.Tensor]
    adam_step: int | None
    meta: dict | None  # rank 0's; None elsewhere
    world_size: int
    keep_last: int


def take_snapshot(trainer, out_dir: str | os.PathLike, loader=None, keep_last: int = 0, copy: bool = True) -> Snapshot:
    """This rank's part of the state in host memory (collective over the trainer's world, and over dp where the engine
    assembles a tensor); the step's files are then written by write_snapshot. `copy`: rank_pieces's."""
    topo = trainer.topo
    final = checkpoints_root(out_dir) / step_dir_name(trainer.step)
    tmp_name = f"{final.name}.tmp-{secrets.token_hex(4)}" if topo.rank == 0 else None
    tmp = final.parent / broadcast_object(tmp_name, topo.global_rank(0, 0, 0), topo.world_group)
    pieces, adam_step = rank_pieces(trainer, copy)
    return Snapshot(final, tmp, pieces, adam_step, _meta(trainer, loader) if topo.rank == 0 else None,
                    topo.layout.world_size, keep_last)


def write_snapshot(snap: Snapshot, rank: int, group, root0: int) -> Path:
    """Every rank writes its file into the temporary directory; rank 0 verifies them all, writes meta.json and renames
    the directory into place. Collective over `group`. Raises CheckpointError on every rank if any rank failed,
    leaving the previous checkpoints and `latest` untouched."""
    report, error = {}, None
    try:
        snap.tmp.mkdir(parents=True, exist_ok=True)
        name = shard_file(rank)
        report = {name: _save_safetensors(snap.pieces, snap.tmp / name, {"format": "pt", "trainer3d": FORMAT})}
    except Exception as e:  # noqa: BLE001 - gathered so every rank raises, none hangs
        error = f"rank {rank} could not write its file into {snap.tmp} ({type(e).__name__}: {first_line(e)})"
    snap.pieces = {}
    gathered = all_gather_object((report, snap.adam_step, error), group)
    errors = [e for *_, e in gathered if e]
    status = None
    if rank == 0:
        try:
            if errors:
                shutil.rmtree(snap.tmp, ignore_errors=True)
            else:
                files = {}
                for r, _, _ in gathered:
                    files.update(r)
                steps = {s for _, s, _ in gathered if s is not None}
                if len(steps) > 1:  # every engine steps all its parameters together: ranks cannot disagree
                    raise RuntimeError(f"the ranks' optimizers are at different steps {sorted(steps)}")
                _commit(snap, files, steps.pop() if steps else None)
        except Exception as e:  # noqa: BLE001
            status = f"could not complete checkpoint {snap.final} ({type(e).__name__}: {first_line(e)})"
    if errors:
        raise CheckpointError(f"Saving checkpoint {snap.final} failed: {errors[0]}; the previous checkpoint is "
                              "untouched.")
    status = broadcast_object(status, root0, group)
    if status:
        raise CheckpointError(f"Saving failed: {status}; the previous checkpoint is untouched.")
    return snap.final


def save_checkpoint(trainer, out_dir: str | os.PathLike, loader=None, keep_last: int = 0) -> Path:
    """Save `trainer` (and the data loader's position) as `<out_dir>/checkpoints/step_<step>`; collective over the
    trainer's world group. Returns the checkpoint directory."""
    topo = trainer.topo
    snap = take_snapshot(trainer, out_dir, loader, keep_last, copy=False)  # written before training goes on
    return write_snapshot(snap, topo.rank, topo.world_group, topo.global_rank(0, 0, 0))


def _meta(trainer, loader) -> dict:
    """What meta.json records besides the files, as of now (the files may be written later)."""
    ls = trainer.loss_scale
    return {
        "format": FORMAT,
        "format_version": FORMAT_VERSION,
        "step": trainer.step,
        "lr": lr_at(trainer.step, trainer.cfg),
        "model_family": trainer.mcfg.family,
        "model": config_to_dict(trainer.mcfg),
        "config": trainer.cfg.flat(),
        "hf_source": getattr(trainer, "hf_source", None),  # checkpoint/hf_source.py
        "lora": trainer.lora,  # the adapters' settings and the base's identity (checkpoint/lora_base.py)
        "layout": layout_record(trainer),
        "data_parallel": trainer.engine.describe(),
        "precision": trainer.precision,
        "loader": loader.state_dict() if loader is not None else None,
        "loss_scale": None if ls is None else {k: v for k, v in vars(ls).items()},
        "torch_version": torch.__version__,
    }


def _commit(snap: Snapshot, files: dict, adam_step: int | None) -> None:
    """Rank 0: verify, write meta.json, rename into place, point `latest` at it, prune."""
    tmp, final = snap.tmp, snap.final
    expected = [shard_file(r) for r in range(snap.world_size)]
    for name in expected:
        path = tmp / name
        if name not in files or not path.is_file() or path.stat().st_size != files[name]["bytes"]:
            raise CheckpointError(f"{path} is missing or incomplete after every rank reported success")
    meta = dict(snap.meta, optimizer_step=adam_step, has_optimizer_state=adam_step is not None,
                files={name: files[name] for name in expected}, saved_at=time.time())
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
    _prune(root, final, snap.keep_last)


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


