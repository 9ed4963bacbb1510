"""Training data, offline by default: the trainer only needs blocks of token ids and one batch per dp rank.

Pipeline: corpus (sources: bundled Shakespeare, local files, a saved or Hugging Face dataset) -> tokens
(tokenizer: bundled GPT-2 BPE or any HF tokenizer) -> packed ``[N, seq_len + 1]`` blocks memory-mapped from an
on-disk cache (cache) -> dp-sharded, resumable batches (loader).
"""

from trainer3d.data.cache import TokenBlocks, build_token_blocks, check_seq_len, default_cache_dir
from trainer3d.data.loader import BatchLoader, val_batches
from trainer3d.data.sources import DataConfig, bundled_corpus_files
from trainer3d.data.tokenizer import BUNDLED_TOKENIZER_DIR, load_tokenizer
from trainer3d.errors import DataError

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
