"""What a checkpoint costs each rank: memory during a save, bytes written and read, save time against the number of
ranks writing, and the training step's stall under --async-save (issue 22; bench/README.md section "Checkpoint
state at scale").

    python bench/checkpoint_state.py [--model gpt2-medium] [--sections save,resume,scaling,async]

Memory per rank is measured twice: from outside (the parent samples every rank's resident set with psutil every
20 ms) and from inside (the kernel's peak-RSS counter, VmHWM, reset through /proc/self/clear_refs just before the
save). "rise" = the peak during the save minus the resident set just before it. The script runs unchanged against
the format-1 code (copy it into a checkout of 3586fc7 and run it there) for the "before" rows; sections other than
`save` need format 2.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import Case, build_trainer, fmt_bytes, local_batch, stamp, table, world_barrier  # noqa: E402

PRESETS = {  # (n_layer, n_embd, n_head, vocab)
    "gpt2": (12, 768, 12, 50304),
    "gpt2-medium": (24, 1024, 16, 50304),
}


def zero3_offload(case: Case) -> dict:
    from bench.memory import ds_config

    return ds_config(3, True, case)


def _rss() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    return 0


def _hwm() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) * 1024
    return 0


def _reset_hwm() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _case(model: str, dp: int, tp: int, pp: int, zero: bool) -> Case:
    n_layer, n_embd, n_head, vocab = PRESETS[model]
    c = Case(dp=dp, tp=tp, pp=pp, micro_batches=max(1, pp), n_layer=n_layer, n_embd=n_embd, n_head=n_head,
             vocab=vocab, seq_len=64, global_batch=2 * dp * max(1, pp))
    if zero:
        c = Case(**{**c.__dict__, "deepspeed_config": zero3_offload(c)})
    return c


def _save_world(rank, world, model, out, layouts):
    """Every layout: build, one step, quiet, save (timed, memory read around it), optionally resume elsewhere."""
    import torch.distributed as dist

    from trainer3d.checkpoint.save import save_checkpoint

    rows = []
    for name, (dp, tp, pp, zero), resume in layouts:
        case = _case(model, dp, tp, pp, zero)
        name = f"{model} {name}"
        topo, trainer = build_trainer(case)
        trainer.train_step(local_batch(case, topo, 0))
        held = trainer.engine.memory()
        world_barrier()
        time.sleep(1.0)  # a quiet second: the outside sampler sees the steady state
        steady, t0 = _rss(), time.time()
        _reset_hwm()
        path = save_checkpoint(trainer, os.path.join(out, str(len(rows))))
        t1 = time.time()
        peak = _hwm()
        mine = [f for f in os.listdir(path) if f.endswith(f"{rank:05d}.safetensors") or
                (f.endswith(f"pp{topo.pp_rank}.safetensors") and topo.dp_rank == 0 and topo.tp_rank == 0)]
        written = sum(os.path.getsize(os.path.join(path, f)) for f in mine if "rng" not in f or f.startswith("shard"))
        rows.append(dict(name=name, rank=rank, pid=os.getpid(), steady=steady, peak=peak, t0=t0, t1=t1,
                         written=written, held=held["param_bytes"] + held["optim_bytes"],
                         total=trainer.mcfg.num_params() * 12, save_s=t1 - t0))
        del trainer
        topo.destroy()
        world_barrier()
        time.sleep(1.0)
        if resume is not None:
            rows.append(_resume(rank, model, str(path), name, resume))
    dist.barrier()
    return rows


def _resume(rank, model, path, name, layout):
    """Resume `path` at another layout: bytes this rank read (the loader's own count) against what it holds."""
    from trainer3d.checkpoint.load import apply, prepare
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    dp, tp, pp, zero = layout
    case = _case(model, dp, tp, pp, zero)
    cfg = case.train_config()
    cfg = dataclasses.replace(cfg, resume=path)
    setup = validate(cfg, case.world, case.vocab)
    topo = setup.topology(list(range(case.world)))
    world_barrier()
    steady, t0 = _rss(), time.time()
    _reset_hwm()
    mcfg = cfg.model_config(case.vocab)
    start = prepare(cfg, mcfg, topo)
    ckpt = start.checkpoint
    trainer = Trainer(setup, topo, __import__("torch").device("cpu"), mcfg, shard_value=start.shard_value)
    apply(start, trainer)
    t1 = time.time()
    held = trainer.engine.memory()
    row = dict(name=f"{name} -> {case.label()}", rank=rank, pid=os.getpid(), steady=steady, peak=_hwm(), t0=t0, t1=t1,
               read=ckpt.bytes_read, held=held["param_bytes"] + held["optim_bytes"],
               total=mcfg.num_params() * 12, save_s=t1 - t0)
    del trainer
    topo.destroy()
    world_barrier()
    time.sleep(1.0)
    return row


class Sampler:
    """Samples the resident set of every child process of this one (the spawned ranks) every `period` s."""

    def __init__(self, period: float = 0.02):
        import psutil

        self.period, self.samples, self._stop = period, [], threading.Event()
        self._me = psutil.Process()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self):
        import psutil

        while not self._stop.is_set():
            now = time.time()
            for c in self._me.children(recursive=True):
                try:
                    self.samples.append((now, c.pid, c.memory_info().rss))
                except psutil.Error:
                    pass
            time.sleep(self.period)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def rise(self, pid: int, t0: float, t1: float) -> int:
        """Peak RSS of `pid` in [t0, t1] over its last sample before t0."""
        before = [r for t, p, r in self.samples if p == pid and t < t0]
        during = [r for t, p, r in self.samples if p == pid and t0 <= t <= t1]
        return max(during + before[-1:]) - before[-1] if before else 0


