"""The planner for Llama 3.1 405B against the Llama 3 paper's pre-training layouts (Grattafiori et al. 2024, Table 4:
16M tokens a step, H100-80GB; at sequence 8192 tp 8, cp 1, pp 16 and dp 64 / 128 on 8,192 / 16,384 GPUs at 430 / 400
TFLOP/s per GPU, 43% / 41% bf16 MFU; the long-context stage at sequence 131,072 tp 8, cp 16, pp 16, dp 8 on 16,384
GPUs at 380 TFLOP/s, 38%), printed side by side:

  * the published row (tokens/s derived from its TFLOP/s and the family's FLOPs per token);
  * the published layout as trainer3d would run it (interleaved 1F1B, micro-batch 1, ZeRO-2: the paper's FSDP shards
    gradients and optimizer state and keeps the parameters gathered through the step), without recomputation as
    the paper ran it, and with `--recompute full`, which is what trainer3d needs there;
  * the planner's pick for the same cluster, batch and sequence.

Then the memory of the published layout on its worst pipeline rank, term by term, and the kernel efficiency
(`--mfu`) at which the planner's estimate of the published layout equals the published MFU.

    python bench/plan_llama3.py
    python bench/plan_llama3.py --mfu 0.6 --virtual-stages 2
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.harness import stamp, table  # noqa: E402
from trainer3d.models import MODEL_PRESETS  # noqa: E402
from trainer3d.plan.candidate import Candidate, describe, gib  # noqa: E402
from trainer3d.plan.cli import cluster_from_preset  # noqa: E402
from trainer3d.plan.report import model_flops_utilization  # noqa: E402
from trainer3d.plan.search import best_distinct, enumerate_plans, evaluate, worst_rank_memory  # noqa: E402

TOKENS = 16 * 2**20  # the paper's 16M tokens a step: 2048 sequences of 8192, 128 of 131,072
# (GPUs, sequence, tp, cp, pp, dp, TFLOP/s per GPU, bf16 MFU) from Table 4
PUBLISHED = ((8192, 8192, 8, 1, 16, 64, 430, 0.43), (16384, 8192, 8, 1, 16, 128, 400, 0.41),
             (16384, 131072, 8, 16, 16, 8, 380, 0.38))


def published_candidate(cfg, seq: int, tp: int, cp: int, pp: int, dp: int, v: int, recompute: bool) -> Candidate:
    batch = TOKENS // seq
    return Candidate(cfg=cfg, dp=dp, tp=tp, pp=pp, cp=cp, schedule="interleaved-1f1b", virtual_stages=v,
                     micro_batches=batch // dp, micro_batch_size=1, seq_len=seq, precision="bf16-mixed",
                     zero_stage=2, recompute=recompute, sequence_parallel=True)


def mfu_to_match(cand: Candidate, nodes: int, target: float) -> float:
    """The kernel efficiency at which the planner's MFU of `cand` equals `target` (bisection; MFU grows with it)."""
    lo, hi = 0.05, 1.0
    for _ in range(40):
        mid = (lo + hi) / 2
        C = cluster_from_preset("h100", nodes, mfu=mid)
        lo, hi = (mid, hi) if model_flops_utilization(evaluate(cand, C), C) < target else (lo, mid)
    return (lo + hi) / 2


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--mfu", type=float, default=0.5, help="the planner's kernel efficiency (its default: 0.5)")
    ap.add_argument("--virtual-stages", type=int, default=4, help="v of the published layout's interleaved schedule")
    args = ap.parse_args(argv)
    cfg = MODEL_PRESETS["llama3.1-405b"]
    rows, notes = [], []
    for gpus, seq, tp, cp, pp, dp, tflops, mfu in PUBLISHED:
        C = cluster_from_preset("h100", gpus // 8, mfu=args.mfu)
        tokens_s = tflops * 1e12 * gpus / cfg.flops_per_token(seq)
        rows.append([gpus, seq, f"dp{dp} tp{tp} pp{pp} cp{cp}, batch/dp {TOKENS // seq // dp}", "published", "-",
                     f"{TOKENS / tokens_s:.2f}", f"{tokens_s:,.0f}", f"{mfu:.0%}", tflops])
        for recompute in (False, True):
            cand = published_candidate(cfg, seq, tp, cp, pp, dp, args.virtual_stages, recompute)
            p = evaluate(cand, C)
            u = model_flops_utilization(p, C)
            fits = "" if not p.notes else " (does not fit)"
            rows.append([gpus, seq, describe(cand), "planner, published layout", f"{gib(p.memory):.1f}{fits}",
                         f"{p.step_time:.2f}", f"{TOKENS / p.step_time:,.0f}", f"{u:.1%}",
                         f"{u * C.peak_tflops:.0f}"])
        search = enumerate_plans(cfg, C, TOKENS // seq, seq)
        best = best_distinct(search.plans, 1)[0]
        u = model_flops_utilization(best, C)
        rows.append([gpus, seq, describe(best.candidate), f"planner's pick (of {len(search.plans)} feasible)",
                     f"{gib(best.memory):.1f}", f"{best.step_time:.2f}", f"{TOKENS / best.step_time:,.0f}", f"{u:.1%}",
                     f"{u * C.peak_tflops:.0f}"])

        ran = published_candidate(cfg, seq, tp, cp, pp, dp, args.virtual_stages, recompute=False)
        r, e = worst_rank_memory(ran)
        notes.append(
            f"{gpus} GPUs, sequence {seq}, published layout without recomputation, worst pipeline rank {r}: peak {gib(e.peak):.1f} GiB = "
            f"parameters {gib(e.params):.1f} + gradient/optimizer partitions {gib(e.grads + e.optimizer):.1f} + "
            f"buffers {gib(e.zero_buffers + e.pipeline_buffers):.1f} + activations {gib(e.activations):.1f} "
            f"({e.inflight:.2f} micro-batches in flight × {gib(e.activations / e.inflight):.2f} GiB) + transients "
            f"{gib(e.transient):.1f}; the kernel efficiency at which its estimate equals the published {mfu:.0%} MFU: "
            f"{mfu_to_match(ran, gpus // 8, mfu):.2f}")
    C = cluster_from_preset("h100", 1, mfu=args.mfu)
    print(f"Llama 3.1 405B ({cfg.num_params() / 1e9:.2f}B parameters, {cfg.flops_per_token(8192) / 1e12:.3f} / "
          f"{cfg.flops_per_token(131072) / 1e12:.3f} TFLOP per token at sequence 8192 / 131,072), {TOKENS:,} tokens a "
          f"step; cluster preset h100: {C.gpu_memory_gib:g} GiB ({C.reserve_gib:g} "
          f"reserved), {C.peak_tflops:g} TFLOP/s bf16 peak, {args.mfu:.0%} kernel efficiency, {C.intra_node_gbps:g} "
          f"GB/s in a node, {C.inter_node_gbps:g} GB/s across")
    print(table(rows, ["GPUs", "seq", "layout", "source", "GiB/GPU", "step s", "tokens/s", "MFU", "TFLOP/s/GPU"]))
    print()
    for n in notes:
        print("* " + n)
    print()
    print(stamp("python bench/plan_llama3.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
