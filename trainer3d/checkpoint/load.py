"""A checkpoint (or Hugging Face weights) into a trainer, and the training loop's hooks: periodic saves and SLURM's
signals. checkpoint.py owns the files; this module owns what a run does with them:

    prepare(cfg, mcfg, topo)        before the trainer is built: --resume / --init-from-hf checked on every rank,
                                    and the `full_value` hook that materializes each rank's shards from the weights
    apply(start, trainer, loader)   after: optimizer state (through the trainer's hooks, so DDP and every ZeRO stage
                                    alike), step, data position, loss scale and RNG states
    Checkpointer                    --save-every / --keep-last, and SIGTERM/SIGUSR1 -> finish the step, save, exit

RNG states come back exactly when the layout and seed are unchanged, and are re-derived from (seed, step) otherwise.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import signal
import time
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist

from trainer3d.checkpoint.format import (
    Checkpoint, CheckpointError, all_gather_object, broadcast_object, describe_error, layout_record, raise_first,
    shape_diffs, sharded_rngs, group_world_size, write_text_atomic, checkpoints_root, latest_checkpoint,
    resolve_checkpoint, rng_file, save_checkpoint,
)
from trainer3d.model import GPTConfig, canonical_name
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG, shard_tensor


def _stage_params(pm) -> list[tuple[str, torch.nn.Parameter, Any]]:
    """(canonical name, parameter, tp spec) of every parameter object this rank holds, the last stage's tied head
    copy included (as `wte.weight`): what has to be loaded, values and optimizer state alike."""
    out, seen = [], set()
    for m in pm.plain_modules():
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((canonical_name(name), p, getattr(p, "tp_spec", None)))
    return out


# ---- loading into a trainer -------------------------------------------------------------------------------------
def open_for_resume(resume: str, out_dir: str, mcfg: GPTConfig, topo) -> Checkpoint | None:
    """Resolve `--resume` ("latest" = the newest checkpoint of --out-dir, or a path), check it on every rank and
    verify the sha256 of every file (each rank checks a share), agree on the outcome. Returns None for "latest"
    with no checkpoint yet (the run starts fresh; requeued jobs can always pass --resume)."""
    group = topo.world_group
    root0 = topo.global_rank(0, 0, 0)
    target, error = None, None
    if topo.rank == 0:
        try:
            if resume == "latest":
                found = latest_checkpoint(out_dir)
                target = None if found is None else str(found)
            else:
                target = str(resolve_checkpoint(resume))
        except CheckpointError as e:
            error = str(e)
    target, error = broadcast_object((target, error), root0, group)
    if error:
        raise CheckpointError(error)
    if target is None:
        return None
    ckpt, error = None, None
    try:  # rank 0 checks every header; all ranks share the sha256 checks (reading the files) and the shape check
        ckpt = Checkpoint(target, check=topo.rank == 0)
        ckpt.check_model_matches(mcfg)
        names = sorted(ckpt.meta["files"])
        ckpt.verify_files(names[topo.rank :: topo.layout.world_size])
    except CheckpointError as e:
        error = str(e)
    except OSError as e:
        error = f"{target} cannot be read ({describe_error(e)})."
    raise_first(all_gather_object(error, group))
    return ckpt


def restore(trainer, ckpt: Checkpoint, loader=None) -> list[str]:
    """Load optimizer state, step, loss scale, data position and RNG states into a trainer built with
    `full_value=ckpt.full_value(mcfg)`. Returns notes for the log."""
    notes = []
    topo, meta = trainer.topo, ckpt.meta
    trainer.step = ckpt.step
    by_param: dict[str, dict[str, tuple[str, str]]] = {}  # name -> {state key: (file, tensor)}
    for t, f in ckpt.optim_index.items():
        base, _, key = t.rpartition(".")
        by_param.setdefault(base, {})[key] = (f, t)
    items = []
    for name, p, spec in _stage_params(trainer.pm):
        if meta.get("has_optimizer_state") and name not in by_param:
            raise CheckpointError(f"{ckpt.path} holds no optimizer state for {name!r}; the checkpoint is incomplete.")

        def read_state(name=name, spec=spec):
            return {key: _local_shard(ckpt.tensor(f, t), spec, topo) for key, (f, t) in by_param.get(name, {}).items()}

        def read_value(name=name, spec=spec):
            return _local_shard(ckpt.model_tensor(name), spec, topo)

        items.append((p, read_state, read_value))
    # (a checkpoint saved before the first step has values only; ZeRO still takes them into its fp32 masters)
    trainer.load_param_states(items)
    ls = meta.get("loss_scale")
    if trainer.loss_scale is not None and ls:
        for k, v in ls.items():
            setattr(trainer.loss_scale, k, v)
    elif trainer.loss_scale is not None:
        notes.append("the checkpoint has no fp16 loss-scale state (saved in another precision); starting a new one")
    if loader is not None and meta.get("loader"):
        loader.load_state_dict(meta["loader"])
    if layout_record(trainer) == meta["layout"] and trainer.cfg.seed == meta["config"].get("seed"):
        _restore_rngs(trainer, ckpt)
    else:
        rederive_rngs(trainer, ckpt.step)
        saved = meta["layout"]
        notes.append(
            f"layout changed (saved under dp{saved['dp']}×tp{saved['tp']}×pp{saved['pp']} {saved['schedule']}): "
            f"RNG states re-derived from seed {trainer.cfg.seed} and step {ckpt.step}"
        )
    return notes


def _local_shard(full: torch.Tensor, spec, topo) -> torch.Tensor:
    """This tp rank's shard of a full tensor stored in a checkpoint (unchanged if it is not sharded like `spec`)."""
    if spec is not None and tuple(full.shape) == tuple(spec.full_shape):
        return shard_tensor(full, spec, topo.tp_rank, topo.layout.tp)
    return full


