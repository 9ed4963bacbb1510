"""What a run keeps in its --out-dir, named once: metrics.jsonl, checkpoints/ and profile/; and the two questions a new
run asks of that directory before it writes anything: whether an earlier run is there (train/setup.py refuses to mix
with one) and, under --overwrite, removing it."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

METRICS = "metrics.jsonl"  # one JSON object per step (train/metrics.py)
CHECKPOINTS = "checkpoints"  # step_* directories and `latest` (checkpoint/)
PROFILE = "profile"  # torch.profiler traces (train/profiling.py)


def earlier_run(out_dir: str | os.PathLike) -> list[str]:
    """What an earlier run left in `out_dir`: its metrics.jsonl (with records) and its checkpoints (a step_* directory
    with its meta.json)."""
    out = Path(out_dir).expanduser()
    found = [METRICS] if (out / METRICS).is_file() and (out / METRICS).stat().st_size else []
    root = out / CHECKPOINTS
    if root.is_dir() and any(d.name.startswith("step_") and (d / "meta.json").is_file() for d in root.iterdir()):
        found.append(CHECKPOINTS)
    return found


def clear_run(out_dir: str | os.PathLike) -> None:
    """--overwrite: remove an earlier run's metrics, checkpoints and profiles from `out_dir` (nothing else there)."""
    out = Path(out_dir).expanduser()
    (out / METRICS).unlink(missing_ok=True)
    for name in (CHECKPOINTS, PROFILE):
        shutil.rmtree(out / name, ignore_errors=True)
