"""launch/slurm/train_gpt2.sbatch on a real SLURM cluster: two fake nodes on this machine (tests/helpers/slurm_cluster.py).

Each test submits the sbatch file with `sbatch` as a user would (2 nodes × 2 processes, tiny model, tp=2, so
dp=2), waits for the job through `scontrol show job`, and reads the job's log and metrics.jsonl. Skipped where
the machine cannot run SLURM (not root, no apt-get, install or start failure), except under CI=true, where
those are failures. The machine is left as it was (tests/helpers/slurm_cluster.py: a private hosts file per daemon, and the
packages installed for the tests purged after them).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from helpers import slurm_cluster
from helpers.parity import LOSS_RTOL, NORM_RTOL
from helpers.distributed import launch_env
from helpers.slurm_cluster import ClusterError, SlurmCluster, in_ci

ROOT = Path(__file__).resolve().parents[1]
SBATCH = str(ROOT / "launch" / "slurm" / "train_gpt2.sbatch")
TINY = ["--model", "tiny", "--n-layer", "2", "--seq-len", "32", "--global-batch", "8", "--tp", "2",
        "--eval-every", "0", "--log-every", "1", "--dist-timeout", "120"]
AUTO = [*TINY[:8], *TINY[10:], "--layout", "auto"]  # TINY without --tp 2: the planner picks
JOB_TIMEOUT = 600  # a hang guard: the requeue test took 46-56 s alone, 255 s beside the suite's other worker

pytestmark = pytest.mark.timeout(900)


def _unavailable(reason: str):
    if in_ci():
        pytest.fail(f"CI=true but the SLURM cluster cannot run: {reason}")
    pytest.skip(reason)


@pytest.fixture(scope="module")
def cluster():
    """The cluster for this module's tests; afterwards the machine is as before (daemons stopped, files removed,
    the packages it installed purged)."""
    reason = slurm_cluster.unavailable()
    if reason:
        _unavailable(reason)
    try:
        added = slurm_cluster.install()
    except (ClusterError, OSError, TimeoutError) as e:
        _unavailable(f"cannot install SLURM: {e}")
    c = SlurmCluster(cpus_per_node=2)
    try:
        t0 = time.monotonic()
        try:
            c.start()
        except (ClusterError, OSError, TimeoutError) as e:
            _unavailable(f"cannot start a local SLURM cluster: {e}")
        print(f"\n[slurm] cluster up in {time.monotonic() - t0:.1f} s ({c.dir}); installed for it: {added or 'nothing'}")
        yield c
    finally:
        c.stop()
        c.cleanup()
        slurm_cluster.uninstall(added)


@pytest.fixture
def submit_dir(tmp_path):
    (tmp_path / "logs").mkdir()
    return tmp_path


def _job_env(**extra) -> dict:
    env = {k: v for k, v in launch_env().items() if not k.startswith("SLURM_")}
    return dict(env, PYTHON=sys.executable, NPROC_PER_NODE="2", **extra)


def _submit(cluster, submit_dir, name, args, **env):
    t0 = time.monotonic()
    job = cluster.sbatch([f"--job-name={name}", SBATCH, *args], cwd=submit_dir, env=_job_env(**env))
    return job, t0


def _log(submit_dir: Path, name: str, job: int) -> str:
    path = submit_dir / "logs" / f"{name}-{job}.out"
    return path.read_text(errors="replace") if path.exists() else f"(no log file {path})"


def _metrics(submit_dir: Path, name: str, job: int | None) -> list[dict]:
    """The job's metrics.jsonl (job None: the run in submit_dir/name)."""
    path = (submit_dir / "runs" / f"{name}-{job}" if job else submit_dir / name) / "metrics.jsonl"
    return [json.loads(x) for x in path.read_text().splitlines()] if path.exists() else []


