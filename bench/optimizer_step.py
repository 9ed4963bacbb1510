"""The DDP engine's optimizer step on CPU: torch's fused AdamW (what trainer3d.optim.adam picks here) against foreach
and the for-loop (torch's default on CPU), for the parameters of the gpt2 (124M) preset.

The optimizer step alone, in steady state: the engine's parameter groups (optim.param_groups, weight decay 0.1),
fixed random gradients, one optimizer per implementation over the same parameters (each with its own moments),
two warm-up steps each, then `--rounds` rounds with the three stepped in turn (order rotated each round); the median
per implementation, as ratios. "GB/s" counts the 7 fp32 streams a one-pass AdamW must move (read weights,
gradients, both moments; write weights, both moments): the fused step's rate is the memory's.

    python bench/optimizer_step.py            # ~2 min on 2 cores, one thread
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.harness import rotated, stamp, table  # noqa: E402  (sets OMP_NUM_THREADS=1 unless given)

import torch  # noqa: E402

IMPLEMENTATIONS = {"fused": dict(fused=True), "foreach": dict(foreach=True), "for-loop": dict(foreach=False)}


def gpt2_parameters(seed: int = 0) -> list[torch.nn.Parameter]:
    """The gpt2 preset's parameters (GPT-2's 50257-token vocabulary), with random values and gradients."""
    from trainer3d.models import MODEL_PRESETS, build_model

    with torch.device("meta"):
        shapes = [p.shape for p in build_model(MODEL_PRESETS["gpt2"]).parameters()]
    g = torch.Generator().manual_seed(seed)
    params = [torch.nn.Parameter(torch.randn(s, generator=g) * 0.02) for s in shapes]
    for p in params:
        p.grad = torch.randn(p.shape, generator=g) * 1e-3
    return params


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=9)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    from trainer3d.optim import adam, param_groups

    params = gpt2_parameters()
    n = sum(p.numel() for p in params)
    chosen = adam(param_groups(params, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8).defaults
    chosen = "fused" if chosen["fused"] else "foreach" if chosen["foreach"] else "for-loop"
    opts = {k: torch.optim.AdamW(param_groups(params, 0.1), lr=1e-4, betas=(0.9, 0.95), eps=1e-8, **kw)
            for k, kw in IMPLEMENTATIONS.items()}
    for opt in opts.values():
        for _ in range(2):
            opt.step()
    names = list(opts)
    times: dict[str, list[float]] = {k: [] for k in names}
    for r in range(args.rounds):
        for k in rotated(names, r):
            t0 = time.perf_counter()
            opts[k].step()
            times[k].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    rows = [[k + (" (chosen)" if k == chosen else ""), f"{med[k] * 1000:.0f}", f"{min(times[k]) * 1000:.0f}",
             f"{med[k] / med['fused']:.2f}", f"{med['for-loop'] / med[k]:.2f}", f"{7 * 4 * n / med[k] / 1e9:.1f}"]
            for k in names]
    print(f"\n{stamp('python bench/optimizer_step.py')}; gpt2 preset, {n / 1e6:.1f}M fp32 parameters in "
          f"{len(params)} tensors, {torch.get_num_threads()} thread(s), median of {args.rounds} interleaved rounds\n")
    print(table(rows, ["AdamW", "step ms (median)", "min ms", "vs fused", "speed-up vs for-loop", "GB/s (7 streams)"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
