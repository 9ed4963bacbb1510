"""A checkpoint (or Hugging Face weights) into a trainer. format.py owns the files; this module owns what a run
does with them:

    prepare(cfg, mcfg, topo, fp)    before the trainer is built: --resume / --init-from-hf checked on every rank,
                                    the data (fingerprint fp) against the checkpoint's, and the `shard_value` hook
                                    that materializes each rank's shards from the weights
    apply(start, trainer, loader)   after: optimizer state (through the trainer's hooks, so DDP and every ZeRO stage
                                    alike), step, data position, loss scale and RNG states

RNG states come back exactly when the layout and seed are unchanged, and are re-derived from (seed, step) otherwise.
"""

from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path
from typing import Any, Callable

import torch

from trainer3d.checkpoint.format import (
    Checkpoint, checkpoints_root, latest_checkpoint, layout_record, resolve_checkpoint, sharded_rngs,
)
from trainer3d.checkpoint import hf_source
from trainer3d.checkpoint.hf import HFDirectory
from trainer3d.checkpoint.hf_init import hf_shard_value, nonfinite_error, open_hf
from trainer3d.distributed.collectives import agree_on_error, broadcast_object
from trainer3d.errors import CheckpointError, first_line
from trainer3d.fsio import write_text_atomic
from trainer3d.checkpoint.lora_base import record as lora_record
from trainer3d.checkpoint.peft import adapter_reader
from trainer3d.models import canonical_name
from trainer3d.parallel.lora import LoRASpec, initial_value, with_adapters
from trainer3d.parallel.parallelize import rng_seeds, seed_rngs
from trainer3d.parallel.shards import from_full
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG
from trainer3d.rundir import METRICS
from trainer3d.checkpoint.pieces import MOMENTS, local_shape


def _stage_params(pm) -> list[tuple[str, torch.nn.Parameter, Any]]:
    """(canonical name, parameter, tp spec) of every parameter object this rank holds, the last stage's tied head
    copy included (under the embedding's name): what has to be loaded, values and optimizer state alike."""
    out, seen = [], set()
    for m in pm.stages:
        for name, p in m.named_parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append((canonical_name(m.cfg, name), p, getattr(p, "tp_spec", None)))
    return out


# ---- loading into a trainer -------------------------------------------------------------------------------------
def open_for_resume(resume: str, out_dir: str, mcfg, topo) -> Checkpoint | None:
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
        error = f"{target} cannot be read ({first_line(e)})."
    agree_on_error(error, group, CheckpointError)
    return ckpt


def restore(trainer, ckpt: Checkpoint, loader=None) -> list[str]:
    """Load optimizer state, step, loss scale, data position and RNG states into a trainer built with
    `shard_value=ckpt.shard_value(mcfg)`. Returns notes for the log."""
    notes = []
    topo, meta = trainer.topo, ckpt.meta
    trainer.step = ckpt.step
    trainer.hf_source = meta.get("hf_source")  # (what its exports copy from the directory the run started from)
    adam_step = ckpt.optimizer_step
    items = []
    for name, p, spec in _stage_params(trainer.parallel_model):
        if name not in ckpt.saved_shapes:  # a LoRA base: built from the base the checkpoint names
            continue
        rank, size = topo.shard_coords(spec)  # tp, or ep for experts
        shape = local_shape(spec, ckpt.saved_shapes[name], size)  # (not p.shape: ZeRO-3 partitions the parameter)

        def read_state(flat=None, name=name, spec=spec, shape=shape, rank=rank, size=size):
            if adam_step is None:
                return {}
            state = {k: ckpt.local_tensor(k, name, spec, shape, rank, size, flat) for k in MOMENTS}
            return dict(state, step=torch.tensor(float(adam_step)))

        def read_value(flat=None, name=name, spec=spec, shape=shape, rank=rank, size=size):
            return ckpt.local_tensor("param", name, spec, shape, rank, size, flat)

        items.append((p, read_state, read_value))
    # (a checkpoint saved before the first step has values only; ZeRO still takes them into its fp32 masters)
    trainer.engine.load_param_states(items)
    copy_tables(trainer, ckpt.table)
    if trainer.objective is not None:
        trainer.objective.load_run_tables(ckpt.run_table)
    ls = meta.get("loss_scale")
    if trainer.loss_scale is not None and ls:
        for k, v in ls.items():
            setattr(trainer.loss_scale, k, v)
    elif trainer.loss_scale is not None:
        notes.append("the checkpoint has no fp16 loss-scale state (saved in another precision); starting a new one")
    if loader is not None and meta.get("loader"):
        loader.load_state_dict(meta["loader"])
    if layout_record(trainer) == {"ep": 1, **meta["layout"]} and trainer.cfg.seed == meta["config"].get("seed"):
        _restore_rngs(trainer, ckpt)
    else:
        rederive_rngs(trainer, ckpt.step)
        saved = meta["layout"]
        notes.append(
            f"layout changed (saved under dp{saved['dp']}×tp{saved['tp']}×pp{saved['pp']} {saved['schedule']}): "
            f"RNG states re-derived from seed {trainer.cfg.seed} and step {ckpt.step}"
        )
    return notes