def _check_trained(cluster, submit_dir, name, job, info, launcher, steps):
    log = _log(submit_dir, name, job)
    context = f"{info}\n--- job log\n{log[-6000:]}\n--- daemons\n{cluster.logs()}"
    assert info["JobState"] == "COMPLETED" and info["ExitCode"] == "0:0", context
    assert info["NodeList"] == "n[1-2]" and info["NumNodes"] == "2", context
    assert (f"on 2 node(s) n[1-2]: 2 process(es) per node, 4 in all, launcher {launcher}, master n1:"
            in log), context
    assert "[trainer3d] dp2×tp2×pp1" in log, context  # 4 processes: dp = 4 / (tp 2 × pp 1)
    assert f"step {steps:>6} | loss" in log, context
    records = _metrics(submit_dir, name, job)
    assert [r["step"] for r in records] == list(range(1, steps + 1)), context
    assert all(r["loss"] > 0 and r["tokens_per_s"] > 0 for r in records)
    assert "training finished with exit code 0" in log, context


def test_launch_env_reads_srun_steps_not_the_batch_script(monkeypatch):
    """Under srun each task is a rank (SLURM_PROCID of SLURM_STEP_NUM_TASKS); a batch script or salloc shell also
    has SLURM_PROCID=0 and the job's SLURM_NTASKS, but a plain `python` there is one process (no cluster needed)."""
    from trainer3d.distributed.topology import LaunchEnv

    for k in list(os.environ):
        if k.startswith("SLURM_") or k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT"):
            monkeypatch.delenv(k)
    monkeypatch.setenv("SLURM_PROCID", "0")
    monkeypatch.setenv("SLURM_NTASKS", "4")
    monkeypatch.setenv("SLURM_JOB_ID", "1234")
    assert LaunchEnv.from_environ().world_size == 1
    monkeypatch.setenv("SLURM_PROCID", "3")
    monkeypatch.setenv("SLURM_STEP_NUM_TASKS", "4")
    monkeypatch.setenv("SLURM_LOCALID", "1")
    monkeypatch.setenv("MASTER_ADDR", "n1")
    env = LaunchEnv.from_environ()
    assert (env.rank, env.local_rank, env.world_size, env.master_addr, env.master_port) == (3, 1, 4, "n1", 21234)
    monkeypatch.setenv("RANK", "5")  # torchrun (or an sbatch exporting RANK) wins over SLURM_PROCID
    monkeypatch.setenv("WORLD_SIZE", "8")
    assert LaunchEnv.from_environ().rank == 5


@pytest.mark.needs("root")
@pytest.mark.parametrize("launcher", ["torchrun", "srun"])
def test_sbatch_trains_on_two_nodes(cluster, submit_dir, launcher):
    name = f"t3d-{launcher}"
    job, t0 = _submit(cluster, submit_dir, name, [*TINY, "--max-steps", "5"], LAUNCHER=launcher)
    info = cluster.wait(job, JOB_TIMEOUT)
    print(f"\n[slurm] {launcher}: job {job} {info['JobState']} in {time.monotonic() - t0:.1f} s (submit to end)")
    _check_trained(cluster, submit_dir, name, job, info, launcher, steps=5)


