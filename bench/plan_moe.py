"""The planner for mixtures of experts against published Megatron-Core layouts on H100-80GB, printed side by side.

Published runs trainer3d can express (its presets mixtral-8x22b and qwen3-235b-a22b):

  * Mixtral 8x22B. MoE Parallel Folding (Liu et al. 2025, arXiv 2504.14960, abstract of
    https://arxiv.org/html/2504.14960v2): "up to 49.3% MFU" on H100; the run's GPUs, batch and layout are in the
    paper's tables, which were not readable here. The layout is the one of Megatron's MoE model zoo
    (github.com/yanring/Megatron-MoE-ModelZoo, runtime_configs/benchmarking/runtime.conf, Mixtral-8x22B.yaml,
    best_practice/mixtral/run_mixtral_8x22B.sh): 16 nodes of 8 H100, sequence 4096, global batch 256, micro-batch 1,
    TP 2, PP 8, VPP 7, EP 8, expert TP 1, CP 1, distributed optimizer; "around 445 TFLOPS" dropless (all-to-all) and
    "around 470" with token dropping (capacity factor 1).
  * Qwen3-235B-A22B. The model zoo's best_practice/qwen3/readme.md: 256 H100, sequence 4096, global batch 2048,
    micro-batch 1, TP 2, PP 8, VPP 4, EP 32, expert TP 1, DP 16, selective recompute (norm, act), DeepEP: 19.7 s a
    step, 245 TFLOP/s per GPU; with 1F1B all-to-all overlap 17.6 s, 276. NVIDIA's Megatron-Bridge MoE hardware page
    (docs.nvidia.com/nemo/megatron-bridge/nightly/skills/perf-techniques/moe-hardware-configs/SKILL.html): "low-300s
    TFLOPS/GPU, around 30% MFU" at TP2 EP32 PP8 with DeepEP (a rounded band: no GPU count or batch given).

Not expressible, so left out: DeepSeek-V3 (2,048 H800; pp 16, ep 64, ZeRO-1, no tp, as the issue quotes its report):
MLA attention and its group-limited routing are not built in trainer3d and there is no preset; Qwen2-57B-A14B
("39.0% MFU" in the same abstract): trainer3d has no Qwen2-MoE family. No preset is made up for either.

For each expressible run it prints the published rows (tokens/s from the step time where published, else from the
TFLOP/s and the family's FLOPs per token; MFU and TFLOP/s by the planner's count), the published layout as trainer3d
would run it (ep carved from dp: Megatron folds tp into the expert group, trainer3d cannot, so EP 32 at TP 2 over
DP 16 becomes ep 16) under DDP without and with `--recompute full`, and under ZeRO-1 (Megatron's distributed
optimizer: the dense state over dp, the experts' over edp) with `--recompute full`, and the planner's pick at the same cluster, batch
and sequence; then the picks for both models on 256 and 2,048 H100 (32 and 256 nodes) at sequence 4096 and 1,024
sequences a step (4,194,304 tokens); then notes: the worst rank's memory and the kernel efficiency at which the
estimate of the published layout (no recomputation) matches the first published row.

    python bench/plan_moe.py            # about 70 s on 2 cores (six searches)
    python bench/plan_moe.py --mfu 0.6
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import stamp, table  # noqa: E402
from trainer3d.models import MODEL_PRESETS  # noqa: E402
from trainer3d.plan.candidate import describe, gib  # noqa: E402
from trainer3d.plan.cli import cluster_from_preset  # noqa: E402
from trainer3d.plan.report import model_flops_utilization  # noqa: E402
from trainer3d.plan.search import best_distinct, enumerate_plans, evaluate, parse_layout, worst_rank_memory  # noqa: E402

ZOO = "Megatron-MoE-ModelZoo"
# (model, GPUs, sequence, global batch, trainer3d's --evaluate layout, Megatron's layout, published rows:
#  (label, TFLOP/s per GPU or None, step s or None, MFU or None[, the row's own layout: GPUs and batch not given]))
PUBLISHED = (
    ("mixtral-8x22b", 128, 4096, 256, "tp=2,pp=8,ep=8,schedule=interleaved-1f1b,v=7,mbs=1",
     "TP2 PP8 VPP7 EP8 ETP1 (DP8; EP folds TP: EDP2), distributed optimizer",
     ((f"{ZOO} run_mixtral_8x22B.sh, dropless", 445, None, None),
      (f"{ZOO} run_mixtral_8x22B.sh, token drop (capacity 1)", 470, None, None),
      ("arXiv 2504.14960 abstract: 'up to 49.3% MFU'", None, None, 0.493, "in the paper's tables (not read)"))),
    ("qwen3-235b-a22b", 256, 4096, 2048, "tp=2,pp=8,ep=16,schedule=interleaved-1f1b,v=4,mbs=1",
     "TP2 PP8 VPP4 EP32 ETP1 (DP16; EP folds TP: EDP1), selective recompute",
     ((f"{ZOO} qwen3 readme, DeepEP (245 TFLOP/s by Megatron's count)", 245, 19.7, None),
      (f"{ZOO} qwen3 readme, +1F1B a2a overlap (276 by Megatron's)", 276, 17.6, None),
      ("Megatron-Bridge MoE page: 'around 30% MFU' (a band)", None, None, 0.30, "TP2 EP32 PP8, DeepEP"))),
)
GRID_NODES, GRID_SEQ, GRID_BATCH = (32, 256), 4096, 1024


def split(p) -> str:
    """The step time's largest parts, e.g. `compute 83% ep comm 10%`."""
    parts = sorted(p.times.items(), key=lambda kv: -kv[1])
    return " ".join(f"{k} {v / p.step_time:.0%}" for k, v in parts if v / p.step_time >= 0.03)