def copy_tables(trainer, value_of: Callable) -> None:
    """Fill this rank's model tables (CausalLM.state_tables: routers' selection biases) from `value_of(name, shape)`
    (None: the source has none; the table keeps its value)."""
    for m in trainer.parallel_model.stages:
        for name, table in m.state_tables().items():
            saved = value_of(name, tuple(table.shape))
            if saved is not None:
                table.copy_(saved.to(table.device, table.dtype))


def _restore_rngs(trainer, ckpt: Checkpoint) -> None:
    rank = trainer.topo.rank
    torch.set_rng_state(ckpt.rng_state(rank, "cpu"))
    if trainer.device.type == "cuda":
        torch.cuda.set_rng_state(ckpt.rng_state(rank, "cuda"), trainer.device)
    for i, r in enumerate(sharded_rngs(trainer.parallel_model)):
        r.state = ckpt.rng_state(rank, f"sharded{i}")


def rederive_rngs(trainer, step: int) -> None:
    """Fresh RNG states that follow the dropout contract (default generator identical on tp peers, different over
    dp and pp; the sharded stream different on every rank), as a pure function of (seed, step, coordinates)."""
    seed_rngs(trainer.cfg.seed, trainer.topo, step)
    sharded_seed = rng_seeds(trainer.cfg.seed, trainer.topo, step)[1]
    for r in sharded_rngs(trainer.parallel_model):  # one stream a rank, shared by its stages
        r.state = ShardedDropoutRNG(sharded_seed, trainer.device).state


def trim_metrics(out_dir: str | os.PathLike, step: int) -> None:
    """Drop metrics.jsonl records of steps after `step` (logged by the run that was interrupted), atomically."""
    path = Path(out_dir) / METRICS
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


@dataclasses.dataclass
class Start:
    """How a run starts: from a checkpoint, from Hugging Face weights, or from the seed (both None)."""

    checkpoint: Checkpoint | None = None
    shard_value: Callable | None = None  # for Trainer(..., shard_value=)
    source: Any = None  # what shard_value reads (a Checkpoint or an HFDirectory; both count their bytes_read)
    notes: list[str] = dataclasses.field(default_factory=list)


# The run's flags that shape its token rows, named when a resume's data is not the checkpoint's
DATA_FLAGS = ("data", "data_mixture", "data_config", "data_split", "val_data", "text_field", "data_format",
              "messages_field", "tokenizer", "init_from_hf", "seq_len", "val_fraction", "train_on", "train_roles",
              "on_bad_row", "chat_template", "chat_template_kwargs", "eos_token", "overlong", "pack")


def check_data_matches(ckpt: Checkpoint, cfg, fingerprint: str) -> None:
    """A resume onto other data (another --seq-len, corpus or tokenizer) refused before the model is built, naming
    the flags that changed; the loader's own check (data/loader.py) is the backstop."""
    saved = (ckpt.meta.get("loader") or {}).get("fingerprint")
    if saved is None or saved == fingerprint:
        return
    was = ckpt.meta.get("config", {})
    diffs = [f"--{k.replace('_', '-')} {was[k]} (this run: {getattr(cfg, k)})" for k in DATA_FLAGS
             if k in was and was[k] != getattr(cfg, k)]
    what = ", ".join(diffs) or "the same flags, but a file they name (corpus, mixture or tokenizer) changed"
    raise CheckpointError(f"{ckpt.path} was trained on other data: {what}; resume with the data it was saved with, or "
                          "start a fresh run.")


