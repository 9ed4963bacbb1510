"""Communication volume per optimizer step, per rank and group, against the analytic minimum.

Every collective and send of one training step (the second; the first also exchanges shapes) is counted by
wrapping torch.distributed from this process (bench/measure.py: CommCounter; DDP's C++ all-reduce is routed
through torch's default comm hook so that it is seen), attributed to a group by comparing the call's group with
the Topology's (tp, pp, dp, embedding, mp, world), and compared with trainer3d/plan/comm.analytic_comm for
the same rank: the formulas the planner uses.

Convention: bytes are payloads, what is passed to the call (all_reduce: the tensor; all_gather: the gathered
output; reduce_scatter: the input; send: the tensor). gloo does not report what it puts on the wire; the
"wire" column converts both sides with the ring factors (all-reduce 2(n-1)/n, all-gather / reduce-scatter
(n-1)/n, send 1). A ratio of 1.000 means the trainer moves exactly what the formula says.

    python bench/comm_volume.py            # DDP/TP/PP layouts, plus ZeRO 1/2/3 when trainer3d/zero.py exists
"""

from __future__ import annotations

import argparse
import os
import time
import sys
from collections import defaultdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (  # noqa: E402
    Case, build_trainer, candidate_of, fmt_bytes, local_batch, stamp, table, zero_available,
)

GROUPS = ["tp", "cp", "pp", "dp", "embedding", "mp", "world"]
MODEL = dict(n_layer=4, n_embd=64, n_head=4, vocab=512, seq_len=32)


def count_layouts(rank: int, world: int, cases: list[Case]) -> list:
    """On every rank of the world: one warm-up step, then count one step."""
    from bench.measure import CommCounter, group_namer
    from trainer3d.plan.comm import ring_factor

    counter = CommCounter().install()
    out = []
    for case in cases:
        topo, tr = build_trainer(case)
        res = None
        if tr is not None:
            CommCounter.count_ddp(tr.engine.stage_modules)
            tr.train_step(local_batch(case, topo, 0))
            counter.reset()
            counter.enabled = True
            t0 = time.perf_counter()
            tr.train_step(local_batch(case, topo, 1))
            step_s = time.perf_counter() - t0
            counter.enabled = False
            name_of = group_namer(topo)
            per_group = defaultdict(lambda: {"payload": 0, "wire": 0.0, "seconds": 0.0, "calls": defaultdict(int)})
            for c in counter.calls:
                if c.op in ("recv", "irecv"):
                    continue
                g = per_group[name_of(c)]
                n = len(c.group_ranks)
                op = {"isend": "send", "all_gather_into_tensor": "all_gather", "_all_gather_base": "all_gather",
                      "reduce_scatter_tensor": "reduce_scatter", "_reduce_scatter_base": "reduce_scatter"}.get(c.op, c.op)
                g["payload"] += c.nbytes
                g["seconds"] += c.seconds
                g["wire"] += c.nbytes * (ring_factor(op, n) if op != "send" else 1.0)
                g["calls"][f"{op}/{n}"] += 1
            res = dict(coords=(topo.pp_rank, topo.dp_rank, topo.tp_rank, topo.cp_rank), step_s=step_s,
                       groups={k: {**v, "calls": dict(v["calls"])} for k, v in per_group.items()})
        topo.destroy()
        out.append(res)
    counter.uninstall()
    return out


def zero_stage_of(case: Case) -> int:
    return int(case.deepspeed_config["zero_optimization"]["stage"]) if case.deepspeed_config else 0