def published_rows(cfg, gpus: int, seq: int, batch: int, megatron: str, rows, peak: float) -> list[list]:
    out = []
    for label, tflops, step, mfu, *own in rows:
        fpt = cfg.flops_per_token(seq)
        if step:
            per_gpu = batch * seq / step / gpus
        else:
            per_gpu = (tflops if tflops else mfu * peak) * 1e12 / fpt
        u = per_gpu * fpt / (peak * 1e12)
        out.append([cfg_name(cfg), "-" if own else gpus, own[0] if own else megatron, label, "-",
                    f"{step:.1f}" if step else "-", f"{per_gpu:,.0f}", f"{u:.1%}", f"{u * peak:.0f}"])
    return out


def plan_row(name: str, p, C, source: str) -> list:
    c, u = p.candidate, model_flops_utilization(p, C)
    fits = " (does not fit)" if p.notes else ""
    return [name, C.world, describe(c), source, f"{gib(p.memory):.1f}{fits}", f"{p.step_time:.2f}",
            f"{c.global_batch * c.seq_len / p.step_time / C.world:,.0f}", f"{u:.1%}", f"{u * C.peak_tflops:.0f}"]


def pick(cfg, C, batch: int, seq: int):
    search = enumerate_plans(cfg, C, batch, seq)
    return best_distinct(search.plans, 1)[0], len(search.plans)


def mfu_to_match(cfg, nodes: int, layout: str, batch: int, seq: int, tokens_per_gpu: float) -> float:
    """The kernel efficiency at which the planner's tokens/s per GPU of `layout` equals the published one."""
    lo, hi = 0.05, 1.0
    for _ in range(30):
        mid = (lo + hi) / 2
        C = cluster_from_preset("h100", nodes, mfu=mid)
        p = evaluate(parse_layout(layout, cfg, C, batch, seq), C)
        lo, hi = (mid, hi) if batch * seq / p.step_time / C.world < tokens_per_gpu else (lo, mid)
    return (lo + hi) / 2


def memory_note(cand) -> str:
    r, e = worst_rank_memory(cand)
    return (f"worst pipeline rank {r}: {gib(e.peak):.1f} GiB = parameters {gib(e.params):.1f} + gradients and Adam "
            f"{gib(e.grads + e.optimizer):.1f} + buffers {gib(e.zero_buffers + e.pipeline_buffers):.1f} + activations "
            f"{gib(e.activations):.1f} ({e.inflight:.2f} micro-batches in flight) + transients {gib(e.transient):.1f}")


