"""Periodic saves and SLURM's signals in the training loop: SIGTERM / SIGUSR1 (what SLURM sends before preemption or
the time limit) become "finish the current step, agree on stopping, save, exit cleanly"."""

from __future__ import annotations

import signal
import time


from trainer3d.checkpoint.async_save import BackgroundWriter
from trainer3d.checkpoint.save import save_checkpoint, take_snapshot
from trainer3d.errors import CheckpointError


class Checkpointer:
    """Owned by train.run: saves every --save-every steps (and at the end), and turns SIGTERM / SIGUSR1 (what SLURM
    sends before preemption or the time limit) into: finish the current step, agree on stopping (the flag is summed
    over the world inside the step's loss all-reduce: Trainer.train_step(stop_requested=...), so every rank stops at
    the same step without a collective or a host read of its own), save, exit cleanly."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, trainer, loader, out_dir: str, save_every: int = 0, keep_last: int = 0, log: bool = True,
                 on_error: str = "continue", async_save: bool = False):
        self.trainer, self.loader, self.out_dir = trainer, loader, out_dir
        self.save_every, self.keep_last, self.log = save_every, keep_last, log
        self.on_error = on_error  # a failed save (full disk, ...): "continue" training, or "stop" the run
        self.writer = BackgroundWriter(trainer.topo) if async_save else None  # --async-save
        self._started = 0.0  # when the background save in flight began writing
        self.received: int | None = None
        self.last_saved = None  # the path of this run's newest complete checkpoint
        self.stopped_by: str | None = None
        self._previous = {}
        try:
            for s in self.SIGNALS:
                self._previous[s] = signal.signal(s, self._on_signal)
        except ValueError:  # not the main thread: no signal handling
            pass

    def _on_signal(self, signum, frame) -> None:
        self.received = signum

    @property
    def stop_requested(self) -> bool:
        """A signal reached this rank (what it hands to the next Trainer.train_step)."""
        return self.received is not None

    def after_step(self, stop: bool) -> bool:
        """Call after every optimizer step on every rank with the step's agreement on stopping (the record's "stop",
        alike on every rank); True means stop now (a checkpoint has been saved)."""
        t = self.trainer
        last = t.cfg.final_save and t.step >= t.cfg.max_steps
        if (self.save_every > 0 and t.step % self.save_every == 0) or last or stop:
            # in the background only when training goes on: a run that ends next waits for its save anyway
            self._save(background=self.writer is not None and not (stop or last), must_succeed=stop)
        if stop:
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            self.stopped_by = name
            if self.log:
                _write(
                    f"[trainer3d] {name} received: stopped after step {t.step} and saved {self.last_saved}; exiting "
                    "cleanly (continue with --resume)"
                )
        return stop

    def _save(self, background: bool, must_succeed: bool) -> None:
        self._guarded(self.finish, must_succeed)  # the save in flight, if any, completes first
        self._guarded(lambda: self._start_save(background), must_succeed)

    def _start_save(self, background: bool) -> None:
        t0 = time.perf_counter()
        if background:
            self.writer.start(take_snapshot(self.trainer, self.out_dir, self.loader, self.keep_last))
            self._started = time.perf_counter()
            if self.log:
                _write(f"[trainer3d] checkpoint of step {self.trainer.step}: state copied in "
                       f"{self._started - t0:.1f} s, writing in the background")
            return
        self.last_saved = save_checkpoint(self.trainer, self.out_dir, self.loader, self.keep_last)
        if self.log:
            _write(f"[trainer3d] saved checkpoint {self.last_saved} ({time.perf_counter() - t0:.1f} s)")

    def _guarded(self, save, must_succeed: bool) -> None:
        """A failed save raises CheckpointError on every rank alike and leaves the previous checkpoint intact: stop
        the run (a save on a signal, or --on-save-error stop), or warn and train on."""
        try:
            save()
        except CheckpointError as e:
            if must_succeed or self.on_error == "stop":
                raise
            if self.log:
                _write(f"[trainer3d] warning: {e} Training goes on; the next save will try again.")

    def finish(self) -> None:
        """Wait for the background save in flight (--async-save), if any. Raises its CheckpointError."""
        if self.writer is None or not self.writer.busy:
            return
        path = self.writer.wait()
        self.last_saved = path
        if self.log:
            _write(f"[trainer3d] saved checkpoint {path} (in the background, "
                   f"{time.perf_counter() - self._started:.1f} s)")

    def close(self) -> None:
        """After a normal end: wait for the save in flight, then give the signals back."""
        self._guarded(self.finish, must_succeed=False)
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def _write(line: str) -> None:
    """Flushed: a stopping process may be killed by its launcher before the interpreter's exit flushes stdout."""
    import sys

    from tqdm import tqdm

    tqdm.write(line, file=sys.stdout)
    sys.stdout.flush()
