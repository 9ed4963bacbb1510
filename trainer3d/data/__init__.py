"""Training data, offline by default: the trainer only needs blocks of token ids and one batch per dp rank.

Pipeline: corpus (sources: bundled Shakespeare, local files, a saved or Hugging Face dataset) -> tokens
(tokenizer: bundled GPT-2 BPE or any HF tokenizer) -> packed ``[N, seq_len + 1]`` blocks memory-mapped from an
on-disk cache (cache) -> dp-sharded, resumable batches (loader). At scale, `python -m trainer3d.prepare` (prepare)
writes token shards once and training memory-maps windows of them (shards).

The names below are imported on first use, so a process that needs one piece (`python -m trainer3d.prepare` needs
no torch) does not pay for the others.
"""

import importlib

_HOMES = {
    "BUNDLED_TOKENIZER_DIR": "tokenizer", "load_tokenizer": "tokenizer",
    "BatchLoader": "loader", "val_batches": "loader", "corpus_batches": "loader", "Batch": "batch",
    "build_rows": "sft",
    "DataConfig": "sources", "bundled_corpus_files": "sources",
    "TokenBlocks": "cache", "build_token_blocks": "cache", "check_seq_len": "cache", "default_cache_dir": "cache",
}
__all__ = sorted([*_HOMES, "DataError"])


def __getattr__(name: str):
    if name == "DataError":
        from trainer3d.errors import DataError

        return DataError
    if name in _HOMES:
        return getattr(importlib.import_module(f"trainer3d.data.{_HOMES[name]}"), name)
    raise AttributeError(f"module 'trainer3d.data' has no attribute {name!r}")
