"""Batches: every optimizer step consumes one *global* batch of ``global_batch`` sequences, drawn in order from
a per-epoch permutation of the training blocks seeded by ``(seed, epoch)`` only. Data-parallel rank ``r`` takes
rows ``[r * per, (r + 1) * per)`` of it, ``per = global_batch // dp_size``. So ranks sharing a dp coordinate get
identical batches, different dp coordinates get disjoint ones, and the union over dp ranks is the same global
batch whatever ``dp_size`` is. The loader never sees the global rank. Its state counts global sequences, so a
checkpoint resumes under any dp size.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

from trainer3d.data.batch import Batch, LabeledRows, input_count, padding, supervised_count, take
from trainer3d.data.cache import TokenBlocks
from trainer3d.errors import DataError

log = logging.getLogger(__name__)


def _check_layout(global_batch: int, dp_rank: int, dp_size: int) -> int:
    if dp_size < 1 or not 0 <= dp_rank < dp_size:
        raise DataError(f"dp_rank {dp_rank} is outside [0, dp_size={dp_size}); pass the data-parallel coordinate.")
    if global_batch < 1 or global_batch % dp_size:
        raise DataError(
            f"The global batch of {global_batch} sequences does not split over {dp_size} data-parallel ranks; "
            f"make it a positive multiple of {dp_size}."
        )
    return global_batch // dp_size


def _as_rows(blocks: TokenBlocks | np.ndarray, part: str) -> tuple[np.ndarray, str]:
    """(rows, fingerprint) from a TokenBlocks (its `part`), LabeledRows, or a bare [N, seq_len + 1] array."""
    if isinstance(blocks, TokenBlocks):
        return getattr(blocks, part), blocks.fingerprint
    if isinstance(blocks, LabeledRows):
        return blocks, _as_rows(blocks.tokens, part)[1]
    rows = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
    if rows.ndim != 2:
        raise DataError(f"Blocks must be a 2-D [n, seq_len + 1] array, not {tuple(rows.shape)}; pass TokenBlocks.")
    sample = rows[[0, -1]].tobytes() if len(rows) else b""
    return rows, hashlib.sha256(repr((rows.shape, rows.dtype.str)).encode() + sample).hexdigest()[:16]


class BatchLoader:
    """Infinite, epoch-shuffled, dp-sharded, resumable iterator over the training blocks.

    ``blocks`` is the TokenBlocks (its ``.train`` is used; its fingerprint guards resumes) or a bare
    ``[n, seq_len + 1]`` array of training blocks.

    ``next_batch()`` returns this dp rank's Batch (data/batch.py) of ``global_batch // dp_size`` rows of
    ``seq_len + 1`` tokens (inputs ``[:, :-1]``, targets ``[:, 1:]``) with the global batch's supervised count. An epoch is ``len(train) // global_batch`` steps (the
    remainder of the permutation is skipped); the next epoch reshuffles with seed ``(seed, epoch)``.
    """

    def __init__(
        self, blocks: TokenBlocks | np.ndarray, global_batch: int, dp_rank: int, dp_size: int, seed: int = 0
    ):
        self.per = _check_layout(global_batch, dp_rank, dp_size)
        self.rows, self.fingerprint = _as_rows(blocks, "train")
        n = len(self.rows)
        if n < global_batch:
            raise DataError(
                f"The training split has {n} blocks of {self.rows.shape[1]} tokens but one global batch needs "
                f"{global_batch}; add data or lower --global-batch or --seq-len."
            )
        self.global_batch, self.dp_rank, self.dp_size = global_batch, dp_rank, dp_size
        self.seed, self.epoch, self.position = int(seed), 0, 0  # position: global sequences into this epoch
        self.inputs_seen = 0  # non-padding input tokens of every global batch so far (metrics' `tokens`)
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(len(self.rows)), epoch
        return self._perm

    def next_batch(self) -> Batch:
        if self.position + self.global_batch > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
        rows = self._permutation(self.epoch)[self.position : self.position + self.global_batch]
        self.position += self.global_batch
        mine = rows[self.dp_rank * self.per : (self.dp_rank + 1) * self.per]
        inputs = input_count(self.rows, rows)
        self.inputs_seen += inputs
        return take(self.rows, mine, supervised_count(self.rows, rows), inputs)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, int | str]:
        """JSON-serializable and independent of dp size (position counts global sequences)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "global_batch": self.global_batch,
            "inputs_seen": self.inputs_seen,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(
                f"The checkpoint's data fingerprint {state.get('fingerprint')} differs from this run's "
                f"{self.fingerprint}; resume with the same corpus, tokenizer, --seq-len and --val-fraction."
            )
        position = int(state["position"])
        if not 0 <= position <= len(self.rows):
            raise DataError(f"The checkpoint's data position {position} is out of range; resume a matching checkpoint.")
        if int(state["seed"]) != self.seed:
            log.warning("data seed %s replaced by the checkpoint's seed %s", self.seed, state["seed"])
        self.epoch, self.position, self.seed = int(state["epoch"]), position, int(state["seed"])
        steps = (self.epoch * self.steps_per_epoch * self.global_batch + position) // self.global_batch
        self.inputs_seen = int(state.get("inputs_seen", steps * self.global_batch * (self.rows.shape[1] - 1)))
        self._perm_epoch = -1


def val_batches(
    blocks: TokenBlocks | np.ndarray, global_batch: int, dp_rank: int, dp_size: int, max_batches: int | None = None
) -> Iterator[Batch]:
    """Deterministic pass over the validation blocks in order, in full global batches, sharded like training.

    ``blocks`` is the TokenBlocks (its ``.val`` is used) or a bare ``[n, seq_len + 1]`` array of blocks.

    Yields ``min(len(val) // global_batch, max_batches)`` Batches of ``global_batch // dp_size`` rows (a partial last
    batch is skipped so every batch has the same shape on every rank); a split shorter than one global batch is one
    batch padded with rows in no loss. Errors are raised here, at the call, not at the first ``next()``.
    """
    per = _check_layout(global_batch, dp_rank, dp_size)
    rows, _ = _as_rows(blocks, "val")
    n = len(rows)
    if n == 0:
        raise DataError("The validation split is empty; raise --val-fraction, pass --val-data, or turn validation off "
                        "with --val-fraction 0 --eval-every 0.")
    if n < global_batch:  # a short tail: one pass over what it has, padded with rows in no loss
        return corpus_batches(rows, global_batch, dp_rank, dp_size)[1]
    count = n // global_batch if max_batches is None else min(n // global_batch, max_batches)

    def gen() -> Iterator[Batch]:
        for i in range(count):
            start = i * global_batch + dp_rank * per
            whole = np.arange(i * global_batch, (i + 1) * global_batch)
            yield take(rows, np.arange(start, start + per), supervised_count(rows, whole))

    return gen()


def corpus_batches(rows, global_batch: int, dp_rank: int, dp_size: int) -> tuple[int, Iterator[Batch]]:
    """Every row of `rows` once, in order, in global batches sharded like validation; the last batch is filled with
    rows in no loss, so every rank runs the same passes. (number of passes, the Batches)."""
    per = _check_layout(global_batch, dp_rank, dp_size)
    n = len(rows)
    passes = -(-n // global_batch)

    def gen() -> Iterator[Batch]:
        for i in range(passes):
            whole = np.arange(i * global_batch, min(n, (i + 1) * global_batch))
            mine = np.arange(i * global_batch + dp_rank * per, i * global_batch + (dp_rank + 1) * per)
            real = mine[mine < n]
            yield padding(take(rows, real, supervised_count(rows, whole)), per - len(real))

    return passes, gen()
