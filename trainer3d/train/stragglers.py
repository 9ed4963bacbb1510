"""Stragglers: each rank's step time, gathered in the step's loss all-reduce (no collective of its own), and the rank
that stays slower than --straggler-factor × the median for --straggler-intervals logging intervals, named.

What a rank reports is its own work in the step, the part no peer's slowness leaks into: fetching its batch (the
loop's time in loader.next_batch) plus its stages' forward passes. A whole step's wall time would not do: every
collective inside it (DDP's reduction in the last backward, tp's all-reduces, pipeline receives) makes the fast
ranks wait for the slow one, and all of them then show the same time. A forward has no dp or pipeline wait inside
(tp, cp and ep peers do wait for each other there, and ZeRO-3's dp ranks gather parameters there), and the backward costs about twice the forward, so a slow
device, a throttled or shared CPU and a slow input pipeline all show on the rank they happen on. On CPU the clock is
the host's; on CUDA the forwards are timed by CUDA events and reported one step late, when the step's own read has
completed them (reading them earlier would be a device sync).
"""

from __future__ import annotations

import statistics
import time

import torch


class WorkClock:
    """A rank's work in its training step: the data time it is given plus its stage modules' forward passes, timed
    by forward hooks while a training step runs (evaluation and sampling passes are not counted)."""

    def __init__(self, modules, device: torch.device):
        self.cuda = device.type == "cuda"
        self.timing, self.started = False, None
        self.data_s, self.forward_s = 0.0, 0.0
        self.pending: list = []  # CUDA: this step's (start, end) events
        self.done: list = []  # CUDA: the previous step's, complete by now
        for m in modules:
            m.register_forward_pre_hook(self._start)
            m.register_forward_hook(self._stop)

    def _now(self):
        if not self.cuda:
            return time.perf_counter()
        event = torch.cuda.Event(enable_timing=True)
        event.record()
        return event

    def _start(self, module, args) -> None:
        if self.timing:
            self.started = self._now()

    def _stop(self, module, args, out) -> None:
        if not self.timing or self.started is None:
            return
        end = self._now()
        if self.cuda:
            self.pending.append((self.started, end))
        else:
            self.forward_s += end - self.started
        self.started = None

    def begin(self, data_s: float) -> None:
        """A training step starts (its batch took `data_s` seconds to fetch)."""
        self.timing, self.data_s, self.forward_s = True, data_s, 0.0
        if self.cuda:
            self.done, self.pending = self.pending, []

    def seconds(self) -> float:
        """This step's work so far (on CUDA: the forwards of the previous step), when its forwards are all done."""
        self.timing = False
        if self.cuda:
            return self.data_s + sum(a.elapsed_time(b) for a, b in self.done) / 1e3
        return self.data_s + self.forward_s


class StragglerWatch:
    """Per-rank step times summed over a logging interval; at each logged step the interval's min, median and max
    of the ranks' mean step times, and the ranks slower than factor × median for `intervals` intervals running."""

    def __init__(self, factor: float, intervals: int, where=str):
        self.factor, self.intervals, self.where = factor, intervals, where  # where(rank): its coordinates, for a line
        self.sums: list[float] = []
        self.steps = 0
        self.streak: dict[int, int] = {}
        self.named: dict[int, tuple[float, float, float]] = {}  # rank -> (its mean, the median, intervals running)

    def add(self, times: list[float]) -> None:
        if not times:
            return
        self.sums = [a + b for a, b in zip(self.sums, times)] if self.sums else list(times)
        self.steps += 1

    def report(self) -> dict:
        """The interval's step_time_min/median/max (seconds per step) and `stragglers` ({"rank<R>": its time over
        the median}, where any rank has been slow long enough); starts the next interval."""
        if not self.steps:
            return {}
        means = [s / self.steps for s in self.sums]
        median = statistics.median(means)
        self.sums, self.steps = [], 0
        slow = {r for r, t in enumerate(means) if median > 0 and t > self.factor * median}
        self.streak = {r: self.streak.get(r, 0) + 1 for r in slow}
        self.named = {r: (means[r], median, n) for r, n in self.streak.items() if n >= self.intervals}
        out = {"step_time_min": min(means), "step_time_median": median, "step_time_max": max(means)}
        if self.named:
            out["stragglers"] = {f"rank{r}": t / m for r, (t, m, _) in sorted(self.named.items())}
        return out

    def lines(self) -> list[str]:
        """The log's lines for the ranks named at the last report."""
        return [f"straggler: rank {r} ({self.where(r)}) took {t / m:.2f}× the median step time ({t * 1e3:.1f} ms vs "
                f"{m * 1e3:.1f} ms) for {n} consecutive logging intervals" for r, (t, m, n) in sorted(self.named.items())]
