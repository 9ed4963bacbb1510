"""Chat data as rows: every conversation of a corpus (any of data/chat_formats.py's shapes) rendered and masked
(data/chat.py) on all cores, then packed best-fit-decreasing into ``seq_len + 1``-token rows, or one per row
(``pack=False``), and cached like the text blocks (data/cache.py).

In a packed row the documents are the conversations, known from the data and stored beside the tokens (an end-of-text
token inside a conversation splits nothing); training masks attention to each conversation and restarts its positions,
so a packed conversation sees exactly what it would see alone in a row. A conversation's first token is never a
supervised target (in a packed row it would be predicted from the previous conversation). Conversations longer than a
row are truncated (their head kept) or dropped (`overlong`), and counted. A row that cannot be trained on (no mask,
an unknown role, a template error, nothing supervised after truncation) is dropped and counted, the first few named,
or stops the run (`on_bad_row`); data with no supervised token at all is refused.

The cache (tokens, flags and documents, three flat files and a .json written last, each renamed into place) is keyed by
the corpus, the tokenizer and its chat template, the columns, the mask options, the packing and seq_len.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import numpy as np

from trainer3d.data.batch import LabeledRows
from trainer3d.data.cache import (
    FORMAT_VERSION, TokenBlocks, _hash, _n_val, _read_json, build_token_blocks, default_cache_dir,
)
from trainer3d.data.chat import ROLES, TRAIN_ON, BadRow, MaskRule, check_chat_tokenizer, encode, read_template
from trainer3d.data.chat_formats import FORMATS, columns_of, conversation, encode_pair
from trainer3d.data.packing import PARTS, RowWriter, best_fit_decreasing, one_per_row
from trainer3d.data.shards import token_dtype
from trainer3d.data.sources import DataConfig, _resolve_source
from trainer3d.data.tokenizer import _tokenizer_identity, load_tokenizer
from trainer3d.errors import DataError
from trainer3d.fsio import write_text_atomic

log = logging.getLogger(__name__)

OVERLONG = ("truncate", "drop")
BAD_ROW = ("drop", "error")
NAMED = 3  # bad rows named in the chat line


def mask_rule(cfg: DataConfig) -> MaskRule:
    """The supervised targets' rule from the chat options, or one sentence naming the flag."""
    if cfg.train_on not in TRAIN_ON:
        raise DataError(f"--train-on must be one of {', '.join(TRAIN_ON)} (got {cfg.train_on!r}).")
    for name, value, choices in (("overlong", cfg.overlong, OVERLONG), ("on-bad-row", cfg.on_bad_row, BAD_ROW)):
        if value not in choices:
            raise DataError(f"--{name} must be one of {', '.join(choices)} (got {value!r}).")
    roles = tuple(r.strip() for r in (cfg.train_roles or "assistant").split(",") if r.strip())
    if not roles or set(roles) - set(ROLES):
        raise DataError(f"--train-roles {cfg.train_roles!r} names no role or an unknown one; give a comma-separated "
                        f"list of {', '.join(ROLES)}.")
    kwargs: Any = {}
    if cfg.chat_template_kwargs:
        try:
            kwargs = json.loads(cfg.chat_template_kwargs)
        except json.JSONDecodeError as e:
            raise DataError(f"--chat-template-kwargs is not JSON ({e.msg} at character {e.pos}); pass an object such "
                            "as '{\"enable_thinking\": false}'.") from None
        if not isinstance(kwargs, dict):
            raise DataError("--chat-template-kwargs must be a JSON object of the template's variables.")
    return MaskRule(cfg.train_on, tuple(sorted(set(roles))), kwargs)


def chat_tokenizer(cfg: DataConfig):
    """The run's tokenizer with its chat template (--chat-template's file replaces it), checked for chat."""
    tok = load_tokenizer(cfg.tokenizer, cfg.trust_remote_code)
    if cfg.chat_template:
        tok.chat_template = read_template(cfg.chat_template)
    check_chat_tokenizer(tok, cfg.tokenizer or "gpt2 (bundled)")
    return tok


def build_rows(cfg: DataConfig, seq_len: int) -> TokenBlocks:
    """The rows a run trains on (conversations, or text packed into blocks), validation from `val_data` where given
    (every row of it) instead of the tail."""
    build = build_chat_rows if cfg.format in FORMATS else build_token_blocks
    if not cfg.val_data:
        return build(cfg, seq_len)
    train = build(dataclasses.replace(cfg, val_fraction=0.0), seq_len)
    val = build(dataclasses.replace(cfg, data=cfg.val_data, val_data=None, val_fraction=0.0), seq_len)
    stats = {**train.stats, "n_val": len(val.train), "val_data": cfg.val_data}
    return dataclasses.replace(train, val=val.train, fingerprint=_hash([train.fingerprint, val.fingerprint])[:16],
                               stats=stats)


