"""Run a function on N local processes (gloo, CPU) with a hard timeout, and collect what each rank returns.

Spawning a world costs seconds (imports, rendezvous) while a tiny model's step costs milliseconds, so tests
run many layouts inside one world, and the ranks are forked from a forkserver that has imported torch, DeepSpeed,
transformers and trainer3d once (a spawned rank imported them again: ~12 s for a world of 8 on 2 cores). The server
is a clean single-threaded process, as a spawned rank would be; each rank takes the test's environment as it is
when the world starts. Under LD_PRELOAD (bench/measure.preloaded_memhook's malloc counter), which only an exec
applies, the ranks are spawned. A hang fails the test after `timeout` seconds instead of eating CI's budget.
"""

from __future__ import annotations

import datetime
import os
import pickle
import socket
import sys
import tempfile
import time
import traceback

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the repository
LAUNCHER_VARIABLES = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def launch_env(**extra: str) -> dict[str, str]:
    """The environment of a trainer3d process a test launches: the test's, without launcher variables and the user's
    W&B and TRAINER3D_ settings, except the calibration folder tests/conftest.py chose (so that --layout auto plans
    with the presets' constants there too); one thread; the repository importable; `extra` on top."""
    env = {k: v for k, v in os.environ.items() if k not in LAUNCHER_VARIABLES
           and (k == "TRAINER3D_CALIBRATION" or not k.startswith(("WANDB_", "TRAINER3D_")))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT)
    return {**env, **extra}


# imported once by the forkserver, before it forks a rank (each rank re-imports nothing of these); rank_preload also
# does once there what each rank would otherwise repeat (DeepSpeed's Muon import, its glue check, its CPU probe)
PRELOAD = ["torch", "torch.distributed", "deepspeed", "transformers", "trainer3d.train.trainer", "helpers.parity",
           "helpers.rank_preload"]


def _worker(rank, world_size, port, out_dir, environ, fn, args):
    os.environ.clear()
    os.environ.update(environ)  # the test's environment now, not the forkserver's at its start
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank), OMP_NUM_THREADS="1",
    )
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    result = None
    try:
        dist.init_process_group(
            "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
            timeout=datetime.timedelta(seconds=120),
        )
        result = ("ok", fn(rank, world_size, *args))
    except BaseException:  # noqa: BLE001 - reported to the parent
        result = ("error", traceback.format_exc())
    finally:
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        with open(path + ".tmp", "wb") as f:  # renamed when whole: the parent reads results while others run
            pickle.dump(result, f)
        os.replace(path + ".tmp", path)
        if dist.is_initialized():
            dist.destroy_process_group()
    # The result is on disk and the group is gone: skip interpreter teardown, where native threads of DeepSpeed's ops
    # (the async_io handle of ZeRO-Infinity) can still be joinable when their owners are collected and abort the
    # process (seen once: SIGABRT after an NVMe world). A crash during the run still fails the test (no result).
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def _start_forkserver() -> None:
    """The forkserver importing PRELOAD, with the repository and tests/ on its PYTHONPATH (without them parity and
    rank_preload failed to import there, silently: every rank imported them again itself)."""
    from bench.preloaded import start_forkserver

    start_forkserver(PRELOAD, [ROOT, os.path.join(ROOT, "tests")])


def run_world(world_size: int, fn, *args, timeout: float = 300.0) -> list:
    """fn(rank, world_size, *args) on every rank; returns the list of results (rank order). `fn` must be a
    module-level function (it is pickled into spawned processes)."""
    with tempfile.TemporaryDirectory() as out_dir:
        method = "spawn" if os.environ.get("LD_PRELOAD") else "forkserver"
        if method == "forkserver":
            _start_forkserver()
        ctx = mp.start_processes(
            _worker, args=(world_size, free_port(), out_dir, dict(os.environ), fn, args), nprocs=world_size,
            join=False, start_method=method,
        )
        deadline = time.monotonic() + timeout
        try:
            while not ctx.join(timeout=1.0):
                if _failed_rank(out_dir, world_size) is not None:
                    break  # its peers may wait on it in a collective until their own timeout: stop them now
                if time.monotonic() > deadline:
                    raise TimeoutError(f"{world_size}-process world did not finish within {timeout:.0f} s (hang?)")
        except mp.ProcessRaisedException as e:  # pragma: no cover - a rank died before writing its result
            raise RuntimeError(str(e)) from None
        finally:
            for p in ctx.processes:
                if p.is_alive():
                    p.kill()
        failed = _failed_rank(out_dir, world_size)
        if failed is not None:
            raise RuntimeError(f"rank {failed[0]} failed:\n{failed[1]}")
        results = []
        for rank in range(world_size):
            path = os.path.join(out_dir, f"rank{rank}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {rank} exited without a result")
            with open(path, "rb") as f:
                results.append(pickle.load(f)[1])
        return results


def _failed_rank(out_dir: str, world_size: int) -> tuple[int, str] | None:
    """The first rank that has reported an error, and its traceback."""
    for rank in range(world_size):
        path = os.path.join(out_dir, f"rank{rank}.pkl")
        if os.path.exists(path):
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                return rank, value
    return None
