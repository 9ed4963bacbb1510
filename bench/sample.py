"""Sampling speed on CPU: GPT-2 124M (random weights, fp32, batch 1, one thread) with the KV cache against
recomputing the whole prefix for every new token.

Both decode greedily from the same 16-token prompt, so they must produce the same tokens (checked: the table's
last column). "cache" is trainer3d.generate.generate: one prefill, then one position per token. "recompute" is the
loop without a cache, made as cheap as it can be: the blocks run over the whole prefix but the LM head (a third of
124M's matmul FLOPs per position) only over the last position, so the ratio is the cache's gain over the best
uncached loop, not over a naive one. One run of each to 256 new tokens per round, order alternating; the 128-token
row is the same run read at its 128th token. Tokens/s counts new tokens only, prefill included in the time.

    python bench/sample.py                 # ~4 min on 2 shared cores (the recompute runs are most of it)
    python bench/sample.py --rounds 1 --new-tokens 64 128

Last run (bench/sample.md): 2026-11-23 21:20-21:24 UTC, x86_64, 2 cores shared with other engineers'
jobs (load average 2-4), torch 2.13.0+cpu, OMP_NUM_THREADS=1, `python bench/sample.py`: cache 23.3 / 22.7 tok/s at
128 / 256 new tokens, recompute 4.37 / 2.56 tok/s, speed-up 5.3× / 8.9×, same tokens.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from bench.harness import stamp, table  # noqa: E402
from trainer3d.generate import generate  # noqa: E402
from trainer3d.models import MODEL_PRESETS
from trainer3d.models.gpt2 import GPT  # noqa: E402


@torch.no_grad()
def run_cache(model, prompt, n, marks) -> tuple[list[int], dict[int, float]]:
    """Times at each mark from generate() itself: rerun to each mark (the cache's runs are cheap)."""
    times, out = {}, None
    for m in marks:
        t0 = time.perf_counter()
        out = generate(model, prompt, m, temperature=0)
        times[m] = time.perf_counter() - t0
    return out[0, prompt.shape[1]:].tolist(), times


@torch.no_grad()
def run_recompute(model, prompt, n, marks) -> tuple[list[int], dict[int, float]]:
    seq, times = prompt, {}
    positions = torch.arange(model.cfg.n_positions)
    t0 = time.perf_counter()
    for i in range(1, n + 1):
        x = model.wte(seq) + model.wpe(positions[: seq.shape[1]])
        for block in model.h.values():
            x = block(x)
        logits = model.lm_head(model.ln_f(x[:, -1]))
        seq = torch.cat([seq, logits.argmax(-1, keepdim=True)], dim=1)
        if i in marks:
            times[i] = time.perf_counter() - t0
    return seq[0, prompt.shape[1]:].tolist(), times


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--new-tokens", type=int, nargs="+", default=[128, 256])
    ap.add_argument("--prompt-len", type=int, default=16)
    args = ap.parse_args(argv)
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    torch.manual_seed(0)
    model = GPT(MODEL_PRESETS["gpt2"]).eval()  # 124M, torch's default init: random weights time the same
    prompt = torch.randint(0, model.cfg.vocab_size, (1, args.prompt_len), generator=torch.Generator().manual_seed(0))
    marks, n = sorted(args.new_tokens), max(args.new_tokens)
    run_cache(model, prompt, 8, [8])  # warm-up: thread pool, allocator
    times = {"cache": {m: [] for m in marks}, "recompute": {m: [] for m in marks}}
    tokens = {}
    for r in range(args.rounds):
        for mode in (("cache", "recompute") if r % 2 == 0 else ("recompute", "cache")):
            fn = run_cache if mode == "cache" else run_recompute
            toks, t = fn(model, prompt, n, marks)
            tokens[mode] = toks
            for m in marks:
                times[mode][m].append(t[m])
            print(f"round {r + 1} {mode}: " + ", ".join(f"{m} tokens {t[m]:.1f} s" for m in marks), flush=True)
    same = tokens["cache"] == tokens["recompute"]
    rows = []
    for m in marks:
        c, f = statistics.median(times["cache"][m]), statistics.median(times["recompute"][m])
        rows.append([m, f"{m / c:.1f}", f"{1000 * c / m:.1f}", f"{m / f:.2f}", f"{1000 * f / m:.0f}", f"{f / c:.1f}×",
                     "yes" if same else "NO"])
    print(f"\n{stamp('python bench/sample.py')}; gpt2 124M random weights, fp32, batch 1, prompt {args.prompt_len} "
          f"tokens, greedy, {torch.get_num_threads()} thread(s), median of {args.rounds} round(s)\n")
    print(table(rows, ["new tokens", "cache tok/s", "cache ms/tok", "recompute tok/s", "recompute ms/tok",
                       "speed-up", "same tokens"]))
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