@pytest.mark.needs("root")
def test_time_limit_signal_checkpoints_and_requeues_onto_fewer_nodes(cluster, submit_dir):
    """What `--signal=B:USR1@120` does near the time limit, sent by hand: the script forwards USR1, the trainer
    saves and stops, the script requeues the job. Node n2 is then lost (drained) and the held job resized to the
    node left (`scontrol update NumNodes=1 NumTasks=1`: one launcher task per node), so it starts again on n1 alone:
    `--layout auto --resume` plans again for 2 processes instead of 4, resumes with the same global batch, and every
    step's loss and gradient norm equal the one-process run's."""
    name = "t3d-requeue"
    steps = 24
    args = [*AUTO, "--max-steps", str(steps)]
    ref = subprocess.run([sys.executable, str(ROOT / "launch" / "train_gpt2.py"), *args, "--out-dir",
                          str(submit_dir / "ref")], env=_job_env(), capture_output=True, text=True, timeout=300)
    assert ref.returncode == 0, (ref.stdout + ref.stderr)[-3000:]
    job, t0 = _submit(cluster, submit_dir, name, [*args, "--save-every", "8"])
    deadline = time.monotonic() + JOB_TIMEOUT
    while len(_metrics(submit_dir, name, job)) < 3:  # training is under way
        assert time.monotonic() < deadline, f"no progress\n{_log(submit_dir, name, job)[-4000:]}"
        assert cluster.job(job)["JobState"] in ("PENDING", "CONFIGURING", "RUNNING"), _log(submit_dir, name, job)
        time.sleep(0.5)
    cluster.cmd(["scancel", "--batch", "--signal=USR1", str(job)])
    t_signal = time.monotonic()
    while cluster.job(job).get("Restarts", "0") == "0":
        assert time.monotonic() < deadline, f"not requeued\n{_log(submit_dir, name, job)[-4000:]}"
        time.sleep(0.5)
    t_requeued = time.monotonic()
    cluster.cmd(["scontrol", "update", "NodeName=n2", "State=DRAIN", "Reason=lost"])
    cluster.cmd(["scontrol", "update", f"JobId={job}", "NumNodes=1", "NumTasks=1"])
    try:
        # SLURM holds a requeued job for ~2 minutes (Reason=BeginTime). Once n1 has cleaned up after the first run
        # (idle again: a relaunch before that is refused, "Job credential revoked"), let it start now.
        idle_polls = 0
        while idle_polls < 3:
            assert time.monotonic() < deadline, f"n1 not idle\n{cluster.logs()}"
            idle = cluster.cmd(["sinfo", "-h", "-N", "-t", "idle", "-o", "%N"], check=False).stdout.split()
            idle_polls = idle_polls + 1 if "n1" in idle else 0
            time.sleep(0.5)
        cluster.cmd(["scontrol", "update", f"JobId={job}", "StartTime=now"], check=False)
        t_released = time.monotonic()
        info = cluster.wait(job, JOB_TIMEOUT)
    finally:
        cluster.cmd(["scontrol", "update", "NodeName=n2", "State=RESUME"], check=False)
    print(f"\n[slurm] requeue: USR1 {t_signal - t0:.1f} s after submit; requeued {t_requeued - t_signal:.1f} s "
          f"later; n1 idle and job released after {t_released - t_requeued:.1f} s more; second run on one node done "
          f"{time.monotonic() - t_released:.1f} s later ({time.monotonic() - t0:.1f} s in all)")
    log = _log(submit_dir, name, job)
    first, _, second = log.partition("(restart 1)")  # each run's part of the appended log, whole
    context = f"{info}\n--- first run\n{first[-5000:]}\n--- second run\n{second[-3000:]}\n--- daemons\n{cluster.logs()}"
    assert info["JobState"] == "COMPLETED" and info["Restarts"] == "1" and info["NodeList"] == "n1", context
    assert "USR1: time limit near" in first, context
    assert "SIGUSR1 received: stopped after step" in first, context
    assert "requeueing job" in log and "(restart 1) on 1 node(s) n1: 2 process(es) per node" in log, context
    assert "--layout auto on 2 node(s) × 2 cpu ranks" in log and "--layout auto on 1 node(s) × 2 cpu ranks" in log
    assert "[trainer3d] resuming from" in log, context
    got, want = _metrics(submit_dir, name, job), _metrics(submit_dir, "ref", None)
    assert [r["step"] for r in got] == [r["step"] for r in want] == list(range(1, steps + 1)), context
    for key, rtol in (("loss", LOSS_RTOL), ("grad_norm", NORM_RTOL)):
        assert [r[key] for r in got] == pytest.approx([r[key] for r in want], rel=rtol), key