def _restore_rngs(trainer, ckpt: Checkpoint) -> None:
    f = rng_file(trainer.topo.rank)
    torch.set_rng_state(ckpt.tensor(f, "cpu"))
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt.tensor(f, "cuda"), trainer.device)
    for i, r in enumerate(sharded_rngs(trainer.pm)):
        r.state = ckpt.tensor(f, f"sharded{i}")


def _mix(*xs: int) -> int:
    h = hashlib.sha256(repr(xs).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def rederive_rngs(trainer, step: int) -> None:
    """Fresh RNG states that follow the dropout contract (default generator identical on tp peers, different over
    dp and pp; the sharded stream different on every rank), as a pure function of (seed, step, coordinates)."""
    topo, seed = trainer.topo, trainer.cfg.seed
    torch.manual_seed(_mix(seed, step, topo.pp_rank, topo.dp_rank))
    for i, r in enumerate(sharded_rngs(trainer.pm)):
        stream_seed = _mix(seed + 2718, step, topo.pp_rank, topo.dp_rank, topo.tp_rank, i)
        r.state = ShardedDropoutRNG(stream_seed, trainer.device).state


def trim_metrics(out_dir: str | os.PathLike, step: int) -> None:
    """Drop metrics.jsonl records of steps after `step` (logged by the run that was interrupted), atomically."""
    path = Path(out_dir) / "metrics.jsonl"
    if not path.is_file():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            if int(json.loads(line).get("step", 0)) > step:
                continue
        except (ValueError, AttributeError, TypeError):
            pass
        kept.append(line)
    write_text_atomic(path, "".join(k + "\n" for k in kept))


# ---- Hugging Face initialisation --------------------------------------------------------------------------------
def hf_model_config(path: str | os.PathLike) -> GPTConfig:
    """Our GPTConfig from a Hugging Face directory's config.json (shapes only; nothing else is read)."""
    from trainer3d.checkpoint.hf import CONFIG_NAME, gpt_config_from_hf

    p = Path(path)
    if not (p / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"--init-from-hf {p}: {p / CONFIG_NAME} does not exist; pass a GPT2LMHeadModel save_pretrained directory."
        )
    try:
        return gpt_config_from_hf(json.loads((p / CONFIG_NAME).read_text()), dropout=0.0)
    except ValueError as e:
        raise CheckpointError(f"--init-from-hf {p}: {p / CONFIG_NAME} cannot be used ({describe_error(e)}).") from None


def hf_full_value(path: str | os.PathLike, mcfg: GPTConfig) -> Callable[[str, tuple], torch.Tensor]:
    """The `full_value` hook from a Hugging Face GPT2LMHeadModel directory, after checking its shape is `mcfg`'s."""
    from trainer3d.checkpoint.hf import load_hf_checkpoint

    try:
        hcfg, state = load_hf_checkpoint(path, dropout=mcfg.dropout)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--init-from-hf {path}: {describe_error(e)}.") from None
    diffs = shape_diffs(hcfg, mcfg)
    if diffs:
        raise CheckpointError(
            f"--init-from-hf {path} holds a different model shape: {', '.join(diffs)}; drop the conflicting "
            "--n-layer/--n-head/--n-embd/--vocab-size flags (the model's shape comes from its config.json)."
        )

    def value(name: str, shape: tuple) -> torch.Tensor:
        return state[canonical_name(name)]

    return value


# ---- the training loop's hooks: periodic saves and SLURM's signals ------------------------------------------------
class Checkpointer:
    """Owned by train.run: saves every --save-every steps (and at the end), and turns SIGTERM / SIGUSR1 (what SLURM
    sends before preemption or the time limit) into: finish the current step, agree on stopping (all-reduce MAX of
    the flag over the world, so every rank stops at the same step), save, exit cleanly."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, trainer, loader, out_dir: str, save_every: int = 0, keep_last: int = 0, log: bool = True):
        self.trainer, self.loader, self.out_dir = trainer, loader, out_dir
        self.save_every, self.keep_last, self.log = save_every, keep_last, log
        self.received: int | None = None
        self.stopped_by: str | None = None
        self._previous = {}
        try:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread: no signal handling
            pass

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    def _stop_agreed(self) -> bool:
        flag = torch.tensor([1.0 if self.received else 0.0], device=self.trainer.device)
        group = self.trainer.topo.world_group
        if group_world_size(group) > 1:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=group)
        return bool(flag.item())

    def after_step(self) -> bool:
        """Call after every optimizer step on every rank; True means stop now (a checkpoint has been saved)."""
        t = self.trainer
        stop = self._stop_agreed()
        due = self.save_every > 0 and (t.step % self.save_every == 0 or t.step >= t.cfg.max_steps)
        if due or stop:
            t0 = time.perf_counter()
            try:
                path = save_checkpoint(t, self.out_dir, self.loader, self.keep_last)
            except CheckpointError as e:  # raised on every rank alike; the previous checkpoint is intact
                if stop:
                    raise
                if self.log:
                    _write(f"[trainer3d] warning: {e} Training goes on; the next save will try again.")
                return False
            if self.log:
                _write(f"[trainer3d] saved checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
        if stop:
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            self.stopped_by = name
            if self.log:
                _write(
                    f"[trainer3d] {name} received: stopped after step {t.step} and saved {path}; exiting cleanly "
                    "(continue with --resume)"
                )
        return stop

    def close(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def _write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)


@dataclasses.dataclass
class Start:
    """How a run starts: from a checkpoint, from Hugging Face weights, or from the seed (both None)."""

    checkpoint: Checkpoint | None = None
    full_value: Callable[[str, tuple], torch.Tensor] | None = None  # for Trainer(..., full_value=)
    notes: list[str] = dataclasses.field(default_factory=list)


def prepare(cfg, mcfg: GPTConfig, topo) -> Start:
    """Before the trainer is built. --resume wins over --init-from-hf. Raises CheckpointError (on every rank alike)
    for any bad input, before anything is trained or written."""
    start = Start()
    ckpt = open_for_resume(cfg.resume, cfg.out_dir, mcfg, topo) if cfg.resume else None
    if ckpt is not None:
        start.checkpoint, start.full_value = ckpt, ckpt.full_value(mcfg)
        start.notes.append(f"resuming from {ckpt.path} (step {ckpt.step})")
        if cfg.init_from_hf:
            start.notes.append(f"--init-from-hf {cfg.init_from_hf} ignored: the checkpoint's weights are used")
        return start
    if cfg.resume:
        start.notes.append(f"--resume: no checkpoint in {checkpoints_root(cfg.out_dir)} yet; starting from scratch")
    if cfg.init_from_hf:
        start.full_value = hf_full_value(cfg.init_from_hf, mcfg)
        start.notes.append(f"initialised from the Hugging Face weights in {cfg.init_from_hf}")
    return start


def apply(start: Start, trainer, loader=None) -> None:
    """After the trainer and loader are built: restore the rest of the checkpoint, log the notes, and drop the
    interrupted run's metrics.jsonl records past the resumed step."""
    notes = list(start.notes)
    if start.checkpoint is not None:
        notes += restore(trainer, start.checkpoint, loader)
        start.checkpoint.close()
        if trainer.is_logging_rank:
            trim_metrics(trainer.cfg.out_dir, trainer.step)
    if trainer.is_logging_rank:
        for note in notes:
            print(f"[trainer3d] {note}", flush=True)
