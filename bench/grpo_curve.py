"""The GRPO example's learning curve (examples/grpo on trainer3d.engine): the SFT export first (sft.py), then GRPO on
it; reward, exact replies, the clip's share, KL and reply lengths every 5 steps, as a table and a plot
(bench/results/grpo_reward.png).

    python bench/grpo_curve.py                        # SFT, then 60 GRPO steps at one process (~3.5 min on 2 cores)
    python bench/grpo_curve.py --launch "torchrun --nproc_per_node 4" --flags "--tp 2 --pp 2"
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile

from harness import ROOT, stamp, table


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--launch", default=sys.executable, help="what runs the example (python, or torchrun ...)")
    ap.add_argument("--flags", default="", help="more flags for the example (--tp, --pp, --lr, ...)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "results", "grpo_reward.png"))
    args = ap.parse_args()
    example = os.path.join(ROOT, "examples", "grpo")
    with tempfile.TemporaryDirectory() as out:
        subprocess.run([sys.executable, os.path.join(example, "sft.py"), "--out-dir", os.path.join(out, "sft")],
                       check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT)
        cmd = [*shlex.split(args.launch), os.path.join(example, "grpo.py"), "--model", os.path.join(out, "sft", "hf"),
               "--steps", str(args.steps), "--out-dir", os.path.join(out, "grpo"), *shlex.split(args.flags)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        records = [json.loads(line) for line in open(os.path.join(out, "grpo", "grpo.jsonl"))]
    every = [r for r in records if r["step"] == 1 or r["step"] % 5 == 0]
    print(table([[r["step"], f"{r['reward']:.3f}", f"{r['exact']:.2f}", f"{r['clipped']:.3f}", f"{r['kl']:.3f}",
                  f"{r['reply_tokens']:.1f}", f"{r['ended']:.2f}"] for r in every],
                ["step", "reward", "exact", "clipped", "KL to the SFT model", "reply tokens", "ended at eos"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in records]
    left.plot(steps, [r["reward"] for r in records], label="reward")
    left.plot(steps, [r["exact"] for r in records], label="exact replies")
    left.set(xlabel="step", ylim=(0, 1.05), title="reward on the SFT model's task")
    left.legend()
    right.plot(steps, [r["kl"] for r in records], color="tab:orange", label="KL (k3) to the SFT model")
    right.plot(steps, [r["clipped"] for r in records], color="tab:green", label="share the clip holds")
    right.set(xlabel="step", yscale="log", title="KL and the clip")
    right.legend()
    fig.suptitle("GRPO on trainer3d.engine (examples/grpo)")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {os.path.relpath(args.plot, ROOT)}")
    print(stamp("python bench/grpo_curve.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
