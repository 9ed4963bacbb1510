"""A rank that dies or hangs never leaves the others waiting forever, and torchrun restarts resume.

Real jobs under `torchrun --nproc_per_node 2` (tiny model, tp=2 so the ranks talk every step). Faults are
injected with TRAINER3D_FAULT through tests/fault_plugin.py (loaded by TRAINER3D_PLUGINS): `kill` SIGKILLs the rank after a step,
`hang` makes it sleep forever. Each test reports its measured times (pytest -s shows them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import fault_plugin
from distributed import free_port

ROOT = Path(__file__).resolve().parents[1]
ENTRY = str(ROOT / "launch" / "train_gpt2.py")
TINY = ["--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "4", "--eval-every", "0",
        "--log-every", "1"]
BOUND_S = 120  # the job must be over (non-zero) within this long after the fault


def _torchrun(args: list[str], out: Path, fault: str | None = None, max_restarts: int = 0, timeout: float = 300,
              **plugin_env: str):
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "TRAINER3D_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=str(ROOT))
    if fault or plugin_env:
        env.update(fault_plugin.env(**({"TRAINER3D_FAULT": fault} if fault else {}), **plugin_env))
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--max-restarts",
           str(max_restarts), "--master-port", str(free_port()), ENTRY, *TINY, "--tp", "2", "--out-dir", str(out),
           *args]
    t0 = time.monotonic()
    p = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=str(ROOT))
    return p, time.monotonic() - t0, p.stdout + p.stderr


def _fault_time(out: Path) -> float:
    """Seconds from the fault (the mtime of metrics.jsonl after the faulted step) to now."""
    return time.time() - (out / "metrics.jsonl").stat().st_mtime


def _steps(out: Path) -> list[dict]:
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_killed_rank_fails_the_job(tmp_path):
    out = tmp_path / "run"
    p, wall, log = _torchrun(["--max-steps", "200", "--dist-timeout", "300"], out, fault="kill:rank=1:step=3")
    after = _fault_time(out)
    print(f"\n[killed rank] job exited {p.returncode} after {wall:.1f} s in all, {after:.1f} s after the kill")
    assert p.returncode != 0, log[-3000:]
    assert after < BOUND_S and wall < BOUND_S + 60, (wall, after)
    assert "rank 1 (" in log and "did not report the failure: it died or hangs" in log, log[-3000:]
    assert "Signal 9 (SIGKILL)" in log  # torchrun's own summary: rank 1's exit signal


def test_hung_rank_times_out(tmp_path):
    out = tmp_path / "run"
    p, wall, log = _torchrun(["--max-steps", "200", "--dist-timeout", "10"], out, fault="hang:rank=1:step=3")
    after = _fault_time(out)
    print(f"\n[hung rank] job exited {p.returncode} after {wall:.1f} s in all, {after:.1f} s after the hang "
          "(10 s --dist-timeout, 5 s for peers' reports, up to 30 s torchrun grace before SIGKILL of the hung rank)")
    assert p.returncode != 0, log[-3000:]
    assert after < BOUND_S and wall < BOUND_S + 60, (wall, after)
    assert "Timed out waiting 10000ms" in log, log[-3000:]
    assert "rank 1 (" in log and "did not report the failure: it died or hangs" in log, log[-3000:]


def test_peers_name_a_rank_that_failed_on_its_own(tmp_path):
    """Without torchrun (plain processes, as under `srun` or a hand-made launch) nobody tears the job down: rank 1
    raises, rank 0 waits --dist-timeout, then names rank 1 and its error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRAINER3D_", "SLURM_"))}
    env.update(OMP_NUM_THREADS="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
               **fault_plugin.env(TRAINER3D_FAULT="raise:rank=1:step=3"))
    cmd = [sys.executable, ENTRY, *TINY, "--tp", "2", "--out-dir", str(tmp_path / "run"), "--max-steps", "200",
           "--dist-timeout", "15"]
    t0 = time.monotonic()
    procs = [subprocess.Popen(cmd, env={**env, "RANK": str(r), "LOCAL_RANK": str(r)}, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True, cwd=str(ROOT)) for r in (0, 1)]
    try:
        logs = [p.communicate(timeout=240)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
    print(f"\n[own error] rank 1 exited {procs[1].returncode}, rank 0 exited {procs[0].returncode} after "
          f"{time.monotonic() - t0:.1f} s")
    assert procs[1].returncode != 0 and "TRAINER3D_FAULT=raise" in logs[1], logs[1][-3000:]
    assert procs[0].returncode != 0, logs[0][-3000:]
    assert "rank 1 (" in logs[0] and "failed with its own error: RuntimeError: TRAINER3D_FAULT=raise" in logs[0], \
        logs[0][-3000:]


def test_restart_resumes_from_checkpoint(tmp_path):
    """`torchrun --max-restarts 1`, rank 1 SIGKILLed after step 3: the agent restarts both ranks, they resume from
    the step-2 checkpoint (--save-every 2 --resume), and the run ends with the uninterrupted run's loss."""
    steps = ["--max-steps", "6", "--dist-timeout", "60"]
    ref, ref_wall, ref_log = _torchrun(steps, tmp_path / "ref")
    assert ref.returncode == 0, ref_log[-3000:]
    out = tmp_path / "run"
    p, wall, log = _torchrun([*steps, "--save-every", "2", "--resume"], out, fault="kill:rank=1:step=3",
                             max_restarts=1)
    print(f"\n[restart] uninterrupted run {ref_wall:.1f} s; killed and restarted run {wall:.1f} s")
    assert p.returncode == 0, log[-4000:]
    assert "kills after step 3" in log and "resuming from" in log, log[-4000:]
    got, want = _steps(out), _steps(tmp_path / "ref")
    assert [r["step"] for r in got] == [r["step"] for r in want] == [1, 2, 3, 4, 5, 6]
    assert got[-1]["loss"] == pytest.approx(want[-1]["loss"], rel=1e-6, abs=1e-6)
    assert [r["loss"] for r in got] == pytest.approx([r["loss"] for r in want], rel=1e-6, abs=1e-6)


def test_peers_wait_for_the_data_cache_past_the_collective_timeout(tmp_path):
    """Local rank 0 builds the data cache while its peer waits; the wait is in the rendezvous store, not in a
    collective, so a leader slower than --dist-timeout (12 s against 5 s here) does not fail the job."""
    p, wall, log = _torchrun(["--max-steps", "2", "--dist-timeout", "5"], tmp_path / "run",
                             **{fault_plugin.SLOW_DATA_ENV: "12"})
    print(f"\n[slow data leader] job exited {p.returncode} after {wall:.1f} s")
    assert p.returncode == 0, log[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "run") if "loss" in r] == [1, 2]
