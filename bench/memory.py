"""Memory per rank against the model of trainer3d/plan/memory.py (the planner's), on CPU in fp32.

For every layout, every rank reports: its parameters, gradients and Adam state (walking the trainer's objects),
and, from a malloc counter preloaded into the process (bench/memhook.c), the bytes held after a step (static)
and the peak during a step, both relative to what the process held before the trainer was built. The estimate
is plan.memory.estimate_memory for the same rank. ZeRO rows (DeepSpeed, `--deepspeed_config`) run when
trainer3d/zero.py exists.

    python bench/memory.py                 # the bench/memory.md table
    python bench/memory.py --quick         # fewer layouts
    python bench/memory.py --activations   # per layer, against Korthikanti et al. (bench/activations.py)
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import (  # noqa: E402
    Case, build_trainer, candidate_of, fmt_bytes, local_batch, stamp, table, zero_available,
)

STEPS = 3  # the last one is measured: the first allocates Adam's state and the pipeline's buffers (2 suffice)

MODEL = dict(n_layer=4, n_embd=128, n_head=4, vocab=2048, seq_len=64, global_batch=16)


def ds_config(stage: int, offload: bool, case: Case) -> dict:
    """The DeepSpeed JSON of a ZeRO row, from the planner's own writer (TrainConfig takes it as a dict)."""
    from trainer3d.plan.report import deepspeed_config

    return deepspeed_config(
        zero_stage=stage, offload_optimizer=offload, offload_params=offload and stage == 3,
        micro_batch_size=case.micro_batch_size, micro_batches=case.micro_batches, dp=case.dp, precision="fp32",
        cfg=case.model_config(),
    )


