"""Pipeline bubble per schedule: measured idle fraction against theory, with deterministic stage compute.

Each stage is a module whose forward sleeps a fixed time per micro-batch and whose backward sleeps the same
time for the input gradient and again for the weight gradient (so B = 2F, and the zero-bubble schedules can
split it into I = W = F). Sleeping costs no CPU, so the two shared cores and the other engineers' jobs do not
change the compute time; what remains is the schedule. Stages are built and driven exactly as the trainer does
(trainer3d.pipeline: stage ids per rank, torch.distributed.pipelining's schedules via build_schedule). A rank
with v stages (chunks) sleeps 1/v of the time in each, so every rank's compute per micro-batch is the same.

Per rank: idle = 1 - (time spent in the stage's compute) / (step time, barrier to barrier); the table gives
the mean over ranks of the best of the measured steps, next to the schedule's idle fraction simulated from
torch's own per-rank action lists (exact times, free communication: what the implementation would reach on an
ideal machine) and to the textbook formula:
  GPipe, 1F1B:                      (p-1) / (m + p - 1)
  interleaved 1F1B, looped BFS (v): (p-1) / (v·m + p - 1)       (the bubble of 1F1B divided by v)
  zero-bubble (ZB-V, interleaved ZB, DualPipeV) with F = I = W: 0 in the papers' model (Qi et al. 2023)

    python bench/pipeline_bubble.py                  # p=4, m=8 and 16, forward 40 ms per stage and micro-batch
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import stamp, table  # noqa: E402

import torch  # noqa: E402
import torch.nn as nn  # noqa: E402

WIDTH = 16  # activation width: tiny, so that the sends cost nothing next to the sleeps


class Busy:
    """Accumulates the time this process spends in stage compute."""

    total = 0.0

    @classmethod
    def sleep(cls, seconds: float) -> None:
        t0 = time.perf_counter()
        time.sleep(seconds)
        cls.total += time.perf_counter() - t0


class _SleepInput(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        Busy.sleep(seconds)
        return x.clone()

    @staticmethod
    def backward(ctx, grad):
        Busy.sleep(ctx.seconds)  # the input gradient (I)
        return grad, None


class _SleepWeight(torch.autograd.Function):
    @staticmethod
    def forward(ctx, w, seconds):
        ctx.seconds = seconds
        return w.clone()

    @staticmethod
    def backward(ctx, grad):
        Busy.sleep(ctx.seconds)  # the weight gradient (W)
        return grad, None


class SleepStage(nn.Module):
    """y = (x + b) + w: forward sleeps F, backward sleeps F for the gradient of the activation and F for the
    weight gradient (B = I + W = 2F). The bias b makes the activation require grad on the first stage too
    (whose input does not), so every stage does the same work."""

    def __init__(self, seconds: float):
        super().__init__()
        self.seconds = seconds
        self.b = nn.Parameter(torch.zeros(WIDTH))
        self.w = nn.Parameter(torch.zeros(WIDTH))

    def forward(self, x):
        return _SleepInput.apply(x + self.b, self.seconds) + _SleepWeight.apply(self.w, self.seconds)


def theory(schedule: str, p: int, m: int, v: int) -> float:
    if schedule in ("gpipe", "1f1b"):
        return (p - 1) / (m + p - 1)
    if schedule in ("interleaved-1f1b", "looped-bfs"):
        return (p - 1) / (v * m + p - 1)
    return 0.0  # zero-bubble schedules with F = I = W


def action_order(sched) -> dict[int, list]:
    """torch's own per-rank compute order for a schedule (pipeline_order), flattened: [(type, stage, mb)].
    Schedule1F1B's pipeline-order IR (used only for visualisation) skips micro-batch 0 on the last stage, so its
    order is rebuilt from Schedule1F1B._step_microbatches: min(m, p - r) warm-up forwards, then B/F pairs."""
    from torch.distributed.pipelining import schedules

    if isinstance(sched, schedules.Schedule1F1B):
        p, m = sched._num_stages, sched._n_microbatches
        out = {}
        for r in range(p):
            w = min(m, p - r)
            acts = [("F", r, i) for i in range(w)]
            for b in range(m):
                acts.append(("B", r, b))
                if w + b < m:
                    acts.append(("F", r, w + b))
            out[r] = acts
        return out
    order = getattr(sched, "pipeline_order", None)
    if order is None and hasattr(sched, "_get_pipeline_order"):
        order = sched._get_pipeline_order()
    out = {}
    for rank, actions in (order or {}).items():
        flat = []
        for a in actions:
            if a is None:
                continue
            subs = getattr(a, "sub_actions", None) or [a]
            for x in subs:
                t = str(x.computation_type.value if hasattr(x.computation_type, "value") else x.computation_type)
                if t in ("F", "B", "I", "W"):
                    flat.append((t, x.stage_index, x.microbatch_index))
        out[rank] = flat
    return out


def simulate(order: dict[int, list], n_stages: int, per_rank: int, forward: float = 1.0) -> float:
    """Mean idle fraction of torch's action lists run with exact times (F = I = W = forward/v, B = 2F) and
    free communication: the schedule's own bubble, without any noise."""
    dur = {"F": forward / per_rank, "I": forward / per_rank, "W": forward / per_rank, "B": 2 * forward / per_rank}
    done: dict[tuple, float] = {}
    free = {r: 0.0 for r in order}
    pos = {r: 0 for r in order}
    busy = {r: 0.0 for r in order}
    progress = True
    while progress:
        progress = False
        for r, acts in order.items():
            while pos[r] < len(acts):
                t, s, mb = acts[pos[r]]
                if t == "F":
                    deps = [("F", s - 1, mb)] if s > 0 else []
                elif t in ("B", "I"):
                    deps = [("F", s, mb)] + ([("BI", s + 1, mb)] if s < n_stages - 1 else [])
                else:  # W
                    deps = [("BI", s, mb)]
                if any(d not in done for d in deps):
                    break
                start = max([free[r]] + [done[d] for d in deps])
                free[r] = start + dur[t]
                busy[r] += dur[t]
                done[("BI" if t in ("B", "I") else t, s, mb)] = free[r]
                pos[r] += 1
                progress = True
    if any(pos[r] < len(order[r]) for r in order):
        raise RuntimeError("the action lists deadlock in simulation")
    makespan = max(free.values())
    return sum(1 - busy[r] / makespan for r in order) / len(order)


