"""What a checkpoint costs each rank: memory during a save, bytes written and read, save time against the number of
ranks writing, and the training step's stall under --async-save (issue 22; bench/checkpoint_state.md).

    python bench/checkpoint_state.py [--model gpt2-medium] [--sections save,resume,scaling,async]

Memory per rank is measured twice: from outside (the parent samples every rank's resident set with psutil every
20 ms) and from inside (the kernel's peak-RSS counter, VmHWM, reset through /proc/self/clear_refs just before the
save). "rise" = the peak during the save minus the resident set just before it. The script runs unchanged against
the format-1 code (copy it into a checkout of 3586fc7 and run it there) for the "before" rows; sections other than
`save` need format 2.
"""

from __future__ import annotations

import argparse
import copy
import dataclasses
import gc
import os
import sys
import tempfile
import threading
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import Case, build_trainer, fmt_bytes, local_batch, stamp, table, world_barrier  # noqa: E402

PRESETS = {  # (n_layer, n_embd, n_head, vocab)
    "mini": (6, 512, 8, 50304),  # 45M: eight DDP replicas of it fit this host's 24 GiB
    "gpt2": (12, 768, 12, 50304),
    "gpt2-medium": (24, 1024, 16, 50304),
    "gpt2-large": (36, 1280, 20, 50304),
}


def zero3_offload(case: Case) -> dict:
    from bench.memory import ds_config

    return ds_config(3, True, case)


