"""A saved checkpoint's HellaSwag accuracy, and its loss and perplexity over any corpus, at any layout, launched like
training:

    python -m trainer3d.evaluate CKPT --hellaswag hellaswag_val.jsonl
    python -m trainer3d.evaluate CKPT --data held_out.jsonl --data-format chat --output r.json
    torchrun --nproc_per_node 4 -m trainer3d.evaluate CKPT --data data/fineweb_val --tp 2 --pp 2 --output r.json

CKPT is a step_* directory, a `checkpoints` directory or a run's --out-dir (both follow `latest`). The model is built
the way training builds it, so the numbers are the ones training logs: a TrainConfig with the checkpoint's model
shape, run seed and tokenizer and this command's layout, then validate, the Trainer, and the weights through
checkpoint.load.prepare (every file's sha256 checked). --data takes what training's --data takes: every row of it
(text: blocks of seq_len + 1 tokens, each token after a block's first predicted once; chat: the supervised targets of
every conversation, --train-on's rule) goes through the model once, the last global batch padded with rows in no loss,
and `loss` is the mean over all those targets (`tokens`), `ppl` its exponential. Bad input fails with one sentence
before any model is built (a path that is no checkpoint, a flag, the HellaSwag file, --output: before any process
group too); --output (a JSON of the results, with HellaSwag's per-ending losses) is written atomically by one rank
after the last collective, so it is whole or absent.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import tempfile
from pathlib import Path

import numpy as np

from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.load import copy_tables, prepare
from trainer3d.config import PRECISIONS, SCHEDULE_NAMES, TrainConfig
from trainer3d.data import build_rows, corpus_batches
from trainer3d.data.batch import supervised_count
from trainer3d.distributed.failure import run_reported
from trainer3d.distributed.leader import leader_first
from trainer3d.distributed.topology import LaunchEnv, WorldGroup, default_device
from trainer3d.errors import ArgumentParser, ConfigError, UsageError, report
from trainer3d.fsio import write_text_atomic
from trainer3d.models import MODEL_PRESETS
from trainer3d.parallel.batch import default_micro_batches
from trainer3d.train.downstream import Downstream, hellaswag
from trainer3d.train.setup import RunSetup, data_config, validate
from trainer3d.train.trainer import Trainer

ROWS_PER_MICRO_BATCH = 8  # the default --global-batch: this many rows per micro-batch and dp rank


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="python -m trainer3d.evaluate",
        description="HellaSwag accuracy of a trainer3d checkpoint at any (dp, tp, pp) layout (python or torchrun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    p.add_argument("checkpoint", help="step_* directory, checkpoints directory, or a run's --out-dir")
    p.add_argument("--hellaswag", default=None, metavar="PATH", help="HellaSwag jsonl, e.g. hellaswag_val.jsonl")
    p.add_argument("--data", default=None, metavar="PATH",
                   help="a corpus (anything training's --data takes): its loss and perplexity over every row")
    p.add_argument("--data-format", default="text", choices=("text", "chat", "sharegpt"))
    p.add_argument("--data-config", default=None, help="HF dataset config name")
    p.add_argument("--data-split", default="train")
    p.add_argument("--text-field", default="text")
    p.add_argument("--messages-field", default="messages")
    p.add_argument("--train-on", default="assistant", choices=("assistant", "last", "all"),
                   help="chat: the targets scored (as training's --train-on)")
    p.add_argument("--train-roles", default=None, help="chat: the roles whose turns are scored (default: assistant)")
    p.add_argument("--chat-template", default=None, metavar="FILE", help="chat: default: the run's --chat-template")
    p.add_argument("--chat-template-kwargs", default=None, metavar="JSON", help="chat: default: the run's")
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
        trust_remote_code=bool(run.get("trust_remote_code")) and not args.tokenizer,
        eval_hellaswag=args.hellaswag, hellaswag_examples=args.hellaswag_examples,
        data=args.data, data_config=args.data_config, data_split=args.data_split, text_field=args.text_field,
        data_format=args.data_format, messages_field=args.messages_field, train_on=args.train_on,
        train_roles=args.train_roles, **chat_templating(args, run),
        resume=str(ckpt.path), out_dir=tempfile.gettempdir(),  # evaluation writes nothing there
        dist_timeout=args.dist_timeout,
    )


def chat_templating(args, run: dict) -> dict:
    """Chat data is rendered as the run rendered it (its --chat-template and variables) unless the command says
    otherwise; text data has no template."""
    if args.data_format == "text":
        return {}
    return {"chat_template": args.chat_template or run.get("chat_template"),
            "chat_template_kwargs": args.chat_template_kwargs or run.get("chat_template_kwargs")}


def check_asked(args) -> None:
    if args.hellaswag is None and args.data is None:
        raise ConfigError("Nothing to evaluate: pass --hellaswag FILE, --data PATH, or both.")


def check_output(path: str | None) -> None:
    if path is None:
        return
    out = Path(path).expanduser().absolute()
    if out.is_dir():
        raise ConfigError(f"--output {path} is a directory; pass a file name for the JSON.")
    if not out.parent.is_dir() or not os.access(out.parent, os.W_OK | os.X_OK):
        raise ConfigError(f"--output {path} cannot be written ({out.parent} is not a writable directory).")


def load_trainer(setup: RunSetup, topo, device, vocab_size: int, boundary: int | None) -> Trainer:
    """The Trainer on the checkpoint's weights and tables (a router's learned selection bias routes as trained)."""
    mcfg = setup.model_config(vocab_size)
    start = prepare(setup.cfg, mcfg, topo)  # the checkpoint checked on every rank, its sha256 verified
    trainer = Trainer(setup, topo, device, mcfg, shard_value=start.shard_value, boundary=boundary)
    copy_tables(trainer, start.checkpoint.table)
    trainer.step = start.checkpoint.step
    start.checkpoint.close()
    return trainer


def corpus_rows(setup: RunSetup, env: LaunchEnv):
    """Every row of --data (none held out), built once per node like training's."""
    cfg = setup.cfg
    data = dataclasses.replace(data_config(cfg), val_fraction=0.0)
    return leader_first("tokenize the data into the cache", lambda: build_rows(data, cfg.seq_len), env.rank,
                        env.local_rank)


