"""The one-process training step at several git revisions, side by side: each revision checked out in a temporary
worktree, its own `launch/train_gpt2.py` run in turn (the order rotated every round, so the noise of a shared
machine hits all alike), and its step time read from the run's metrics.jsonl: the median over the steps after the
first five, per run; the speed ratio against the first revision is the median of the per-round ratios.

Whole runs rather than one process (bench/overhead.py's way) because two revisions cannot share a process; a
run's median over 20 steps scatters by a few percent between runs, so take several rounds to see 5%.

    python bench/revisions.py 406c14d 6192886 HEAD                    # issue 25's config (bench/revisions.md)
    python bench/revisions.py HEAD~1 HEAD --rounds 5 -- --n-embd 128  # other flags after --
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.harness import rotated, stamp, table  # noqa: E402

# issue 25: GPT-2 L4 d256 h8, sequence 128, global batch 16, fp32, one thread
DEFAULT_FLAGS = ["--n-layer", "4", "--n-embd", "256", "--n-head", "8", "--seq-len", "128", "--global-batch", "16",
                 "--precision", "fp32", "--max-steps", "25", "--eval-every", "1000"]


def run_once(tree: str, flags: list[str], out_dir: str) -> tuple[float, float]:
    """(median step seconds after the first five steps, last loss) of one run of `tree`'s trainer."""
    cmd = [sys.executable, os.path.join(tree, "launch", "train_gpt2.py"), *flags, "--out-dir", out_dir]
    done = subprocess.run(cmd, cwd=tree, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
    if done.returncode:
        raise SystemExit(f"{tree}: exit {done.returncode}\n{done.stderr[-2000:]}")
    with open(os.path.join(out_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    seconds = [r["step_time_s"] for r in rows if "step_time_s" in r and r["step"] > 5]
    return statistics.median(seconds), rows[-1].get("loss", float("nan"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("revisions", nargs="+", help="git revisions; the first is the baseline")
    ap.add_argument("--rounds", type=int, default=3)
    argv = sys.argv[1:] if argv is None else argv
    cut = argv.index("--") if "--" in argv else len(argv)  # trainer flags after --, instead of issue 25's config
    args = ap.parse_args(argv[:cut])
    flags = argv[cut + 1:] or DEFAULT_FLAGS
    with tempfile.TemporaryDirectory(prefix="revisions-") as tmp:
        trees = {}
        for rev in args.revisions:
            sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=ROOT, capture_output=True, text=True,
                                 check=True).stdout.strip()
            trees[rev] = os.path.join(tmp, sha)
            subprocess.run(["git", "worktree", "add", "--detach", "-q", trees[rev], sha], cwd=ROOT, check=True)
        try:
            seconds, losses = {r: [] for r in trees}, {}
            names = list(trees)
            for i in range(args.rounds):
                for rev in rotated(names, i):
                    t, losses[rev] = run_once(trees[rev], flags, os.path.join(tmp, f"run-{i}-{len(seconds[rev])}"))
                    seconds[rev].append(t)
                    print(f"round {i + 1} {rev}: {t * 1e3:.0f} ms", flush=True)
        finally:
            for path in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", path], cwd=ROOT)
    given = {f: int(flags[flags.index(f) + 1]) for f in ("--global-batch", "--seq-len") if f in flags}
    tokens = given["--global-batch"] * given["--seq-len"] if len(given) == 2 else float("nan")
    base = seconds[names[0]]
    rows = [[rev, *(f"{t * 1e3:,.0f}" for t in seconds[rev]), f"{tokens / statistics.median(seconds[rev]):,.0f}",
             f"{statistics.median(b / t for b, t in zip(base, seconds[rev])):.3f}", f"{losses[rev]:.6f}"]
            for rev in names]
    print(table(rows, ["revision", *(f"ms, round {i + 1}" for i in range(args.rounds)), "tok/s (median)",
                       f"speed vs {names[0]}", "last loss"]))
    print(stamp("python bench/revisions.py " + " ".join(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())
