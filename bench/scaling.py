"""Scaling: speedup against the number of processes, measured, ideal, and the planner's prediction of the same runs.

Strong scaling keeps the global batch (32 sequences) and spreads it over more ranks; weak scaling keeps each rank's
share of the work (4 sequences per rank) and grows the batch with the world. Two
families: DDP (dp = N) and a tp×pp layout (tp2, then pp = N/2: (1,2,1), (1,2,2), (1,2,4)). Every run is its own
gloo world of N processes, median step time of `--steps` steps after two warm-up steps.

The planner's prediction (trainer3d.plan.step_time) is for a machine described by measurements taken in this run:
its per-device speed is the one-process run's TFLOP/s, its bandwidth a 2-process gloo all-reduce's bus bandwidth.
It assumes one device per rank. On a 2-core host, 4 and 8 processes share 2 cores, so the measured speedup cannot
pass 2 and the measured/predicted ratio shows how far oversubscription is from the planner's machine; on a GPU
host (one device per rank) the same command compares like with like.

    python bench/scaling.py                       # ~10 min on 2 cores; bench/scaling.png + bench/results/scaling.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.harness import Case, build_trainer, local_batch, stamp, table, world_barrier  # noqa: E402

MODEL = dict(n_layer=8, n_embd=128, n_head=4, vocab=2048, seq_len=64)
WORLDS = (1, 2, 4, 8)


def layout_of(family: str, n: int) -> tuple[int, int, int]:
    """(dp, tp, pp) of a family at world size n."""
    if family == "ddp":
        return n, 1, 1
    return (1, 1, 1) if n == 1 else (1, 2, n // 2)


def case_of(mode: str, family: str, n: int) -> Case:
    dp, tp, pp = layout_of(family, n)
    micro = 2 if pp == 1 else 2 * pp
    global_batch = 32 if mode == "strong" else 4 * n  # weak: 4 sequences of work per rank, whatever the layout
    return Case(dp=dp, tp=tp, pp=pp, micro_batches=micro, global_batch=global_batch, **MODEL)


def measure(rank: int, world: int, case: Case, steps: int) -> float | None:
    topo, trainer = build_trainer(case)
    times = []
    for step in range(steps + 2):
        batch = local_batch(case, topo, step)
        world_barrier()
        t0 = time.perf_counter()
        trainer.train_step(batch)
        world_barrier()
        if step >= 2:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) if rank == 0 else None


def bus_bandwidth(rank: int, world: int, n_bytes: int = 1 << 22, reps: int = 20) -> float | None:
    """GB/s of a ring all-reduce (bus bandwidth: 2(n-1)/n × bytes / time), as the planner counts bandwidth."""
    import torch
    import torch.distributed as dist

    x = torch.ones(n_bytes // 4)
    for _ in range(3):
        dist.all_reduce(x)
    t0 = time.perf_counter()
    for _ in range(reps):
        dist.all_reduce(x)
    dt = (time.perf_counter() - t0) / reps
    return 2 * (world - 1) / world * n_bytes / dt / 1e9 if rank == 0 else None


def predict(case: Case, tflops: float, gbps: float) -> float:
    from trainer3d.plan.candidate import Candidate
    from trainer3d.plan.cluster import Cluster
    from trainer3d.plan.step_time import step_times

    cand = Candidate(cfg=case.model_config(), dp=case.dp, tp=case.tp, pp=case.pp, micro_batches=case.micro_batches,
                     micro_batch_size=case.micro_batch_size, seq_len=case.seq_len, precision="fp32")
    machine = Cluster(nodes=1, gpus_per_node=8, gpu_memory_gib=1024, peak_tflops=tflops, intra_node_gbps=gbps,
                      inter_node_gbps=gbps, mfu=1.0)
    return sum(step_times(cand, machine).values())


def plot(rows: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 4.5), sharey=True)
    for ax, mode in zip(axes, ("strong", "weak")):
        ax.plot(WORLDS, WORLDS, "k--", lw=1, label="ideal")
        ax.axhline(min(os.cpu_count() or 1, max(WORLDS)), color="grey", lw=0.8, ls=":",
                   label=f"{os.cpu_count()} cores on this host")
        for family, color in (("ddp", "tab:blue"), ("tp×pp", "tab:orange")):
            rs = [r for r in rows if r["mode"] == mode and r["family"] == family]
            ax.plot([r["world"] for r in rs], [r["speedup"] for r in rs], "o-", color=color, label=f"{family} measured")
            ax.plot([r["world"] for r in rs], [r["speedup_predicted"] for r in rs], "s:", color=color,
                    label=f"{family} planner")
        ax.set_xscale("log", base=2)
        ax.set_yscale("log", base=2)
        ax.set_xticks(WORLDS, [str(w) for w in WORLDS])
        ax.set_yticks([0.25, 0.5, 1, 2, 4, 8], ["1/4", "1/2", "1", "2", "4", "8"])
        ax.set_xlabel("processes")
        ax.set_title(f"{mode} scaling ({'fixed global batch' if mode == 'strong' else 'fixed per-rank batch'})")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel("speedup over one process (tokens/s ratio)")
    axes[1].legend(fontsize=8, loc="upper left")
    fig.suptitle("trainer3d on a CPU host: gloo processes, fp32", fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


def main(argv=None) -> int:
    from helpers.distributed import run_world

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "scaling.png"))
    args = ap.parse_args(argv)
    gbps = run_world(2, bus_bandwidth, timeout=300)[0]
    rows = []
    for mode in ("strong", "weak"):
        for family in ("ddp", "tp×pp"):
            for n in WORLDS:
                case = case_of(mode, family, n)
                t = run_world(n, measure, case, args.steps, timeout=900)[0]
                rows.append(dict(mode=mode, family=family, world=n, layout=f"({case.dp},{case.tp},{case.pp})",
                                 global_batch=case.global_batch, micro_batches=case.micro_batches, step_s=t,
                                 tokens_per_s=case.global_batch * case.seq_len / t, case=case))
                print(f"{mode:6} {family:6} N={n}: {t * 1000:.0f} ms/step", flush=True)
    one = next(r for r in rows if r["world"] == 1 and r["mode"] == "strong")
    flops = one["case"].model_config().flops_per_token(MODEL["seq_len"]) * one["global_batch"] * MODEL["seq_len"]
    tflops = flops / one["step_s"] / 1e12  # the one-process run's speed is the planner's per-device speed
    for r in rows:
        base = next(b for b in rows if b["mode"] == r["mode"] and b["family"] == r["family"] and b["world"] == 1)
        r["predicted_s"] = predict(r["case"], tflops, gbps)
        base_pred = predict(base["case"], tflops, gbps)
        r["speedup"] = r["tokens_per_s"] / base["tokens_per_s"]
        r["speedup_predicted"] = (r["global_batch"] / r["predicted_s"]) / (base["global_batch"] / base_pred)
    plot(rows, args.out)
    header = ["mode", "family", "N", "(dp,tp,pp)", "batch", "step ms", "planner ms", "measured/planner", "speedup",
              "planner speedup"]
    print(f"\nper-device speed (1 process): {tflops * 1e3:.2f} GFLOP/s; gloo all-reduce bus bandwidth (2 processes): "
          f"{gbps:.2f} GB/s; {stamp('python bench/scaling.py')}\n")
    print(table([[r["mode"], r["family"], r["world"], r["layout"], r["global_batch"], f"{r['step_s'] * 1e3:.0f}",
                  f"{r['predicted_s'] * 1e3:.0f}", f"{r['step_s'] / r['predicted_s']:.2f}", f"{r['speedup']:.2f}",
                  f"{r['speedup_predicted']:.2f}"] for r in rows], header))
    os.makedirs(os.path.join(ROOT, "bench", "results"), exist_ok=True)
    with open(os.path.join(ROOT, "bench", "results", "scaling.json"), "w") as f:
        json.dump({"gflops_per_process": tflops * 1e3, "bus_gbps": gbps, "cpu_count": os.cpu_count(),
                   "rows": [{k: v for k, v in r.items() if k != "case"} for r in rows]}, f, indent=1)
    print(f"\nwrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
