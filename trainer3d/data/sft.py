"""Chat data as rows: every conversation of a corpus rendered and masked (data/chat.py), then packed into
``seq_len + 1``-token rows, or one per row (``pack=False``), padded, and cached like the text blocks (data/cache.py).

In a packed row the documents are the conversations, known from the data and stored beside the tokens (an end-of-text
token inside a conversation splits nothing); training masks attention to each conversation and restarts its positions,
so a packed conversation sees exactly what it would see alone in a row. A conversation's first token is never a
supervised target (in a packed row it would be predicted from the previous conversation). Packing is greedy in the
corpus's order: a conversation that does not fit in the rest of a row opens the next one. Conversations longer than a
row are truncated (their head kept) or dropped (`overlong`), and counted.

The cache (tokens, flags and documents, three flat files and a .json written last, each renamed into place) is keyed by
the corpus, the tokenizer and its chat template, the messages column, the mask and packing options and seq_len.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from trainer3d.data.batch import LabeledRows
from trainer3d.data.cache import (
    FORMAT_VERSION, TokenBlocks, _hash, _n_val, _read_json, build_token_blocks, default_cache_dir,
)
from trainer3d.data.chat import TRAIN_ON, check_chat_tokenizer, check_messages, encode
from trainer3d.data.shards import token_dtype
from trainer3d.data.sources import DataConfig, _resolve_source
from trainer3d.data.tokenizer import _tokenizer_identity, load_tokenizer
from trainer3d.errors import DataError
from trainer3d.fsio import write_text_atomic

log = logging.getLogger(__name__)

OVERLONG = ("truncate", "drop")
PARTS = ("tokens", "flags", "documents")


def check_chat_config(cfg: DataConfig) -> None:
    if cfg.train_on not in TRAIN_ON:
        raise DataError(f"--train-on must be one of {', '.join(TRAIN_ON)} (got {cfg.train_on!r}).")
    if cfg.overlong not in OVERLONG:
        raise DataError(f"--overlong must be one of {', '.join(OVERLONG)} (got {cfg.overlong!r}).")


def build_rows(cfg: DataConfig, seq_len: int) -> TokenBlocks:
    """The rows a run trains on: conversations (format "chat") or text packed into blocks."""
    return build_chat_rows(cfg, seq_len) if cfg.format == "chat" else build_token_blocks(cfg, seq_len)


def build_chat_rows(cfg: DataConfig, seq_len: int) -> TokenBlocks:
    """Render, mask and pack (or reuse the cache), then split off the tail rows for validation."""
    check_chat_config(cfg)
    t_start = time.perf_counter()
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    tok = load_tokenizer(cfg.tokenizer)
    check_chat_tokenizer(tok, cfg.tokenizer or "gpt2 (bundled)")
    src = _resolve_source(cfg, cache / "hf")
    dtype, block = token_dtype(len(tok)), seq_len + 1
    key = _hash({"format": FORMAT_VERSION, "chat": 1, "corpus": src.identity, "tokenizer": _tokenizer_identity(tok),
                 "template": tok.chat_template, "field": cfg.messages_field, "train_on": cfg.train_on,
                 "overlong": cfg.overlong, "pack": cfg.pack, "seq_len": seq_len, "dtype": dtype.str})
    folder = cache / "chat" / key[:24]
    folder.mkdir(parents=True, exist_ok=True)
    meta = _read_json(folder / "rows.json")
    cached = bool(meta and meta.get("key") == key and all((folder / f"{p}.bin").exists() for p in PARTS))
    if not cached:
        meta = {"key": key, "seq_len": seq_len, "tokenizer": cfg.tokenizer or "gpt2 (bundled)", "corpus": src.name,
                **_write_rows(_conversations(src, cfg, tok), folder, block, dtype, cfg, _pad_id(tok))}
        write_text_atomic(folder / "rows.json", json.dumps(meta, indent=1))
    n = int(meta["rows"])
    if n == 0:
        raise DataError(f"The chat data {src.name} gave no rows ({meta['conversations']} conversations, "
                        f"{meta['dropped']} dropped as longer than --seq-len + 1); add data or raise --seq-len.")
    parts = [np.memmap(folder / f"{p}.bin", dtype=d, mode="r", shape=(n, block))
             for p, d in zip(PARTS, (dtype, np.uint8, np.uint32))]
    n_val = _n_val(cfg, n) if n > 1 else 0
    n_train = n - n_val
    stats = {**{k: meta[k] for k in ("corpus", "tokenizer", "conversations", "truncated", "dropped", "supervised",
                                     "tokens")}, "rows": n, "n_train": n_train, "n_val": n_val, "cached": cached,
             "build_seconds": round(time.perf_counter() - t_start, 3)}
    log.info("chat data: %d conversations in %d rows of %d tokens (%d train, %d val); %d truncated, %d dropped%s",
             meta["conversations"], n, block, n_train, n_val, meta["truncated"], meta["dropped"],
             " from cache" if cached else "")
    return TokenBlocks(train=LabeledRows(*(p[:n_train] for p in parts)), val=LabeledRows(*(p[n_train:] for p in parts)),
                       seq_len=seq_len, vocab_size=len(tok), eos_id=int(tok.eos_token_id),
                       fingerprint=_hash({"chat": key, "n_val": n_val})[:16], stats=stats)


def describe(stats: dict) -> str | None:
    """The one line a run prints about its chat rows (None for other data): conversations, rows, what is supervised,
    what did not fit."""
    if "conversations" not in stats:
        return None
    return (f"chat data: {stats['conversations']:,} conversations in {stats['rows']:,} rows ({stats['n_train']:,} "
            f"train, {stats['n_val']:,} val), {stats['supervised']:,} of {stats['tokens']:,} tokens supervised, "
            f"{stats['truncated']} truncated and {stats['dropped']} dropped as longer than --seq-len + 1")


def _pad_id(tok) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


def _conversations(src, cfg: DataConfig, tok):
    """(row number, ids, flags) of every conversation, in the corpus's order."""
    rows = src.load()
    if cfg.messages_field not in rows.column_names:
        raise DataError(f"The chat data {src.name} has no column '{cfg.messages_field}'; set --messages-field to one "
                        f"of: {', '.join(rows.column_names)}.")
    rows = rows.select_columns([cfg.messages_field])
    n = 0
    for batch in rows.iter(batch_size=256):
        for messages in batch[cfg.messages_field]:
            messages = check_messages(messages, n, cfg.messages_field)
            ids, flags = encode(tok, messages, n, cfg.train_on)
            flags[0] = 0  # never a target of its own conversation
            yield n, ids, flags
            n += 1


