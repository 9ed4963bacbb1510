"""The entry point and the training loop: validate before any process group, build the data, the trainer and the
checkpoint state, then train to --max-steps, logging on one rank (console, progress bar, metrics.jsonl, W&B)."""

from __future__ import annotations

import dataclasses
import gc
import math
import time

import numpy as np
import torch.distributed as dist

from trainer3d.checkpoint.load import apply, prepare
from trainer3d.checkpoint.signals import Checkpointer
from trainer3d.config import parse_args
from trainer3d.data.cache import TokenBlocks
from trainer3d.data.mixture import MixtureBlocks, MixtureValidation
from trainer3d.data.preference import PairRows, describe as describe_pairs
from trainer3d.data.sft import describe as describe_chat_rows
from trainer3d.distributed.collectives import agree_on_error
from trainer3d.distributed.failure import Heartbeat, run_reported
from trainer3d.distributed.topology import LaunchEnv, WorldGroup, default_device
from trainer3d.plan.auto import agree_on_pick, choice_lines
from trainer3d.parallel.lora import LoRASpec, trained_flops_per_token
from trainer3d.plugins import load_plugins
from trainer3d.errors import UsageError, first_line, report
from trainer3d.rundir import clear_run
from trainer3d.train.data_setup import build_blocks, build_val_pairs, make_loader, make_val_batches
from trainer3d.train.downstream import Downstream
from trainer3d.train.dpo import evaluate as dpo_evaluate, load_or_score
from trainer3d.train.metrics import device_peak_tflops
from trainer3d.train.report import Report
from trainer3d.train.profiling import StepProfiler
from trainer3d.train.setup import check_out_dir, data_config, validate, with_epochs
from trainer3d.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    env = LaunchEnv.from_environ()
    try:
        load_plugins()  # TRAINER3D_PLUGINS, first of all
        setup = validate(cfg, env.world_size)  # before any process group: bad input fails here
        check_out_dir(setup.cfg)
    except UsageError as e:
        return report(e, env.rank)
    cfg, layout, plan = setup.cfg, setup.layout, setup.plan
    if env.rank == 0 and cfg.layout_choice is not None:  # --layout auto: the pick, why, the runner-up
        print("\n".join(f"[trainer3d] {line}" for line in choice_lines(cfg.layout_choice)), flush=True)
    device = default_device(env.local_rank)
    group = WorldGroup(env, device, cfg.dist_timeout)
    Heartbeat().beat(0)

    def train() -> None:
        if cfg.layout_choice is not None:  # --layout auto: every rank planned alike (one gather, before any group)
            agree_on_pick(cfg.layout_choice, dist.group.WORLD)
        if cfg.overwrite:  # the earlier run goes before anything of this one is written (validate checked the rest)
            error = None
            if env.rank == 0:
                try:
                    clear_run(cfg.out_dir)
                except OSError as e:
                    error = f"--overwrite could not remove the earlier run in {cfg.out_dir} ({first_line(e)})."
            agree_on_error(error, dist.group.WORLD, UsageError)
        topo = group.topology = setup.topology()
        blocks = build_blocks(cfg, data_config(cfg), env.rank, env.local_rank)  # one source, a mixture's, or pairs
        if env.rank == 0:
            for line in chat_lines(blocks, cfg) + document_lines(blocks, cfg):
                print(f"[trainer3d] {line}", flush=True)
        dpo = cfg.objective == "dpo"  # the loader draws pairs, two rows each (padding-free: rows of pairs)
        items = plan.global_batch // 2 if dpo and not cfg.dpo_padding_free else plan.global_batch
        loader = make_loader(blocks, items, topo.dp_rank, layout.dp, cfg.seed)
        run_setup = with_epochs(setup, loader.steps_per_epoch)  # --epochs: max_steps from the rows
        if env.rank == 0 and cfg.epochs:
            print(f"[trainer3d] --epochs {cfg.epochs:g}: {run_setup.cfg.max_steps} steps ({loader.steps_per_epoch} "
                  f"a pass over the training rows)", flush=True)
        mcfg = setup.model_config(blocks.vocab_size)
        start = prepare(run_setup.cfg, mcfg, topo, loader.fingerprint)  # checked before anything is built
        val_pairs = build_val_pairs(cfg, data_config(cfg)) if dpo else None  # --val-data's pairs, DPO's validation
        if dpo and cfg.ref_model and start.checkpoint is None:  # --ref-model scores the pairs first, then goes
            score_with_reference(run_setup, topo, device, mcfg, blocks, cfg.out_dir, val_pairs)
        trainer = Trainer(run_setup, topo, device, mcfg, shard_value=start.shard_value, boundary=blocks.eos_id)
        if validates(cfg) and not dpo:  # too few rows: said before step 1
            make_val_batches(blocks, plan.global_batch, topo.dp_rank, layout.dp, None)
        apply(start, trainer, loader)  # optimizer, step, data position, RNG, loss scale
        if dpo:  # the reference log-probs of every pair: the checkpoint's, --ref-model's, or the initial weights'
            load_or_score(trainer, blocks, cfg.out_dir, fresh=start.checkpoint is None, val_rows=val_pairs)
        downstream = Downstream(trainer, setup.hellaswag)  # HellaSwag rows, the sample prompt (when asked for)
        run(trainer, loader,
            lambda: make_val_batches(blocks, plan.global_batch, topo.dp_rank, layout.dp, cfg.eval_batches), downstream)

    return run_reported(env.rank, env.world_size, train, group.close,
                        layout=lambda: group.topology.layout if group.topology is not None else None)


