"""HellaSwag (Zellers et al. 2019) scored the way llm.c scores it: each ending is judged by the model's loss on its own
tokens given the context, and the ending with the lowest loss is the model's pick.

The file is the official jsonl (`hellaswag_val.jsonl`, 10042 examples): one JSON object a line with `ctx` (text),
`endings` (a list of texts, four in the official file) and `label` (the right ending's index). Every line is checked
when the file is read, and a bad one fails with its line number. Nothing here downloads anything or touches
torch.distributed: train/downstream.py runs the rows through the parallel model.

A row is one (example, ending): the context's tokens, then the ending's (tokenized as " " + ending, as llm.c does),
left-truncated to seq_len + 1 tokens (the context loses its start; at least one context token is kept if the ending
fits), padded after the ending. Only the ending's tokens are scored, so padding never matters: attention is causal.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Sequence

import numpy as np
import torch

from trainer3d.errors import DataError, first_line

IGNORE = -1  # a target position that is not scored (the context, the padding)
FORMAT = ('every line must be a JSON object with "ctx" (text), "endings" (a list of texts) and "label" (the right '
          "ending's index)")


@dataclass(frozen=True)
class Example:
    ctx: str
    endings: tuple[str, ...]
    label: int


def _problem(obj) -> str | None:
    """What is wrong with one parsed line, or None."""
    if not isinstance(obj, dict):
        return f"is a JSON {type(obj).__name__}, not an object"
    for key in ("ctx", "endings", "label"):
        if key not in obj:
            return f"has no {key!r}"
    if not isinstance(obj["ctx"], str) or not obj["ctx"]:  # the first ending token needs something to follow
        return "has a 'ctx' that is not a non-empty text"
    endings = obj["endings"]  # an empty ending is still " ", one token
    if not isinstance(endings, list) or len(endings) < 2 or not all(isinstance(e, str) for e in endings):
        return "has 'endings' that are not a list of at least 2 texts"
    label = obj["label"]
    if isinstance(label, bool) or not isinstance(label, int) or not 0 <= label < len(endings):
        return f"has a 'label' of {label!r}, not an index into its {len(endings)} endings"
    return None


def read_examples(path: str | Path, limit: int | None = None) -> list[Example]:
    """Every example of a HellaSwag jsonl (blank lines skipped), checked line by line; the first `limit` if given."""
    p = Path(path).expanduser()
    if not p.is_file():
        what = "is a directory" if p.is_dir() else "does not exist"
        raise DataError(f"HellaSwag file {path} {what}; pass a jsonl file such as hellaswag_val.jsonl.")
    examples = []
    try:
        with open(p, encoding="utf-8") as f:
            for number, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                try:
                    obj = json.loads(line)
                except ValueError as e:
                    problem = f"is not valid JSON ({first_line(e)})"
                else:
                    problem = _problem(obj)
                if problem:
                    raise DataError(f"HellaSwag file {path}, line {number} {problem}; {FORMAT}.")
                examples.append(Example(obj["ctx"], tuple(obj["endings"]), obj["label"]))
    except UnicodeDecodeError as e:
        raise DataError(f"HellaSwag file {path} is not UTF-8 text ({first_line(e)}); pass the jsonl file.") from None
    except OSError as e:
        raise DataError(f"HellaSwag file {path} cannot be read ({first_line(e)}).") from None
    if not examples:
        raise DataError(f"HellaSwag file {path} holds no examples; {FORMAT}.")
    if limit is not None and limit > len(examples):
        raise DataError(
            f"--hellaswag-examples {limit} exceeds the {len(examples)} examples in {path}; pass at most "
            f"{len(examples)}, or omit it to use them all."
        )
    return examples[:limit]


@dataclass
class ScoringRows:
    """One row per (example, ending), example after example."""

    tokens: list[np.ndarray]  # per row: context + ending ids, at most seq_len + 1 of them
    ending_start: np.ndarray  # per row: index in `tokens` of the ending's first (kept) token
    first_row: np.ndarray  # per example: its first row; one more entry at the end (the row count)
    labels: np.ndarray  # per example
    seq_len: int

    def __len__(self) -> int:
        return len(self.tokens)

    def batch(self, rows: Sequence[int], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets), each [len(rows), seq_len]: targets hold the next token where it belongs to the
        ending and IGNORE elsewhere. A row index past the last row gives a padding row (nothing scored)."""
        inputs = torch.full((len(rows), self.seq_len), pad_id, dtype=torch.long)
        targets = torch.full((len(rows), self.seq_len), IGNORE, dtype=torch.long)
        for i, r in enumerate(rows):
            if r >= len(self.tokens):
                continue
            toks = torch.from_numpy(self.tokens[r])
            n, start = len(toks), max(int(self.ending_start[r]), 1)  # the row's first token has no prediction
            inputs[i, : n - 1] = toks[:-1]
            targets[i, start - 1 : n - 1] = toks[start:]
        return inputs, targets