class _RowWriter:
    """Rows of the three parts appended to temporary files, renamed into place by `commit`."""

    def __init__(self, folder: Path, block: int, dtype: np.dtype, pad_id: int, stack: ExitStack):
        self.block, self.pad_id, self.rows = block, pad_id, 0
        tag = f"tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
        self.paths = {p: (folder / f"{p}.bin.{tag}", folder / f"{p}.bin") for p in PARTS}
        self.files = {p: stack.enter_context(open(tmp, "wb")) for p, (tmp, _) in self.paths.items()}
        self.dtypes = dict(zip(PARTS, (dtype, np.uint8, np.uint32)))
        self._reset()

    def _reset(self) -> None:
        self.parts = {p: np.zeros(self.block, dtype=d) for p, d in self.dtypes.items()}
        self.parts["tokens"][:] = self.pad_id
        self.fill, self.docs = 0, 0

    def room(self) -> int:
        return self.block - self.fill

    def add(self, ids: np.ndarray, flags: np.ndarray) -> None:
        a, b = self.fill, self.fill + len(ids)
        self.parts["tokens"][a:b], self.parts["flags"][a:b], self.parts["documents"][a:b] = ids, flags, self.docs
        self.fill, self.docs = b, self.docs + 1

    def close_row(self) -> None:
        if self.fill == 0:
            return
        self.parts["documents"][self.fill:] = self.docs  # the padding: a document of its own
        for p, f in self.files.items():
            f.write(self.parts[p].tobytes())
        self.rows += 1
        self._reset()

    def commit(self) -> None:
        for f in self.files.values():
            f.close()
        for tmp, final in self.paths.values():
            os.replace(tmp, final)

    def discard(self) -> None:
        for tmp, _ in self.paths.values():
            tmp.unlink(missing_ok=True)


def _write_rows(conversations, folder: Path, block: int, dtype: np.dtype, cfg: DataConfig, pad_id: int
                ) -> dict[str, Any]:
    counts = {"conversations": 0, "truncated": 0, "dropped": 0, "supervised": 0, "tokens": 0}
    with ExitStack() as stack:
        out = _RowWriter(folder, block, dtype, pad_id, stack)
        try:
            for _, ids, flags in conversations:
                counts["conversations"] += 1
                if len(ids) > block:
                    if cfg.overlong == "drop":
                        counts["dropped"] += 1
                        continue
                    ids, flags = ids[:block], flags[:block]
                    counts["truncated"] += 1
                if not cfg.pack or len(ids) > out.room():
                    out.close_row()
                out.add(ids, flags)
                counts["supervised"] += int(flags.sum())
                counts["tokens"] += len(ids)
            out.close_row()
            out.commit()
        except BaseException:
            out.discard()
            raise
    return {**counts, "rows": out.rows}
