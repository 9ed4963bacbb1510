"""Soak: a long run of the real entry point under torchrun, each rank's resident memory (RSS) and open file
descriptors sampled from outside (psutil) against the step it has reached (metrics.jsonl).

RSS swings by a step's transient buffers (activations, gradients, optimizer scratch) wherever a sample lands; a
leak shows as a rising floor. So the figure of merit is the least-squares growth, per 1,000 steps, of the floor:
the minimum RSS of each 500-step window after warm-up (two checkpoint cycles: see `analyse`), in % of the rank's
mean (target < 1%). glibc's dynamic mmap
threshold makes freed tensors stay in the heap in chunks of tens of MiB, which moves that floor between a few
levels at random; MALLOC_MMAP_THRESHOLD_ is fixed at 128 KiB in the workers, so large tensors are mapped and
returned to the system when freed, and the floor is what the process really holds.

Two configurations, one after the other: DDP at (dp, tp, pp) = (2, 1, 2) and ZeRO-3 with CPU offload of optimizer
and parameters at dp = 2, both with evaluation every 100 steps and a checkpoint every 250 (keep-last 1), so saves,
evaluation and the pipeline schedules all run many times. Each run ends with SIGTERM (save, clean exit).

    python bench/soak.py --minutes 15      # per configuration; bench/soak.png + bench/results/soak.json
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.harness import stamp, table  # noqa: E402
from helpers.distributed import free_port  # noqa: E402

COMMON = ["--model", "tiny", "--n-layer", "4", "--seq-len", "64", "--global-batch", "8", "--max-steps", "10000000",
          "--eval-every", "100", "--eval-batches", "2", "--save-every", "250", "--keep-last", "1", "--log-every", "500",
          "--warmup-steps", "10"]  # (--save-every: SAVE_EVERY below)
CONFIGS = {
    "DDP (2,1,2)": dict(nproc=4, flags=["--pp", "2"]),
    "ZeRO-3 + offload dp2": dict(nproc=2, flags=["--deepspeed_config", "ZERO3_JSON", "--precision", "fp32"]),
}


def last_step(metrics: str) -> int:
    try:
        with open(metrics, "rb") as f:
            f.seek(max(0, os.path.getsize(metrics) - 4096))
            lines = [ln for ln in f.read().decode(errors="replace").splitlines() if ln.strip().startswith("{")]
        return int(json.loads(lines[-1])["step"]) if lines else 0
    except (OSError, ValueError, KeyError):
        return 0


def soak(name: str, spec: dict, minutes: float, work: str, every_s: float = 2.0) -> dict:
    out = os.path.join(work, name.split()[0].lower())
    flags = [f if f != "ZERO3_JSON" else os.path.join(ROOT, "ds_configs", "zero3_offload.json") for f in spec["flags"]]
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1", "--nproc_per_node", str(spec["nproc"]),
           "--master_addr", "127.0.0.1", "--master_port", str(free_port()), os.path.join(ROOT, "launch", "train_gpt2.py"),
           *COMMON, *flags, "--out-dir", out]
    env = dict(os.environ, OMP_NUM_THREADS="1", TQDM_DISABLE="1", WANDB_MODE="disabled",
               TRAINER3D_CACHE=os.path.join(work, "cache"), MALLOC_MMAP_THRESHOLD_="131072")
    log = open(os.path.join(work, f"{os.path.basename(out)}.log"), "w")
    agent = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    samples = []  # (seconds, rank, step, rss bytes, open fds)
    t0 = time.monotonic()
    try:
        while time.monotonic() - t0 < minutes * 60:
            time.sleep(every_s)
            if agent.poll() is not None:
                raise RuntimeError(f"{name}: the job exited ({agent.returncode}); see {log.name}")
            step = last_step(os.path.join(out, "metrics.jsonl"))
            for w in psutil.Process(agent.pid).children():
                try:
                    rank = int(w.environ().get("RANK", -1))
                    samples.append((time.monotonic() - t0, rank, step, w.memory_info().rss, w.num_fds()))
                except psutil.Error:
                    pass
        for w in psutil.Process(agent.pid).children():
            w.send_signal(signal.SIGTERM)  # what SLURM sends: every rank saves and exits cleanly
        rc = agent.wait(300)
    finally:
        if agent.poll() is None:
            os.killpg(agent.pid, signal.SIGKILL)
        log.close()
    return {"name": name, "samples": samples, "exit_code": rc, "steps": last_step(os.path.join(out, "metrics.jsonl"))}


def slope(points: list[tuple[float, float]]) -> float:
    """Least-squares slope of y over x."""
    n = len(points)
    mx = sum(x for x, _ in points) / n
    my = sum(y for _, y in points) / n
    sxx = sum((x - mx) ** 2 for x, _ in points)
    return sum((x - mx) * (y - my) for x, y in points) / sxx if sxx else 0.0


SAVE_EVERY = 250  # steps between checkpoints, as in COMMON
FLOOR_WINDOW = 2 * SAVE_EVERY  # steps: every window spans whole save and evaluation cycles


def analyse(run: dict, warmup_frac: float = 0.25, window: int = FLOOR_WINDOW) -> list[dict]:
    """Per rank after warm-up: the floor (least RSS) of each `window`-step window and its least-squares growth per
    1,000 steps. A window must span the longest periodic event (a checkpoint save every 250 steps leaves the last
    stage's ranks ~25 MiB higher for a while): with windows shorter than that, some windows never see the level the
    rank returns to, and their floors read as growth."""
    rows = []
    for rank in sorted({s[1] for s in run["samples"]}):
        ss = [s for s in run["samples"] if s[1] == rank and s[2] > 0]
        start = ss[0][2] + warmup_frac * (ss[-1][2] - ss[0][2])
        steady = [s for s in ss if s[2] >= start]
        windows: dict[int, list[int]] = {}
        for s in steady:
            windows.setdefault(s[2] // window, []).append(s[3])
        floor = [(w * window + window // 2, min(v)) for w, v in sorted(windows.items()) if len(v) >= 3]
        mean = sum(s[3] for s in steady) / len(steady)
        per_1k = slope(floor) * 1000
        rows.append(dict(config=run["name"], rank=rank, steps=f"{int(start)}-{steady[-1][2]}", rss_mib=mean / 2**20,
                         floor_mib=f"{min(v for _, v in floor) / 2**20:.0f}-{max(v for _, v in floor) / 2**20:.0f}",
                         growth_pct_per_1k_steps=100 * per_1k / mean,
                         fds=f"{min(s[4] for s in steady)}-{max(s[4] for s in steady)}",
                         fd_slope_per_1k_steps=slope([(s[2], s[4]) for s in steady]) * 1000))
    return rows


def plot(runs: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(2, len(runs), figsize=(6 * len(runs), 6), sharex="col", squeeze=False)
    for j, run in enumerate(runs):
        for rank in sorted({s[1] for s in run["samples"]}):
            ss = [s for s in run["samples"] if s[1] == rank and s[2] > 0]
            axes[0][j].plot([s[2] for s in ss], [s[3] / 2**20 for s in ss], lw=1, label=f"rank {rank}")
            axes[1][j].plot([s[2] for s in ss], [s[4] for s in ss], lw=1, label=f"rank {rank}")
        axes[0][j].set_title(run["name"])
        axes[0][j].set_ylabel("RSS (MiB)")
        axes[1][j].set_ylabel("open file descriptors")
        axes[1][j].set_xlabel("optimizer step")
        axes[0][j].legend(fontsize=8)
        for ax in axes[:, j]:
            ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--minutes", type=float, default=15.0, help="per configuration")
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "soak.png"))
    ap.add_argument("--reanalyse", action="store_true", help="only re-read bench/results/soak.json (no runs)")
    args = ap.parse_args(argv)
    results = os.path.join(ROOT, "bench", "results", "soak.json")
    if args.reanalyse:
        with open(results) as f:
            runs = json.load(f)["runs"]
    else:
        with tempfile.TemporaryDirectory() as work:
            runs = [soak(name, spec, args.minutes, work) for name, spec in CONFIGS.items()]
    rows = [r for run in runs for r in analyse(run)]
    for run in runs:  # what the floor reads with 100-step windows, for comparison
        print(f"{run['name']}: floor growth with 100-step windows: " + ", ".join(
            f"rank {r['rank']} {r['growth_pct_per_1k_steps']:+.2f}%" for r in analyse(run, window=100)))
    command = "python bench/soak.py " + ("--reanalyse" if args.reanalyse else f"--minutes {args.minutes:g}")
    print(f"\n{stamp(command)}\n")
    print(table([[r["config"], r["rank"], r["steps"], f"{r['rss_mib']:.0f}", r["floor_mib"],
                  f"{r['growth_pct_per_1k_steps']:+.2f}%", r["fds"], f"{r['fd_slope_per_1k_steps']:+.2f}"] for r in rows],
                ["config", "rank", "steps (after warm-up)", "mean RSS MiB", f"floor MiB (per {FLOOR_WINDOW} steps)",
                 "floor growth / 1k steps", "fds", "fd slope / 1k"]))
    print("exit codes after SIGTERM: " + ", ".join(f"{run['name']}: {run['exit_code']} at step {run['steps']}" for run in runs))
    plot(runs, args.out)
    os.makedirs(os.path.dirname(results), exist_ok=True)
    with open(results, "w") as f:
        json.dump({"rows": rows, "runs": [{k: v for k, v in run.items()} for run in runs]}, f)
    print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
