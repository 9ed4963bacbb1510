"""The planner's step time, calibrated on this machine, against the measured step time of every layout of 8 processes
(issue 36): a small GPT-2 and a small Llama, 1F1B, every (dp, tp, pp) factorisation of 8.

In one world of 8 processes: `plan/calibrate.calibrate` measures this machine as `--layout auto` would (matmuls at the
model's shapes with every rank busy, the links' latency and bandwidth, the overlap), then each layout trains a few
steps (the median after a warm-up, fp32). Outside the world the planner (plan/search.evaluate over the calibrated
cluster) predicts each layout's step time. Reported: the rank correlation (Spearman) and the mean absolute percentage
error of predicted against measured, the planner's pick among these layouts against the fastest measured, and the
time the planner takes to search every layout of 8 ranks for the model.

    python bench/calibration.py               # ~5 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from dataclasses import replace

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.harness import Case, build_trainer, local_batch, stamp, table  # noqa: E402

WORLD, SEQ, GB = 8, 128, 16
MODELS = {
    "gpt2": dict(),
    "llama": dict(model="llama-tiny", n_kv_heads=8, ffn_hidden=512),  # 8 kv heads: tp 8 shards them whole
}


def layouts() -> list[tuple[int, int, int]]:
    return [(WORLD // (tp * pp), tp, pp) for tp in (1, 2, 4, 8) for pp in (1, 2, 4, 8) if WORLD % (tp * pp) == 0]


def case(model: str, dp: int, tp: int, pp: int) -> Case:
    return Case(dp=dp, tp=tp, pp=pp, micro_batches=pp, n_layer=8, n_embd=256, n_head=8, vocab=4096, seq_len=SEQ,
                global_batch=GB, extra=dict(MODELS[model]))


def _measure(rank: int, world: int, steps: int) -> dict:
    import torch
    import torch.distributed as dist

    from trainer3d.plan.calibrate import calibrate

    out = {}
    for model in MODELS:
        mcfg = case(model, 1, 1, 1).model_config()
        out[(model, "calibration")] = calibrate(mcfg, GB // WORLD * SEQ, torch.float32, torch.device("cpu"), WORLD)
        for dp, tp, pp in layouts():
            c = case(model, dp, tp, pp)
            topo, trainer = build_trainer(c)
            trainer.train_step(local_batch(c, topo, 0))  # warm-up
            times = []
            for s in range(steps):
                dist.barrier()
                t0 = time.perf_counter()
                trainer.train_step(local_batch(c, topo, s + 1))
                t = torch.tensor(time.perf_counter() - t0)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                times.append(float(t))
            out[(model, (dp, tp, pp))] = statistics.median(times)
            topo.destroy()
    return out


def predicted(model: str, calib, layout) -> float:
    from trainer3d.plan.calibrate import apply
    from trainer3d.plan.cluster import Cluster
    from trainer3d.plan.search import evaluate, parse_layout

    C = apply(Cluster(nodes=1, gpus_per_node=WORLD, gpu_memory_gib=1000, peak_tflops=1, intra_node_gbps=1,
                      inter_node_gbps=1), calib)
    dp, tp, pp = layout
    cfg = case(model, *layout).model_config()
    cand = parse_layout(f"tp={tp},pp={pp},mbs={GB // (dp * pp)},sp=0", cfg, C, GB, SEQ)
    return evaluate(replace(cand, precision="fp32"), C).step_time


def plan_seconds(model: str, calib) -> float:
    from trainer3d.plan.calibrate import apply
    from trainer3d.plan.cluster import Cluster
    from trainer3d.plan.search import enumerate_plans

    C = apply(Cluster(nodes=1, gpus_per_node=WORLD, gpu_memory_gib=1000, peak_tflops=1, intra_node_gbps=1,
                      inter_node_gbps=1), calib)
    t0 = time.perf_counter()
    enumerate_plans(case(model, 1, 1, 1).model_config(), C, GB, SEQ)
    return time.perf_counter() - t0


def spearman(a: list[float], b: list[float]) -> float:
    """Rank correlation (no ties expected among step times); five lines, not a scipy dependency."""
    rank = lambda xs: {i: r for r, i in enumerate(sorted(range(len(xs)), key=xs.__getitem__))}  # noqa: E731
    ra, rb, n = rank(a), rank(b), len(a)
    return 1 - 6 * sum((ra[i] - rb[i]) ** 2 for i in range(n)) / (n * (n * n - 1))


def main() -> None:
    from helpers.distributed import run_world

    p = argparse.ArgumentParser()
    p.add_argument("--steps", type=int, default=4)
    args = p.parse_args()
    print(stamp("python bench/calibration.py " + " ".join(sys.argv[1:])))
    got = run_world(WORLD, _measure, args.steps, timeout=3000)[0]
    summary = []
    for model in MODELS:
        calib = got[(model, "calibration")]
        print(f"\n{model}: calibration: {calib.describe()}")
        rows, meas, pred = [], [], []
        for layout in layouts():
            m, q = got[(model, layout)], predicted(model, calib, layout)
            meas.append(m)
            pred.append(q)
            rows.append([f"{layout}", f"{m:.3f}", f"{q:.3f}", f"{q / m:.2f}"])
        print(table(rows, ["(dp,tp,pp)", "measured s/step", "predicted s/step", "predicted/measured"]))
        pick = min(range(len(pred)), key=pred.__getitem__)
        best = min(range(len(meas)), key=meas.__getitem__)
        mape = statistics.mean(abs(q - m) / m for q, m in zip(pred, meas))
        summary.append([model, f"{spearman(meas, pred):.2f}", f"{mape:.0%}", f"{layouts()[pick]}",
                        f"{layouts()[best]}", f"{meas[pick] / meas[best]:.2f}", f"{plan_seconds(model, calib):.2f}"])
    print()
    print(table(summary, ["model", "Spearman", "MAPE", "pick", "fastest measured", "pick / fastest", "plan s"]))


if __name__ == "__main__":
    main()
