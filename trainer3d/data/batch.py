"""What one pass's rows carry to the trainer, and the row stores they are taken from.

A row is ``seq_len + 1`` token ids (inputs ``[:-1]``, targets ``[1:]``). Pre-training rows are a plain
``[n, seq_len + 1]`` array (the cache's blocks, a prepared split's windows): every target is supervised and the
documents of a packed row are found from its end-of-text tokens. Chat rows (data/chat.py) are a `LabeledRows`: beside
the tokens, which targets are supervised and which conversation each token belongs to, both known from the data.

The loss of a step is the sum over its supervised targets divided by their count over the whole global batch
(`Batch.targets`), so it does not depend on packing, accumulation or layout (torchtune #1875's bug avoided): the loader
counts them from each row's count, with no collective.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch


@dataclass
class Batch:
    tokens: torch.Tensor  # [B, seq_len + 1] int64: this dp rank's rows
    supervised: torch.Tensor | None = None  # [B, seq_len] bool: target t is in the loss; None: every target
    documents: torch.Tensor | None = None  # [B, seq_len + 1] int64: the document of each token; None: from end-of-text
    targets: int | None = None  # supervised targets of the whole global batch; None: global rows × seq_len
    inputs: int | None = None  # input tokens of the whole global batch that are not padding; None: rows × seq_len
    lengths: torch.Tensor | None = None  # [B] int64: each row's tokens before its padding; None: no padding
    reference: torch.Tensor | None = None  # [B] float64: DPO's reference log-prob of each row (train/dpo.py)


class LabeledRows:
    """Rows with a supervised flag and a document index per token, indexed like a ``[n, seq_len + 1]`` array.

    ``tokens``, ``flags`` (1 where the token is a supervised target) and ``documents`` are ``[n, seq_len + 1]``
    arrays (memory-mapped from the cache); ``counts[i]`` is the number of supervised targets of row i, ``lengths[i]``
    its tokens before the padding (all of them where not given)."""

    def __init__(self, tokens: np.ndarray, flags: np.ndarray, documents: np.ndarray, lengths: np.ndarray | None = None):
        self.tokens, self.flags, self.documents = tokens, flags, documents
        self.counts = np.asarray(flags[:, 1:].sum(axis=1), dtype=np.int64) if len(flags) else np.zeros(0, np.int64)
        self.lengths = np.full(len(tokens), tokens.shape[1], np.int64) if lengths is None else np.asarray(lengths)
        self.shape = tokens.shape
        self.reference: np.ndarray | None = None  # DPO's reference log-prob of each row (data/preference.py)

    def __len__(self) -> int:
        return len(self.tokens)

    def rows_of(self, index):
        """The rows that `index` names (a PairRows indexes pairs: each pair's two rows)."""
        return index

    def __getitem__(self, index) -> LabeledRows:
        index = self.rows_of(index)
        out = LabeledRows(self.tokens[index], self.flags[index], self.documents[index], self.lengths[index])
        out.reference = None if self.reference is None else self.reference[index]
        return out


def supervised_count(rows, index: np.ndarray) -> int:
    """Supervised targets of rows[index] (every target of a plain row)."""
    if isinstance(rows, LabeledRows):
        return int(rows.counts[rows.rows_of(index)].sum())
    return len(index) * (rows.shape[1] - 1)


def input_count(rows, index: np.ndarray) -> int:
    """Input tokens of rows[index] that are not padding (a row of L tokens feeds min(L, seq_len) inputs): what a step
    trains on, for honest tokens/s."""
    if isinstance(rows, LabeledRows):
        return int(np.minimum(rows.lengths[rows.rows_of(index)], rows.shape[1] - 1).sum())
    return len(index) * (rows.shape[1] - 1)


def take(rows, index: np.ndarray, targets: int | None = None, inputs: int | None = None) -> Batch:
    """The Batch of rows[index]; `targets`, `inputs`: the counts of the global batch it belongs to."""
    if not isinstance(rows, LabeledRows):
        return Batch(torch.from_numpy(np.asarray(rows[index]).astype(np.int64)), targets=targets, inputs=inputs)
    part = rows[index]  # a PairRows (data/preference.py) gives its pairs' rows, each pair's two adjacent
    return Batch(
        tokens=torch.from_numpy(part.tokens.astype(np.int64)),
        supervised=torch.from_numpy(part.flags[:, 1:].astype(bool)),
        documents=torch.from_numpy(part.documents.astype(np.int64)),
        targets=targets,
        inputs=inputs,
        lengths=torch.from_numpy(part.lengths.astype(np.int64)),
        reference=None if part.reference is None else torch.from_numpy(part.reference),
    )


def supervised_mask(batch: Batch) -> torch.Tensor:
    """[B, seq_len] bool: which targets are in the loss (every one of a plain batch)."""
    if batch.supervised is not None:
        return batch.supervised
    return torch.ones(batch.tokens.shape[0], batch.tokens.shape[1] - 1, dtype=torch.bool)


def real_inputs(batch: Batch) -> torch.Tensor | None:
    """[B, seq_len] bool: which input tokens are not padding (a row of L tokens feeds min(L, seq_len) real inputs);
    None where the batch has no padding. What the MoE balance counts (parallel/moe_balance.py)."""
    if batch.lengths is None:
        return None
    return torch.arange(batch.tokens.shape[1] - 1) < batch.lengths.unsqueeze(1)


def document_ids(tokens: torch.Tensor, boundary: int) -> torch.Tensor:
    """[B, T] -> [B, T]: how many documents opened at or before each token (each `boundary` token opens one): a plain
    row's documents, where a packed chat row stores its own."""
    return torch.cumsum(tokens == boundary, dim=1)


def documents_of(batch: Batch, boundary: int) -> torch.Tensor:
    """[B, T] document ids: the batch's stored ones, else those its `boundary` tokens open."""
    return batch.documents if batch.documents is not None else document_ids(batch.tokens, boundary)


def padding(batch: Batch, rows: int) -> Batch:
    """`batch` followed by `rows` rows that are in no loss (the last, partial batch of a whole-corpus pass)."""
    if rows == 0:
        return batch
    T1 = batch.tokens.shape[1]
    supervised = supervised_mask(batch)
    tokens = torch.cat([batch.tokens, batch.tokens.new_zeros(rows, T1)])
    documents = None
    if batch.documents is not None:
        documents = torch.cat([batch.documents, batch.documents.new_zeros(rows, T1)])
    lengths = batch.lengths if batch.lengths is not None else torch.full((batch.tokens.shape[0],), T1)
    return Batch(tokens, torch.cat([supervised, supervised.new_zeros(rows, T1 - 1)]), documents, batch.targets,
                 batch.inputs, torch.cat([lengths, lengths.new_zeros(rows)]))