def default_cases(zero: bool = True, only_zero: bool = False) -> list[Case]:
    c = [] if only_zero else [
        Case(tp=2, global_batch=8, **MODEL),
        Case(pp=2, micro_batches=4, global_batch=8, **MODEL),
        Case(dp=2, global_batch=8, **MODEL),
        Case(dp=2, micro_batches=2, global_batch=8, **MODEL),
        Case(dp=2, tp=2, pp=2, micro_batches=4, global_batch=16, **MODEL),
        Case(dp=2, tp=2, pp=2, schedule="gpipe", micro_batches=4, global_batch=16, **MODEL),
        Case(tp=2, pp=4, schedule="interleaved-1f1b", virtual_stages=2, micro_batches=4, global_batch=8,
             **{**MODEL, "n_layer": 8}),
        Case(dp=2, pp=4, schedule="zbv", micro_batches=8, global_batch=16, **{**MODEL, "n_layer": 8}),
        Case(dp=8, global_batch=16, **MODEL),
    ]
    # sequence parallelism, and bf16 autocast (what a GPU run uses: tp collectives and pipeline sends in bf16), each
    # next to the same layout without it (SUMMARY_PAIRS compares them)
    for extra in ({"sequence_parallel": True}, {"precision": "bf16"}, {"precision": "bf16", "sequence_parallel": True}):
        c += [] if only_zero else [
            Case(tp=2, global_batch=8, extra=extra, **MODEL),
            Case(dp=2, tp=2, pp=2, micro_batches=4, global_batch=16, extra=extra, **MODEL),
            Case(tp=2, pp=4, schedule="interleaved-1f1b", virtual_stages=2, micro_batches=4, global_batch=8,
                 extra=extra, **{**MODEL, "n_layer": 8}),
        ]
    # context parallelism: the cp group's key/value gathers and their gradients' reduce-scatters, and the gradient
    # reduction over dp × cp, with tp + sequence parallelism, a pipeline and dp
    c += [] if only_zero else [
        Case(cp=2, global_batch=8, **MODEL),
        Case(cp=4, global_batch=8, **MODEL),
        Case(dp=2, cp=2, global_batch=8, **MODEL),
        Case(tp=2, cp=2, global_batch=8, extra={"sequence_parallel": True}, **MODEL),
        Case(pp=2, cp=2, micro_batches=4, global_batch=8, **MODEL),
        Case(dp=2, tp=2, cp=2, global_batch=8, extra={"sequence_parallel": True}, **MODEL),
    ]
    if zero and zero_available():
        from bench.memory import ds_config

        # ZeRO layouts must span the whole world (DeepSpeed's ZeRO-3 set-up has a barrier on the world group)
        for stage in (1, 2, 3):
            for base in (Case(dp=8, global_batch=16, **MODEL),
                         Case(dp=2, tp=2, pp=2, micro_batches=2, global_batch=8, **MODEL)):
                c.append(Case(**{**base.__dict__, "deepspeed_config": ds_config(stage, False, base)}))
    return c


def label(case: Case) -> str:
    return (case.label() + (" bf16" if case.extra.get("precision") == "bf16" else "")
            + (" SP" if case.extra.get("sequence_parallel") else ""))


def summary(cases: list[Case], results: list[list]) -> list[list]:
    """Each sequence-parallel or bf16 layout against the same layout without it: measured tp and pp wire bytes (all
    ranks), their ratio, and the analytic ratio. Under SP the tp bytes split into the all-gathers and reduce-scatters
    that replace the all-reduces ("replacements only"), the re-gather of each saved input shard for the weight
    gradient, and the once-per-step sum of the replicated parameters' gradients."""
    from trainer3d.plan.comm import analytic_comm

    def wire(i, group):
        return sum(r["groups"].get(group, {}).get("wire", 0.0) for r in results[i] if r is not None)

    def sp_extra(i):  # analytic bytes of the backward re-gathers and the per-step gradient sum, all ranks
        return sum(t.wire for r in results[i] if r is not None
                   for t in analytic_comm(candidate_of(cases[i]), r["coords"][0])
                   if "gathered again" in t.why or "once per step" in t.why)

    def key(c: Case, **override):
        extra = {**c.extra, **override}
        return (c.dp, c.tp, c.pp, c.schedule, c.n_layer, extra.get("precision"), bool(extra.get("sequence_parallel")))

    index = {key(c): i for i, c in enumerate(cases)}
    rows = []
    for i, c in enumerate(cases):
        sp, bf16 = bool(c.extra.get("sequence_parallel")), c.extra.get("precision") == "bf16"
        for what, base in (("SP", key(c, sequence_parallel=False) if sp else None),
                           ("bf16", key(c, precision=None) if bf16 else None)):
            j = index.get(base)
            if j is None:
                continue
            tp_i, tp_j, pp_i, pp_j = wire(i, "tp"), wire(j, "tp"), wire(i, "pp"), wire(j, "pp")
            ana = lambda k, g: sum(t.wire for r in results[k] if r is not None  # noqa: E731
                                   for t in analytic_comm(candidate_of(cases[k]), r["coords"][0]) if t.group == g)
            rows.append([
                f"{label(c)} vs without {what}", fmt_bytes(tp_j), fmt_bytes(tp_i), f"{tp_i / tp_j:.3f}",
                f"{ana(i, 'tp') / ana(j, 'tp'):.3f}",
                f"{(tp_i - sp_extra(i)) / tp_j:.3f}" if what == "SP" else "-",
                fmt_bytes(pp_j) if pp_j else "-", fmt_bytes(pp_i) if pp_i else "-",
                f"{pp_i / pp_j:.3f}" if pp_j else "-", f"{ana(i, 'pp') / ana(j, 'pp'):.3f}" if pp_j else "-",
            ])
    return rows


