"""Weighted data mixtures (``--data-mixture FILE.json``): several corpora, each drawn at a share of the rows.

The file is a JSON list of ``{"source": ..., "weight": ...}`` objects (optional ``format``, ``text_field``,
``data_config``, ``split``, and for chat sources ``messages_field``, ``train_on``, ``train_roles``); a source is anything
``--data`` takes, and an option it does not give is the run's. Weights are normalized to shares of the rows drawn, not
of tokens or corpus sizes.

The draw uses no random stream (Megatron's BlendedDataset rule): global sample i (counted over the whole run) goes to
the source s with the largest ``share_s * (i + 1) - drawn_s``, ties to the lowest index. Source s's k-th row is row
``k % n_s`` of its epoch ``k // n_s`` permutation, seeded by ``(seed, s, epoch)``: a source that runs out starts a
reshuffled epoch by itself. Everything is a function of the global sample count, so the loader's state (the counts)
does not depend on the dp layout and a checkpoint resumes exactly at any dp size.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import math
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from trainer3d.data.batch import Batch, documents_of, input_count, supervised_count, supervised_mask, take
from trainer3d.data.loader import _as_rows, _check_layout, val_batches
from trainer3d.data.sources import DataConfig, check_data_path
from trainer3d.errors import ConfigError, DataError, UsageError

log = logging.getLogger(__name__)

OPTIONS = ("format", "text_field", "data_config", "split", "messages_field", "train_on", "train_roles")  # DataConfig's
KEYS = ("source", "weight", *OPTIONS)
FORMATS = ("text", "chat", "sharegpt")


@dataclass(frozen=True)
class MixtureSource:
    name: str  # short and unique within the mixture: metrics' data_mix and val_loss/<name>
    source: str  # anything --data takes
    share: float  # of the rows drawn; the shares sum to 1
    format: str = "text"
    text_field: str = "text"
    data_config: str | None = None
    options: tuple[tuple[str, str], ...] = ()  # the entry's own split, messages_field, train_on, train_roles

    def data_config_of(self, run: DataConfig) -> DataConfig:
        """The run's data options with this source's own in their place."""
        return dataclasses.replace(run, data=self.source, data_config=self.data_config, text_field=self.text_field,
                                   format=self.format, **dict(self.options))


def read_mixture(path: str, text_field: str = "text") -> list[MixtureSource]:
    """The sources of a mixture file, every entry checked (one sentence naming the fix for each problem, before any
    process group). `text_field`: the run's --text-field, the default of an entry that names none."""
    where = f"--data-mixture {path}"
    if not Path(path).expanduser().is_file():
        raise ConfigError(f"{where} does not exist; pass a JSON file listing {{\"source\": ..., \"weight\": ...}} objects.")
    try:
        entries = json.loads(Path(path).expanduser().read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{where} is not valid JSON ({str(e).splitlines()[0]}); fix the file.") from None
    if not isinstance(entries, list) or not entries:
        raise ConfigError(f"{where} must hold a non-empty JSON list of {{\"source\": ..., \"weight\": ...}} objects.")
    checked = [_entry(f"{where}, entry {i + 1}", e, text_field) for i, e in enumerate(entries)]
    total = sum(e["weight"] for e in checked)
    names = _names([e["source"] for e in checked])
    own = ("split", "messages_field", "train_on", "train_roles")
    return [MixtureSource(name, e["source"], e["weight"] / total, e.get("format", "text"), e["text_field"],
                          e.get("data_config"), tuple((k, e[k]) for k in own if k in e))
            for name, e in zip(names, checked)]


def _entry(where: str, entry: Any, text_field: str) -> dict:
    """One entry of the file, checked: an object of known keys, a source that can exist, a positive finite weight."""
    if not isinstance(entry, dict):
        raise ConfigError(f"{where} is not an object; write {{\"source\": ..., \"weight\": ...}}.")
    unknown = sorted(set(entry) - set(KEYS))
    if unknown:
        raise ConfigError(f"{where} has an unknown key {unknown[0]!r}; the keys are {', '.join(KEYS)}.")
    for key in ("source", "weight"):
        if key not in entry:
            raise ConfigError(f"{where} has no {key!r}; every entry needs \"source\" and \"weight\".")
    weight = entry["weight"]
    if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not (math.isfinite(weight) and weight > 0):
        raise ConfigError(f"{where} has a weight of {weight!r}; a weight must be a positive finite number.")
    for key in ("source", *OPTIONS[1:]):
        if key in entry and not (isinstance(entry[key], str) and entry[key]):
            raise ConfigError(f"{where} has a {key!r} of {entry[key]!r}; it must be a non-empty string.")
    if entry.get("format", "text") not in FORMATS:
        raise ConfigError(f"{where} has a format of {entry['format']!r}; use one of {', '.join(FORMATS)}.")
    try:
        check_data_path(entry["source"])
    except UsageError as e:
        raise ConfigError(f"{where}: {e}") from None
    return {**entry, "weight": float(weight), "text_field": entry.get("text_field", text_field)}


def _names(sources: list[str]) -> list[str]:
    """Each source's short name (its path's or dataset's last part, without suffix), made unique with -2, -3, ..."""
    out: list[str] = []
    for source in sources:
        stem = Path(source.rstrip("/\\")).stem or "source"
        base = re.sub(r"[^A-Za-z0-9_.-]", "_", stem)
        name, n = base, 1
        while name in out:
            n += 1
            name = f"{base}-{n}"
        out.append(name)
    return out


@dataclass
class MixtureBlocks:
    """The blocks of each source (TokenBlocks, LabeledRows or bare arrays), in the file's order, with its name and
    share; what `MixtureLoader` and `mixture_validation` read."""
    names: list[str]
    shares: list[float]
    parts: list[Any]
    vocab_size: int = 0
    eos_id: int | None = None
    fingerprint: str = field(init=False)

    def __post_init__(self):
        prints = [_as_rows(p, "train")[1] for p in self.parts]
        key = json.dumps([self.names, [round(s, 12) for s in self.shares], prints])
        self.fingerprint = hashlib.sha256(key.encode()).hexdigest()[:16]


def combine(sources: list[MixtureSource], blocks: list) -> MixtureBlocks:
    """The mixture of the sources' built TokenBlocks; they must agree on the end-of-text token (one tokenizer)."""
    eos = {b.eos_id for b in blocks}
    if len(eos) > 1:
        raise DataError(f"The mixture's sources have different end-of-text tokens ({sorted(eos)}); tokenize or "
                        "prepare every source with the run's --tokenizer.")
    return MixtureBlocks([s.name for s in sources], [s.share for s in sources], list(blocks),
                         max(b.vocab_size for b in blocks), eos.pop())


def draw(shares: np.ndarray, drawn: np.ndarray, start: int, n: int) -> np.ndarray:
    """The sources of global samples start .. start + n - 1, given the rows `drawn` from each before `start`: each
    goes to the source furthest below its share (the largest share * (i + 1) - drawn), ties to the lowest index."""
    counts = drawn.astype(np.float64)
    out = np.empty(n, dtype=np.int64)
    for j in range(n):
        s = int(np.argmax(shares * (start + j + 1) - counts))
        out[j] = s
        counts[s] += 1
    return out


class MixtureLoader:
    """BatchLoader's interface over a mixture: every global batch drawn by `draw`, dp rank r taking its rows
    ``[r * per, (r + 1) * per)``; ``Batch.targets`` counts the supervised targets of the whole global batch over every
    source. The state is the rows drawn from each source (a function of the global sample count)."""

    def __init__(self, blocks: MixtureBlocks, global_batch: int, dp_rank: int, dp_size: int, seed: int = 0):
        self.per = _check_layout(global_batch, dp_rank, dp_size)
        self.blocks, self.names = blocks, list(blocks.names)
        self.rows = [_as_rows(p, "train")[0] for p in blocks.parts]
        for name, rows in zip(self.names, self.rows):
            if len(rows) == 0:
                raise DataError(f"The mixture's source {name} has no training blocks; add data or lower --seq-len.")
        self.shares = np.asarray(blocks.shares, dtype=np.float64)
        self.global_batch, self.dp_rank, self.dp_size, self.seed = global_batch, dp_rank, dp_size, int(seed)
        self.fingerprint, self.samples, self.inputs_seen = blocks.fingerprint, 0, 0  # inputs: see BatchLoader
        self.drawn_rows = np.zeros(len(self.rows), dtype=np.int64)
        self._perms: dict[tuple[int, int], np.ndarray] = {}

    @property
    def steps_per_epoch(self) -> int:
        """Steps until the first source runs out (it then starts its next epoch on its own)."""
        return max(1, int(min(len(r) / (s * self.global_batch) for r, s in zip(self.rows, self.shares))))

    def drawn(self) -> dict[str, int]:
        """Rows drawn from each source so far, over the whole global batch (metrics' `data_mix`)."""
        return {name: int(c) for name, c in zip(self.names, self.drawn_rows)}

    def _permutation(self, s: int, epoch: int) -> np.ndarray:
        if (s, epoch) not in self._perms:
            if len(self._perms) > 2 * len(self.rows):  # the epochs in use: at most a few per source
                self._perms.clear()
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, s, epoch]))
            self._perms[(s, epoch)] = rng.permutation(len(self.rows[s]))
        return self._perms[(s, epoch)]

    def _row_index(self, s: int, k: np.ndarray) -> np.ndarray:
        """Rows of source s for its k-th draws: row k % n of the permutation of epoch k // n."""
        n = len(self.rows[s])
        out = np.empty(len(k), dtype=np.int64)
        for epoch in np.unique(k // n):
            at = k // n == epoch
            out[at] = self._permutation(s, int(epoch))[k[at] % n]
        return out

    def next_batch(self) -> Batch:
        src = draw(self.shares, self.drawn_rows, self.samples, self.global_batch)
        index, targets, inputs = np.empty(len(src), dtype=np.int64), 0, 0  # each row's index in its source's rows
        for s in np.unique(src):
            at = src == s  # the source's next draws, in order
            index[at] = self._row_index(int(s), self.drawn_rows[s] + np.arange(int(at.sum())))
            targets += supervised_count(self.rows[s], index[at])
            inputs += input_count(self.rows[s], index[at])
        self.drawn_rows += np.bincount(src, minlength=len(self.rows))
        self.samples += self.global_batch
        self.inputs_seen += int(inputs)
        mine = slice(self.dp_rank * self.per, (self.dp_rank + 1) * self.per)
        return self._assemble(src[mine], index[mine], int(targets), int(inputs))

    def _assemble(self, src: np.ndarray, index: np.ndarray, targets: int, inputs: int) -> Batch:
        """This rank's rows, taken from each source and put back in the global batch's order."""
        sources = [int(s) for s in np.unique(src)]
        parts = [take(self.rows[s], index[src == s], targets, inputs) for s in sources]
        if len(parts) == 1:
            return parts[0]
        order = torch.from_numpy(np.argsort(np.concatenate([np.flatnonzero(src == s) for s in sources]), kind="stable"))
        tokens = torch.cat([p.tokens for p in parts])
        supervised = documents = None
        if any(p.supervised is not None for p in parts):
            supervised = torch.cat([supervised_mask(p) for p in parts])
        if any(p.documents is not None for p in parts):  # a plain row's documents: opened by end-of-text tokens
            eos = -1 if self.blocks.eos_id is None else self.blocks.eos_id
            documents = torch.cat([documents_of(p, eos) for p in parts])
        pick = lambda t: None if t is None else t[order]  # noqa: E731
        return Batch(tokens[order], pick(supervised), pick(documents), targets, inputs)

    def __iter__(self) -> Iterator[Batch]:
        return self

    def __next__(self) -> Batch:
        return self.next_batch()

    def state_dict(self) -> dict[str, Any]:
        """JSON-serializable and independent of dp size: the global samples drawn, and from which source."""
        return {"samples": self.samples, "drawn": self.drawn(), "seed": self.seed, "fingerprint": self.fingerprint,
                "global_batch": self.global_batch, "inputs_seen": self.inputs_seen}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        drawn = state.get("drawn")
        if state.get("fingerprint") != self.fingerprint or not isinstance(drawn, dict) or sorted(drawn) != sorted(self.names):
            raise DataError(
                f"The checkpoint's data {state.get('fingerprint')} is not this run's mixture {self.fingerprint}; "
                "resume with the same --data-mixture file (sources, weights and order), tokenizer and --seq-len.")
        counts = np.asarray([int(drawn[n]) for n in self.names], dtype=np.int64)
        if int(counts.sum()) != int(state["samples"]) or (counts < 0).any():
            raise DataError("The checkpoint's mixture counts do not add up to its samples; resume a matching checkpoint.")
        if int(state["seed"]) != self.seed:
            log.warning("data seed %s replaced by the checkpoint's seed %s", self.seed, state["seed"])
        self.samples, self.drawn_rows, self.seed = int(state["samples"]), counts, int(state["seed"])
        self.inputs_seen = int(state.get("inputs_seen", self.samples * (self.rows[0].shape[1] - 1)))
        self._perms.clear()


class MixtureValidation:
    """Each source's own held-out batches. `record(evaluate)`: its loss as ``val_loss/<name>``, and ``val_loss``, the
    training objective's expectation over the mixture: every source's mean loss weighted by its share of the rows
    times the supervised targets a row of it holds (a chat row supervises fewer tokens than a text row, and weighs
    less in a step's loss, which is a mean over all its supervised targets)."""

    def __init__(self, parts: list[tuple[str, float, Iterator[Batch]]]):
        self.parts = parts

    def record(self, evaluate) -> dict[str, float]:
        losses = {f"val_loss/{name}": evaluate(batches) for name, _, batches in self.parts}
        total = sum(weight for _, weight, _ in self.parts)
        overall = sum(weight * loss for (_, weight, _), loss in zip(self.parts, losses.values())) / total
        return {"val_loss": overall, **losses}


def mixture_validation(blocks: MixtureBlocks, global_batch: int, dp_rank: int, dp_size: int,
                       max_batches: int | None = None) -> MixtureValidation:
    """`val_batches` of every source (each its own validation split), sharded like training, each weighted by its
    share times the supervised targets of its average validation row."""
    parts = []
    for name, share, part in zip(blocks.names, blocks.shares, blocks.parts):
        rows = _as_rows(part, "val")[0]
        per_row = supervised_count(rows, np.arange(len(rows))) / max(1, len(rows))
        try:
            parts.append((name, share * per_row, val_batches(part, global_batch, dp_rank, dp_size, max_batches)))
        except DataError as e:
            raise DataError(f"The mixture's source {name}: {e}") from None
    return MixtureValidation(parts)