def cfg_name(cfg) -> str:
    return next(k for k, v in MODEL_PRESETS.items() if v is cfg)


def compare_published(mfu: float) -> tuple[list[list], list[str]]:
    rows, notes = [], []
    for name, gpus, seq, batch, layout, megatron, published in PUBLISHED:
        cfg, C = MODEL_PRESETS[name], cluster_from_preset("h100", gpus // 8, mfu=mfu)
        pub = published_rows(cfg, gpus, seq, batch, megatron, published, C.peak_tflops)
        rows += pub
        ran = None
        for extra in ("", ",recompute=1", ",recompute=1,zero=1"):
            p = evaluate(parse_layout(layout + extra, cfg, C, batch, seq), C)
            ran = ran or p
            rows.append(plan_row(name, p, C, "planner, published layout"))
            notes.append(f"{name}, {describe(p.candidate)}: time {split(p)}")
        best, n = pick(cfg, C, batch, seq)
        rows.append(plan_row(name, best, C, f"planner's pick (of {n:,} feasible)"))
        notes.append(f"{name}, pick {describe(best.candidate)}: time {split(best)}")
        target = float(pub[0][6].replace(",", ""))
        notes.append(f"{name}, published layout as trainer3d runs it, no recomputation: {memory_note(ran.candidate)}; "
                     f"kernel efficiency at which its estimate equals the first published row ({pub[0][6]} tokens/s "
                     f"per GPU): {mfu_to_match(cfg, gpus // 8, layout, batch, seq, target):.2f}")
    return rows, notes


def grid(mfu: float) -> list[list]:
    rows = []
    for name in ("qwen3-235b-a22b", "mixtral-8x22b"):
        cfg = MODEL_PRESETS[name]
        for nodes in GRID_NODES:
            C = cluster_from_preset("h100", nodes, mfu=mfu)
            best, n = pick(cfg, C, GRID_BATCH, GRID_SEQ)
            rows.append(plan_row(name, best, C, f"pick of {n:,}")[:-1] + [split(best)])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfu", type=float, default=0.5, help="the planner's kernel efficiency (its default: 0.5)")
    args = ap.parse_args(argv)
    C = cluster_from_preset("h100", 1, mfu=args.mfu)
    for name in ("mixtral-8x22b", "qwen3-235b-a22b"):
        cfg = MODEL_PRESETS[name]
        print(f"{name}: {cfg.num_params() / 1e9:.2f}B parameters, {cfg.flops_per_token(4096) / 1e9:.1f} GFLOP per "
              f"token at sequence 4096 (the planner's count: 6 per active matmul parameter + 12·L·(Hq·hd)·T)")
    print(f"cluster preset h100: {C.gpu_memory_gib:g} GiB ({C.reserve_gib:g} reserved), {C.peak_tflops:g} TFLOP/s "
          f"bf16 peak, {args.mfu:.0%} kernel efficiency, {C.intra_node_gbps:g} GB/s in a node, {C.inter_node_gbps:g} "
          f"GB/s across; MFU and TFLOP/s columns by the planner's FLOP count, no recomputed forward counted\n")
    rows, notes = compare_published(args.mfu)
    print(table(rows, ["model", "GPUs", "layout", "source", "GiB/GPU", "step s", "tokens/s/GPU", "MFU",
                       "TFLOP/s/GPU"]))
    print()
    for n in notes:
        print("* " + n)
    print(f"\nPicks at sequence {GRID_SEQ}, {GRID_BATCH} sequences ({GRID_BATCH * GRID_SEQ:,} tokens) a step:\n")
    print(table(grid(args.mfu), ["model", "GPUs", "layout", "source", "GiB/GPU", "step s", "tokens/s/GPU", "MFU",
                                 "time split"]))
    print()
    print(stamp("python bench/plan_moe.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
