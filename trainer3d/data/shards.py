"""Prepared token shards (written by `python -m trainer3d.prepare`): the on-disk format and the reader.

A prepared directory holds ``val_000000.bin, ...`` and ``train_000000.bin, ...``, flat little-endian ``uint16``
token ids (``uint32`` for vocabularies over 65536), every document preceded by EOS as in llm.c, and
``manifest.json``: the shards of each split with their token counts, the tokenizer's identity, the source's
identity and, while a prepare runs, where it stopped. Shards and manifest are written atomically, so a reader
sees whole shards only, and ``complete`` tells a finished prepare from an interrupted one.

Training draws ``seq_len + 1``-token windows at a stride of ``seq_len`` (one shared token, as llm.c does) over the
concatenated shards of a split: any --seq-len works on the same shards, and opening them costs one ``stat`` per
shard, not a pass over the corpus.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import numpy as np

from trainer3d.errors import DataError

MANIFEST = "manifest.json"
FORMAT = "trainer3d-shards"
VERSION = 1
SPLITS = ("train", "val")


def shard_name(split: str, index: int) -> str:
    return f"{split}_{index:06d}.bin"


def token_dtype(vocab_size: int) -> np.dtype:
    """THE storage type of token ids, for the data cache and prepared shards alike: uint16 while every id fits
    (GPT-2's 50257), uint32 above 65,536 tokens (Llama 3's 128256)."""
    return np.dtype(np.uint16 if vocab_size <= 65536 else np.uint32)


def looks_prepared(path: str | os.PathLike) -> bool:
    """A directory that is (or was meant to be) a prepare's output: it has a manifest or shard files."""
    p = Path(path).expanduser()
    return p.is_dir() and ((p / MANIFEST).exists() or any(p.glob("train_*.bin")) or any(p.glob("val_*.bin")))


def read_manifest(directory: str | os.PathLike, require_complete: bool = True) -> dict[str, Any]:
    """The manifest of a prepared directory, checked: present, parseable, this format, finished (when
    `require_complete`), and every shard present at its full size. One sentence naming the fix otherwise."""
    d = Path(directory).expanduser()
    path = d / MANIFEST
    rerun = "re-run `python -m trainer3d.prepare` into it (it resumes) or into a new directory"
    if not path.exists():
        raise DataError(f"The prepared directory {d} has shard files but no {MANIFEST}; {rerun}.")
    try:
        manifest = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise DataError(f"{path} is not readable JSON ({e.__class__.__name__}); {rerun}.") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT or manifest.get("version") != VERSION:
        raise DataError(f"{path} is not a {FORMAT} v{VERSION} manifest; {rerun}.")
    try:
        for split in SPLITS:
            for shard in manifest["shards"][split]:
                str(shard["file"]), int(shard["tokens"])
        int(manifest["tokenizer"]["vocab_size"]), int(manifest["tokenizer"]["eos_id"])
    except (KeyError, TypeError, ValueError) as e:
        raise DataError(f"{path} lacks the field {e} or holds a wrong type there; {rerun}.") from None
    if require_complete and not manifest.get("complete"):
        raise DataError(f"The prepare that wrote {d} did not finish; {rerun}.")
    itemsize = np.dtype(manifest["dtype"]).itemsize
    for split in SPLITS:
        for shard in manifest["shards"][split]:
            f = d / shard["file"]
            size = f.stat().st_size if f.exists() else -1
            if size != shard["tokens"] * itemsize:
                found = "is missing" if size < 0 else f"holds {size // itemsize:,} tokens"
                raise DataError(
                    f"Shard {f} {found} but {MANIFEST} says {shard['tokens']:,}; {rerun}."
                )
    return manifest


def check_tokenizer(manifest: dict[str, Any], identity: str, name: str | None, directory: str) -> None:
    """Refuse shards written by another tokenizer than the run's (ids would mean other words)."""
    if manifest["tokenizer"].get("identity") != identity:
        theirs = manifest["tokenizer"].get("name") or "gpt2 (bundled)"
        raise DataError(
            f"{directory} was prepared with the tokenizer {theirs!r}, not this run's {name or 'gpt2 (bundled)'!r}; "
            f"pass --tokenizer {theirs} or prepare the corpus again with this tokenizer."
        )


class TokenWindows:
    """``seq_len + 1``-token windows over the concatenated shards of one split, at a stride of ``seq_len``.

    Indexed like a ``[len, seq_len + 1]`` array by an int array or a slice (what the batch loader does); a window
    that crosses a shard boundary is stitched from both shards. Shards are memory-mapped on first use."""

    def __init__(self, files: list[Path], counts: list[int], dtype: np.dtype, seq_len: int):
        self.files, self.dtype, self.seq_len = files, dtype, seq_len
        self.starts = np.concatenate([[0], np.cumsum(counts, dtype=np.int64)])  # token offset of each shard
        total = int(self.starts[-1])
        self.n = max(0, (total - 1) // seq_len)
        self.shape = (self.n, seq_len + 1)
        self._maps: dict[int, np.ndarray] = {}

    def __len__(self) -> int:
        return self.n

    def _shard(self, i: int) -> np.ndarray:
        if i not in self._maps:
            self._maps[i] = np.memmap(self.files[i], dtype=self.dtype, mode="r")
        return self._maps[i]

    def _tokens(self, start: int, count: int, out: np.ndarray) -> None:
        i = int(np.searchsorted(self.starts, start, side="right")) - 1
        filled = 0
        while filled < count:
            shard, offset = self._shard(i), start + filled - int(self.starts[i])
            take = min(count - filled, len(shard) - offset)
            out[filled : filled + take] = shard[offset : offset + take]
            filled, i = filled + take, i + 1

    def __getitem__(self, index) -> np.ndarray:
        rows = np.arange(self.n)[index] if isinstance(index, slice) else np.asarray(index, dtype=np.int64)
        if rows.ndim != 1 or (rows.size and (rows.min() < 0 or rows.max() >= self.n)):
            raise IndexError(f"window indices out of range [0, {self.n})")
        out = np.empty((rows.size, self.seq_len + 1), dtype=self.dtype)
        for k, w in enumerate(rows):
            self._tokens(int(w) * self.seq_len, self.seq_len + 1, out[k])
        return out


def open_windows(directory: str | os.PathLike, manifest: dict[str, Any], split: str, seq_len: int) -> TokenWindows:
    d = Path(directory).expanduser()
    shards = manifest["shards"][split]
    return TokenWindows(
        [d / s["file"] for s in shards], [int(s["tokens"]) for s in shards], np.dtype(manifest["dtype"]), seq_len
    )


def manifest_fingerprint(manifest: dict[str, Any]) -> str:
    """What identifies the prepared tokens (not where or how fast they were written)."""
    keep = {k: manifest[k] for k in ("tokenizer", "source", "shards", "dtype")}
    return hashlib.sha256(json.dumps(keep, sort_keys=True).encode()).hexdigest()
