"""Periodic saves and SLURM's signals in the training loop: SIGTERM / SIGUSR1 (what SLURM sends before preemption or
the time limit) become "finish the current step, agree on stopping, save, exit cleanly"."""

from __future__ import annotations

import signal
import time


from trainer3d.checkpoint.save import save_checkpoint
from trainer3d.errors import CheckpointError


class Checkpointer:
    """Owned by train.run: saves every --save-every steps (and at the end), and turns SIGTERM / SIGUSR1 (what SLURM
    sends before preemption or the time limit) into: finish the current step, agree on stopping (the flag is summed
    over the world inside the step's loss all-reduce: Trainer.train_step(stop_requested=...), so every rank stops at
    the same step without a collective or a host read of its own), save, exit cleanly."""

    SIGNALS = (signal.SIGTERM, signal.SIGUSR1)

    def __init__(self, trainer, loader, out_dir: str, save_every: int = 0, keep_last: int = 0, log: bool = True,
                 on_error: str = "continue"):
        self.trainer, self.loader, self.out_dir = trainer, loader, out_dir
        self.save_every, self.keep_last, self.log = save_every, keep_last, log
        self.on_error = on_error  # a failed save (full disk, ...): "continue" training, or "stop" the run
        self.received: int | None = None
        self.last_saved = None  # the path of this run's newest checkpoint
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
        due = (self.save_every > 0 and t.step % self.save_every == 0) or (t.cfg.final_save and t.step >= t.cfg.max_steps)
        if due or stop:
            t0 = time.perf_counter()
            try:
                path = save_checkpoint(t, self.out_dir, self.loader, self.keep_last)
            except CheckpointError as e:  # raised on every rank alike; the previous checkpoint is intact
                if stop or self.on_error == "stop":
                    raise
                if self.log:
                    _write(f"[trainer3d] warning: {e} Training goes on; the next save will try again.")
                return False
            self.last_saved = path
            if self.log:
                _write(f"[trainer3d] saved checkpoint {path} ({time.perf_counter() - t0:.1f} s)")
        if stop:
            name = signal.Signals(self.received).name if self.received else "a peer's signal"
            self.stopped_by = name
            if self.log:
                _write(
                    f"[trainer3d] {name} received: stopped after step {t.step} and saved {path}; exiting cleanly "
                    "(continue with --resume)"
                )
        return stop

    def close(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous = {}


def _write(line: str) -> None:
    from tqdm import tqdm

    tqdm.write(line)
