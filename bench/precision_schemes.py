"""The two bf16 parameter schemes trainer3d has, side by side: bytes on the wire per step and memory per GPU.

  bf16-autocast  the DDP engine: fp32 parameters, gradients and Adam state, matmuls under torch.autocast(bf16); TP
                 collectives and pipeline sends move bf16 (inputs cast before the collective, stage boundaries cast),
                 the residual stream is fp32 inside a stage, gradients are all-reduced in fp32
  bf16-mixed     DeepSpeed's bf16 section (ZeRO 0-3): bf16 parameters and gradients, fp32 master weights and Adam
                 state in the optimizer (the ZeRO paper's 2 + 2 + 12 bytes), everything in the stage bf16

Both from the planner's models (trainer3d/plan/comm.py, memory.py), which bench/comm_volume.py checks against the
trainer's measured bytes (ratio 1.000, the bf16 rows included) and bench/memory.py against measured memory (±10%).
The worst pipeline rank's peak; GiB per GPU; bytes per GPU per optimizer step, ring algorithm (what a rank sends).

    python bench/precision_schemes.py
"""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.harness import fmt_bytes, stamp, table  # noqa: E402

# (model, dp, tp, pp, micro-batches, micro-batch size, recompute): GPT-3 sizes on 8, 16 and 64 GPUs
RUNS = [("gpt3-1.3b", 2, 2, 2, 8, 1, False), ("gpt3-6.7b", 2, 4, 2, 8, 1, True), ("gpt3-13b", 4, 8, 2, 16, 1, True)]


def main() -> int:
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.plan.candidate import Candidate, gib
    from trainer3d.plan.comm import analytic_comm
    from trainer3d.plan.memory import estimate_memory

    rows = []
    for name, dp, tp, pp, m, mbs, rc in RUNS:
        for precision, zero in (("bf16-autocast", 0), ("bf16-mixed", 0), ("bf16-mixed", 1)):
            cand = Candidate(cfg=MODEL_PRESETS[name], dp=dp, tp=tp, pp=pp, micro_batches=m, micro_batch_size=mbs,
                             seq_len=2048, precision=precision, zero_stage=zero, recompute=rc, sequence_parallel=tp > 1)
            ranks = sorted({0, pp - 1})
            wire = {g: max(sum(t.wire for t in analytic_comm(cand, r) if t.group == g) for r in ranks)
                    for g in ("tp", "pp", "dp")}
            est = max((estimate_memory(cand, r) for r in ranks), key=lambda e: e.peak)
            rows.append([f"{name} dp{dp} tp{tp} pp{pp} m{m}x{mbs}" + (" +recompute" if rc else "") + " +sp",
                         precision + (f" ZeRO-{zero}" if precision == "bf16-mixed" else " (DDP)"),
                         fmt_bytes(wire["tp"]), fmt_bytes(wire["pp"]), fmt_bytes(wire["dp"]),
                         f"{gib(est.model_states):.1f}", f"{gib(est.activations):.1f}", f"{gib(est.peak):.1f}"])
    print(table(rows, ["run (seq 2048)", "scheme", "tp bytes/GPU", "pp bytes/GPU", "dp bytes/GPU",
                       "model states GiB", "activations GiB", "peak GiB"]))
    print()
    print(stamp("python bench/precision_schemes.py"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
