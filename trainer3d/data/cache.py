"""The token cache: tokenize a corpus once, pack it into fixed-length blocks, and memory-map them on every
later call and on every other rank.

``datasets.map`` writes the tokens to ``<cache>/data/<key>/tokens*.arrow``, where ``key`` hashes the corpus
identity, the tokenizer and the text field. The token stream (EOS appended after every document) is then packed
into ``seq_len + 1``-token blocks stored as a flat ``uint16`` (``uint32`` above 65,536 tokens: shards.token_dtype) file
``blocks-L<seq_len>.bin`` next to a ``.json`` that is written last and marks the cache entry complete. Both files
are written to temporary names and renamed, so concurrent builders and readers never see a partial file: the
trainer builds on each node's local rank 0 first (one builder per node, and several nodes may share the cache),
then the other ranks call the same function, find the ``.json`` and only memory-map the blocks. Changing
``seq_len`` re-packs without re-tokenizing; changing the corpus, the tokenizer or the text field re-tokenizes.

The last ``val_fraction`` of the blocks (a contiguous tail, as in nanoGPT, so validation text is not
interleaved with training text) is the validation split.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from trainer3d.data.shards import (
    TokenWindows, check_tokenizer, looks_prepared, manifest_fingerprint, open_windows, read_manifest, token_dtype,
)
from trainer3d.data.sources import DataConfig, _no_text, _resolve_source, _select_text, _Source
from trainer3d.data.tokenizer import load_tokenizer, tokenizer_facts, tokenizer_identity
from trainer3d.errors import DataError
from trainer3d.fsio import write_text_atomic

if TYPE_CHECKING:  # heavy imports stay lazy: ranks that hit the cache never import `datasets`
    import datasets
    from transformers import PreTrainedTokenizerBase

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the on-disk layout or packing rule changes


@dataclass
class TokenBlocks:
    train: np.ndarray | TokenWindows  # [n_train, seq_len + 1], uint16 or uint32, memory-mapped
    val: np.ndarray | TokenWindows  # [n_val, seq_len + 1]
    seq_len: int
    vocab_size: int  # len(tokenizer): every id is < vocab_size
    eos_id: int
    fingerprint: str  # corpus + tokenizer + text field + seq_len + train/val split
    stats: dict[str, Any] = field(default_factory=dict)


def check_seq_len(seq_len: int, n_positions: int) -> None:
    """Raise DataError unless 1 <= seq_len <= n_positions (the model's context)."""
    if seq_len < 1:
        raise DataError(f"seq_len must be a positive number of tokens, got {seq_len}; set --seq-len to at least 1.")
    if seq_len > n_positions:
        raise DataError(
            f"seq_len {seq_len} is larger than the model's context of {n_positions} positions; "
            f"set --seq-len to at most {n_positions}."
        )


def default_cache_dir() -> Path:
    return Path(os.environ.get("TRAINER3D_CACHE") or Path.home() / ".cache" / "trainer3d")


class _Encode:
    """Picklable batched tokenization function for datasets.map (num_proc > 1 pickles it)."""

    def __init__(self, tokenizer: PreTrainedTokenizerBase, column: str):
        self.tokenizer = tokenizer
        self.column = column

    def __call__(self, batch: dict[str, list]) -> dict[str, list]:
        texts = [t if isinstance(t, str) else "" for t in batch[self.column]]
        enc = self.tokenizer(texts, add_special_tokens=False, return_attention_mask=False, verbose=False)
        return {"input_ids": enc["input_ids"]}


def _hash(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def _read_json(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, ValueError):
        return None


def _tokenize(
    src: _Source, cfg: DataConfig, tok: PreTrainedTokenizerBase, tok_dir: Path, key: str
) -> tuple[datasets.Dataset, dict[str, Any], bool]:
    """Tokenized dataset (column input_ids), its stats, and whether it was tokenized now (not cached)."""
    import datasets

    info_path = tok_dir / "tokens.json"
    info = _read_json(info_path)
    if info and info.get("key") == key:
        try:
            parts = [datasets.Dataset.from_file(str(tok_dir / f)) for f in info["files"]]
            ds = parts[0] if len(parts) == 1 else datasets.concatenate_datasets(parts)
            return ds, info, False
        except Exception:  # noqa: BLE001 - a file went missing: tokenize again
            log.warning("tokenized cache in %s is incomplete; tokenizing again", tok_dir)

    raw = src.load()
    column = _select_text(raw, src, cfg.text_field)
    raw = raw.select_columns([column])
    num_proc = cfg.num_proc or (1 if len(raw) < 20_000 else min(8, os.cpu_count() or 1))
    num_proc = max(1, min(num_proc, len(raw)))
    n_bytes = raw.data.nbytes
    log.info(
        "tokenizing %s: %d documents, %.1f MB of text, %d process(es)", src.name, len(raw), n_bytes / 1e6, num_proc
    )
    t0 = time.perf_counter()
    ds = raw.map(
        _Encode(tok, column),
        batched=True,
        batch_size=256,
        remove_columns=[column],
        features=datasets.Features({"input_ids": datasets.List(datasets.Value("int32"))}),
        cache_file_name=str(tok_dir / "tokens.arrow"),
        new_fingerprint=key[:32],
        load_from_cache_file=True,
        num_proc=num_proc if num_proc > 1 else None,
        desc=f"Tokenizing {src.name}",
    )
    seconds = time.perf_counter() - t0
    lengths = np.zeros(0, np.int64)
    if len(ds):
        lengths = np.asarray(ds.data.column("input_ids").combine_chunks().value_lengths(), dtype=np.int64)
    n_tokens = int(lengths.sum())
    info = {
        "key": key,
        "files": [os.path.basename(c["filename"]) for c in ds.cache_files],
        "corpus": src.name,
        "n_docs": int((lengths > 0).sum()),
        "n_tokens": n_tokens,
        "text_mb": round(n_bytes / 1e6, 3),
        "tokenize_seconds": round(seconds, 3),
        "tokens_per_second": round(n_tokens / max(seconds, 1e-9)),
        "num_proc": num_proc,
    }
    if n_tokens == 0:
        raise _no_text(src.name, column)
    log.info(
        "tokenized %s tokens from %s documents in %.1fs (%s tokens/s)",
        f"{n_tokens:,}", f"{info['n_docs']:,}", seconds, f"{info['tokens_per_second']:,}",
    )
    write_text_atomic(info_path, json.dumps(info, indent=1))
    return ds, info, True


def _pack(tokens: datasets.Dataset, eos_id: int, block: int, dtype: np.dtype, path: Path) -> int:
    """Write the stream doc0 EOS doc1 EOS ... cut into `block`-token rows (tail dropped); return the row count."""
    limit = np.iinfo(dtype).max
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    written = 0
    try:
        with open(tmp, "wb") as f:
            for table in tokens.with_format("arrow").iter(batch_size=4096):
                col = table.column("input_ids").combine_chunks()
                lengths = np.asarray(col.value_lengths(), dtype=np.int64)
                values = np.asarray(col.flatten(), dtype=np.int64)
                if values.size and (values.max() > limit or values.min() < 0):
                    raise DataError(f"Token ids exceed the {dtype} range; use a tokenizer whose len() covers its ids.")
                ends = np.cumsum(lengths)[lengths > 0]  # EOS after every non-empty document
                eos_pos = ends + np.arange(len(ends))
                out = np.empty(values.size + len(ends), dtype=dtype)
                keep = np.ones(out.size, dtype=bool)
                keep[eos_pos] = False
                out[keep] = values
                out[eos_pos] = eos_id
                f.write(out.tobytes())
                written += out.size
            n_blocks = written // block
            f.truncate(n_blocks * block * dtype.itemsize)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()
    return n_blocks


_CORPUS_STATS = ("corpus", "n_docs", "n_tokens", "text_mb", "tokenize_seconds", "tokens_per_second")


def build_token_blocks(cfg: DataConfig | None, seq_len: int) -> TokenBlocks:
    """Tokenize (or reuse the cache), pack into [N, seq_len + 1] blocks and split off validation; or open the
    shards of a prepared directory (python -m trainer3d.prepare)."""
    cfg = cfg or DataConfig()
    t_start = time.perf_counter()
    if seq_len < 1:
        raise DataError(f"seq_len must be a positive number of tokens, got {seq_len}; set --seq-len to at least 1.")
    if cfg.data and looks_prepared(cfg.data):
        return open_prepared(cfg, seq_len)
    if not 0.0 <= cfg.val_fraction < 0.5:
        raise DataError(f"val_fraction {cfg.val_fraction} is outside [0, 0.5); set it to e.g. 0.01, or 0 for none.")
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    # loaded once, only if needed
    tokenizer = functools.cache(functools.partial(load_tokenizer, cfg.tokenizer, cfg.trust_remote_code))
    identity, eos_id, vocab_size = tokenizer_facts(cfg.tokenizer, tokenizer)
    dtype = token_dtype(vocab_size)
    src = _resolve_source(cfg, cache / "hf")
    tok_key = _hash({
        "format": FORMAT_VERSION,
        "corpus": src.identity,
        "tokenizer": identity,
        "text_field": src.fixed_field or cfg.text_field,
    })
    blocks_key = _hash({"tokens": tok_key, "seq_len": seq_len, "dtype": dtype.str, "eos": eos_id})
    tok_dir = cache / "data" / tok_key[:24]
    tok_dir.mkdir(parents=True, exist_ok=True)
    meta_path, bin_path = tok_dir / f"blocks-L{seq_len}.json", tok_dir / f"blocks-L{seq_len}.bin"
    block = seq_len + 1

    meta = _read_json(meta_path)
    cached = bool(
        meta
        and meta.get("key") == blocks_key
        and bin_path.exists()
        and bin_path.stat().st_size == meta["n_blocks"] * block * dtype.itemsize
    )
    retokenized = False
    if not cached:
        tokens, info, retokenized = _tokenize(src, cfg, tokenizer(), tok_dir, tok_key)
        n_blocks = _pack(tokens, eos_id, block, dtype, bin_path)
        meta = {
            "key": blocks_key,
            "format": FORMAT_VERSION,
            "seq_len": seq_len,
            "dtype": dtype.str,
            "n_blocks": n_blocks,
            "vocab_size": vocab_size,
            "eos_id": eos_id,
            "tokenizer": cfg.tokenizer or "gpt2 (bundled)",
            **{k: info[k] for k in _CORPUS_STATS},
        }
        write_text_atomic(meta_path, json.dumps(meta, indent=1))
    assert meta is not None
    n_blocks = int(meta["n_blocks"])
    if n_blocks == 0:
        raise DataError(
            f"The corpus {src.name} has {meta['n_tokens']} tokens, fewer than one block of seq_len + 1 = {block}; "
            "add data or lower --seq-len."
        )
    n_val = _n_val(cfg, n_blocks)
    n_train = n_blocks - n_val
    mm = np.memmap(bin_path, dtype=dtype, mode="r", shape=(n_blocks, block))
    stats = {
        **{k: meta[k] for k in ("tokenizer", *_CORPUS_STATS)},
        "seq_len": seq_len,
        "n_blocks": n_blocks,
        "n_train": n_train,
        "n_val": n_val,
        "dtype": dtype.name,
        "cached": cached,  # blocks memory-mapped from the cache
        "tokenized": retokenized,  # the tokenizer ran in this call
        "build_seconds": round(time.perf_counter() - t_start, 3),
        "cache_path": str(bin_path),
    }
    log.info(
        "data: %s blocks of %d tokens (%d train, %d val)%s",
        f"{n_blocks:,}", block, n_train, n_val, " from cache" if cached else "",
    )
    return TokenBlocks(
        train=mm[:n_train],
        val=mm[n_train:],
        seq_len=seq_len,
        vocab_size=vocab_size,
        eos_id=eos_id,
        fingerprint=_hash({"blocks": blocks_key, "n_val": n_val})[:16],
        stats=stats,
    )


def _n_val(cfg: DataConfig, n_blocks: int) -> int:
    """Tail blocks held out: val_fraction of the corpus, at least min(min_val_blocks, 10%), at least 1, < all."""
    if cfg.val_fraction == 0:
        return 0
    n = max(round(cfg.val_fraction * n_blocks), min(cfg.min_val_blocks, n_blocks // 10), 1)
    return min(n, n_blocks - 1)


def open_prepared(cfg: DataConfig, seq_len: int) -> TokenBlocks:
    """Windows over the shards of a prepared directory: a manifest read, a stat per shard, nothing tokenized."""
    manifest = read_manifest(cfg.data)
    check_tokenizer(manifest, tokenizer_identity(cfg.tokenizer, cfg.trust_remote_code), cfg.tokenizer, cfg.data)
    train, val = (open_windows(cfg.data, manifest, split, seq_len) for split in ("train", "val"))
    if len(train) == 0:
        raise DataError(
            f"The training shards of {cfg.data} hold fewer than seq_len + 1 = {seq_len + 1} tokens; lower --seq-len "
            "or prepare more data."
        )
    tok = manifest["tokenizer"]
    return TokenBlocks(
        train=train,
        val=val,
        seq_len=seq_len,
        vocab_size=int(tok["vocab_size"]),
        eos_id=int(tok["eos_id"]),
        fingerprint=_hash({"shards": manifest_fingerprint(manifest), "seq_len": seq_len})[:16],
        stats={"prepared": str(cfg.data), "n_train": len(train), "n_val": len(val), "seq_len": seq_len,
               "tokens": int(train.starts[-1] + val.starts[-1])},
    )
