"""The entry point and the training loop: validate before any process group, build the data, the trainer and the
checkpoint state, then train to --max-steps, logging on one rank (console, progress bar, metrics.jsonl, W&B)."""

from __future__ import annotations

import json
import math
import sys
import time

import torch.distributed as dist

from trainer3d.checkpoint.load import apply, prepare
from trainer3d.checkpoint.signals import Checkpointer
from trainer3d.config import parse_args
from trainer3d.data import BatchLoader, DataConfig, build_token_blocks, val_batches
from trainer3d.distributed.collectives import agree_on_error
from trainer3d.distributed.leader import leader_first
from trainer3d.distributed.failure import Heartbeat, run_reported
from trainer3d.distributed.topology import LaunchEnv, default_device, init_distributed
from trainer3d.plugins import load_plugins
from trainer3d.errors import UsageError, first_line
from trainer3d.rundir import clear_run
from trainer3d.train.downstream import Downstream
from trainer3d.train.metrics import MetricsFile, PeakMemory, RunSummary, device_peak_tflops
from trainer3d.train.profiling import StepProfiler
from trainer3d.train.setup import check_out_dir, validate
from trainer3d.train.tracking import Tracker
from trainer3d.train.trainer import Trainer


def main(argv: list[str] | None = None) -> int:
    cfg = parse_args(argv)
    env = LaunchEnv.from_environ()
    try:
        load_plugins()  # TRAINER3D_PLUGINS, first of all
        setup = validate(cfg, env.world_size)  # before any process group: bad input fails here
        check_out_dir(setup.cfg)
    except UsageError as e:
        if env.rank == 0:
            print(f"trainer3d: error: {e}", file=sys.stderr)
        return 2
    cfg, layout, plan = setup.cfg, setup.layout, setup.plan
    device = default_device(env.local_rank)
    init_distributed(env, device, timeout_s=cfg.dist_timeout)
    Heartbeat().beat(0)

    def train() -> None:
        if cfg.overwrite:  # the earlier run goes before anything of this one is written (validate checked the rest)
            error = None
            if env.rank == 0:
                try:
                    clear_run(cfg.out_dir)
                except OSError as e:
                    error = f"--overwrite could not remove the earlier run in {cfg.out_dir} ({first_line(e)})."
            agree_on_error(error, dist.group.WORLD, UsageError)
        topo = setup.topology()
        data_cfg = DataConfig(
            data=cfg.data,
            data_config=cfg.data_config,
            split=cfg.data_split,
            text_field=cfg.text_field,
            tokenizer=cfg.tokenizer,
        )
        blocks = leader_first("tokenize the data into the cache", lambda: build_token_blocks(data_cfg, cfg.seq_len),
                              env.rank, env.local_rank)
        mcfg = setup.model_config(blocks.vocab_size)
        start = prepare(cfg, mcfg, topo)  # --resume / --init-from-hf: checked before anything is built
        trainer = Trainer(setup, topo, device, mcfg, shard_value=start.shard_value, boundary=blocks.eos_id)
        loader = BatchLoader(blocks, plan.global_batch, topo.dp_rank, layout.dp, cfg.seed)
        apply(start, trainer, loader)  # optimizer, step, data position, RNG, loss scale
        downstream = Downstream(trainer, setup.hellaswag)  # HellaSwag rows, the sample prompt (when asked for)
        run(trainer, loader, lambda: val_batches(blocks, plan.global_batch, topo.dp_rank, layout.dp, cfg.eval_batches),
            downstream)

    return run_reported(env.rank, env.world_size, train, dist.destroy_process_group)


