"""Work each node does once, on its local rank 0, before the node's other ranks reuse what it left (the data cache).
The other ranks wait for their leader through the rendezvous store, not in a collective: a collective times out
after --dist-timeout (300 s by default), while tokenizing a large corpus may take hours. A waiting rank prints how
long it has waited (one rank a node), and an error on any rank still reaches every rank, as one sentence, through
one collective once all of them are done."""

from __future__ import annotations

import sys
import time
from typing import Callable, TypeVar

import torch.distributed as dist

from trainer3d.distributed.collectives import agree_on_error, rendezvous_store
from trainer3d.errors import UsageError

T = TypeVar("T")
READY = "trainer3d/leader-first/{}/{}"  # (what, the leader's global rank) -> "ok" or the leader's error


def leader_first(what: str, build: Callable[[], T], rank: int, local_rank: int, poll_s: float = 1.0,
                 report_every_s: float = 60.0) -> T:
    """`build()` on each node's local rank 0, then on the node's other ranks (which find its results); collective
    over the world. A UsageError (a bad corpus, say) on any rank is raised on every rank, with its sentence. `what`
    names the work in the store's keys and in the waiting ranks' messages."""
    store = rendezvous_store()
    key = READY.format(what.replace(" ", "-"), rank - local_rank)  # a node's ranks are contiguous (every launcher)
    result, error = None, None
    if local_rank == 0:
        try:
            result = build()
        except UsageError as e:
            error = e
        if store is not None:
            store.set(key, "ok" if error is None else "failed")
    elif _wait(store, key, what, loud=local_rank == 1, poll_s=poll_s, report_every_s=report_every_s) == "ok":
        try:
            result = build()
        except UsageError as e:
            error = e
    # a leader's error (its peers built nothing) or any other rank's: every rank raises the first one
    agree_on_error(None if error is None else str(error), dist.group.WORLD, type(error) if error else UsageError)
    return result


def _wait(store, key: str, what: str, loud: bool, poll_s: float, report_every_s: float) -> str:
    """Poll the store until the leader has written `key` (no timeout: the leader's failure ends the job anyway)."""
    if store is None:
        return "ok"
    t0 = last = time.monotonic()
    while not store.check([key]):
        time.sleep(poll_s)
        if loud and time.monotonic() - last >= report_every_s:
            last = time.monotonic()
            print(f"[trainer3d] waiting for local rank 0 to {what} ({last - t0:.0f} s so far)", file=sys.stderr,
                  flush=True)
    return store.get(key).decode()
