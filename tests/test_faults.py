"""A rank that dies or hangs never leaves the others waiting forever, and torchrun's elastic restarts resume.

Real jobs under `torchrun --nproc_per_node 2` (tiny model, tp=2 so the ranks talk every step). Faults are
injected with TRAINER3D_FAULT through tests/helpers/fault_plugin.py (loaded by TRAINER3D_PLUGINS): `kill` SIGKILLs the rank after a step,
`hang` makes it sleep forever. Each test reports its measured times (pytest -s shows them).
"""

from __future__ import annotations

import datetime
import json
import math
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch.distributed as dist

from helpers import fault_plugin
from helpers.distributed import free_port, launch_env
from helpers.parity import LOSS_RTOL, NORM_RTOL
from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint

ROOT = Path(__file__).resolve().parents[1]
ENTRY = str(ROOT / "launch" / "train_gpt2.py")
TINY = ["--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "4", "--eval-every", "0",
        "--log-every", "1"]
BOUND_S = 120  # the job must be over (non-zero) within this long after the fault


def _torchrun(args: list[str], out: Path, fault: str | None = None, timeout: float = 300,
              **plugin_env: str):
    env = _env(**({"TRAINER3D_FAULT": fault} if fault else {}), **plugin_env)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-port", str(free_port()),
           ENTRY, *TINY, "--tp", "2", "--out-dir", str(out), *args]
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
    assert "pp0 dp0 cp0 tp1; in rank 0's tp group, ranks 0, 1) did not report" in log, log[-3000:]  # where it waits


