"""Where a suite run's wall time went, from the file TRAINER3D_TEST_TIMELINE names (tests/conftest.py writes each
test's start and end per worker, and the CPU seconds it used): each test file's span and worker, the files that used
the most CPU (on a machine the suite keeps busy, the time to cut), the files that ran last, and how long each worker
sat idle before the run ended (a long file started late leaves the other core waiting).

    TRAINER3D_TEST_TIMELINE=/tmp/timeline.txt python -m pytest && python tests/helpers/timeline.py /tmp/timeline.txt
"""

from __future__ import annotations

import sys
from collections import defaultdict


def spans(path: str) -> dict[tuple[str, str], list[float]]:
    """(worker, test file) -> [first start, last end]."""
    out: dict[tuple[str, str], list[float]] = {}
    with open(path) as f:
        for line in f:
            t, worker, _event, nodeid = line.split(maxsplit=3)
            key = (worker, nodeid.split("::")[0])
            span = out.setdefault(key, [float(t), float(t)])
            span[0], span[1] = min(span[0], float(t)), max(span[1], float(t))
    return out


def cpu_seconds(path: str) -> dict[str, float]:
    """Test file -> the CPU seconds its tests used (the end events' cpu= field)."""
    out: dict[str, float] = defaultdict(float)
    with open(path) as f:
        for line in f:
            _t, _worker, event, nodeid = line.split(maxsplit=3)
            if event.startswith("end,cpu="):
                out[nodeid.split("::")[0]] += float(event.split("=", 1)[1])
    return out


def main(path: str, top: int = 12) -> None:
    files = spans(path)
    start = min(s for s, _ in files.values())
    end = max(e for _, e in files.values())
    print(f"{len(files)} files, {(end - start) / 60:.1f} min from the first test's start to the last one's end\n")
    print(f"{'file':<40} {'worker':>6} {'start':>7} {'end':>7} {'s':>6}")
    for (worker, name), (s, e) in sorted(files.items(), key=lambda kv: kv[1][1] - kv[1][0], reverse=True)[:top]:
        print(f"{name:<40} {worker:>6} {s - start:7.0f} {e - start:7.0f} {e - s:6.0f}")
    last = defaultdict(float)
    for (worker, _), (_, e) in files.items():
        last[worker] = max(last[worker], e)
    cpu = cpu_seconds(path)
    print(f"\nCPU seconds (the tests' processes and their children): {sum(cpu.values()):.0f} in all; the most:")
    for name, seconds in sorted(cpu.items(), key=lambda kv: kv[1], reverse=True)[:top]:
        print(f"  {name:<40} {seconds:7.0f}")
    print("\nidle at the end: " + ", ".join(f"{w} {end - t:.0f} s" for w, t in sorted(last.items())))
    print("ran last: " + ", ".join(f"{n} ({w}, {e - s:.0f} s)" for (w, n), (s, e)
                                   in sorted(files.items(), key=lambda kv: kv[1][1])[-4:]))


if __name__ == "__main__":
    main(sys.argv[1])