def run(trainer: Trainer, loader, make_val_batches, downstream: Downstream | None = None) -> None:
    """Train to max_steps, logging on one rank (report.py): console, progress bar, metrics.jsonl, W&B; HellaSwag beside
    every validation and text samples every --sample-every steps (`downstream`); checkpoints when due."""
    cfg = trainer.cfg
    tokens_per_step = trainer.plan.global_batch * cfg.seq_len
    saver = Checkpointer(trainer, loader, cfg.out_dir, cfg.save_every, cfg.keep_last, trainer.is_logging_rank,
                         cfg.on_save_error, cfg.async_save)
    profiler = StepProfiler(cfg.profile_steps, cfg.max_steps, cfg.out_dir, dist.get_rank(), trainer.device)
    heartbeat, downstream, report = Heartbeat(), downstream or Downstream(trainer), Report(trainer)
    speed = Throughput(trainer, tokens_per_step)
    report.start(tokens_per_step)
    if cfg.eval_every and trainer.step == 0 and validates(cfg):  # the starting point of the validation curve
        report.record({"step": 0, **evaluation(trainer, make_val_batches, downstream)})
    exit_code = 1  # what W&B records if the loop ends by an exception (a non-finite step, a failed peer)
    try:
        while trainer.step < cfg.max_steps:
            heartbeat.beat(trainer.step + 1)
            profiler.start(trainer.step + 1)
            t0 = time.perf_counter()
            batch = loader.next_batch()
            record = trainer.train_step(batch, stop_requested=saver.stop_requested, data_s=time.perf_counter() - t0)
            stop = record.pop("stop")  # every rank's signals, agreed in the step's own all-reduce
            record.update(speed.of(trainer.step, time.perf_counter() - t0, batch, getattr(loader, "inputs_seen", None)))
            if hasattr(loader, "drawn"):  # a mixture: the rows drawn from each source so far
                record["data_mix"] = loader.drawn()
            profiler.stop(trainer.step)
            last = trainer.step == cfg.max_steps
            if ((cfg.eval_every and trainer.step % cfg.eval_every == 0) or last) and validates(cfg):
                record.update(evaluation(trainer, make_val_batches, downstream))
            report.record(record)
            if downstream.samples_due(trainer.step, last):  # every rank: one forward pass per token
                report.samples(trainer.step, downstream.samples())
            if saver.after_step(stop):  # checkpoint when due; True after SIGTERM/SIGUSR1: saved, every rank stops here
                break
        exit_code = 0
    finally:
        report.close(exit_code)
        profiler.close()
    # After a normal end only: on an error the SIGTERM handler stays, so that the launcher's SIGTERM to the survivors
    # of a dead rank waits until the failure is reported (dist.failure.run_reported)
    saver.close()
    report.summarize(saver.last_saved)


