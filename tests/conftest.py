"""The suite's one rule for skipping: a test skips only for a condition of the machine it cannot change, declared with
`@pytest.mark.needs(<condition>)` (NEEDS below) and decided here, before the test runs. Any other skip (a
`pytest.skip` somewhere, a test helper giving up) is a failure when CI is set, and so is a skip for a condition
that TRAINER3D_ALLOWED_SKIPS (which .ci/run sets) does not list. `python tests/helpers/counts.py` derives the README's test
counts from these markers, and tests/test_docs.py checks that the README states them."""

from __future__ import annotations

import os
from typing import Callable, NamedTuple

import pytest


class Need(NamedTuple):
    met: Callable[[], bool]
    why: str  # the skip's reason where it is not met


def _aio() -> bool:
    from trainer3d.zero import ops as zero_ops

    return zero_ops.aio_available()


NEEDS: dict[str, Need] = {
    "libaio": Need(_aio, "DeepSpeed's async_io op (ZeRO-Infinity's NVMe offload) needs libaio-dev"),
    "root": Need(lambda: os.geteuid() == 0, "needs root (mounting a filesystem, running SLURM's daemons)"),
    "not-root": Need(lambda: os.geteuid() != 0, "root can write anywhere, so an unwritable directory cannot be made"),
}
ALLOWED_ENV = "TRAINER3D_ALLOWED_SKIPS"  # conditions CI may skip for, space-separated (.ci/run)
_SKIPPED_FOR = pytest.StashKey[str]()
_MADE = pytest.StashKey[list]()  # the directories this session made for itself (_own_directory), gone with it


def in_ci() -> bool:
    return os.environ.get("CI", "").lower() in ("1", "true", "yes")


def pytest_configure(config):
    # Two test files run at once on the machine's cores (pyproject's -n 2), so a process's second intra-op thread
    # only spin-waits against the other worker's (a tiny model's step took 1.3 s instead of 30 ms): every test, and
    # every process it starts (they inherit the variable), computes on one thread
    os.environ["OMP_NUM_THREADS"] = "1"
    import torch

    torch.set_num_threads(1)
    # --layout auto reads a calibration of this kind of machine where one was measured (plan/calibrate.py): the tests
    # plan with the presets' constants, whatever a user of this machine calibrated
    _own_directory(config, "TRAINER3D_CALIBRATION", "trainer3d-calibration-")
    # inductor's kernel cache: the session's own, empty, as on CI's clean machine (shared by its workers and every
    # process they start), so that a local run takes the time CI takes: /tmp/torchinductor_$USER, warm from earlier
    # runs, made test_compile.py alone 2.4x faster (76 s against 181 s). One compile thread: inductor's pool of
    # worker processes, one pool per compiling rank, cost CPU (294 against 266 CPU-s) on cores the other worker uses
    _own_directory(config, "TORCHINDUCTOR_CACHE_DIR", "trainer3d-inductor-")
    os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # --fp8 on this GPU-less machine: torchao's emulation (parallel/fp8.py); test_fp8.py unsets it to see the refusal
    os.environ.setdefault("TRAINER3D_FP8_EMULATE", "1")
    config.addinivalue_line("markers", f"needs(condition): skip unless the machine meets it ({', '.join(NEEDS)})")


def _own_directory(config, variable: str, prefix: str) -> None:
    """$variable names a new empty directory of this session's (its xdist workers inherit it), unless the environment
    already names one: that one is used and kept."""
    if variable not in os.environ:
        import tempfile

        os.environ[variable] = made = tempfile.mkdtemp(prefix=prefix)
        config.stash.setdefault(_MADE, []).append(made)


def pytest_unconfigure(config):
    import shutil

    for made in config.stash.get(_MADE, []):
        shutil.rmtree(made, ignore_errors=True)


def pytest_runtest_setup(item):
    for mark in item.iter_markers("needs"):
        (condition,) = mark.args
        need = NEEDS[condition]
        if not need.met():
            item.stash[_SKIPPED_FOR] = condition
            pytest.skip(f"[needs {condition}] {need.why}")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Under CI, a skip is a failure unless it is a declared condition the allow-list names."""
    report = (yield).get_result()
    if report.skipped and in_ci() and not getattr(report, "wasxfail", None):
        condition = item.stash.get(_SKIPPED_FOR, None)
        allowed = os.environ.get(ALLOWED_ENV, "").split()
        if condition is None or condition not in allowed:
            report.outcome = "failed"
            why = "not a declared machine condition" if condition is None else f"{condition!r} is not in {ALLOWED_ENV}"
            report.longrepr = f"CI: skipped ({why}): {report.longrepr}"


# Files whose one or few tests run for minutes: queued first. xdist's default queue (pyproject's
# --no-loadscope-reorder turns it off) hands out the files with the most tests first, so these came last, and one
# worker ran them alone while the other sat idle (277 s of a 41-minute run, tests/helpers/timeline.py).
LONG_FEW = ("test_gpu_round.py", "test_compile.py", "test_sft_trl.py", "test_deepspeed_launcher.py", "test_dsa.py")


def pytest_collection_modifyitems(config, items):
    """The queue: LONG_FEW first, then the other files, those with the most tests first (xdist's own order)."""
    files: dict[str, list] = {}
    for item in items:
        files.setdefault(item.path.name, []).append(item)
    order = sorted(files, key=lambda f: (LONG_FEW.index(f) if f in LONG_FEW else len(LONG_FEW), -len(files[f])))
    items[:] = [item for f in order for item in files[f]]


TIMELINE_ENV = "TRAINER3D_TEST_TIMELINE"  # a file: when each test started and ended, on which worker (docs/testing.md)


def _timeline(path: str, event: str, nodeid: str) -> None:
    import time

    with open(path, "a") as f:
        f.write(f"{time.time():.1f} {os.environ.get('PYTEST_XDIST_WORKER', 'main')} {event} {nodeid}\n")


def _cpu_seconds() -> float:
    """This process's CPU time, its finished children's (the runs a test started and joined), and its live children's
    with the children they reaped (a forkserver's ranks: tests/helpers/distributed.py)."""
    import resource

    total = sum(u.ru_utime + u.ru_stime for u in (resource.getrusage(resource.RUSAGE_SELF),
                                                  resource.getrusage(resource.RUSAGE_CHILDREN)))
    me, tick = os.getpid(), os.sysconf("SC_CLK_TCK")
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()  # after the command's name, which may hold spaces
        except OSError:
            continue  # it ended meanwhile
        if int(fields[1]) == me:  # ppid; then utime, stime, cutime, cstime
            total += sum(int(x) for x in fields[11:15]) / tick
    return total


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item, nextitem):
    """With TRAINER3D_TEST_TIMELINE set, each test's start and end (setup to teardown) where it runs (a worker, or
    the one process under -n 0; never xdist's controller), and the CPU seconds it used: when each worker was busy,
    what ran last while the other waited, and what the suite's CPU-bound time is spent on (tests/helpers/timeline.py)."""
    path = os.environ.get(TIMELINE_ENV)
    if path:
        _timeline(path, "start", item.nodeid)
        cpu = _cpu_seconds()
    yield
    if path:
        _timeline(path, f"end,cpu={_cpu_seconds() - cpu:.1f}", item.nodeid)
