"""Which rank died or hangs, when a collective fails: every rank records the step it starts in the rendezvous store,
and the survivors of a failed collective name the ranks that never reported (see Heartbeat)."""

from __future__ import annotations

import datetime
import os
import socket
import sys
import time
from typing import Callable

import torch.distributed as dist

from trainer3d.distributed.collectives import rendezvous_store
from trainer3d.distributed.topology import ORDER, Layout
from trainer3d.errors import UsageError, report


class Heartbeat:
    """Which rank died or hangs, when a collective fails.

    Every rank records the step it starts in the rendezvous store (one small `set` per step). A rank whose
    collective fails (a peer died, or `--dist-timeout` expired because a peer hangs) records that it saw the
    failure, waits a few seconds for the other survivors to record theirs, and names the ranks that did not: they
    are the ones that died or hang. A rank that fails with an error of its own (out of memory, a bug) records it,
    so the peers left waiting name it. The store lives on torchrun's agent (or on rank 0 under plain srun)."""

    STEP = "trainer3d/heartbeat/{}"
    FAILED = "trainer3d/failed/{}"

    def __init__(self):
        self.store = rendezvous_store()
        self.rank = dist.get_rank() if dist.is_initialized() else 0
        self.world = dist.get_world_size() if dist.is_initialized() else 1

    def beat(self, step: int) -> None:
        if self.store is not None and self.world > 1:
            self.store.set(self.STEP.format(self.rank), f"{step} {socket.gethostname()} {os.getpid()}")

    def record_own_failure(self, msg: str) -> None:
        if self.store is not None and self.world > 1:
            try:
                self.store.set_timeout(datetime.timedelta(seconds=5))
                self.store.set(self.FAILED.format(self.rank), "own " + msg)
            except Exception:  # noqa: BLE001 - best effort: the error itself is what matters
                pass

    def describe(self, wait_s: float = 5.0, layout: Layout | None = None) -> str:
        """Record this rank's failed collective, wait up to `wait_s` for the others' reports, and name the ranks
        that failed on their own or never reported (died or hang), with their coordinates in `layout` and the group
        of this rank's they belong to (where this rank waits for them). Never raises."""
        if self.store is None or self.world == 1:
            return ""
        try:
            store = self.store
            store.set_timeout(datetime.timedelta(seconds=5))
            store.set(self.FAILED.format(self.rank), "peer")
            deadline = time.monotonic() + wait_s
            while True:
                failed = [r for r in range(self.world) if store.check([self.FAILED.format(r)])]
                if len(failed) == self.world or time.monotonic() > deadline:
                    break
                time.sleep(0.2)
            own = {}
            for r in failed:
                value = store.get(self.FAILED.format(r)).decode()
                if value.startswith("own "):
                    own[r] = value[4:]
            seen = {}
            for r in range(self.world):
                if store.check([self.STEP.format(r)]):
                    step, host, pid = store.get(self.STEP.format(r)).decode().split()
                    seen[r] = (int(step), host, pid)
        except Exception as e:  # noqa: BLE001 - the store's host (rank 0 or the agent) may be gone too
            return f"could not read the other ranks' state ({type(e).__name__}: {e})"
        silent = [r for r in range(self.world) if r not in failed]

        def where(r: int) -> str:
            text = f"{seen[r][1]} pid {seen[r][2]}, last started step {seen[r][0]}" if r in seen else "never started"
            return text + (f"; {shared_group(layout, self.rank, r)}" if layout is not None else "")

        lines = [f"rank {r} ({where(r)}) failed with its own error: {msg}" for r, msg in sorted(own.items())]
        lines += [f"rank {r} ({where(r)}) did not report the failure: it died or hangs" for r in silent]
        if own or silent:
            lines.append(f"look at rank(s) {_ranks(sorted(own) + silent)} first")
        else:
            lines.append("every rank reported a failed collective; the first error in the logs names the cause")
        steps = ", ".join(f"{r}: {s}" for r, (s, *_) in sorted(seen.items()))
        return "; ".join(lines) + f" (last step started per rank: {steps})"


def shared_group(layout: Layout, me: int, other: int) -> str:
    """`other`'s coordinates, and the axis group it shares with `me` (where `me` waits for it), if any: ranks that
    differ in one coordinate meet in that axis's collectives (or its pipeline sends), others only in collectives over
    several axes (the gradient norm's over tp and pp, the loss's over the world)."""
    a, b = layout.coords(me), layout.coords(other)
    coords = b.label()
    differ = [axis for axis in ORDER if getattr(a, axis) != getattr(b, axis)]
    if len(differ) != 1:
        return f"{coords}; in none of rank {me}'s axis groups: they meet in the gradient norm's or the loss's sums"
    axis = differ[0]
    ranks = [other + (i - getattr(b, axis)) * layout.stride(axis) for i in range(getattr(layout, axis))]
    return f"{coords}; in rank {me}'s {axis} group, ranks {_ranks(ranks)}"


def _is_comm_error(e: BaseException) -> bool:
    """A failed collective or rendezvous (a peer's fault, as far as this rank can tell)."""
    text = str(e)
    return isinstance(e, dist.DistError) or any(k in text for k in ("gloo", "NCCL", "c10d", "Connection closed"))


def report_failure(rank: int, error: BaseException, wait_s: float = 5.0, layout: Layout | None = None) -> None:
    """On a failed collective, print (stderr) the root error at once, then which ranks died or hang (and, given the
    run's layout, where they sit and which of this rank's groups waits for them). On an error of this rank's own,
    record it for the peers it leaves waiting (the traceback that follows says the rest)."""
    root = error
    while root.__cause__ is not None:  # torch.distributed.pipelining wraps the backend's error
        root = root.__cause__
    msg = next((line for line in str(root).splitlines() if line.strip()), type(root).__name__)[:300]
    if not _is_comm_error(root):
        Heartbeat().record_own_failure(f"{type(root).__name__}: {msg}")
        return
    print(f"trainer3d: rank {rank}: a collective failed: {msg}", file=sys.stderr, flush=True)
    print(f"trainer3d: rank {rank}: {Heartbeat().describe(wait_s, layout)}", file=sys.stderr, flush=True)


def _ranks(ranks: list[int]) -> str:
    return ", ".join(str(r) for r in ranks)


def run_reported(rank: int, world_size: int, body: Callable[[], None], cleanup: Callable[[], None],
                 layout: Callable[[], Layout | None] = lambda: None) -> int:
    """Run an entry point's `body` once its process group exists: a UsageError (a corpus or checkpoint that cannot be
    used, found on every rank alike) becomes its sentence on rank 0 and exit code 2; any other error names the rank
    that died or hangs (report_failure, with `layout()`: the run's layout once built) and is raised; `cleanup` runs
    either way. Returns the exit code."""
    try:
        body()
    except UsageError as e:
        return report(e, rank)
    except Exception as e:  # a collective failed (a peer died, or hung past --dist-timeout): name it
        if world_size > 1:
            report_failure(rank, e, layout=layout())
        raise
    finally:
        cleanup()
    return 0