def cp_summary(cases: list[Case], results: list[list]) -> list[list]:
    """Context parallelism's cost in one step, per cp layout: its wire bytes (all ranks) against the planner's count,
    its time per step (rank mean; gloo's collectives return when done, so this includes waiting for the slowest peer)
    and share of the step, and, where the layout has tp, its seconds per wire MiB against the tp collectives' in the
    same step: the planner prices both groups at one bandwidth inside a node (ratio 1)."""
    from trainer3d.plan.comm import analytic_comm

    rows = []
    for case, per_rank in zip(cases, results):
        if case.cp == 1:
            continue
        ranks = [r for r in per_rank if r is not None]
        group = lambda g, k: sum(r["groups"].get(g, {}).get(k, 0.0) for r in ranks)  # noqa: E731
        analytic = sum(t.wire for r in ranks for t in analytic_comm(candidate_of(case), r["coords"][0]) if t.group == "cp")
        calls = sum(sum(r["groups"].get("cp", {}).get("calls", {}).values()) for r in ranks)
        cp_s = group("cp", "seconds") / len(ranks)
        step = sum(r["step_s"] for r in ranks) / len(ranks)
        per_mib = lambda g: group(g, "seconds") / max(group(g, "wire") / 2**20, 1e-12)  # noqa: E731
        rows.append([label(case), fmt_bytes(group("cp", "wire")), fmt_bytes(analytic),
                     f"{group('cp', 'wire') / analytic:.3f}", f"{cp_s * 1e3:.1f} ms", f"{cp_s / step:.1%}",
                     f"{group('cp', 'seconds') / calls * 1e3:.2f} ms",
                     f"{per_mib('cp') / per_mib('tp'):.2f}" if case.tp > 1 else "-"])
    return rows


def compare(cases: list[Case], results: list[list]) -> tuple[list[list], list[str]]:
    from trainer3d.plan.comm import analytic_comm

    rows, notes = [], []
    for case, per_rank in zip(cases, results):
        cand = candidate_of(case, zero_stage_of(case))
        meas = defaultdict(lambda: [0.0, 0.0])  # group -> [payload, wire], summed over ranks
        ana = defaultdict(lambda: [0.0, 0.0])
        worst = defaultdict(float)  # group -> max |ratio - 1| over ranks
        for r in per_rank:
            if r is None:
                continue
            a_rank = defaultdict(lambda: [0.0, 0.0])
            for t in analytic_comm(cand, r["coords"][0]):
                a_rank[t.group][0] += t.payload
                a_rank[t.group][1] += t.wire
            for g in set(a_rank) | set(r["groups"]):
                mp = r["groups"].get(g, {}).get("payload", 0)
                mw = r["groups"].get(g, {}).get("wire", 0.0)
                meas[g][0] += mp
                meas[g][1] += mw
                ana[g][0] += a_rank[g][0]
                ana[g][1] += a_rank[g][1]
                if a_rank[g][0]:
                    worst[g] = max(worst[g], abs(mp / a_rank[g][0] - 1))
                elif mp:
                    worst[g] = float("inf")
        for g in GROUPS + sorted(set(meas) - set(GROUPS)):
            if g not in meas and g not in ana:
                continue
            mp, mw = meas[g]
            ap, aw = ana[g]
            ratio = f"{mp / ap:.3f}" if ap else ("-" if not mp else "extra")
            calls = defaultdict(int)
            for r in per_rank:
                if r is not None:
                    for k, v in r["groups"].get(g, {}).get("calls", {}).items():
                        calls[k] += v
            rows.append([
                label(case), g, fmt_bytes(mp), fmt_bytes(ap), ratio, fmt_bytes(mw), fmt_bytes(aw),
                f"{worst[g]:.1e}" if worst[g] != float("inf") else "extra",
                ", ".join(f"{k}×{v}" for k, v in sorted(calls.items())),
            ])
    return rows, notes


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--no-zero", action="store_true", help="skip the ZeRO rows")
    ap.add_argument("--only-zero", action="store_true", help="only the ZeRO rows")
    args = ap.parse_args(argv)
    from helpers.distributed import run_world

    cases = default_cases(zero=not args.no_zero, only_zero=args.only_zero)
    world = max(c.world for c in cases)
    per_rank = run_world(world, count_layouts, cases, timeout=1200)
    results = [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]
    rows, _ = compare(cases, results)
    print(table(rows, ["layout", "group", "measured (all ranks)", "analytic", "ratio", "wire measured",
                       "wire analytic", "max rank |r-1|", "calls (op/group size × count, all ranks)"]))
    print()
    print(table(summary(cases, results), ["layout", "tp wire without", "tp wire with", "tp ratio", "analytic",
                                          "tp ratio, replacements only", "pp without", "pp with", "pp ratio",
                                          "analytic"]))
    print()
    print(table(cp_summary(cases, results), ["cp layout", "cp wire measured", "analytic", "ratio", "cp time/step",
                                             "share of step", "per call", "cp vs tp s per wire MiB (model: 1)"]))
    print()
    print(stamp("python bench/comm_volume.py" + (" --no-zero" if args.no_zero else "")))
    if not zero_available():
        print("ZeRO rows skipped: trainer3d/zero.py does not exist yet.")
    return 0


if __name__ == "__main__":
    sys.exit(main())