def _sleep_stage_shapes(stage_index: int) -> dict:
    """One row of WIDTH per micro-batch, in and out of every stage (static: no shape-inference pass)."""
    meta = torch.device("meta")
    inp = torch.empty(1, WIDTH, device=meta, requires_grad=stage_index > 0)
    return {"input_args": (inp,), "output_args": (torch.empty(1, WIDTH, device=meta, requires_grad=True),)}


def run_schedules(rank: int, world: int, cases: list[tuple[str, int, int]], forward_s: float, steps: int) -> list:
    import torch.distributed as dist

    from trainer3d.parallel import pipeline

    group = dist.new_group(list(range(world)))
    out = []
    for schedule, m, v in cases:
        per_rank = pipeline.stages_per_rank(schedule, v)
        n_stages = world * per_rank
        ids = pipeline.stage_ids(rank, world, schedule, v)
        modules = [SleepStage(forward_s / per_rank) for _ in ids]
        sched = pipeline.build_schedule(
            modules, ids, n_stages, schedule, m, lambda y, target: (y - target).pow(2).mean(), group,
            torch.device("cpu"), shapes=_sleep_stage_shapes,
        )
        has_first, has_last = 0 in ids, n_stages - 1 in ids
        sim = None
        if rank == 0:
            try:
                sim = simulate(action_order(sched), n_stages, per_rank)
            except Exception as e:  # noqa: BLE001 - reported in the table
                sim = f"n/a ({type(e).__name__})"
        x = torch.zeros(m, WIDTH)
        target = torch.zeros(m, WIDTH)
        idle = []
        for step in range(steps + 1):  # the first step warms up the p2p connections: not measured
            for mod in modules:
                mod.zero_grad(set_to_none=True)
            dist.barrier(group)
            Busy.total = 0.0
            t0 = time.perf_counter()
            args = (x,) if has_first else ()
            kwargs = {"target": target} if has_last else {}
            sched.step(*args, **kwargs)
            dist.barrier(group)
            elapsed = time.perf_counter() - t0
            if step:
                idle.append((1 - Busy.total / elapsed, elapsed, Busy.total))
        out.append((*min(idle), sim))  # the least disturbed step
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pp", type=int, default=4)
    ap.add_argument("--micro-batches", type=int, nargs="+", default=[8, 16])
    ap.add_argument("--forward-ms", type=float, default=40.0, help="forward time per stage and micro-batch")
    ap.add_argument("--steps", type=int, default=3)
    args = ap.parse_args(argv)
    from helpers.distributed import run_world

    from trainer3d.parallel.pipeline import SCHEDULES

    p = args.pp
    cases = []
    for m in args.micro_batches:
        for s, info in SCHEDULES.items():
            v = 2 if info.multi_stage else 1
            cases.append((s, m, v))
    per_rank = run_world(p, run_schedules, cases, args.forward_ms / 1000, args.steps, timeout=1800)
    rows = []
    for i, (s, m, v) in enumerate(cases):
        idle = sum(r[i][0] for r in per_rank) / p
        step_s = max(r[i][1] for r in per_rank)
        busy = sum(r[i][2] for r in per_rank) / p
        th = theory(s, p, m, v)
        sim = per_rank[0][i][3]
        ideal = m * 3 * args.forward_ms / 1000
        rows.append([s, p, m, v, f"{step_s * 1000:.0f}", f"{busy * 1000:.0f}", f"{ideal * 1000:.0f}",
                     f"{idle:.3f}", f"{th:.3f}", sim if isinstance(sim, str) else f"{sim:.3f}",
                     f"{idle - th:+.3f}"])
    print(table(rows, ["schedule", "p", "m", "v (stages/rank)", "step ms", "busy ms/rank", "ideal busy ms",
                       "idle measured", "idle formula", "idle simulated", "measured - formula"]))
    print()
    print(stamp("python bench/pipeline_bubble.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