def encode_rows(
    examples: Sequence[Example], encode: Callable[[list[str]], list[list[int]]], seq_len: int, vocab_size: int
) -> ScoringRows:
    """Tokenize every context and every " " + ending (`encode`: texts -> id lists, in one batch) into rows."""
    contexts = encode([e.ctx for e in examples])
    endings = encode([" " + text for e in examples for text in e.endings])
    tokens, starts, first_row = [], [], [0]
    k = 0
    for ex, ctx in zip(examples, contexts):
        for _ in ex.endings:
            ending = endings[k]
            k += 1
            row = list(ctx) + list(ending)
            cut = max(0, len(row) - (seq_len + 1))
            tokens.append(np.asarray(row[cut:], dtype=np.int64))
            starts.append(max(0, len(ctx) - cut))
        first_row.append(len(tokens))
    highest = max(int(t.max()) for t in tokens)
    if highest >= vocab_size:
        raise DataError(
            f"The tokenizer gives HellaSwag token id {highest}, outside the model's vocabulary of {vocab_size}; "
            "evaluate with the tokenizer the model was trained with."
        )
    return ScoringRows(tokens, np.asarray(starts), np.asarray(first_row), np.asarray([e.label for e in examples]),
                       seq_len)


@dataclass
class HellaSwagResult:
    """Per-ending losses of every example and the two accuracies llm.c reports."""

    loss_sum: list[list[float]]  # per example, per ending: summed loss of the ending's tokens
    loss_mean: list[list[float]]  # ... and its mean per token
    picks: list[int]  # lowest mean loss (llm.c's acc_norm, its headline number)
    picks_sum: list[int]  # lowest summed loss (llm.c's acc)
    labels: list[int]

    @property
    def acc(self) -> float:
        return sum(p == y for p, y in zip(self.picks, self.labels)) / len(self.labels)

    @property
    def acc_sum(self) -> float:
        return sum(p == y for p, y in zip(self.picks_sum, self.labels)) / len(self.labels)

    def metrics(self) -> dict:
        """What metrics.jsonl and W&B get: `hellaswag_acc` by mean loss, `hellaswag_acc_sum` by summed loss."""
        return {"hellaswag_acc": self.acc, "hellaswag_acc_sum": self.acc_sum}


def score(rows: ScoringRows, loss_sum: np.ndarray, count: np.ndarray) -> HellaSwagResult:
    """Picks from each row's summed loss and scored-token count (ties go to the first ending)."""
    sums, means, picks, picks_sum = [], [], [], []
    for a, b in zip(rows.first_row[:-1], rows.first_row[1:]):
        s = np.asarray(loss_sum[a:b], dtype=np.float64)
        m = s / np.maximum(np.asarray(count[a:b], dtype=np.float64), 1.0)
        sums.append(s.tolist())
        means.append(m.tolist())
        picks.append(int(np.argmin(m)))
        picks_sum.append(int(np.argmin(s)))
    return HellaSwagResult(sums, means, picks, picks_sum, rows.labels.tolist())
