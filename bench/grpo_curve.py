"""The GRPO example's learning curve (examples/grpo/grpo.py on trainer3d.engine): its reward and KL every 25 steps,
as a table and a plot (bench/results/grpo_reward.png).

    python bench/grpo_curve.py                        # 300 steps at one process (~70 s on 2 cores)
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
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--launch", default=sys.executable, help="what runs the example (python, or torchrun ...)")
    ap.add_argument("--flags", default="", help="more flags for the example (--tp, --pp, --lr, ...)")
    ap.add_argument("--plot", default=os.path.join(ROOT, "bench", "results", "grpo_reward.png"))
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as out:
        cmd = [*shlex.split(args.launch), os.path.join(ROOT, "examples", "grpo", "grpo.py"), "--steps",
               str(args.steps), "--out-dir", out, *shlex.split(args.flags)]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=ROOT)
        records = [json.loads(line) for line in open(os.path.join(out, "grpo.jsonl"))]
    every = [r for r in records if r["step"] == 1 or r["step"] % 25 == 0]
    print(table([[r["step"], f"{r['reward']:.3f}", f"{r['kl']:.3f}", f"{r['grad_norm']:.3f}"] for r in every],
                ["step", "reward", "KL to the reference", "grad norm"]))
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (left, right) = plt.subplots(1, 2, figsize=(9, 3.2))
    steps = [r["step"] for r in records]
    left.plot(steps, [r["reward"] for r in records])
    left.set(xlabel="step", ylabel="reward", ylim=(0, 1.05), title="reward: the share of reply tokens copied")
    right.plot(steps, [r["kl"] for r in records], color="tab:orange")
    right.set(xlabel="step", ylabel="KL (k3)", yscale="log", title="KL to the initial model")
    fig.suptitle("GRPO on trainer3d.engine (examples/grpo)")
    fig.tight_layout()
    fig.savefig(args.plot, dpi=100)
    print(f"plot: {os.path.relpath(args.plot, ROOT)}")
    print(stamp("python bench/grpo_curve.py " + " ".join(shlex.quote(a) for a in sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
