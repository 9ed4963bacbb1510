"""HellaSwag accuracy of a saved checkpoint, at any layout, launched like training:

    python -m trainer3d.evaluate CKPT --hellaswag hellaswag_val.jsonl
    torchrun --nproc_per_node 4 -m trainer3d.evaluate CKPT --hellaswag hellaswag_val.jsonl --tp 2 --pp 2 --output r.json

CKPT is a step_* directory, a `checkpoints` directory or a run's --out-dir (both follow `latest`). The model is built
the way training builds it, so the number is the one training logs as `hellaswag_acc`: a TrainConfig with the
checkpoint's model shape, run seed and tokenizer and this command's layout, then validate, the Trainer, and the
weights through checkpoint.load.prepare (every file's sha256 checked), then train/downstream.py. Bad input fails
with one sentence before any model is built (a path that is no checkpoint, a flag, the HellaSwag file, --output: before
any process group too); --output (a JSON of the accuracies and every example's per-ending losses) is written
atomically by one rank after the last collective, so it is whole or absent.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from pathlib import Path

import torch.distributed as dist

from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.load import prepare
from trainer3d.config import PRECISIONS, SCHEDULE_NAMES, TrainConfig
from trainer3d.distributed.failure import run_reported
from trainer3d.distributed.topology import LaunchEnv, default_device, init_distributed
from trainer3d.errors import ConfigError, UsageError
from trainer3d.fsio import write_text_atomic
from trainer3d.models import MODEL_PRESETS
from trainer3d.parallel.batch import default_micro_batches
from trainer3d.train.downstream import Downstream, hellaswag
from trainer3d.train.setup import RunSetup, validate
from trainer3d.train.trainer import Trainer

ROWS_PER_MICRO_BATCH = 8  # the default --global-batch: this many rows per micro-batch and dp rank


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="python -m trainer3d.evaluate",
        description="HellaSwag accuracy of a trainer3d checkpoint at any (dp, tp, pp) layout (python or torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="step_* directory, checkpoints directory, or a run's --out-dir")
    p.add_argument("--hellaswag", required=True, metavar="PATH", help="HellaSwag jsonl, e.g. hellaswag_val.jsonl")
    p.add_argument("--hellaswag-examples", type=int, default=None, metavar="N", help="the first N examples only")
    p.add_argument("--tp", type=int, default=1)
    p.add_argument("--pp", type=int, default=1)
    p.add_argument("--cp", type=int, default=1, help="context parallelism (each row split over cp ranks)")
    p.add_argument("--schedule", default="1f1b", choices=SCHEDULE_NAMES)
    p.add_argument("--virtual-stages", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=None, help="per pass and dp rank (default as in training)")
    p.add_argument("--global-batch", type=int, default=None,
                   help=f"rows per forward pass over all dp ranks (default {ROWS_PER_MICRO_BATCH} per micro-batch)")
    p.add_argument("--seq-len", type=int, default=None,
                   help="row length; longer examples lose the start of their context (default: the run's)")
    p.add_argument("--precision", default="auto", choices=PRECISIONS)
    p.add_argument("--tokenizer", default=None, help="default: the one the run trained with")
    p.add_argument("--output", default=None, metavar="FILE", help="write the results as JSON (atomically)")
    p.add_argument("--dist-timeout", type=float, default=300.0)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def eval_config(ckpt: Checkpoint, args, world_size: int) -> TrainConfig:
    """The checkpoint's run at this command's layout (the model itself is the checkpoint's config, validate's
    `base_model`); nothing of the run that would touch its files."""
    run = ckpt.meta["config"]
    dp = max(1, world_size // max(1, args.tp * args.pp * args.cp))
    micro_batches = args.micro_batches or default_micro_batches(args.schedule, args.pp)
    return TrainConfig(
        model=run.get("model") if run.get("model") in MODEL_PRESETS else "tiny",
        tp=args.tp, pp=args.pp, cp=args.cp, schedule=args.schedule, virtual_stages=args.virtual_stages,
        micro_batches=args.micro_batches,
        seq_len=args.seq_len or int(run.get("seq_len", 128)),
        global_batch=args.global_batch or ROWS_PER_MICRO_BATCH * dp * micro_batches,
        precision=args.precision, seed=int(run.get("seed", 1337)),
        tokenizer=args.tokenizer or run.get("tokenizer"),
        eval_hellaswag=args.hellaswag, hellaswag_examples=args.hellaswag_examples,
        resume=str(ckpt.path), out_dir=tempfile.gettempdir(),  # evaluation writes nothing there
        dist_timeout=args.dist_timeout,
    )


def check_output(path: str | None) -> None:
    if path is None:
        return
    out = Path(path).expanduser().absolute()
    if out.is_dir():
        raise ConfigError(f"--output {path} is a directory; pass a file name for the JSON.")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path} cannot be written ({out.parent} is not a writable directory).")


def evaluate(setup: RunSetup, topo, device, vocab_size: int):
    """The Trainer on the checkpoint's weights, then HellaSwag; (result, trainer)."""
    mcfg = setup.model_config(vocab_size)
    start = prepare(setup.cfg, mcfg, topo)  # the checkpoint checked on every rank, its sha256 verified
    trainer = Trainer(setup, topo, device, mcfg, shard_value=start.shard_value)
    trainer.step = start.checkpoint.step
    start.checkpoint.close()
    downstream = Downstream(trainer, setup.hellaswag)
    return hellaswag(trainer, downstream.rows, downstream.pad_id), trainer


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = LaunchEnv.from_environ()
    try:  # before any process group: the checkpoint's meta.json, the flags, the HellaSwag file, --output
        ckpt = Checkpoint(resolve_checkpoint(args.checkpoint), check=False)
        setup = validate(eval_config(ckpt, args, env.world_size), env.world_size, base_model=ckpt.model_config)
        check_output(args.output)
    except UsageError as e:
        if env.rank == 0:
            print(f"trainer3d: error: {e}", file=sys.stderr)
        return 2
    device = default_device(env.local_rank)
    owns_group = not dist.is_initialized()  # (tests run this inside a world they made)
    init_distributed(env, device, timeout_s=setup.cfg.dist_timeout)
    made: list = []  # the Topology, once built (cleanup destroys it when the caller owns the group)

    def run() -> None:
        topo = setup.topology()
        made.append(topo)
        result, trainer = evaluate(setup, topo, device, ckpt.model_config.vocab_size)
        if trainer.is_logging_rank:
            print(f"trainer3d.evaluate: {ckpt.path} (step {trainer.step}) at {topo.layout} "
                  f"schedule={setup.cfg.schedule} precision={trainer.precision}, {len(result.labels)} HellaSwag "
                  f"examples: hellaswag_acc {result.acc:.4f} (by mean token loss: llm.c's acc_norm), "
                  f"hellaswag_acc_sum {result.acc_sum:.4f} (by summed loss: llm.c's acc)", flush=True)
            if args.output:
                report = {
                    "checkpoint": str(ckpt.path), "step": trainer.step, "hellaswag": args.hellaswag,
                    "examples": len(result.labels), **result.metrics(),
                    "layout": {"dp": topo.layout.dp, "tp": topo.layout.tp, "pp": topo.layout.pp, "cp": topo.layout.cp,
                               "schedule": setup.cfg.schedule, "precision": trainer.precision},
                    "per_example": [{"label": y, "pick": p, "pick_sum": q, "loss_mean": m, "loss_sum": s}
                                    for y, p, q, m, s in zip(result.labels, result.picks, result.picks_sum,
                                                             result.loss_mean, result.loss_sum)],
                }
                write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")

    def cleanup() -> None:
        if owns_group:
            dist.destroy_process_group()
        elif made:
            made[0].destroy()

    return run_reported(env.rank, env.world_size, run, cleanup)


if __name__ == "__main__":
    sys.exit(main())