def run(trainer: Trainer, loader, make_val_batches, downstream: Downstream | None = None) -> None:
    """Train to max_steps, logging on one rank: console, progress bar and metrics.jsonl; HellaSwag beside every
    validation and text samples every --sample-every steps (`downstream`)."""
    from tqdm import tqdm

    cfg, topo, plan = trainer.cfg, trainer.topo, trainer.plan
    log = trainer.is_logging_rank
    verbose = log or cfg.verbose
    tokens_per_step = plan.global_batch * cfg.seq_len
    flops_tok = trainer.mcfg.flops_per_token(cfg.seq_len)
    peak = device_peak_tflops(trainer.device, trainer.precision, cfg.peak_tflops)
    saver = Checkpointer(trainer, loader, cfg.out_dir, cfg.save_every, cfg.keep_last, log, cfg.on_save_error,
                         cfg.async_save)
    metrics = MetricsFile(cfg.out_dir, enabled=log, append=trainer.step > 0)  # resumed: continue the file
    tracker = Tracker(trainer)  # W&B, on the logging rank only
    profiler = StepProfiler(cfg.profile_steps, cfg.max_steps, cfg.out_dir, dist.get_rank(), trainer.device)
    heartbeat = Heartbeat()
    memory = PeakMemory(trainer.device, topo.world_group)
    downstream = downstream or Downstream(trainer)
    if verbose:
        n_params = trainer.mcfg.num_params()
        print(
            f"[trainer3d] {topo.layout} schedule={cfg.schedule} stages={trainer.pm.n_stages} "
            f"layers/stage={[len(r) for r in trainer.pm.layer_ranges]} micro-batches={plan.micro_batches}×"
            f"{plan.micro_batch_size} global-batch={plan.global_batch} seqs ({tokens_per_step} tokens) "
            f"model={cfg.init_from_hf or cfg.model} ({trainer.mcfg.family}, {n_params / 1e6:.1f}M params) "
            f"precision={trainer.precision} device={trainer.device}",
            flush=True,
        )
    mem = trainer.engine.memory()  # at start; every step record carries it too (metrics.jsonl)
    if verbose:
        mib = lambda k: f"{mem[k + '_bytes'] / 2**20:.1f} MiB ({mem[k + '_offloaded_bytes'] / 2**20:.1f} offloaded)"  # noqa: E731
        print(f"[trainer3d] rank {dist.get_rank()} memory ({trainer.engine.name}): params {mib('param')}, grads {mib('grad')}, "
              f"optimizer states {mib('optim')}", flush=True)
    summary = RunSummary(trainer.step)
    if cfg.eval_every and trainer.step == 0:  # the starting point of the validation curve
        val = trainer.evaluate(make_val_batches())
        record0 = {"step": 0, "val_loss": val, "val_ppl": math.exp(min(val, 50.0)), **downstream.evaluate()}
        metrics.write(record0)
        summary.observe(record0)
        tracker.log(record0)
        if log:
            print(f"step      0 | val_loss {val:.4f}{hellaswag_text(record0)}", flush=True)
    # In a log file (SLURM, nohup) a bar redrawn every step is a wall of \r-joined updates: redraw every 30 s there.
    bar = tqdm(total=cfg.max_steps, initial=trainer.step, disable=not log, dynamic_ncols=True, unit="step",
               mininterval=0.1 if sys.stderr.isatty() else 30.0)
    exit_code = 1  # what W&B records if the loop ends by an exception (a non-finite step, a failed peer)
    try:
        while trainer.step < cfg.max_steps:
            heartbeat.beat(trainer.step + 1)
            profiler.start(trainer.step + 1)
            t0 = time.perf_counter()
            record = trainer.train_step(loader.next_batch(), stop_requested=saver.stop_requested)
            stop = record.pop("stop")  # every rank's signals, agreed in the step's own all-reduce
            dt = time.perf_counter() - t0
            profiler.stop(trainer.step)
            tps = tokens_per_step / dt
            record.update(
                tokens=trainer.step * tokens_per_step,
                step_time_s=dt,
                tokens_per_s=tps,
                tflops_per_device=tps * flops_tok / topo.layout.world_size / 1e12,
                mfu=(tps * flops_tok / topo.layout.world_size / (peak * 1e12)) if peak else None,
            )
            last = trainer.step == cfg.max_steps
            logged = trainer.step % cfg.log_every == 0 or last or trainer.step == 1  # alike on every rank
            if logged:  # the highest of any rank since the previous logged step
                record["peak_mem_bytes"] = memory.report()
            if (cfg.eval_every and trainer.step % cfg.eval_every == 0) or last:
                val = trainer.evaluate(make_val_batches())
                record.update(val_loss=val, val_ppl=math.exp(min(val, 50.0)), **downstream.evaluate())
            metrics.write(record)
            summary.observe(record)
            tracker.log(record)
            bar.update(1)
            bar.set_postfix(loss=f"{record['loss']:.4f}", tok_s=f"{tps:,.0f}", refresh=False)
            if log and logged:
                fd = bar.format_dict  # the ETA in the step lines too, for log files: mean step time of this run so far
                eta = None if last or fd["n"] <= fd["initial"] else \
                    fd["elapsed"] / (fd["n"] - fd["initial"]) * (cfg.max_steps - trainer.step)
                bar.write(step_line(record, eta))
            if downstream.samples_due(trainer.step, last):  # every rank: one forward pass per token
                texts = downstream.samples()
                tracker.log_samples(trainer.step, texts)
                for i, text in enumerate(texts if log else []):
                    bar.write(f"step {trainer.step:>6} | sample {i}: {json.dumps(text, ensure_ascii=False)}")
            if saver.after_step(stop):  # checkpoint when due; True after SIGTERM/SIGUSR1: saved, every rank stops here
                break
        exit_code = 0
    finally:
        bar.close()  # first: an error's sentence then starts on a line of its own
        metrics.close()
        profiler.close()
        tracker.finish(exit_code)
    # After a normal end only: on an error the SIGTERM handler stays, so that the launcher's SIGTERM to the survivors
    # of a dead rank waits until the failure is reported (dist.failure.run_reported)
    saver.close()
    for line in summary.lines(cfg.out_dir, saver.last_saved) if log else []:
        print(line, flush=True)


def step_line(record: dict, eta_s: float | None) -> str:
    """A step's console line, from its metrics record."""
    from tqdm import tqdm

    line = (f"step {record['step']:>6} | loss {record['loss']:.4f} | lr {record['lr']:.2e} | "
            f"grad_norm {record['grad_norm']:.3f} | {record['step_time_s'] * 1000:.0f} ms | "
            f"{record['tokens_per_s']:,.0f} tok/s")
    if record.get("mfu") is not None:
        line += f" | mfu {100 * record['mfu']:.1f}%"
    line += f" | mem {record['peak_mem_bytes'] / 2**30:.2f} GiB"
    if record["skipped"]:
        line += " | skipped (non-finite)"
    if eta_s is not None:
        line += f" | eta {tqdm.format_interval(eta_s)}"
    if "val_loss" in record:
        line += f" | val_loss {record['val_loss']:.4f}{hellaswag_text(record)}"
    return line


def hellaswag_text(record: dict) -> str:
    return f" | hellaswag {record['hellaswag_acc']:.4f}" if "hellaswag_acc" in record else ""


if __name__ == "__main__":
    sys.exit(main())