def test_peers_name_a_rank_that_failed_on_its_own(tmp_path):
    """Without torchrun (plain processes, as under `srun` or a hand-made launch) nobody tears the job down: rank 1
    raises, rank 0 waits --dist-timeout, then names rank 1 and its error."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRAINER3D_", "SLURM_"))}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE="2",
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


def test_elastic_restarts_on_fewer_ranks_and_grows_back(tmp_path):
    """torchrun's elastic agent, no person in the loop. Two agents (`--nnodes 1:2`, 2 workers each, c10d rendezvous)
    train with `--layout auto --resume`; after step 3 rank 3's node is lost (the rank and its agent SIGKILLed). The
    surviving agent restarts its workers: they rendezvous as a world of 2, plan a layout for it and resume from the
    step-2 checkpoint with twice the rows per rank. At step 8 (held there) a third agent joins: torchrun stops the
    workers (SIGTERM: they save step 9) and restarts them at 4 ranks, planned and resumed again. Every step's loss and
    gradient norm equal the one-process run's."""
    steps = ["--max-steps", "12", "--layout", "auto"]
    out = tmp_path / "run"
    ref = subprocess.run([sys.executable, ENTRY, *TINY, *steps, "--out-dir", str(tmp_path / "ref")], env=_env(),
                         capture_output=True, text=True, timeout=300, cwd=str(ROOT))
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    port = free_port()  # the rendezvous store lives here, as on a cluster's own host: either node may be lost
    store = dist.TCPStore("127.0.0.1", port, is_master=True, multi_tenant=True, timeout=datetime.timedelta(seconds=60))
    conf = "is_host=false,join_timeout=60,last_call_timeout=2,keep_alive_interval=1,keep_alive_max_attempt=3"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nnodes", "1:2", "--nproc-per-node", "2",
           "--max-restarts", "1", "--rdzv-backend", "c10d", "--rdzv-endpoint", f"127.0.0.1:{port}", "--rdzv-id",
           "elastic", "--rdzv-conf", conf, ENTRY, *TINY, *steps, "--save-every", "2", "--resume", "--dist-timeout",
           "30", "--out-dir", str(out)]
    # torch 2.13's shared rendezvous store hands a joining node no address (docs/operations.md): a store per round
    env = dict(_env(TRAINER3D_FAULT="node:rank=3:step=3", **{fault_plugin.HOLD_ENV: "world=2:step=8"}),
               TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def start() -> subprocess.Popen:
        return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                cwd=str(ROOT))

    t0 = time.monotonic()
    agents = [start(), start()]
    try:
        while not ((out / "metrics.jsonl").exists() and '"step": 8,' in (out / "metrics.jsonl").read_text()):
            if time.monotonic() - t0 > 200 or agents[0].poll() is not None:  # what the agents said, to see why
                said = [a.communicate(timeout=30)[0][-3000:] if a.poll() is not None else "(running)" for a in agents]
                raise AssertionError(f"the world of 2 never reached step 8; the agents said: {said}")
            time.sleep(0.2)
        t_join = time.monotonic()
        agents.append(start())
        logs = [a.communicate(timeout=200)[0] for a in agents]
    finally:
        _reap(agents, out)
        del store
    print(f"\n[elastic] agents exited {[a.returncode for a in agents]}: node lost at step 3, a node joined at step 8 "
          f"({t_join - t0:.1f} s in), the run finished {time.monotonic() - t_join:.1f} s later")
    lost = next(i for i in (0, 1) if "node:rank=3:step=3: rank 3, node, after step 3" in logs[i])
    kept, joined = logs[1 - lost], logs[2]
    assert [a.returncode for a in agents] == [0, 0, 0][:lost] + [-9] + [0, 0][lost:], kept[-4000:]
    def plans(log: str) -> list[str]:  # what rank 0 printed of each round's pick
        return [line.split(" cpu ranks")[0].split("auto on ")[1] for line in log.splitlines()
                if "--layout auto on" in line]

    # rank 0 is on the kept node in the first two rounds (the lost node held ranks 2 and 3), on either in the third
    assert plans(kept)[:2] == ["2 node(s) × 2", "1 node(s) × 2"], kept[-4000:]
    assert plans(kept)[2:] + plans(joined) == ["2 node(s) × 2"], (kept + joined)[-4000:]
    assert "step_000002 (step 2)" in kept and "SIGTERM received" in kept and "step_000009 (step 9)" in kept + joined
    got, want = _steps(out), _steps(tmp_path / "ref")
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, 13))
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=rtol), key
    worlds = {s: Checkpoint(resolve_checkpoint(out / "checkpoints" / f"step_{s:06d}")).meta["layout"]
              for s in (2, 8, 12)}
    assert [math.prod(worlds[s][a] for a in ("dp", "tp", "pp", "cp")) for s in (2, 8, 12)] == [4, 2, 4], worlds


def _env(**plugin_env: str) -> dict[str, str]:
    return launch_env(**fault_plugin.env(**plugin_env)) if plugin_env else launch_env()


def _reap(agents, out: Path) -> None:
    """Kill the agents and any worker of theirs still alive (workers run in sessions of their own, so a lost agent's
    workers outlive it until their next collective fails)."""
    for a in agents:
        if a.poll() is None:
            a.kill()
    for proc in Path("/proc").iterdir():
        try:
            if proc.name.isdigit() and str(out).encode() in (proc / "cmdline").read_bytes():
                os.kill(int(proc.name), signal.SIGKILL)
        except OSError:
            pass


def test_peers_wait_for_the_data_cache_past_the_collective_timeout(tmp_path):
    """Local rank 0 builds the data cache while its peer waits; the wait is in the rendezvous store, not in a
    collective, so a leader slower than --dist-timeout (12 s against 5 s here) does not fail the job."""
    p, wall, log = _torchrun(["--max-steps", "2", "--dist-timeout", "5"], tmp_path / "run",
                             **{fault_plugin.SLOW_DATA_ENV: "12"})
    print(f"\n[slow data leader] job exited {p.returncode} after {wall:.1f} s")
    assert p.returncode == 0, log[-3000:]
    assert [r["step"] for r in _steps(tmp_path / "run") if "loss" in r] == [1, 2]