def run_saves(model: str, world: int, layouts) -> list[list]:
    from distributed import run_world

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out, Sampler() as sampler:
        results = run_world(world, _save_world, model, out, layouts, timeout=3000)
    rows = []
    for r in sorted((r for per_rank in results for r in per_rank), key=lambda r: (r["name"], r["rank"])):
        moved = r.get("written", r.get("read", 0))
        rows.append([r["name"], r["rank"], fmt_bytes(r["steady"]), fmt_bytes(sampler.rise(r["pid"], r["t0"], r["t1"])),
                     fmt_bytes(max(0, r["peak"] - r["steady"])), fmt_bytes(r["held"]), fmt_bytes(moved),
                     f"{moved / (r['total'] / world):.2f}", f"{r['save_s']:.1f}"])
    return rows


def _scaling_world(rank, world, model, out, repeats):
    """Save time at dp=world (DDP): every rank writes ~1/world of the state (format 2)."""
    from trainer3d.checkpoint.save import save_checkpoint

    case = _case(model, world, 1, 1, False)
    topo, trainer = build_trainer(case)
    trainer.train_step(local_batch(case, topo, 0))
    times = []
    for i in range(repeats):
        world_barrier()
        t0 = time.perf_counter()
        save_checkpoint(trainer, os.path.join(out, f"w{world}"), keep_last=1)
        world_barrier()
        times.append(time.perf_counter() - t0)
    topo.destroy()
    return min(times)


def _async_world(rank, world, model, out, steps, every):
    """Mean step time over `steps` steps at dp=world: no saves, a save every `every` steps, the same with --async-save."""
    from trainer3d.checkpoint.async_save import BackgroundWriter
    from trainer3d.checkpoint.save import save_checkpoint, take_snapshot

    case = _case(model, world, 1, 1, False)
    topo, trainer = build_trainer(case)
    writer = BackgroundWriter(topo)
    trainer.train_step(local_batch(case, topo, 0))
    out_rows = {}
    for mode in ("none", "sync", "async", "none"):
        world_barrier()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            trainer.train_step(local_batch(case, topo, i))
            if mode != "none" and i % every == 0:
                if mode == "sync":
                    save_checkpoint(trainer, os.path.join(out, mode), keep_last=1)
                else:
                    writer.wait()
                    writer.start(take_snapshot(trainer, os.path.join(out, mode), keep_last=1))
        writer.wait()
        world_barrier()
        out_rows.setdefault(mode, []).append((time.perf_counter() - t0) / steps)
    topo.destroy()
    return {k: min(v) for k, v in out_rows.items()}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS), help="the 2-process rows' model")
    p.add_argument("--small", default="gpt2", choices=sorted(PRESETS), help="the 8-process rows' model")
    p.add_argument("--sections", default="save,resume,scaling,async")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    from distributed import run_world

    print(stamp("python bench/checkpoint_state.py " + " ".join(sys.argv[1:])))
    header = ["save (layout)", "rank", "RSS before", "rise (outside)", "rise (VmHWM)", "held (params+Adam)",
              "bytes written/read", "÷ total/world", "s"]
    if "save" in sections or "resume" in sections:
        layouts = []
        if "save" in sections:
            layouts += [("ddp (2,2,2)", (2, 2, 2, False), None), ("zero3+offload (2,2,2)", (2, 2, 2, True), None)]
        if "resume" in sections:
            layouts += [("ddp (2,2,2)", (2, 2, 2, False), (4, 1, 2, False)),
                        ("ddp (2,2,2)", (2, 2, 2, False), (4, 1, 2, True))]
        print(f"\n## {args.small}: a save, and a resume at another layout, per rank (8 processes)\n")
        print(table(run_saves(args.small, 8, layouts), header))
    if "save" in sections:  # the model of the measurement, at the world size this host's 24 GiB holds
        layouts = [("ddp (2,1,1)", (2, 1, 1, False), None), ("zero3+offload (2,1,1)", (2, 1, 1, True), None)]
        print(f"\n## {args.model}: a save, per rank (2 processes)\n")
        print(table(run_saves(args.model, 2, layouts), header))
    if "scaling" in sections:
        model = "gpt2"
        rows, base = [], None
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
            for world in (1, 2, 4, 8):
                t = run_world(world, _scaling_world, model, out, 3, timeout=1800)[0]
                base = base or t
                rows.append([world, f"{t:.2f}", f"{base / t:.2f}"])
        print(f"\n## {model}: save time against the number of ranks writing (DDP, dp = ranks; best of 3)\n")
        print(table(rows, ["ranks writing", "save s", "speed-up vs 1"]))
    if "async" in sections:
        model = "gpt2"
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
            r = run_world(2, _async_world, model, out, 12, 4, timeout=1800)[0]
        rows = [[m, f"{r[m]:.3f}", f"{r[m] / r['none']:.2f}"] for m in ("none", "sync", "async")]
        print(f"\n## {model} at dp 2: mean step time with a save every 4 steps (12 steps, best of the two no-save runs)\n")
        print(table(rows, ["saves", "s / step", "vs none"]))


if __name__ == "__main__":
    main()