def score_with_reference(setup, topo, device, mcfg, rows, out_dir: str, val_rows=None) -> None:
    """--ref-model: its log-probs of every row (rows.reference, and the file; the --val-data pairs' too), by a Trainer
    of it at this layout, freed before the policy's is built."""
    cfg = dataclasses.replace(setup.cfg, init_from_hf=setup.cfg.ref_model, resume=None)
    start = prepare(cfg, mcfg, topo)
    reference = Trainer(dataclasses.replace(setup, cfg=cfg), topo, device, mcfg, shard_value=start.shard_value,
                        boundary=rows.eos_id)
    apply(start, reference)
    load_or_score(reference, rows, out_dir, fresh=True, val_rows=val_rows)
    del reference, start
    gc.collect()


def evaluation(trainer: Trainer, make_val_batches, downstream: Downstream) -> dict:
    """The validation loss (and perplexity) and the downstream scores (HellaSwag), every rank; DPO's: TRL's
    evaluation of the held-out pairs."""
    if trainer.objective is not None:
        return dpo_evaluate(trainer)
    batches = make_val_batches()
    if isinstance(batches, MixtureValidation):  # each source's own held-out part: val_loss/<source> and their mean
        record = batches.record(trainer.evaluate)
    else:
        record = {"val_loss": trainer.evaluate(batches)}
    return {**record, "val_ppl": math.exp(min(record["val_loss"], 50.0)), **downstream.evaluate()}


def validates(cfg) -> bool:
    """Whether the run has validation rows (--val-fraction 0 without --val-data holds none out)."""
    return cfg.val_fraction > 0 or bool(cfg.val_data)


def chat_lines(blocks, cfg) -> list[str]:
    """The chat data's line for the run's rows or each chat source of a mixture, with its mask options."""
    if isinstance(blocks, PairRows):
        return [describe_pairs(blocks.stats)]
    if isinstance(blocks, MixtureBlocks):
        named = [(f"{name}: ", part.stats) for name, part in zip(blocks.names, blocks.parts)]
    else:
        named = [("", getattr(blocks, "stats", {}))]
    mask = f"--train-on {cfg.train_on}" + (f" --train-roles {cfg.train_roles}" if cfg.train_roles else "")
    return [f"{prefix}{line} ({mask})" for prefix, stats in named if (line := describe_chat_rows(stats))]


def document_lines(blocks, cfg, limit: int = 20_000) -> list[str]:
    """Under --document-mask on packed text: how many training rows (of the first `limit`) hold more than one
    document, so that a run whose data has few boundaries (the bundled plays: 38 documents in 23,069 rows at seq 64)
    says once that the mask acts on few rows, or on none."""
    if not cfg.document_mask or not isinstance(blocks, TokenBlocks):
        return []
    rows = blocks.train[: min(limit, len(blocks.train))]
    if not isinstance(rows, np.ndarray):  # chat rows (LabeledRows): their documents come with them
        return []
    several = int((rows[:, 1:-1] == blocks.eos_id).any(axis=1).sum())  # a boundary past a row's first input
    scanned = f"{len(rows):,} training rows" + ("" if len(rows) == len(blocks.train) else " scanned")
    if several == 0:
        return [f"--document-mask: none of the {scanned} holds more than one document (an end-of-text token past its "
                "first position); the mask changes nothing on this data"]
    return [f"--document-mask: {several:,} of the {scanned} hold more than one document; the others train as "
            "without the mask"]


class Throughput:
    """A step's tokens, time, tokens/s, TFLOP/s per device and MFU (where the device's peak is known). Tokens are the
    inputs that are not padding (a chat batch's rows are part padding), counted by the loader; a step's supervised
    targets are logged beside them."""

    def __init__(self, trainer: Trainer, tokens_per_step: int):
        self.tokens_per_step = tokens_per_step
        self.flops_per_device = trained_flops_per_token(trainer.mcfg, trainer.cfg.seq_len, LoRASpec.of(trainer.cfg)) \
            / trainer.topo.layout.world_size
        self.peak = device_peak_tflops(trainer.device, trainer.precision, trainer.cfg.peak_tflops)

    def of(self, step: int, seconds: float, batch=None, seen: int | None = None) -> dict:
        inputs = getattr(batch, "inputs", None) or self.tokens_per_step
        tps = inputs / seconds
        tflops = tps * self.flops_per_device / 1e12
        record = {"tokens": seen if seen is not None else step * self.tokens_per_step, "step_time_s": seconds,
                  "tokens_per_s": tps, "tflops_per_device": tflops, "mfu": tflops / self.peak if self.peak else None}
        if getattr(batch, "supervised", None) is not None:
            record["supervised_tokens"] = batch.targets
        return record
