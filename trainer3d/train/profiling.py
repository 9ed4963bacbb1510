"""`--profile-steps A:B`: a torch.profiler trace of optimizer steps A..B (1-based, inclusive) on every rank.

Each rank writes `<out-dir>/profile/rank<R>.pt.trace.json`, a Chrome trace: open it in Perfetto
(https://ui.perfetto.dev) or chrome://tracing, or point TensorBoard's profiler plugin at `<out-dir>/profile`
(it reads `*.pt.trace.json`). Steps are marked with `ProfilerStep#N` ranges.
"""

from __future__ import annotations

import os

import torch

from trainer3d.errors import ConfigError
from trainer3d.rundir import PROFILE


def parse_step_range(spec: str, max_steps: int) -> tuple[int, int]:
    """'A:B' (or 'A' for one step) -> (A, B), checked against 1 <= A <= B <= max_steps."""
    try:
        parts = [int(x) for x in spec.split(":")]
        if len(parts) == 1:
            parts *= 2
        first, last = parts
    except ValueError:
        raise ConfigError(f"--profile-steps {spec!r} is not A:B (two step numbers, e.g. 3:5).") from None
    if not 1 <= first <= last <= max_steps:
        raise ConfigError(
            f"--profile-steps {spec!r} must satisfy 1 <= A <= B <= --max-steps ({max_steps}), e.g. 3:5."
        )
    return first, last


class StepProfiler:
    """Call `start(step)` before and `stop(step)` after each optimizer step (step = the 1-based step number)."""

    def __init__(self, spec: str | None, max_steps: int, out_dir: str, rank: int, device: torch.device):
        self.range = parse_step_range(spec, max_steps) if spec else None
        self.path = os.path.join(out_dir, PROFILE, f"rank{rank}.pt.trace.json")
        self.device = device
        self._prof = None
        self._step_ctx = None

    def start(self, step: int) -> None:
        if self.range is None or not self.range[0] <= step <= self.range[1]:
            return
        if self._prof is None:
            activities = [torch.profiler.ProfilerActivity.CPU]
            if self.device.type == "cuda":
                activities.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=activities, record_shapes=True, profile_memory=True)
            self._prof.__enter__()
        self._step_ctx = torch.profiler.record_function(f"ProfilerStep#{step}")
        self._step_ctx.__enter__()

    def stop(self, step: int) -> None:
        if self._step_ctx is not None:
            self._step_ctx.__exit__(None, None, None)
            self._step_ctx = None
        if self._prof is not None and step >= self.range[1]:
            self.close()

    def close(self) -> None:
        """Write the trace (also called if training stops early)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        os.makedirs(os.path.dirname(self.path), exist_ok=True)
        prof.export_chrome_trace(self.path)
