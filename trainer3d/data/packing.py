"""Conversations into rows of ``seq_len + 1`` tokens: best-fit decreasing (TRL's "bfd"), or one per row.

Best-fit decreasing takes the conversations longest first (ties in the corpus's order, so the rows are the same on
every rank and every run) and puts each into the fullest row it still fits, opening a row where none does: rows end
99.6% full where filling them in the corpus's order left a quarter of each empty (bench/sft.md, 512 tokens). A
packed row's documents are its conversations, stored beside the tokens; the rest of the row is padding, a document of
its own in no loss.
"""

from __future__ import annotations

import bisect
import os
import uuid
from contextlib import ExitStack
from pathlib import Path

import numpy as np

PARTS = ("tokens", "flags", "documents")  # [rows, block] each; beside them lengths.bin: each row's tokens before padding


def best_fit_decreasing(lengths: np.ndarray, capacity: int) -> list[list[int]]:
    """The conversations of each row (indices into `lengths`, each ≤ capacity)."""
    order = sorted(range(len(lengths)), key=lambda i: (-int(lengths[i]), i))
    rooms: list[tuple[int, int]] = []  # (room left, row), sorted: the fullest row that fits is the first ≥ length
    rows: list[list[int]] = []
    for i in order:
        need = int(lengths[i])
        k = bisect.bisect_left(rooms, (need, -1))
        if k == len(rooms):
            rows.append([i])
            row, room = len(rows) - 1, capacity - need
        else:
            room, row = rooms.pop(k)
            rows[row].append(i)
            room -= need
        if room > 0:
            bisect.insort(rooms, (room, row))
    return rows


def one_per_row(n: int) -> list[list[int]]:
    return [[i] for i in range(n)]


class RowWriter:
    """Rows of the three parts appended to temporary files, renamed into place by `commit` (a reader never sees a
    partial file)."""

    def __init__(self, folder: Path, block: int, dtype: np.dtype, pad_id: int, stack: ExitStack):
        self.block, self.pad_id, self.rows = block, pad_id, 0
        tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = {p: (folder / f"{p}.bin.{tag}", folder / f"{p}.bin") for p in (*PARTS, "lengths")}
        self.files = {p: stack.enter_context(open(tmp, "wb")) for p, (tmp, _) in self.paths.items()}
        self.dtypes = dict(zip(PARTS, (dtype, np.uint8, np.uint32)))

    def write(self, pieces: list[tuple[np.ndarray, np.ndarray]]) -> None:
        """One row holding `pieces` [(ids, flags)] in order, padded."""
        parts = {p: np.zeros(self.block, dtype=d) for p, d in self.dtypes.items()}
        parts["tokens"][:] = self.pad_id
        fill = 0
        for doc, (ids, flags) in enumerate(pieces):
            a, b = fill, fill + len(ids)
            parts["tokens"][a:b], parts["flags"][a:b], parts["documents"][a:b] = ids, flags, doc
            fill = b
        parts["documents"][fill:] = len(pieces)  # the padding: a document of its own
        parts["lengths"] = np.asarray([fill], dtype=np.uint32)
        for p, f in self.files.items():
            f.write(parts[p].tobytes())
        self.rows += 1

    def commit(self) -> None:
        for f in self.files.values():
            f.close()
        for tmp, final in self.paths.values():
            os.replace(tmp, final)

    def discard(self) -> None:
        for tmp, _ in self.paths.values():
            tmp.unlink(missing_ok=True)