def measure_layouts(rank: int, world: int, cases: list[tuple[Case, int, bool]], steps: int = STEPS) -> list:
    """Runs on every rank of a spawned world (under bench.measure.preloaded_memhook)."""
    from bench.measure import MallocCounter, model_state_bytes

    mc = MallocCounter()
    # warm-up, on every rank of the world: the first process group, the first collectives and the first steps of
    # a process pay one-time costs (gloo, thread pools, oneDNN) that would otherwise land on the first case to
    # use that rank
    tiny = dict(n_layer=2, n_embd=32, n_head=2, vocab=128, seq_len=8)
    warm = [Case(dp=world, global_batch=2 * world, **tiny)]
    if world >= 2:
        tp = 2 if world >= 4 else 1
        warm.append(Case(tp=tp, pp=world // tp, micro_batches=world // tp, global_batch=2 * world, **tiny))
    # and the BLAS/oneDNN scratch space, which grows to the largest matmul seen and stays: one step of each
    # model at the largest micro-batch any case uses, on every rank
    for dims in {(c.n_layer, c.n_embd, c.n_head, c.vocab, c.seq_len) for c, _, _ in cases}:
        L, d, h, v, s = dims
        mbs = max(c.micro_batch_size for c, _, _ in cases if (c.n_layer, c.n_embd, c.n_head, c.vocab, c.seq_len) == dims)
        warm.append(Case(dp=world, n_layer=L, n_embd=d, n_head=h, vocab=v, seq_len=s, global_batch=mbs * world))
    warmups = list(warm)
    if any(c.deepspeed_config for c, _, _ in cases):  # DeepSpeed's one-time set-up (comm, CPU Adam) too
        small = dict(n_layer=2, n_embd=32, n_head=2, vocab=128, seq_len=8, global_batch=4 * world, dp=world)
        offload = any(off for c, _, off in cases if c.deepspeed_config)  # CPU Adam only when needed (a JIT build)
        warmups += [Case(**small, deepspeed_config=ds_config(z, off, Case(**small))) for z, off in ((3, offload), (2, False))]
    for w in warmups:
        topo, tr = build_trainer(w)
        if tr is not None:
            tr.train_step(local_batch(w, topo, 0))
        topo.destroy()
        del tr, topo
    out = []
    for case, zero_stage, offload in cases:
        gc.collect()
        base = mc.current()
        topo, tr = build_trainer(case)
        res = None
        if tr is not None:
            built = mc.current() - base
            for s in range(steps):
                gc.collect()
                mc.reset_peak()
                record = tr.train_step(local_batch(case, topo, s))
            peak = mc.peak() - base
            static = mc.current() - base
            res = dict(coords=(topo.pp_rank, topo.dp_rank, topo.tp_rank), built=built, peak=peak, static=static)
            if "param_bytes" in record:  # the trainer's own accounting (DDP and ZeRO alike), taken at the step
                rep = record
                res.update(params=rep["param_bytes"], grads=rep["grad_bytes"], optimizer=rep["optim_bytes"],
                           offloaded=rep["param_offloaded_bytes"] + rep["grad_offloaded_bytes"] + rep["optim_offloaded_bytes"])
            else:
                res.update(model_state_bytes(tr))
        topo.destroy()
        del tr, topo
        out.append(res)
    return out


def run(cases: list[tuple[Case, int, bool]], world: int, timeout: float = 900, steps: int = STEPS) -> list[list]:
    """[case][rank] -> measurement (None on idle ranks)."""
    from bench.measure import preloaded_memhook
    from helpers.distributed import run_world

    with preloaded_memhook():
        per_rank = run_world(world, measure_layouts, cases, steps, timeout=timeout)
    return [[per_rank[r][i] for r in range(world)] for i in range(len(cases))]


def compare(case: Case, zero_stage: int, offload: bool, measured: list) -> list[dict]:
    from trainer3d.plan.memory import estimate_memory

    cand = candidate_of(case, zero_stage, offload)
    rows = []
    for m in measured:
        if m is None:
            continue
        pp_rank = m["coords"][0]
        e = estimate_memory(cand, pp_rank)
        rows.append(dict(case=case, zero=zero_stage, offload=offload, coords=m["coords"], m=m, e=e))
    return rows


def label(case: Case) -> str:
    extra = case.extra
    return (case.label() + (" SP" if extra.get("sequence_parallel") else "")
            + (f" recompute={extra['recompute']}" if extra.get("recompute", "none") != "none" else ""))


def default_cases(quick: bool = False, zero: bool = True, only_zero: bool = False) -> list[tuple[Case, int, bool]]:
    c = [] if only_zero else [
        Case(**MODEL),
        Case(micro_batches=4, **MODEL),
        Case(dp=2, **MODEL),
        Case(tp=2, **MODEL),
        Case(pp=2, micro_batches=4, **MODEL),
        Case(pp=2, micro_batches=4, schedule="gpipe", **MODEL),
        Case(dp=2, tp=2, **MODEL),
        Case(tp=2, pp=2, micro_batches=4, **MODEL),
        Case(dp=2, pp=2, micro_batches=2, **MODEL),
        Case(pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batches=4, **MODEL),
        Case(pp=4, micro_batches=4, **MODEL),
        Case(tp=2, extra={"sequence_parallel": True}, **MODEL),
        Case(tp=2, pp=2, micro_batches=4, extra={"sequence_parallel": True}, **MODEL),
        Case(tp=2, pp=2, micro_batches=4, extra={"sequence_parallel": True, "recompute": "full"}, **MODEL),
    ]
    if quick:
        c = c[:6]
    cases = [(x, 0, False) for x in c]
    if zero and zero_available():
        # Every ZeRO layout spans the whole world: DeepSpeed's ZeRO-3 set-up has a barrier on the world group,
        # so a layout on a subset of the world's ranks would hang the idle ones.
        for stage in (1, 2, 3):
            for offload in (False, True):
                for base in (Case(dp=4, **MODEL), Case(dp=2, tp=2, **MODEL), Case(dp=2, pp=2, micro_batches=2, **MODEL)):
                    if quick and base.world > 4:
                        continue
                    x = Case(**{**base.__dict__, "deepspeed_config": ds_config(stage, offload, base)})
                    cases.append((x, stage, offload))
    return cases


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--no-zero", action="store_true", help="DDP layouts only")
    ap.add_argument("--only-zero", action="store_true", help="ZeRO layouts only")
    ap.add_argument("--json", help="also write the rows here")
    ap.add_argument("--activations", action="store_true",
                    help="activation memory per layer: recompute none/selective/full, with and without sequence "
                         "parallelism, against Korthikanti et al. 2022")
    args = ap.parse_args(argv)
    if args.activations:
        from bench.activations import main as activations_main

        return activations_main(args.quick)
    cases = default_cases(args.quick, zero=not args.no_zero, only_zero=args.only_zero)
    world = max(c.world for c, _, _ in cases)
    results = run(cases, world)
    rows = []
    for (case, z, off), measured in zip(cases, results):
        for r in compare(case, z, off, measured):
            m, e = r["m"], r["e"]
            ms = m["params"] + m["grads"] + m["optimizer"]
            # on a CPU host "offloaded" is the same memory: compare totals (device + host)
            host = e.offloaded + e.host_buffers
            est_states, est_static, est_peak = e.model_states + e.offloaded, e.static + host, e.peak + host
            rows.append([
                label(case), "p{}d{}t{}".format(*r["coords"]),
                fmt_bytes(m["params"]), fmt_bytes(m["grads"]), fmt_bytes(m["optimizer"]),
                fmt_bytes(m.get("offloaded", 0)) if z else "-",
                f"{ms / est_states:.3f}",
                fmt_bytes(m["static"]), fmt_bytes(est_static), f"{m['static'] / est_static:.3f}",
                fmt_bytes(m["peak"]), fmt_bytes(est_peak), f"{m['peak'] / est_peak:.3f}",
                f"{e.inflight:g}",
            ])
    header = ["layout", "rank", "params", "grads", "optimizer", "offloaded", "states/model", "static", "model",
              "ratio", "peak", "model", "ratio", "in-flight"]
    print(table(rows, header))
    print()
    # one line per layout: the spread of the ratios over its ranks
    by_layout: dict[str, list] = {}
    for r in rows:
        by_layout.setdefault(r[0], []).append(r)
    summary = []
    for name, rs in by_layout.items():
        col = lambda i: [float(x[i]) for x in rs]  # noqa: E731
        spread = lambda v: f"{min(v):.3f}" if max(v) - min(v) < 5e-4 else f"{min(v):.3f}-{max(v):.3f}"  # noqa: E731
        peak_max = max(rs, key=lambda x: float(x[12]))
        summary.append([name, len(rs), spread(col(6)), spread(col(9)), peak_max[10], peak_max[11], spread(col(12))])
    print(table(summary, ["layout", "ranks", "states/model", "static/model", "peak (worst rank)", "model",
                          "peak/model (all ranks)"]))
    print()
    print(stamp("python bench/memory.py" + (" --quick" if args.quick else "")))
    if not zero_available():
        print("ZeRO rows skipped: trainer3d/zero.py does not exist yet.")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(rows, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
