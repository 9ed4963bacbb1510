"""Faults and pauses that tests ask a training or prepare subprocess for through environment variables (a process
launched by torchrun or SLURM cannot be monkeypatched from the test). Loaded by trainer3d's TRAINER3D_PLUGINS
(trainer3d/plugins.py): `env(...)` below gives a subprocess what it needs; imported where one of its variables is
set, the module wraps three trainer3d functions from outside; elsewhere it patches nothing.

    TRAINER3D_TEST_PAUSE_SAVE_AT_STEP=S        writer ranks stop after writing their file of step S's save
    TRAINER3D_FAULT=kill|hang|raise:rank=R:step=S   rank R fails after optimizer step S
    TRAINER3D_FAULT=node:rank=R:step=S          rank R's node is lost: its torchrun agent and the rank SIGKILLed
    TRAINER3D_FAULT=alloc:rank=R:step=S:mib=N       rank R holds N MiB for a moment after step S
    TRAINER3D_TEST_PAUSE_PREPARE_AFTER_SHARDS=N   prepare stops once N shards are committed
    TRAINER3D_TEST_SLOW_DATA_S=S               local rank 0 takes S seconds more to build the data cache
    TRAINER3D_TEST_HOLD=world=W:step=S        in a world of W ranks, every rank waits after step S until a signal
                                               asks it to stop (SIGTERM from torchrun when a node joins)
"""

from __future__ import annotations

import functools
import os
import signal
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]


def env(**variables: str) -> dict[str, str]:
    """The environment entries that load this plugin into a subprocess, plus `variables` (PYTHONPATH: the
    repository and tests/)."""
    return {"TRAINER3D_PLUGINS": "helpers.fault_plugin", "PYTHONPATH": os.pathsep.join([str(TESTS.parent), str(TESTS)]),
            **variables}

# When saving this step, every rank stops after writing its file, creates `PAUSED` in the temporary directory and
# sleeps, so a test can SIGKILL the job in the middle of a save (tests/test_checkpoint.py).
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
    print(f"[trainer3d] TRAINER3D_FAULT={spec}: rank {rank}, {kind}, after step {step}", file=sys.stderr, flush=True)
    if kind == "node":  # the agent first (else it would restart the rank), then the rank; its siblings fail alone
        os.kill(os.getppid(), signal.SIGKILL)
    if kind in ("kill", "node"):
        os.kill(os.getpid(), signal.SIGKILL)
    elif kind == "hang":
        while True:
            time.sleep(3600)
    elif kind == "raise":
        raise RuntimeError(f"TRAINER3D_FAULT={spec}")
    elif kind == "alloc":  # a memory peak of `mib` MiB on this rank, at once released
        block = bytearray(int(opts["mib"]) * 2**20)
        block[::4096] = b"\1" * len(block[::4096])  # touch every page: resident, not just reserved
        del block
    else:
        raise ValueError(f"TRAINER3D_FAULT: unknown fault {kind!r} (kill, node, hang, raise or alloc)")


# `python -m trainer3d.prepare` stops (sleeps, after creating `PAUSED` in the output) once this many shards are
# committed, so a test can SIGKILL it mid-corpus and resume (tests/test_prepare.py).
PAUSE_PREPARE_ENV = "TRAINER3D_TEST_PAUSE_PREPARE_AFTER_SHARDS"


def pause_after_shard(n_shards: int, out_dir) -> None:
    _pause_if(PAUSE_PREPARE_ENV, n_shards, out_dir)


# Local rank 0 sleeps this many seconds before it builds the data cache (its peers wait for it: tests/test_faults.py).
SLOW_DATA_ENV = "TRAINER3D_TEST_SLOW_DATA_S"


# In a world of this many ranks, every rank holds after this step until SIGTERM/SIGUSR1 asks it to stop: a test starts
# a node while the job waits for it (tests/test_faults.py). The signal is then agreed in the next step, as ever.
HOLD_ENV = "TRAINER3D_TEST_HOLD"


def hold_for_signal(step: int, checkpointer) -> None:
    opts = dict(f.split("=", 1) for f in os.environ.get(HOLD_ENV, "").split(":") if f)
    if opts and int(opts["world"]) == int(os.environ.get("WORLD_SIZE", "1")) and int(opts["step"]) == step:
        while not checkpointer.stop_requested:
            time.sleep(0.1)


# ---- the wrappers, installed on import ------------------------------------------------------------------------------
def _install() -> None:
    import torch.distributed as dist

    from trainer3d.checkpoint import save, signals
    from trainer3d.data import prepare
    from trainer3d.train import data_setup

    build_blocks = data_setup.build_rows

    @functools.wraps(build_blocks)
    def slow_leader_then_build(*args, **kwargs):
        if os.environ.get("LOCAL_RANK", "0") == "0":
            time.sleep(float(os.environ.get(SLOW_DATA_ENV, "0")))
        return build_blocks(*args, **kwargs)

    data_setup.build_rows = slow_leader_then_build

    write_file = save._save_safetensors

    @functools.wraps(write_file)
    def save_then_maybe_pause(tensors, path, metadata):
        info = write_file(tensors, path, metadata)
        step = int(Path(path).parent.name.split(".")[0].removeprefix("step_"))  # step_000123.tmp-xxxx/
        pause_mid_save(step, Path(path).parent)
        return info

    save._save_safetensors = save_then_maybe_pause

    after_step = signals.Checkpointer.after_step

    @functools.wraps(after_step)
    def fault_then_after_step(self, stop):
        inject_fault(self.trainer.step, dist.get_rank())
        hold_for_signal(self.trainer.step, self)
        return after_step(self, stop)

    signals.Checkpointer.after_step = fault_then_after_step

    commit = prepare.ShardWriter.commit

    @functools.wraps(commit)
    def commit_then_maybe_pause(self, next_cursor, complete=False):
        commit(self, next_cursor, complete)
        if not complete:
            pause_after_shard(len(self.m["shards"]["val"]) + len(self.m["shards"]["train"]), self.out)

    prepare.ShardWriter.commit = commit_then_maybe_pause


if any(os.environ.get(v) for v in (PAUSE_SAVE_ENV, "TRAINER3D_FAULT", PAUSE_PREPARE_ENV, SLOW_DATA_ENV, HOLD_ENV)):
    _install()  # (a test importing the module for env() patches nothing)