def corpus_loss(trainer: Trainer, rows) -> dict:
    """The mean loss over every supervised target of `rows` (one forward pass each), its count and perplexity."""
    topo = trainer.topo
    passes, batches = corpus_batches(rows, trainer.plan.global_batch, topo.dp_rank, topo.layout.dp)
    loss = trainer.evaluate(batches)
    return {"loss": loss, "tokens": supervised_count(rows, np.arange(len(rows))), "ppl": math.exp(min(loss, 50.0)),
            "rows": len(rows), "passes": passes}


def hellaswag_report(path: str, result) -> dict:
    return {"hellaswag": path, "examples": len(result.labels), **result.metrics(),
            "per_example": [{"label": y, "pick": p, "pick_sum": q, "loss_mean": m, "loss_sum": s}
                            for y, p, q, m, s in zip(result.labels, result.picks, result.picks_sum, result.loss_mean,
                                                     result.loss_sum)]}


def say(report: dict, setup: RunSetup, topo, trainer: Trainer) -> None:
    head = (f"trainer3d.evaluate: {report['checkpoint']} (step {report['step']}) at {topo.layout} "
            f"schedule={setup.cfg.schedule} precision={trainer.precision}")
    if "loss" in report:
        print(f"{head}, {report['data']} ({report['data_format']}): loss {report['loss']:.6f} over "
              f"{report['tokens']:,} tokens, ppl {report['ppl']:.4f}", flush=True)
    if "hellaswag" in report:
        print(f"{head}, {report['examples']} HellaSwag examples: hellaswag_acc {report['hellaswag_acc']:.4f} (by mean "
              f"token loss: llm.c's acc_norm), hellaswag_acc_sum {report['hellaswag_acc_sum']:.4f} (by summed loss: "
              "llm.c's acc)", flush=True)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    env = LaunchEnv.from_environ()
    try:  # before any process group: the checkpoint's meta.json, the flags, the HellaSwag file, --output
        ckpt = Checkpoint(resolve_checkpoint(args.checkpoint), check=False)
        check_asked(args)
        setup = validate(eval_config(ckpt, args, env.world_size), env.world_size, base_model=ckpt.model_config)
        check_output(args.output)
    except UsageError as e:
        return report(e, env.rank)
    device = default_device(env.local_rank)
    group = WorldGroup(env, device, setup.cfg.dist_timeout)

    def run() -> None:
        topo = group.topology = setup.topology()
        rows = corpus_rows(setup, env) if args.data else None
        trainer = load_trainer(setup, topo, device, ckpt.model_config.vocab_size,
                               rows.eos_id if rows is not None else None)
        report = {"checkpoint": str(ckpt.path), "step": trainer.step,
                  "layout": {"dp": topo.layout.dp, "tp": topo.layout.tp, "pp": topo.layout.pp, "cp": topo.layout.cp,
                             "schedule": setup.cfg.schedule, "precision": trainer.precision}}
        if rows is not None:  # loss, tokens, ppl at the top, beside HellaSwag's keys
            report.update(data=args.data, data_format=args.data_format, **corpus_loss(trainer, rows.train))
        if args.hellaswag:
            downstream = Downstream(trainer, setup.hellaswag)
            report.update(hellaswag_report(args.hellaswag, hellaswag(trainer, downstream.rows, downstream.pad_id)))
        if trainer.is_logging_rank:
            say(report, setup, topo, trainer)
            if args.output:
                write_text_atomic(args.output, json.dumps(report, indent=1) + "\n")

    return run_reported(env.rank, env.world_size, run, group.close)


if __name__ == "__main__":
    sys.exit(main())