def build_chat_rows(cfg: DataConfig, seq_len: int) -> TokenBlocks:
    """Render, mask and pack (or reuse the cache), then split off the tail rows for validation."""
    t_start = time.perf_counter()
    rule = mask_rule(cfg)
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    tok = chat_tokenizer(cfg)
    src = _resolve_source(cfg, cache / "hf")
    dtype, block = token_dtype(len(tok)), seq_len + 1
    key = _hash({"format": FORMAT_VERSION, "chat": 2, "corpus": src.identity, "tokenizer": _tokenizer_identity(tok),
                 "template": tok.chat_template, "shape": cfg.format, "field": cfg.messages_field,
                 "rule": dataclasses.asdict(rule), "overlong": cfg.overlong, "pack": cfg.pack, "seq_len": seq_len,
                 "dtype": dtype.str})
    folder = cache / "chat" / key[:24]
    folder.mkdir(parents=True, exist_ok=True)
    meta = _read_json(folder / "rows.json")
    cached = bool(meta and meta.get("key") == key and all((folder / f"{p}.bin").exists() for p in (*PARTS, "lengths")))
    if not cached:
        with tempfile.TemporaryDirectory(dir=folder, prefix="encoded-") as scratch:
            encoded = _encode_corpus(src, cfg, tok, rule, Path(scratch))
            meta = {"key": key, "seq_len": seq_len, "tokenizer": cfg.tokenizer or "gpt2 (bundled)",
                    "corpus": src.name, **_write_rows(encoded, folder, block, dtype, cfg, _pad_id(tok), src.name)}
        write_text_atomic(folder / "rows.json", json.dumps(meta, indent=1))
    if cfg.on_bad_row == "error" and meta["bad"]:  # rows cached by a run that dropped them
        raise bad_row_error(*meta["bad_examples"][0], src.name)
    n = int(meta["rows"])
    if n == 0 or meta["supervised"] == 0:
        raise DataError(f"The chat data {src.name} holds no supervised token ({meta['conversations']} conversations, "
                        f"{meta['bad']} dropped as bad rows, {meta['dropped']} as longer than --seq-len + 1); check "
                        "--train-on, --train-roles and --messages-field, or raise --seq-len.")
    parts = [np.memmap(folder / f"{p}.bin", dtype=d, mode="r", shape=(n, block))
             for p, d in zip(PARTS, (dtype, np.uint8, np.uint32))]
    parts.append(np.memmap(folder / "lengths.bin", dtype=np.uint32, mode="r", shape=(n,)))
    n_val = _n_val(dataclasses.replace(cfg, min_val_blocks=0), n) if n > 1 else 0  # no floor: small sets train whole
    stats = {**{k: meta[k] for k in ("corpus", "tokenizer", "conversations", "truncated", "dropped", "bad",
                                     "bad_examples", "supervised", "tokens", "fill")},
             "rows": n, "n_train": n - n_val, "n_val": n_val, "cached": cached,
             "build_seconds": round(time.perf_counter() - t_start, 3)}
    log.info("%s%s", describe(stats), " (from cache)" if cached else "")
    return TokenBlocks(train=LabeledRows(*(p[:n - n_val] for p in parts)),
                       val=LabeledRows(*(p[n - n_val:] for p in parts)), seq_len=seq_len, vocab_size=len(tok),
                       eos_id=int(tok.eos_token_id), fingerprint=_hash({"chat": key, "n_val": n_val})[:16],
                       stats=stats)


def describe(stats: dict) -> str | None:
    """The one line a run prints about its chat rows (None for other data): conversations, rows, what is supervised,
    what was dropped and why."""
    if "conversations" not in stats:
        return None
    named = "; ".join(f"row {r}: {why}" for r, why in stats.get("bad_examples", [])[:NAMED])
    return (f"chat data: {stats['conversations']:,} conversations in {stats['rows']:,} rows ({stats['n_train']:,} "
            f"train, {stats['n_val']:,} val{', from --val-data' if stats.get('val_data') else ''}; "
            f"{stats['fill']:.0%} full), {stats['supervised']:,} of {stats['tokens']:,} tokens supervised, "
            f"{stats['truncated']} truncated and {stats['dropped']} dropped as longer than --seq-len + 1, "
            f"{stats['bad']} dropped as bad rows" + (f" ({named}{', ...' if stats['bad'] > NAMED else ''})"
                                                     if named else ""))


def _pad_id(tok) -> int:
    return int(tok.pad_token_id if tok.pad_token_id is not None else tok.eos_token_id)


