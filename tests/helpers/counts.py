"""The suite's test counts on each kind of machine, derived from the tests' `needs` markers (tests/conftest.py):
what `python -m pytest` ends with where the conditions hold or not. The README states these numbers and
tests/test_docs.py checks that it does.

    python tests/helpers/counts.py          # a table
    python tests/helpers/counts.py --json   # for test_docs
"""

from __future__ import annotations

import itertools
import json
import sys
from collections import Counter
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
# The machine conditions a skip may depend on, as the README names them: (condition, name when met, name when not).
MACHINES = (("root", "as root", "not as root"), ("libaio", "with libaio-dev", "without libaio-dev"))


class _Collector:
    def __init__(self):
        self.needs: list[tuple[str, ...]] = []

    def pytest_collection_modifyitems(self, items):
        self.needs = [tuple(m.args[0] for m in item.iter_markers("needs")) for item in items]


def collect() -> list[tuple[str, ...]]:
    """Every test's needed conditions (empty: it always runs)."""
    collector = _Collector()
    code = pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", str(ROOT / "tests")], plugins=[collector])
    if code != 0:
        raise SystemExit(f"collection failed ({code})")
    return collector.needs


def counts(needs: list[tuple[str, ...]]) -> dict[str, tuple[int, int]]:
    """'as root, with libaio-dev' -> (passed, skipped), for every combination of MACHINES."""
    tally = Counter(needs)
    out = {}
    for flags in itertools.product((True, False), repeat=len(MACHINES)):
        met = {cond for (cond, _, _), on in zip(MACHINES, flags) if on}
        met |= {"not-root"} if "root" not in met else set()
        skipped = sum(n for conds, n in tally.items() if not set(conds) <= met)
        name = ", ".join(yes if on else no for (_, yes, no), on in zip(MACHINES, flags))
        out[name] = (len(needs) - skipped, skipped)
    return out


def line(passed: int, skipped: int) -> str:
    """As pytest's summary says it."""
    return f"{passed} passed" + (f", {skipped} skipped" if skipped else "")


def main() -> None:
    import contextlib
    import io

    with contextlib.redirect_stdout(io.StringIO()):
        result = counts(collect())
    if "--json" in sys.argv:
        print(json.dumps(result))
        return
    for name, (passed, skipped) in result.items():
        print(f"{name:<40} {line(passed, skipped)}")


if __name__ == "__main__":
    main()
