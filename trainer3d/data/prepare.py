"""Tokenize a corpus once into token shards (format: shards.py), in parallel worker processes, with memory that
does not grow with the corpus, resumable after an interruption:

    python -m trainer3d.prepare SOURCE OUT [--num-proc N] [--shard-tokens 100000000] [--val-tokens N] ...

SOURCE is anything --data takes (a Hugging Face dataset name, streamed; local files or folders; a save_to_disk
folder). Documents are read in order, sent in batches to `--num-proc` workers (at most a few batches in flight),
and their tokens, each document preceded by EOS, fill one shard buffer at a time: the first `--val-tokens` go to
the validation shards, the rest to training shards of `--shard-tokens`. After every shard the manifest records the
shards so far and the document (and token within it) where the next shard starts, so a rerun with the same
arguments continues there and writes the same bytes a straight run would.

The GPT-2 BPE runs through tiktoken (the same ranks, built from the bundled vocabulary, whose files are checked
against OpenAI's published hashes; ~5x the tokens/s of `tokenizers` on one core); any other tokenizer through
the Hugging Face `tokenizers` backend.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import re
import shutil
import sys
import time
from collections import deque
from collections.abc import Iterator
from itertools import islice
from pathlib import Path
from typing import Any

import numpy as np

from trainer3d.data.cache import default_cache_dir
from trainer3d.data.shards import FORMAT, MANIFEST, VERSION, read_manifest, shard_name, token_dtype
from trainer3d.data.sources import DataConfig, stream_documents
from trainer3d.data.tokenizer import BUNDLED_TOKENIZER_DIR, is_bundled_gpt2, load_tokenizer, tokenizer_identity
from trainer3d.plugins import load_plugins
from trainer3d.errors import ArgumentParser, DataError, UsageError, report
from trainer3d.fsio import replace_durably, temp_name, write_text_atomic

# OpenAI's published sha256 of the GPT-2 BPE files (tiktoken_ext.openai_public.gpt2); the bundled copies match.
GPT2_MERGES_SHA256 = "1ce1664773c50f3e0cc8842619a93edc4624525b728b188a9e0be33b7726adc5"
GPT2_VOCAB_SHA256 = "196139668be63f3b5d6574427317ae82f612a97c5d1cdaf36ed2256dbf636783"
_OUR_TEMP = re.compile(r"^((val|train)_\d{6}\.bin|manifest\.json)\.tmp-")  # fsio.temp_name of what we write
TASK_CHARS = 1 << 20  # text per worker task: large enough to amortize the pickling, small enough to bound memory


# ---- encoders (built once per worker) -----------------------------------------------------------------------------
def gpt2_tiktoken():
    """tiktoken's GPT-2 encoding from the bundled files (no download; the hashes prove they are OpenAI's)."""
    import tiktoken
    from tiktoken.load import data_gym_to_mergeable_bpe_ranks
    from tiktoken_ext.openai_public import r50k_pat_str

    d = BUNDLED_TOKENIZER_DIR
    ranks = data_gym_to_mergeable_bpe_ranks(
        str(d / "merges.txt"), str(d / "vocab.json"), GPT2_MERGES_SHA256, GPT2_VOCAB_SHA256
    )
    return tiktoken.Encoding("gpt2", pat_str=r50k_pat_str, mergeable_ranks=ranks,
                             special_tokens={"<|endoftext|>": 50256}, explicit_n_vocab=50257)


class Encoder:
    """texts -> (tokens with EOS before each non-empty document, tokens per document). Built in the main process
    and inherited by the forked workers (pickled under spawn)."""

    def __init__(self, tokenizer: str | None, trust_remote_code: bool = False):
        if is_bundled_gpt2(tokenizer):
            self.tiktoken, self.hf = gpt2_tiktoken(), None
            self.name, self.vocab_size, self.eos = "tiktoken", self.tiktoken.n_vocab, self.tiktoken.eot_token
        else:
            self.tiktoken, self.hf = None, load_tokenizer(tokenizer, trust_remote_code)
            self.name, self.vocab_size, self.eos = "tokenizers", len(self.hf), int(self.hf.eos_token_id)
        self.dtype = token_dtype(self.vocab_size)

    def encode(self, texts: list[str]) -> list[list[int]]:
        if self.tiktoken is not None:
            return [self.tiktoken.encode_ordinary(t) for t in texts]
        backend = getattr(self.hf, "backend_tokenizer", None)
        if backend is not None:
            return [e.ids for e in backend.encode_batch(texts, add_special_tokens=False)]
        return self.hf(texts, add_special_tokens=False)["input_ids"]

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        ids = self.encode(texts)
        lengths = np.array([len(t) + 1 if t else 0 for t in ids], dtype=np.int64)
        out = np.empty(int(lengths.sum()), dtype=self.dtype)
        pos = 0
        for t in ids:
            if t:
                out[pos] = self.eos
                out[pos + 1 : pos + 1 + len(t)] = t
                pos += len(t) + 1
        return out, lengths


_WORKER: Encoder | None = None


def _init_worker(encoder: Encoder) -> None:
    global _WORKER
    os.environ["TOKENIZERS_PARALLELISM"] = "false"  # one core per worker: --num-proc is the parallelism
    _WORKER = encoder


def _encode_task(texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
    assert _WORKER is not None
    return _WORKER(texts)


def _tasks(texts: Iterator[str]) -> Iterator[list[str]]:
    batch, size = [], 0
    for t in texts:
        batch.append(t)
        size += len(t)
        if size >= TASK_CHARS:
            yield batch
            batch, size = [], 0
    if batch:
        yield batch


def _encoded(pool, texts: Iterator[str], in_flight: int) -> Iterator[tuple[np.ndarray, np.ndarray]]:
    """Results in document order with at most `in_flight` tasks queued (Pool.imap would read the whole corpus)."""
    pending: deque = deque()
    for batch in _tasks(texts):
        pending.append(pool.apply_async(_encode_task, (batch,)))
        if len(pending) >= in_flight:
            yield pending.popleft().get()
    while pending:
        yield pending.popleft().get()


# ---- the writer -----------------------------------------------------------------------------------------------------
class ShardWriter:
    """Fills one shard buffer at a time and commits shard + manifest atomically; knows where the next shard starts."""

    def __init__(self, out: Path, manifest: dict[str, Any]):
        self.out, self.m = out, manifest
        self.dtype = np.dtype(manifest["dtype"])
        self.buffer = np.empty(self._capacity(), dtype=self.dtype)
        self.filled = 0

    def _written(self, split: str) -> int:
        return _count(self.m, split)

    @property
    def split(self) -> str:
        return "val" if self._written("val") < self.m["val_tokens"] else "train"

    def _capacity(self) -> int:
        if self.split == "val":
            return min(self.m["shard_tokens"], self.m["val_tokens"] - self._written("val"))
        return self.m["shard_tokens"]

    def remaining(self) -> int | None:
        """Tokens still wanted under --max-tokens (None: no limit)."""
        cap = self.m.get("max_tokens")
        return None if cap is None else cap - self._written("val") - self._written("train") - self.filled

    def add(self, tokens: np.ndarray, cursor: tuple[int, int], lengths: np.ndarray) -> None:
        """Append `tokens` (the documents from `cursor` = (document, token offset) on, `lengths` tokens each)."""
        start = 0
        while start < len(tokens):
            take = min(len(self.buffer) - self.filled, len(tokens) - start)
            self.buffer[self.filled : self.filled + take] = tokens[start : start + take]
            self.filled, start = self.filled + take, start + take
            if self.filled == len(self.buffer):
                self.commit(_advance(cursor, lengths, start))

    def commit(self, next_cursor: tuple[int, int] | None, complete: bool = False) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        if self.filled:
            split = self.split
            name = shard_name(split, len(self.m["shards"][split]))
            tmp = temp_name(self.out / name)
            with open(tmp, "wb") as f:
                f.write(self.buffer[: self.filled].tobytes())
            replace_durably(tmp, self.out / name)
            self.m["shards"][split].append({"file": name, "tokens": int(self.filled)})
            self.filled = 0
        if next_cursor is not None:
            self.m["resume"] = {"next_doc": next_cursor[0], "offset": next_cursor[1]}
        self.m["complete"] = complete
        write_text_atomic(self.out / MANIFEST, json.dumps(self.m, indent=1))
        if not complete:
            self.buffer = np.empty(self._capacity(), dtype=self.dtype)


def _advance(cursor: tuple[int, int], lengths: np.ndarray, consumed: int) -> tuple[int, int]:
    """The (document, offset) `consumed` tokens after `cursor`, where `lengths` are the tokens of the documents from
    cursor[0] on (the first of them `cursor[1]` tokens in already)."""
    ends = np.cumsum(lengths) - cursor[1]
    k = int(np.searchsorted(ends, consumed, side="right"))
    before = 0 if k == 0 else int(ends[k - 1])
    return cursor[0] + k, (consumed - before) + (cursor[1] if k == 0 else 0)


def _settings(cfg: DataConfig, src_identity: dict, encoder: Encoder, args) -> dict[str, Any]:
    return {
        "format": FORMAT,
        "version": VERSION,
        "dtype": encoder.dtype.str,
        "tokenizer": {"name": args.tokenizer, "identity": tokenizer_identity(args.tokenizer, args.trust_remote_code),
                      "vocab_size": encoder.vocab_size, "eos_id": encoder.eos},
        "source": {"name": cfg.data or "bundled Shakespeare", "identity": src_identity,
                   "text_field": cfg.text_field, "split": cfg.split, "config": cfg.data_config},
        "shard_tokens": args.shard_tokens,
        "val_tokens": args.val_tokens,
        "max_tokens": args.max_tokens,
        "eos": "before each document",
    }


def prepare(args, say=print) -> dict[str, Any]:
    """Run (or resume) a prepare; returns the finished manifest. A corpus that turns out unusable leaves no
    directory behind that this call created (an interrupted run keeps its shards: rerun to resume)."""
    out = Path(args.out).expanduser()
    created = not out.exists()
    try:
        return _prepare(args, out, say)
    except DataError:
        if created and out.exists():
            shutil.rmtree(out)
        raise


def _prepare(args, out: Path, say) -> dict[str, Any]:
    cfg = DataConfig(data=args.source, data_config=args.data_config, split=args.split, text_field=args.text_field,
                     tokenizer=args.tokenizer, trust_remote_code=args.trust_remote_code)
    encoder = Encoder(args.tokenizer, args.trust_remote_code)
    src, texts = stream_documents(cfg, default_cache_dir() / "hf", say)
    settings = _settings(cfg, src.identity, encoder, args)
    manifest = _resume_or_start(out, settings)
    if manifest.get("complete"):
        say(f"[trainer3d] {out} is already complete ({_count(manifest):,} tokens); nothing to do")
        return manifest
    writer = ShardWriter(out, manifest)
    cursor = (manifest["resume"]["next_doc"], manifest["resume"]["offset"])
    if cursor != (0, 0):
        say(f"[trainer3d] resuming {out} at document {cursor[0]:,} ({_count(manifest):,} tokens already written)")
    texts = islice(texts, cursor[0], None)
    # fork: workers start without re-importing anything (nothing has started threads yet); spawn elsewhere
    t0, n_tokens = time.perf_counter(), 0
    ctx = mp.get_context("fork" if sys.platform == "linux" else "spawn")
    with ctx.Pool(args.num_proc, initializer=_init_worker, initargs=(encoder,)) as pool:
        for tokens, lengths in _encoded(pool, texts, in_flight=2 * args.num_proc + 1):
            tokens = tokens[cursor[1]:]  # resuming mid-document: its first tokens are in the last shard
            remaining = writer.remaining()
            if remaining is not None and remaining <= len(tokens):
                writer.add(tokens[:remaining], cursor, lengths)
                n_tokens += remaining
                break
            writer.add(tokens, cursor, lengths)
            n_tokens += len(tokens)
            cursor = (cursor[0] + len(lengths), 0)
    if writer.split == "val" or (not manifest["shards"]["train"] and not writer.filled):
        raise DataError(
            f"The corpus {src.name} has {_count(manifest) + writer.filled:,} tokens, not more than --val-tokens "
            f"{args.val_tokens:,}; lower --val-tokens or add data."
        )
    seconds = time.perf_counter() - t0
    manifest["stats"] = {"tokens_this_run": n_tokens, "seconds_this_run": round(seconds, 3),
                         "tokens_per_s_this_run": round(n_tokens / max(seconds, 1e-9)), "num_proc": args.num_proc,
                         "encoder": encoder.name}
    writer.commit(None, complete=True)
    say(f"[trainer3d] {out}: {_count(manifest):,} tokens in {len(manifest['shards']['val'])} val + "
        f"{len(manifest['shards']['train'])} train shards ({n_tokens / max(seconds, 1e-9):,.0f} tokens/s)")
    return manifest


def _count(m: dict, *splits: str) -> int:
    """Tokens in the committed shards of `splits` (default: both)."""
    return sum(s["tokens"] for split in splits or ("val", "train") for s in m["shards"][split])


def _resume_or_start(out: Path, settings: dict[str, Any]) -> dict[str, Any]:
    for leftover in out.glob("*.tmp-*") if out.is_dir() else ():  # a shard or manifest cut short by a kill
        if _OUR_TEMP.match(leftover.name):
            leftover.unlink()
    if not (out / MANIFEST).exists():
        if out.is_dir() and any(out.iterdir()):
            raise DataError(f"{out} exists and is not a prepared directory; choose an empty or new output directory.")
        return {**settings, "complete": False, "shards": {"val": [], "train": []},
                "resume": {"next_doc": 0, "offset": 0}}
    manifest = read_manifest(out, require_complete=False)
    differs = [k for k in settings if manifest.get(k) != settings[k]]
    if differs:
        raise DataError(
            f"{out} holds a prepare with other settings ({', '.join(differs)}); use a new output directory, or "
            "the same source, tokenizer and sizes to resume it."
        )
    return manifest


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(prog="python -m trainer3d.prepare", description=__doc__.split("\n\n")[0],
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("source", help="HF dataset name, a file or folder of .txt/.jsonl/.json/.parquet/.csv, a "
                                  "save_to_disk folder, or 'shakespeare' for the bundled corpus")
    p.add_argument("out", help="output directory (a rerun with the same arguments resumes it)")
    p.add_argument("--data-config", default=None, help="HF dataset config, e.g. sample-10BT")
    p.add_argument("--split", default="train")
    p.add_argument("--text-field", default="text")
    p.add_argument("--tokenizer", default=None, help="HF tokenizer name or folder (default: GPT-2 BPE)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the code a tokenizer ships (its tokenizer_config.json's auto_map); off: refused")
    p.add_argument("--num-proc", type=int, default=max(1, (os.cpu_count() or 2) - 1), help="tokenizer processes")
    p.add_argument("--shard-tokens", type=int, default=100_000_000, help="tokens per shard (llm.c: 1e8)")
    p.add_argument("--val-tokens", type=int, default=1 << 18,
                   help="the first N tokens form the validation shards (llm.c FineWeb: 100000000)")
    p.add_argument("--max-tokens", type=int, default=None, help="stop after N tokens (e.g. a 10B-token sample)")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.source == "shakespeare":
        args.source = None
    try:
        load_plugins()  # TRAINER3D_PLUGINS, first of all
        for flag, low in (("num_proc", 1), ("shard_tokens", 1), ("val_tokens", 1), ("max_tokens", 2)):
            value = getattr(args, flag)
            if value is not None and value < low:
                raise UsageError(f"--{flag.replace('_', '-')} must be at least {low}, got {value}.")
        if args.max_tokens is not None and args.max_tokens <= args.val_tokens:
            raise UsageError(f"--max-tokens {args.max_tokens} leaves no training tokens after --val-tokens "
                             f"{args.val_tokens}; raise it or lower --val-tokens.")
        prepare(args)
    except UsageError as e:
        return report(e)
    return 0