class _EncodeChat:
    """Picklable batched function for datasets.map (num_proc > 1 pickles it): each row's ids and flags, or the reason
    it is a bad row."""

    def __init__(self, tok, rule: MaskRule, kind: str, columns: list[str], sharegpt: bool):
        self.tok, self.rule, self.kind, self.columns, self.sharegpt = tok, rule, kind, columns, sharegpt

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        out: dict[str, list] = {"ids": [], "flags": [], "bad": []}
        for i in range(len(batch[self.columns[0]])):
            try:
                conv = conversation({c: batch[c][i] for c in self.columns}, self.kind, self.columns, self.sharegpt)
                ids, flags = encode_pair(self.tok, *conv) if isinstance(conv, tuple) else \
                    encode(self.tok, conv, self.rule)
                bad = ""
            except BadRow as e:
                ids, flags, bad = np.zeros(0, np.int64), np.zeros(0, np.uint8), str(e)
            flags[:1] = 0  # never a target of its own conversation
            out["ids"].append(ids)
            out["flags"].append(flags)
            out["bad"].append(bad)
        return out


def _encode_corpus(src, cfg: DataConfig, tok, rule: MaskRule, scratch: Path):
    """Every row encoded by datasets.map, on up to 8 processes for a large corpus (rendering a conversation costs
    ~1 ms)."""
    import datasets

    rows = src.load()
    kind, columns = columns_of(rows.column_names, cfg.format, cfg.messages_field, src.name)
    rows = rows.select_columns(columns)
    num_proc = cfg.num_proc or (1 if len(rows) < 4_000 else min(8, os.cpu_count() or 1))
    num_proc = max(1, min(num_proc, len(rows)))
    features = datasets.Features({"ids": datasets.List(datasets.Value("int32")),
                                  "flags": datasets.List(datasets.Value("uint8")), "bad": datasets.Value("string")})
    return rows.map(_EncodeChat(tok, rule, kind, columns, cfg.format == "sharegpt"), batched=True, batch_size=64,
                    remove_columns=columns, features=features, cache_file_name=str(scratch / "encoded.arrow"),
                    num_proc=num_proc if num_proc > 1 else None, desc=f"Rendering {src.name}")


def _flat(ds, column: str) -> tuple[np.ndarray, np.ndarray]:
    """(values, offsets) of a list column, without copying it into Python lists."""
    col = ds.data.column(column).combine_chunks()
    return col.values.to_numpy(zero_copy_only=False), col.offsets.to_numpy()


def bad_row_error(row: int, why: str, name: str) -> DataError:
    return DataError(f"Row {row} of the chat data {name}: {why}; fix the row, or pass --on-bad-row drop to leave such "
                     "rows out.")


def _select(encoded, cfg: DataConfig, block: int, name: str) -> tuple[list[tuple[int, int]], dict[str, Any]]:
    """[(conversation, length kept)] of the rows that train, and the counts of those that do not."""
    flags, ids_off = _flat(encoded, "flags")  # the ids' offsets too: a row's flags are as long as its ids
    bad = encoded["bad"]
    counts: dict[str, Any] = {"conversations": len(encoded), "truncated": 0, "dropped": 0, "bad": 0,
                              "bad_examples": []}
    kept = []
    for i in range(len(encoded)):
        a, b = int(ids_off[i]), int(ids_off[i + 1])
        why, length = bad[i], b - a
        if not why and length > block:
            if cfg.overlong == "drop":
                counts["dropped"] += 1
                continue
            counts["truncated"] += 1
            length = block
        if not why and not flags[a:a + length].any():
            why = "it has no supervised token" + (" left after truncation" if length < b - a else "")
        if why:
            if cfg.on_bad_row == "error":
                raise bad_row_error(i, why, name)
            counts["bad"] += 1
            if len(counts["bad_examples"]) < NAMED:
                counts["bad_examples"].append([i, why])
            continue
        kept.append((i, length))
    return kept, counts


def _write_rows(encoded, folder: Path, block: int, dtype: np.dtype, cfg: DataConfig, pad_id: int, name: str
                ) -> dict[str, Any]:
    kept, counts = _select(encoded, cfg, block, name)
    lengths = np.asarray([n for _, n in kept], dtype=np.int64)
    plan = best_fit_decreasing(lengths, block) if cfg.pack else one_per_row(len(kept))
    ids, offsets = _flat(encoded, "ids")
    flags = _flat(encoded, "flags")[0]
    supervised = 0
    with ExitStack() as stack:
        out = RowWriter(folder, block, dtype, pad_id, stack)
        try:
            for row in plan:
                pieces = []
                for j in row:
                    conv, n = kept[j]
                    a = int(offsets[conv])
                    pieces.append((ids[a:a + n], flags[a:a + n]))
                    supervised += int(flags[a:a + n].sum())
                out.write(pieces)
            out.commit()
        except BaseException:
            out.discard()
            raise
    tokens = int(lengths.sum())
    return {**counts, "supervised": supervised, "tokens": tokens, "rows": out.rows,
            "fill": tokens / max(1, out.rows * block)}