def prepare(cfg, mcfg, topo, data_fingerprint: str | None = None) -> Start:
    """Before the trainer is built. --resume wins over --init-from-hf. Raises CheckpointError (on every rank alike)
    for any bad input, before anything is trained or written."""
    start = Start()
    ckpt = open_for_resume(cfg.resume, cfg.out_dir, mcfg, topo) if cfg.resume else None
    if ckpt is not None and data_fingerprint is not None:
        check_data_matches(ckpt, cfg, data_fingerprint)
    if ckpt is not None:
        check_lora_matches(ckpt, LoRASpec.of(cfg))
        start.checkpoint = start.source = ckpt
        start.shard_value = ckpt.shard_value(mcfg)
        start.notes.append(f"resuming from {ckpt.path} (step {ckpt.step})")
        if cfg.init_from_hf:
            start.notes.append(f"--init-from-hf {cfg.init_from_hf} ignored: the checkpoint's weights are used")
        return start
    if cfg.resume:
        start.notes.append(f"--resume: no checkpoint in {checkpoints_root(cfg.out_dir)} yet; starting from scratch")
    if cfg.init_from_hf:
        start.source = open_hf(cfg.init_from_hf, mcfg)
        start.shard_value = hf_shard_value(start.source, mcfg)
        start.notes.append(f"initialised from the Hugging Face weights in {cfg.init_from_hf}")
        start.notes += start.source.notes
    spec = LoRASpec.of(cfg)
    if spec is not None and cfg.init_from_hf:  # the adapters' start: a PEFT directory's, or PEFT's initialisation
        if cfg.lora_from:  # (validate: only over --init-from-hf)
            adapters = adapter_reader(cfg.lora_from, mcfg, spec)
            start.notes.append(f"LoRA adapters continued from {cfg.lora_from}")
        else:
            adapters = lambda name, shape: initial_value(name, shape, cfg.seed)  # noqa: E731
        start.shard_value = with_adapters(start.shard_value, from_full(adapters))
    return start


def check_lora_matches(ckpt: Checkpoint, spec: LoRASpec | None) -> None:
    """A resume trains what the checkpoint holds: its adapters with their settings over the base it names (opened
    here, so that a base gone or changed is refused before anything is built), or every weight."""
    if ckpt.lora_spec != spec:
        held = "no LoRA adapters" if ckpt.lora_spec is None else f"LoRA adapters ({ckpt.lora_spec})"
        asked = "none" if spec is None else f"LoRA adapters ({spec})"
        raise CheckpointError(f"{ckpt.path} holds {held}, and this run asks for {asked}; resume with the LoRA flags "
                              "it was saved with.")
    if spec is not None:
        ckpt.base  # noqa: B018 - opened and checked


def apply(start: Start, trainer, loader=None) -> None:
    """After the trainer and loader are built: restore the rest of the checkpoint, log the notes, and drop the
    interrupted run's metrics.jsonl records past the resumed step."""
    notes = list(start.notes)
    if isinstance(start.source, HFDirectory):  # every rank has read its shards: refuse non-finite weights together
        agree_on_error(nonfinite_error(start.source), trainer.topo.world_group, CheckpointError)
        copy_tables(trainer, lambda name, shape: start.source.table(name))  # (a router's selection bias)
        trainer.hf_source = hf_source.record(start.source)
    spec = LoRASpec.of(trainer.cfg)
    if spec is not None:  # what the checkpoints record of the adapters and the base
        trainer.lora = start.checkpoint.lora if start.checkpoint is not None else lora_record(trainer.cfg, spec)
    if start.checkpoint is not None:
        notes += restore(trainer, start.checkpoint, loader)
        start.checkpoint.close()
        if trainer.is_logging_rank:
            trim_metrics(trainer.cfg.out_dir, trainer.step)
    if trainer.is_logging_rank:
        for note in notes:
            print(f"[trainer3d] {note}", flush=True)
