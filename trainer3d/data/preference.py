"""Preference pairs for DPO (`--data-format preference`): rows of `prompt`, `chosen` and `rejected`, each a string or
a list of {role, content} messages (TRL's standard and conversational shapes), as two rows each: prompt + chosen and
prompt + rejected, the loss on the completion's targets only.

Tokenized as TRL's DPOTrainer does, so that the same pairs give the same tokens: a conversational prompt is rendered
by the chat template with the generation prompt and each side as prompt + completion without it; plain text is the
tokenizer's (special tokens included) of the prompt and of prompt + completion + eos; the completion is what follows
the longest common prefix of the prompt's tokens and both sides'.
A pair whose longer side is past `seq_len + 1` tokens is truncated as TRL's `truncation_mode` says (`overlong`
truncate; keep_start by default, as TRL) or is dropped. A pair missing a side, with identical completions, or with an empty completion is
dropped and counted (`on_bad_row` drop) or stops the run (error).

The pairs sit as rows 2i (chosen) and 2i + 1 (rejected) of a LabeledRows, and `PairRows` indexes pairs: the loader
shuffles, shards over dp and batches whole pairs, so a pair never splits across ranks or micro-batches (an even number
of rows per micro-batch). Padding-free (`--dpo-padding-free`, TRL's padding_free): a row holds several pairs, each
pair's chosen and rejected sequences adjacent documents 2j and 2j + 1 of it (packed best-fit decreasing by the
pair's tokens, data/packing.py), the rest of the row padding in a document of its own; the loader batches rows, and a pair longer than
a row is dropped and counted. Small sets: rendered in memory on each rank, no cache.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from trainer3d.data.batch import LabeledRows
from trainer3d.data.cache import default_cache_dir
from trainer3d.data.packing import best_fit_decreasing
from trainer3d.data.sources import DataConfig, _resolve_source
from trainer3d.data.tokenizer import load_tokenizer
from trainer3d.errors import DataError

SIDES = ("prompt", "chosen", "rejected")


class BadPair(Exception):
    pass


class PairRows(LabeledRows):
    """A LabeledRows of 2n rows (chosen, rejected, chosen, ...) indexed by pair: pairs[idx] is the LabeledRows of the
    rows of those pairs, each pair's two rows adjacent. `reference`: each row's reference log-probability (summed
    over its completion), set once the reference model has scored them (train/dpo.py)."""

    def __init__(self, tokens, flags, lengths, stats: dict, vocab_size: int, eos_id: int | None,
                 documents: np.ndarray | None = None):
        super().__init__(tokens, flags, np.zeros_like(tokens) if documents is None else documents, lengths)
        self.stats, self.vocab_size, self.eos_id = stats, vocab_size, eos_id
        self.packed = documents is not None  # padding-free: items are rows of several pairs (the module docstring)
        self.shape = (len(self), tokens.shape[1])

    def __len__(self) -> int:
        return len(self.tokens) if self.packed else len(self.tokens) // 2

    def rows_of(self, index):
        if self.packed:
            return index
        pairs = np.atleast_1d(np.arange(len(self))[index])
        return np.stack([2 * pairs, 2 * pairs + 1], axis=1).reshape(-1)


def _messages(x) -> bool:
    return isinstance(x, list) and all(isinstance(m, dict) and "role" in m for m in x)


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def encode_pair(tok, row: dict) -> tuple[list[int], list[int], list[int]]:
    """(prompt ids, chosen ids, rejected ids) of one row, as TRL's DPOTrainer tokenizes it: the prompt and both whole
    sequences tokenized, the prompt cut to its longest common prefix with both, each completion what follows it.
    Raises BadPair."""
    missing = [k for k in SIDES if not row.get(k)]
    if missing:
        raise BadPair(f"it has no {missing[0]!r}")
    prompt, chosen, rejected = (row[k] for k in SIDES)
    if chosen == rejected:
        raise BadPair("its chosen and rejected completions are identical")
    if _messages(prompt):
        if not (_messages(chosen) and _messages(rejected)):
            raise BadPair("its prompt is a list of messages and a completion is not")
        render = lambda messages, **kw: tok(tok.apply_chat_template(messages, tokenize=False, **kw),  # noqa: E731
                                            add_special_tokens=False)["input_ids"]
        head = render(prompt, add_generation_prompt=True)
        sides = [render(prompt + chosen), render(prompt + rejected)]
    elif all(isinstance(x, str) for x in (prompt, chosen, rejected)):
        eos = tok.eos_token or ""
        ends = lambda text: text if text.endswith(eos) else text + eos  # noqa: E731
        head = tok(prompt)["input_ids"]
        sides = [tok(prompt + ends(chosen))["input_ids"], tok(prompt + ends(rejected))["input_ids"]]
    else:
        raise BadPair("its prompt, chosen and rejected are neither all strings nor all lists of messages")
    cut = min(_common_prefix(head, side) for side in sides)
    completions = [side[cut:] for side in sides]
    if not all(completions):
        raise BadPair("a completion renders to no token")
    return head[:cut], completions[0], completions[1]


def fit(prompt: list[int], completions: list[list[int]], limit: int, overlong: str,
        mode: str) -> list[tuple[list[int], int]] | None:
    """Each side as (its tokens, where its completion starts), within `limit` tokens (None: drop the pair). Under
    --overlong truncate, as TRL's collator cuts each side: keep_start its first `limit` tokens (a prompt that fills
    them leaves no completion: dropped, as TRL drops it), keep_end its last ones; keep_completions cuts the prompt's
    head alike for both sides and keeps the completions whole."""
    sides = [(prompt + c, len(prompt)) for c in completions]
    over = len(prompt) + max(len(c) for c in completions) - limit
    if over <= 0:
        return sides
    if overlong == "drop":
        return None
    if mode == "keep_start":
        return None if len(prompt) >= limit else [(ids[:limit], start) for ids, start in sides]
    if mode == "keep_end":
        return [(ids[-limit:], max(0, start - (len(ids) - limit))) if len(ids) > limit else (ids, start)
                for ids, start in sides]
    if over >= len(prompt):
        return None
    return [(prompt[over:] + c, len(prompt) - over) for c in completions]


def build_pairs(cfg: DataConfig, seq_len: int, padding_free: bool = False) -> PairRows:
    """Every usable pair of the corpus as two rows of seq_len + 1 tokens, padded with the eos (in no loss); or,
    `padding_free`, packed several pairs a row."""
    tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    if cfg.chat_template:
        from trainer3d.data.chat import read_template

        tok.chat_template = read_template(cfg.chat_template)
    src = _resolve_source(cfg, Path(cfg.cache_dir or default_cache_dir()) / "hf")
    rows = src.load()
    width, pad = seq_len + 1, tok.eos_token_id if tok.eos_token_id is not None else 0
    tokens, flags, lengths, sequences = [], [], [], []  # (sequences: each pair's two (ids, start), padding-free)
    bad, overlong, examples = 0, 0, []
    for i, row in enumerate(rows):
        try:
            prompt, chosen, rejected = encode_pair(tok, row)
        except BadPair as e:
            if cfg.on_bad_row == "error":
                raise DataError(f"Row {i} of {src.name} cannot be trained on: {e}; fix it or pass --on-bad-row drop.")
            bad += 1
            examples.append((i, str(e)))
            continue
        sides = fit(prompt, [chosen, rejected], width, cfg.overlong, cfg.truncation_mode)
        if sides is None or (padding_free and sum(len(ids) for ids, _ in sides) > width):
            overlong += 1
            continue
        if padding_free:
            sequences.append(sides)
            continue
        for ids, start in sides:
            t = np.full(width, pad, dtype=np.int64)
            t[:len(ids)] = ids
            f = np.zeros(width, dtype=np.uint8)
            f[start:len(ids)] = 1  # flags[k]: token k is a supervised target
            tokens.append(t)
            flags.append(f)
            lengths.append(len(ids))
    stats = {"pairs": len(sequences) if padding_free else len(tokens) // 2, "bad": bad, "overlong": overlong,
             "overlong_rule": cfg.overlong, "bad_examples": examples[:3], "corpus": src.name}
    if not stats["pairs"]:
        raise DataError(f"{src.name} has no usable preference pair ({bad} bad, {overlong} longer than --seq-len "
                        f"{seq_len} + 1 tokens); each row needs 'prompt', 'chosen' and 'rejected'.")
    if padding_free:
        return packed_pairs(sequences, width, pad, stats, len(tok), tok.eos_token_id)
    return PairRows(np.stack(tokens), np.stack(flags), np.asarray(lengths, dtype=np.int64), stats, len(tok),
                    tok.eos_token_id)


def packed_pairs(sequences: list, width: int, pad: int, stats: dict, vocab_size: int, eos_id: int | None) -> PairRows:
    """Pairs (each its two sides' (ids, completion start)) packed best-fit decreasing by their tokens into rows of
    `width` (data/packing.py, as SFT's conversations): pair j of a row its documents 2j (chosen) and 2j + 1
    (rejected), the padding after them the next one."""
    rows = best_fit_decreasing(np.asarray([sum(len(ids) for ids, _ in pair) for pair in sequences]), width)
    tokens = np.full((len(rows), width), pad, dtype=np.int64)
    flags = np.zeros((len(rows), width), dtype=np.uint8)
    documents = np.zeros((len(rows), width), dtype=np.int64)
    lengths = np.zeros(len(rows), dtype=np.int64)  # each row's tokens before its padding
    for r, members in enumerate(rows):
        at, doc = 0, 0
        for i in members:
            for ids, start in sequences[i]:
                tokens[r, at:at + len(ids)] = ids
                flags[r, at + start:at + len(ids)] = 1
                documents[r, at:at + len(ids)] = doc
                at, doc = at + len(ids), doc + 1
        documents[r, at:], lengths[r] = doc, at  # the padding: a document of its own
    return PairRows(tokens, flags, lengths, {**stats, "rows": len(rows)}, vocab_size, eos_id, documents=documents)


def describe(stats: dict) -> str:
    """The run's line about its pairs."""
    line = f"preference pairs: {stats['pairs']} from {stats['corpus']}"
    if stats["bad"]:
        named = "; ".join(f"row {i}: {why}" for i, why in stats["bad_examples"])
        line += f"; {stats['bad']} dropped ({named})"
    if stats["overlong"]:
        line += f"; {stats['overlong']} longer than a row dropped"
    if "rows" in stats:
        line += f"; padding-free: {stats['rows']} rows of several pairs"
    return line
