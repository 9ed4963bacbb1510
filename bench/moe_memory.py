"""Memory per rank of a mixture of experts under expert parallelism, DDP and ZeRO 1/3, measured from outside the
process and from inside, against the planner (trainer3d/plan/memory.py) (issue 42).

    python bench/moe_memory.py [--layouts ddp-ep2,zero1-ep2,zero3-ep2,zero3-ep1] [--steps 3]

A Qwen3-MoE of 8 MoE layers (16 experts of width 512, top 2, hidden 256), fp32, on a world of 4 (dp 4; ZeRO spans
the world: DeepSpeed's stage-3 barriers are on the world group), a fresh world per layout. Each rank first trains a
tiny model one step (one-time costs: gloo, thread pools, DeepSpeed's set-up), then builds the measured trainer and
trains `--steps` steps. "Rise" is from just before the build to the peak of the steps, three ways: the parent
samples every rank's resident set every 20 ms (outside, bench/checkpoint_state.Sampler); the kernel's peak-RSS
counter VmHWM, reset just before the build (inside); the malloc counter bench/memhook.c (inside, every byte).
The planner's figure is its step peak on a CPU host (device + host: offload is the same memory here).

"all gathered experts" is what a ZeRO-3 rank would hold on top if every MoE layer kept its gathered experts from its
forward to its backward (what a view of the weights saved for the backward did before issue 42): the 8 layers' experts
of this ep rank. A ZeRO-3 row whose peak sits near the planner's (which counts at most two layers gathered) shows
each layer's gathered experts freed after its forward.

`MALLOC_MMAP_THRESHOLD_=131072 python bench/moe_memory.py` fixes glibc's mmap threshold (which otherwise rises to
32 MiB after the first large free, so that freed blocks stay in the heap, resident): the outside figures then show
what the allocator's peak is, without the heap's retention.
"""

from __future__ import annotations

import argparse
import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.checkpoint_state import Sampler, _hwm, _reset_hwm, _rss  # noqa: E402
from bench.harness import (  # noqa: E402
    Case, build_trainer, candidate_of, fmt_bytes, local_batch, stamp, table, world_barrier,
)
from bench.memory import ds_config  # noqa: E402

WORLD = 4
MOE = dict(model="qwen3-moe-tiny", n_experts=16, top_k=2, moe_ffn_hidden=512)
SHAPE = dict(n_layer=8, n_embd=256, n_head=4, vocab=2048, seq_len=64, global_batch=16)
LAYOUTS = {  # name -> (zero stage, ep)
    "ddp-ep2": (0, 2), "zero1-ep2": (1, 2), "zero3-ep2": (3, 2), "zero3-ep1": (3, 1),
}


def case_of(layout: str, shape: dict = SHAPE) -> Case:
    stage, ep = LAYOUTS[layout]
    base = Case(dp=WORLD, extra=dict(MOE, ep=ep), **shape)
    if stage:
        base = Case(**{**base.__dict__, "deepspeed_config": ds_config(stage, False, base)})
    return base


def _world(rank, world, layout, steps):
    from bench.measure import MallocCounter

    mc = MallocCounter()
    warm = case_of(layout, dict(n_layer=2, n_embd=64, n_head=4, vocab=256, seq_len=16, global_batch=8))
    topo, tr = build_trainer(warm)
    tr.train_step(local_batch(warm, topo, 0))
    topo.destroy()
    del tr, topo
    gc.collect()
    case = case_of(layout)
    world_barrier()
    before, base, t0 = _rss(), mc.current(), time.time()
    _reset_hwm()
    mc.reset_peak()
    topo, tr = build_trainer(case)
    for s in range(steps):
        tr.train_step(local_batch(case, topo, s))
    t1 = time.time()
    out = dict(layout=layout, rank=rank, pid=os.getpid(), t0=t0, t1=t1, vmhwm=_hwm() - before,
               malloc=mc.peak() - base)
    time.sleep(0.1)  # the outside sampler's last reads fall inside [t0, t1 + 0.1]
    out["t1"] = time.time()
    topo.destroy()
    return out


def planner(layout: str) -> tuple[float, float]:
    """(the planner's step peak on a CPU host, the bytes of every MoE layer's gathered experts of one ep rank)."""
    from trainer3d.plan.candidate import expert_params
    from trainer3d.plan.memory import estimate_memory

    stage, ep = LAYOUTS[layout]
    cand = candidate_of(case_of(layout), stage)
    e = estimate_memory(cand, 0)
    gathered = expert_params(cand.cfg, 1, cand.stages(0), ep) * 4
    return e.peak + e.offloaded + e.host_buffers, gathered


def main(argv=None) -> int:
    from bench.measure import preloaded_memhook
    from helpers.distributed import run_world

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--layouts", default=",".join(LAYOUTS))
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    rows, summary = [], []
    with Sampler() as sampler, preloaded_memhook():
        for layout in args.layouts.split(","):
            model, gathered = planner(layout)
            kept = fmt_bytes(gathered) if LAYOUTS[layout][0] == 3 else "-"  # a ZeRO-3 rank's, had none been freed
            results = run_world(WORLD, _world, layout, args.steps, timeout=1800)
            ratios = []
            for r in results:
                outside = sampler.rise(r["pid"], r["t0"], r["t1"])
                ratios.append((outside / model, r["vmhwm"] / model, r["malloc"] / model))
                rows.append([layout, r["rank"], fmt_bytes(outside), fmt_bytes(r["vmhwm"]), fmt_bytes(r["malloc"]),
                             fmt_bytes(model), *(f"{x:.2f}" for x in ratios[-1]), kept])
            span = lambda i: f"{min(x[i] for x in ratios):.2f}-{max(x[i] for x in ratios):.2f}"  # noqa: E731
            summary.append([layout, fmt_bytes(model), span(0), span(1), span(2), kept])
    print(table(rows, ["layout", "rank", "rise (outside)", "rise (VmHWM)", "malloc peak", "planner",
                       "outside / planner", "VmHWM / planner", "malloc / planner", "all gathered experts"]))
    print()
    print(table(summary, ["layout", "planner (per rank)", "outside / planner", "VmHWM / planner", "malloc / planner",
                          "all gathered experts"]))
    env = "".join(f"{k}={os.environ[k]} " for k in ("MALLOC_MMAP_THRESHOLD_",) if k in os.environ)
    print(stamp(env + "python bench/moe_memory.py " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
