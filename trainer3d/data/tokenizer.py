"""The tokenizer: GPT-2 BPE shipped inside the package so the default run needs no network, or any Hugging Face
tokenizer. Its identity (a hash of its full serialization) is part of the cache key, so a different tokenizer
re-tokenizes instead of reusing ids that mean something else."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import TYPE_CHECKING, Callable

from trainer3d.errors import DataError, first_line

if TYPE_CHECKING:  # heavy import stays lazy: ranks that hit the cache never need it for the blocks
    from transformers import PreTrainedTokenizerBase

BUNDLED_TOKENIZER_DIR = Path(__file__).resolve().parents[1] / "assets" / "gpt2_tokenizer"
_GPT2_ALIASES = {"gpt2", "openai-community/gpt2"}  # same BPE as the bundled files: served offline


def load_tokenizer(name_or_path: str | None = None, trust_remote_code: bool = False) -> PreTrainedTokenizerBase:
    """The bundled GPT-2 BPE (None, "gpt2"), or any Hugging Face tokenizer by name or local folder. One that ships
    code of its own (its tokenizer_config.json's auto_map: Kimi K2's, Moonlight's) is run only with
    `trust_remote_code` (--trust-remote-code), else refused in one sentence that names the flag."""
    from transformers import AutoTokenizer

    if is_bundled_gpt2(name_or_path):
        name_or_path = str(BUNDLED_TOKENIZER_DIR)
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path, trust_remote_code=trust_remote_code)
    except Exception as e:  # noqa: BLE001 - OSError, ValueError, HF hub errors...
        if not trust_remote_code and "trust_remote_code" in str(e):
            raise DataError(f"Tokenizer '{name_or_path}' runs code of its own (its tokenizer_config.json's auto_map), "
                            "which trainer3d runs only when asked: pass --trust-remote-code if you trust that "
                            "code.") from None
        raise DataError(
            f"Could not load tokenizer '{name_or_path}' ({type(e).__name__}: {_first_line(e)}); pass --tokenizer a "
            "Hugging Face tokenizer name that is cached or reachable, or a folder with tokenizer files, or omit it "
            "for GPT-2."
        ) from None
    if tok.eos_token_id is None:
        raise DataError(f"Tokenizer '{name_or_path}' has no end-of-text token; use a tokenizer that defines eos_token.")
    tok.model_max_length = int(1e30)  # we tokenize whole documents; silence the length warning
    return tok


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def has_tokenizer_files(directory: str | os.PathLike) -> bool:
    """Whether a folder (a Hugging Face model directory, say) ships a tokenizer."""
    return any((Path(directory) / f).is_file() for f in TOKENIZER_FILES)


def is_bundled_gpt2(name_or_path: str | None) -> bool:
    return name_or_path is None or (name_or_path in _GPT2_ALIASES and not os.path.exists(name_or_path))


def tokenizer_identity(name_or_path: str | None, trust_remote_code: bool = False) -> str:
    """What prepared shards record and check: the bundled GPT-2 BPE by the hash of its files (no transformers
    import, which costs seconds per process), any other tokenizer by its full serialization."""
    if is_bundled_gpt2(name_or_path):
        h = hashlib.sha256(b"gpt2-bpe")
        for f in ("vocab.json", "merges.txt"):
            h.update((BUNDLED_TOKENIZER_DIR / f).read_bytes())
        return h.hexdigest()
    return _tokenizer_identity(load_tokenizer(name_or_path, trust_remote_code))


def tokenizer_facts(name_or_path: str | None, tokenizer: Callable[[], PreTrainedTokenizerBase]) -> tuple[str, int, int]:
    """(identity, end-of-text id, vocabulary size): what a data cache is keyed by and packs with. The bundled GPT-2
    BPE's are read from its files, so that a run whose blocks are cached never imports transformers (1.3 s of every
    process's start); any other tokenizer's from the one `tokenizer()` loads."""
    if is_bundled_gpt2(name_or_path):
        vocab = json.loads((BUNDLED_TOKENIZER_DIR / "vocab.json").read_text())
        return tokenizer_identity(None), vocab["<|endoftext|>"], len(vocab)
    tok = tokenizer()
    return _tokenizer_identity(tok), int(tok.eos_token_id), len(tok)


def _tokenizer_identity(tok: PreTrainedTokenizerBase) -> str:
    backend = getattr(tok, "backend_tokenizer", None)
    h = hashlib.sha256(type(tok).__name__.encode())
    if backend is not None:
        h.update(backend.to_str().encode())  # full serialization: vocab, merges, normalizer, pre-tokenizer
    else:
        h.update(json.dumps(sorted(tok.get_vocab().items())).encode())
    h.update(json.dumps([tok.eos_token_id, len(tok), str(tok.all_special_tokens)]).encode())
    return h.hexdigest()


def _first_line(e: BaseException) -> str:
    """The cause quoted in data errors, as before the split: capped at 200 characters, and empty (not the type's
    name, which errors.first_line gives) when the message is, since the type is already quoted beside it."""
    return first_line(e)[:200] if str(e).strip() else ""
