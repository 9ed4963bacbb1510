"""The only test-only code the runtime runs: faults and pauses that tests/ ask for through environment variables
(a subprocess launched by torchrun or SLURM cannot be patched from the test). Unset, every hook is a no-op."""

from __future__ import annotations

import os
import signal
import sys
import time

# When saving this step, writer ranks stop after their model file, create `PAUSED` in the temporary directory and
# sleep, so a test can SIGKILL the job in the middle of a save (tests/test_checkpoint.py).
PAUSE_SAVE_ENV = "TRAINER3D_TEST_PAUSE_SAVE_AT_STEP"


def pause_mid_save(step: int, tmp_dir) -> None:
    _pause_if(PAUSE_SAVE_ENV, step, tmp_dir)


def _pause_if(env: str, value: int, directory) -> None:
    """Create `PAUSED` in `directory` and sleep forever when the variable `env` equals `value`."""
    if os.environ.get(env) == str(value):
        (directory / "PAUSED").touch()
        while True:
            time.sleep(1)


def inject_fault(step: int, rank: int) -> None:
    """TEST-ONLY fault injection after optimizer step `step`: TRAINER3D_FAULT=kill:rank=R:step=S makes rank R
    SIGKILL itself, hang:rank=R:step=S makes it sleep forever, raise:rank=R:step=S raises a RuntimeError. Only on a job's first attempt
    (TORCHELASTIC_RESTART_COUNT and SLURM_RESTART_COUNT 0), so that a restart or requeue runs clean."""
    spec = os.environ.get("TRAINER3D_FAULT")
    restarted = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0") != "0" or os.environ.get("SLURM_RESTART_COUNT", "0") != "0"
    if not spec or restarted:
        return
    kind, *fields = spec.split(":")
    opts = dict(f.split("=", 1) for f in fields)
    if int(opts.get("rank", -1)) != rank or int(opts.get("step", -1)) != step:
        return
    print(f"[trainer3d] TRAINER3D_FAULT={spec}: rank {rank} {kind}s after step {step}", file=sys.stderr, flush=True)
    if kind == "kill":
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError(f"TRAINER3D_FAULT={spec}")
    else:
        raise ValueError(f"TRAINER3D_FAULT: unknown fault {kind!r} (kill, hang or raise)")


# `python -m trainer3d.prepare` stops (sleeps, after creating `PAUSED` in the output) once this many shards are
# committed, so a test can SIGKILL it mid-corpus and resume (tests/test_prepare.py).
PAUSE_PREPARE_ENV = "TRAINER3D_TEST_PAUSE_PREPARE_AFTER_SHARDS"


def pause_after_shard(n_shards: int, out_dir) -> None:
    _pause_if(PAUSE_PREPARE_ENV, n_shards, out_dir)
