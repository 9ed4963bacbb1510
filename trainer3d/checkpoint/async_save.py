"""--async-save: a save's files are written while training goes on, as torchtitan and Megatron-LM do. The step only
waits for the snapshot (save.take_snapshot: this rank's share of the state copied to host memory); a background
thread writes the rank's file and then runs the commit (rank 0 verifies, writes meta.json, renames, moves `latest`)
exactly as a synchronous save does, so a crash in the middle still leaves the previous checkpoint and `latest`
intact. The next save, and the end of the run, wait for the one in flight first.

The thread's collectives (gathering the ranks' reports) run on a process group of their own, created once for
this purpose, so they never interleave with the training step's collectives on the trainer's groups.
"""

from __future__ import annotations

import threading
from pathlib import Path

import torch.distributed as dist

from trainer3d.checkpoint.save import Snapshot, write_snapshot


class BackgroundWriter:
    """Writes one snapshot at a time in a background thread. Construct on every rank of the default group alike
    (it creates a process group)."""

    def __init__(self, topo):
        self.rank, self.root0 = topo.rank, topo.global_rank(0, 0, 0)
        self.group = dist.new_group(ranks=topo.ranks, backend="gloo")
        self._thread: threading.Thread | None = None
        self._outcome: Path | BaseException | None = None

    @property
    def busy(self) -> bool:
        return self._thread is not None

    def start(self, snap: Snapshot) -> None:
        if self._thread is not None:
            raise RuntimeError("BackgroundWriter.start while a save is in flight; wait() for it first")

        def work():
            try:
                self._outcome = write_snapshot(snap, self.rank, self.group, self.root0)
            except BaseException as e:  # noqa: BLE001 - handed to wait()
                self._outcome = e

        self._outcome = None
        self._thread = threading.Thread(target=work, name="trainer3d-async-save", daemon=True)
        self._thread.start()

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; its checkpoint's path (None if none was in flight). Raises
        what the save raised (a CheckpointError, alike on every rank)."""
        if self._thread is None:
            return None
        self._thread.join()
        self._thread = None
        outcome, self._outcome = self._outcome, None
        if isinstance(outcome, BaseException):
            raise outcome
        return outcome