def _status_bytes(field: str) -> int:
    """A memory line of /proc/self/status (VmRSS: resident now, VmHWM: its peak), in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    return 0


def _rss() -> int:
    return _status_bytes("VmRSS")


def _hwm() -> int:
    return _status_bytes("VmHWM")


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
        gc.collect()
        topo.destroy()
        world_barrier()
        time.sleep(1.0)
        if resume is not None:
            rows.append(_resume(rank, model, str(path), name, resume))
    dist.barrier()
    return sorted(rows, key=lambda r: r["name"])


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
    from helpers.distributed import run_world

    results = []
    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out, Sampler() as sampler:
        for i, layout in enumerate(layouts):  # a fresh world each: nothing a previous engine held lingers
            results += run_world(world, _save_world, model, os.path.join(out, str(i)), [layout], timeout=3000)
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
    """Mean step time over `steps` steps at dp=world: no saves, a save every `every` steps, the same with --async-save;
    and how long the training loop was blocked per save (sync: the whole save; async: the snapshot, plus any wait
    for the previous save to finish)."""
    from trainer3d.checkpoint.async_save import BackgroundWriter
    from trainer3d.checkpoint.save import save_checkpoint, take_snapshot

    case = _case(model, world, 1, 1, False)
    topo, trainer = build_trainer(case)
    writer = BackgroundWriter(topo)
    trainer.train_step(local_batch(case, topo, 0))
    step_time, blocked = {}, {}
    for mode in ("none", "sync", "async", "none"):
        world_barrier()
        t0 = time.perf_counter()
        for i in range(1, steps + 1):
            trainer.train_step(local_batch(case, topo, i))
            if mode != "none" and i % every == 0:
                b0 = time.perf_counter()
                if mode == "sync":
                    save_checkpoint(trainer, os.path.join(out, mode), keep_last=1)
                else:
                    writer.wait()
                    writer.start(take_snapshot(trainer, os.path.join(out, mode), keep_last=1))
                blocked.setdefault(mode, []).append(time.perf_counter() - b0)
        writer.wait()
        world_barrier()
        step_time.setdefault(mode, []).append((time.perf_counter() - t0) / steps)
    topo.destroy()
    return {k: min(v) for k, v in step_time.items()}, {k: sum(v) / len(v) for k, v in blocked.items()}


# (dp, offload, model) of the start-up rows: the 774M model at dp 4 and at dp 2 with offload, and a 355M model
# at dp 8, where the whole model in fp32 (4 bytes a parameter) outweighs the ZeRO-3 partition (~20 / dp)
STARTUP = [(4, False, "gpt2-large"), (2, True, "gpt2-large"), (8, False, "gpt2-medium")]


def _startup_world(rank, world, model, offload, hf):
    """Build a ZeRO-3 trainer (or HF GPT2LMHeadModel under deepspeed.zero.Init + deepspeed.initialize, the way
    DeepSpeed's docs build a model too big for one device): this rank's peak resident memory while building, over
    what it held before, against what it holds once built (its partition of parameters and Adam state)."""
    from bench.memory import ds_config

    case = _case(model, world, 1, 1, False)
    ds = ds_config(3, offload, case)
    world_barrier()
    time.sleep(1.0)
    before, t0 = _rss(), time.time()
    _reset_hwm()
    if hf:
        _hf_zero3(case, ds)
    else:
        build_trainer(Case(**{**case.__dict__, "deepspeed_config": ds}))
    t1 = time.time()
    # what ZeRO-3 allocates at start-up in fp32, per parameter: the parameter's partition, its gradient partition,
    # the fp32 master and Adam's two moments, 20 bytes, over dp
    held = case.model_config().num_params() * 20 / world
    world_barrier()
    return dict(name=("HF + zero.Init" if hf else "trainer3d") + f" {model} ZeRO-3{' +offload' if offload else ''} dp{world}",
                rank=rank, pid=os.getpid(), steady=before, peak=_hwm(), t0=t0, t1=t1, held=held,
                total=case.model_config().num_params() * 16, written=0, save_s=t1 - t0)


def _hf_zero3(case: Case, ds: dict) -> None:
    import deepspeed
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    from trainer3d.zero.ops import use_prebuilt_ops

    use_prebuilt_ops()
    deepspeed.init_distributed(dist_backend="gloo", dist_init_required=False)
    cfg = GPT2Config(n_layer=case.n_layer, n_embd=case.n_embd, n_head=case.n_head, vocab_size=case.vocab,
                     n_positions=max(case.seq_len, 1024))
    with deepspeed.zero.Init(config_dict_or_path=copy.deepcopy(ds)):
        model = GPT2LMHeadModel(cfg)
    opt_cls = torch.optim.AdamW
    if (ds["zero_optimization"].get("offload_optimizer") or {}).get("device", "none") != "none":
        from deepspeed.ops.adam import DeepSpeedCPUAdam as opt_cls
    deepspeed.initialize(model=model, optimizer=opt_cls(model.parameters(), lr=1e-4), config=copy.deepcopy(ds))


def llama_405b_rows() -> list[list]:
    """What one rank holds, writes and reads of Llama 3.1 405B's state at the Llama 3 paper's layout, by the
    planner's arithmetic (plan/state_memory.py), against format 1's (the (dp 0, tp 0) rank of each stage gathered
    and wrote the stage: 12 bytes a parameter of it; ZeRO-3 start-up built the rank's tp shard of the stage whole)."""
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.plan.candidate import gib, rank_params
    from trainer3d.plan.cli import cluster_from_preset
    from trainer3d.plan.search import parse_layout, representative_ranks
    from trainer3d.plan.state_memory import state_memory

    cfg, C = MODEL_PRESETS["llama3.1-405b"], cluster_from_preset("h100", 2048)
    rows = []
    for zero in (1, 3):
        cand = parse_layout(f"tp=8,pp=16,schedule=interleaved-1f1b,v=4,mbs=1,zero={zero},recompute=1", cfg, C,
                            2048, 8192)
        ranks = representative_ranks(cand.pp)
        stage = max(rank_params(cfg, 1, cand.stages(r)) for r in ranks)  # all tp shards of the rank's stages
        tp_shard = max(rank_params(cfg, cand.tp, cand.stages(r)) for r in ranks)
        after = [state_memory(cand, r) for r in ranks]
        worst = lambda f: max(getattr(a, f) for a in after)  # noqa: E731
        rows.append([f"ZeRO-{zero}", f"{stage / 1e9:.1f}B params",
                     f"{gib(stage * 12):.0f} GiB on 1 of 1,024 ranks", f"{gib(worst('save_written')):.2f} GiB on each",
                     f"{gib(worst('save_host')):.2f} GiB",
                     f"{gib(tp_shard * 4):.1f} GiB" if zero == 3 else "-",
                     f"{gib(worst('startup_device')):.1f} GiB (+{gib(worst('startup_host')):.1f} host)",
                     f"{gib(worst('resume_read')):.1f} GiB"])
    return rows


def _vs_deepspeed_world(rank, world, model, out, rounds, offload):
    """One ZeRO-3 engine: trainer3d's save and DeepSpeed's own save_checkpoint of the same engines, rounds in rotated
    order; each save's time (to the last rank done), this rank's peak rise (VmHWM) and bytes written."""
    import shutil

    import torch.distributed as dist

    from bench.harness import rotated
    from trainer3d.checkpoint.save import save_checkpoint

    case = _case(model, world, 1, 1, False)
    case = Case(**{**case.__dict__, "deepspeed_config": _zero3(case, offload)})
    topo, trainer = build_trainer(case)
    trainer.train_step(local_batch(case, topo, 0))
    rows = []
    for r in range(rounds):
        for name in rotated(["trainer3d", "trainer3d, no fsync", "deepspeed"], r):
            path = os.path.join(out, f"{name[:9]}{r}")
            gc.collect()
            world_barrier()
            steady, t0 = _rss(), time.time()
            _reset_hwm()
            if name == "trainer3d":
                save_checkpoint(trainer, path)
            elif name == "trainer3d, no fsync":  # what durability costs: DeepSpeed's torch.save does not fsync
                fsync, os.fsync = os.fsync, lambda fd: None
                try:
                    save_checkpoint(trainer, path)
                finally:
                    os.fsync = fsync
            else:  # what a DeepSpeed user runs: every engine's own save_checkpoint
                for i, engine in enumerate(trainer.engine.engines):
                    engine.save_checkpoint(path, tag=f"stage{i}")
            world_barrier()
            t1, peak = time.time(), _hwm()
            written = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs) \
                if rank == 0 else 0
            rows.append(dict(name=name, round=r, rank=rank, save_s=t1 - t0, rise=peak - steady, steady=steady,
                             written=written))
            world_barrier()
            if rank == 0:
                shutil.rmtree(path, ignore_errors=True)
    dist.barrier()
    return rows


def _zero3(case: Case, offload: bool) -> dict:
    from bench.memory import ds_config

    return ds_config(3, offload, case)


def vs_deepspeed(model: str, world: int, rounds: int, offload: bool) -> list[list]:
    from helpers.distributed import run_world

    with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
        results = run_world(world, _vs_deepspeed_world, model, out, rounds, offload, timeout=3000)
    rows = []
    for name in ("trainer3d", "trainer3d, no fsync", "deepspeed"):
        mine = [r for per_rank in results for r in per_rank if r["name"] == name]
        times = sorted({r["round"]: r["save_s"] for r in mine}.values())
        rows.append([name, ", ".join(f"{t:.1f}" for t in times), f"{times[len(times) // 2]:.1f}",
                     " / ".join(fmt_bytes(max(r["rise"] for r in mine if r["rank"] == k)) for k in range(world)),
                     " / ".join(fmt_bytes(max(r["steady"] for r in mine if r["rank"] == k)) for k in range(world)),
                     fmt_bytes(max(r["written"] for r in mine))])
    base = float(rows[-1][2])
    for row in rows:
        row.insert(3, f"{float(row[2]) / base:.2f}")
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", default="gpt2-medium", choices=sorted(PRESETS), help="the 2-process rows' model")
    p.add_argument("--small", default="gpt2", choices=sorted(PRESETS), help="the 8-process rows' model")
    p.add_argument("--sections", default="save,resume,startup,scaling,async,llama,vs-deepspeed")
    p.add_argument("--no-hf", action="store_true", help="skip the HF + zero.Init rows of the startup section")
    p.add_argument("--startup-rows", default="0,1,2", help="which of STARTUP the startup section runs")
    args = p.parse_args()
    sections = set(args.sections.split(","))
    from helpers.distributed import run_world

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
    if "startup" in sections:
        rows = []
        with Sampler() as sampler:
            results = []
            for world, offload, model in [STARTUP[int(i)] for i in args.startup_rows.split(",")]:
                for hf in (False,) if args.no_hf else (False, True):
                    results += run_world(world, _startup_world, model, offload, hf, timeout=3000)
        for r in results:
            rows.append([r["name"], r["rank"], fmt_bytes(r["steady"]),
                         fmt_bytes(sampler.rise(r["pid"], r["t0"], r["t1"])), fmt_bytes(r["peak"] - r["steady"]),
                         fmt_bytes(r["held"]), fmt_bytes(r["total"] / 16 * 4), f"{r['save_s']:.1f}"])
        print("\n## start-up under ZeRO-3, per rank\n")
        print(table(rows, ["build", "rank", "RSS before", "rise (outside)", "rise (VmHWM)", "ZeRO-3 state / dp",
                           "whole model fp32", "s"]))
    if "vs-deepspeed" in sections:  # issue 32: the save of a ZeRO-3 engine against DeepSpeed's own, same engines
        for offload in (False, True):
            print(f"\n## {args.model} ZeRO-3{' + CPU offload' if offload else ''} at dp 2: trainer3d's save against "
                  "DeepSpeed's save_checkpoint (rotated rounds)\n")
            print(table(vs_deepspeed(args.model, 2, 3, offload),
                        ["save", "s per round", "median s", "÷ DeepSpeed", "peak rise rank 0 / 1 (VmHWM)",
                         "RSS before rank 0 / 1", "bytes written"]))
    if "llama" in sections:
        print("\n## Llama 3.1 405B at dp128 tp8 pp16 interleaved v4, worst pipeline rank (the planner's arithmetic)\n")
        print(table(llama_405b_rows(), ["ZeRO", "a rank's stages", "save, before: written", "save, after: written",
                                        "save, after: host rise", "start-up before (ZeRO-3)", "start-up after",
                                        "resume reads"]))
    if "scaling" in sections:
        model = "mini"
        rows, base = [], None
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
            for world in (1, 2, 4, 8):
                t = run_world(world, _scaling_world, model, out, 3, timeout=1800)[0]
                base = base or t
                rows.append([world, f"{t:.2f}", f"{base / t:.2f}"])
        print(f"\n## {model}: save time against the number of ranks writing (DDP, dp = ranks; best of 3)\n")
        print(table(rows, ["ranks writing", "save s", "speed-up vs 1"]))
    if "async" in sections:
        model = "mini"
        with tempfile.TemporaryDirectory(dir=os.environ.get("BENCH_TMP")) as out:
            r, blocked = run_world(2, _async_world, model, out, 12, 4, timeout=1800)[0]
        rows = [[m, f"{r[m]:.3f}", f"{r[m] / r['none']:.2f}",
                 f"{blocked[m]:.3f}" if m in blocked else "-",
                 f"{blocked[m] / blocked['sync']:.2f}" if m in blocked else "-"] for m in ("none", "sync", "async")]
        print(f"\n## {model} at dp 2: a save every 4 steps (12 steps; no saves: best of two runs)\n")
        print(table(rows, ["saves", "s / step", "vs none", "loop blocked per save, s", "vs sync"]))


if __name__ == "__main__":
    main()
