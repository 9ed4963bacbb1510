"""The experts' LoRA pairs (parallel/lora.ExpertLoRA): through torch._grouped_mm against the per-expert loop, with
full training's grouped SwiGLU (its custom backward, no pairs) beside them, forward and backward of one MoE layer's
experts, as ratios within one run (rounds interleaved in rotated order, medians).

E experts of a Qwen3-MoE-like width get M routed token rows, split by a random routing (one expert left without a
token); LoRA rank r on both stacked weights. The loop is what every pair ran through before (one matmul per expert
and per factor, one host read of the counts); the grouped path is six grouped matmuls and no host read.

    python bench/lora_experts.py                    # the bench/lora.md table (CPU, fp32)
    python bench/lora_experts.py --dtype bf16       # on a GPU (sm90/sm100: torch._grouped_mm's fast path)
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

import torch  # noqa: E402

import trainer3d.parallel.lora as lora  # noqa: E402
from bench.harness import stamp, table, time_rotated  # noqa: E402
from trainer3d.models.moe import Experts, MoESpec  # noqa: E402


def experts_pass(experts: Experts, x: torch.Tensor, counts: torch.Tensor, grouped: bool):
    """One forward and backward of the experts (LoRA's pairs where they have them), the loop forced where not
    `grouped`."""

    def run():
        applies = lora.grouped_mm_applies
        if not grouped:
            lora.grouped_mm_applies = lambda *args: False
        try:
            experts.zero_grad(set_to_none=True)
            x.grad = None
            experts(x, counts).square().mean().backward()
        finally:
            lora.grouped_mm_applies = applies
        if x.is_cuda:
            torch.cuda.synchronize()

    return run


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--experts", type=int, default=16)
    ap.add_argument("--hidden", type=int, default=1024)
    ap.add_argument("--expert-hidden", type=int, default=512)
    ap.add_argument("--rows", type=int, default=8192, help="routed token rows (tokens x top-k)")
    ap.add_argument("--rank", type=int, default=16)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--dtype", choices=("fp32", "bf16"), default="fp32")
    args = ap.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    dtype = torch.float32 if args.dtype == "fp32" else torch.bfloat16
    torch.manual_seed(0)
    E, H, I, M = args.experts, args.hidden, args.expert_hidden, args.rows
    spec = MoESpec(n_experts=E, top_k=1, expert_hidden=I)
    base, adapted = Experts(H, spec).to(device, dtype), Experts(H, spec).to(device, dtype)
    for m in (base, adapted):
        torch.nn.init.normal_(m.gate_up_proj, std=0.02), torch.nn.init.normal_(m.down_proj, std=0.02)
    adapted.load_state_dict(base.state_dict())
    adapted.lora = lora.ExpertLoRA(adapted, lora.LoRASpec(args.rank, 2.0 * args.rank, targets=("experts",)),
                                   device).to(dtype)
    for p in adapted.lora.parameters():
        torch.nn.init.normal_(p, std=0.02)
    adapted.gate_up_proj.requires_grad_(False), adapted.down_proj.requires_grad_(False)  # (the base, frozen)
    share = torch.rand(E)
    share[1] = 0.0  # an expert without a token
    counts = torch.distributions.Multinomial(M, share / share.sum()).sample().long().to(device)
    x = torch.randn(M, H, device=device, dtype=dtype, requires_grad=True)
    grouped = lora.grouped_mm_applies(x, adapted.gate_up_proj, adapted.down_proj)
    passes = {"full training (grouped, no pairs)": experts_pass(base, x, counts, True),
              "LoRA pairs, grouped": experts_pass(adapted, x, counts, True),
              "LoRA pairs, loop": experts_pass(adapted, x, counts, False)}
    timed = time_rotated(passes, args.rounds, base="LoRA pairs, loop")
    rows = [[name, f"{t * 1e3:.1f}", f"{ratio:.2f}"] for name, (t, ratio) in timed.items()]
    print(f"E {E}, hidden {H}, expert hidden {I}, {M} rows, rank {args.rank}, {args.dtype} on {device}; "
          f"torch._grouped_mm applies: {grouped}")
    print(table(rows, ["experts' forward + backward", "ms (median)", "time / the loop's"]))
    print(stamp("python bench/lora_experts.py" + "".join(f" {a}" for a in (argv or sys.argv[1:]))))


if __name__ == "__main__":
    main()
