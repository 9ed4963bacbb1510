"""--compile on CPU: training tokens/s with torch.compile (inductor) on each block against eager, (1,1,1), one process.

Two models: the default run's (`python launch/train_gpt2.py` with no flags: tiny, 4 blocks of d 128, seq 128, 8
sequences a step, GPT-2's 50257-token vocabulary) and GPT-2 124M with a short sequence (seq 128, 4 sequences a step),
fp32, dropout 0. For each, an eager and a compiled Trainer are built from the same seed and stepped on the same
batches, alternating, order swapped each round: the median step after two warm-up rounds gives tokens/s. The compiled
trainer's first step less its median step is the compile time, reported apart: each model runs in a process of its
own with an empty inductor cache, so it is what a new run on a new machine pays (a warm cache shortens it). "blocks"
times a forward and backward through the blocks alone (what --compile changes), interleaved the same way; their share
of the eager step says how much of the step compile can touch. "loss rel diff" is the largest relative difference
between the two trainers' losses over all steps (same model, same data: it must stay ~1e-6).

    python bench/compile.py                  # ~4 min on 2 shared cores, one thread
    python bench/compile.py --models tiny --rounds 5
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")  # as every benchmark here; inductor's kernels follow torch's threads

import torch  # noqa: E402

from bench.harness import stamp, table  # noqa: E402

VOCAB = 50257  # the bundled GPT-2 tokenizer's, which the default run uses
MODELS = {  # TrainConfig fields; everything else is the default run's
    "tiny": dict(model="tiny"),
    "gpt2": dict(model="gpt2", global_batch=4),
}


def build(fields: dict, compile_blocks: bool):
    import torch.distributed as dist

    from trainer3d.config import TrainConfig
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainConfig(**fields, compile=compile_blocks, precision="fp32", max_steps=10**6)
    setup = validate(cfg, 1, VOCAB)
    return Trainer(setup, setup.topology(), torch.device("cpu"), setup.model_config(VOCAB)), cfg


def measure(name: str, rounds: int) -> list:
    from torch._dynamo.utils import counters

    eager, cfg = build(MODELS[name], False)
    compiled, _ = build(MODELS[name], True)
    g = torch.Generator().manual_seed(0)
    batches = torch.randint(0, VOCAB, (rounds + 2, cfg.global_batch, cfg.seq_len + 1), generator=g)
    losses = {"eager": [], "compile": []}
    times: dict[str, list[float]] = {"eager": [], "compile": []}
    trainers = {"eager": eager, "compile": compiled}
    counters.clear()
    for r, batch in enumerate(batches):
        order = ("eager", "compile") if r % 2 == 0 else ("compile", "eager")
        for mode in order:
            t0 = time.perf_counter()
            losses[mode].append(trainers[mode].train_step(batch)["loss"])
            dt = time.perf_counter() - t0
            if r == 0 and mode == "compile":
                first = dt
            if r >= 2:  # round 0 compiles and warms up, round 1 settles (allocator, thread pools)
                times[mode].append(dt)
    graphs = counters["stats"]["unique_graphs"]
    blocks = {mode: [] for mode in trainers}  # the part --compile touches, alone
    x = torch.randn(cfg.global_batch, cfg.seq_len, eager.mcfg.n_embd, generator=g)
    for r in range(rounds + 1):
        for mode in ("eager", "compile") if r % 2 == 0 else ("compile", "eager"):
            dt = blocks_pass(trainers[mode], x)
            if r:
                blocks[mode].append(dt)
    tokens = cfg.global_batch * cfg.seq_len
    t_eager, t_compile = statistics.median(times["eager"]), statistics.median(times["compile"])
    b_eager, b_compile = statistics.median(blocks["eager"]), statistics.median(blocks["compile"])
    rel = max(abs(a - b) / abs(b) for a, b in zip(losses["compile"], losses["eager"]))
    mcfg = compiled.mcfg
    return [f"{name} (d {mcfg.n_embd}, {mcfg.n_layer} blocks)", f"{cfg.global_batch}×{cfg.seq_len}",
            f"{tokens / t_eager:.0f}", f"{tokens / t_compile:.0f}", f"{t_eager / t_compile:.2f}",
            f"{b_eager / b_compile:.2f}", f"{b_eager / t_eager:.0%}", f"{first - t_compile:.0f}", str(graphs),
            f"{rel:.1e}"]


def blocks_pass(trainer, x: torch.Tensor) -> float:
    """Seconds for a forward and backward through the stage's blocks only (no embedding, head, loss or optimizer)."""
    h = x.clone().requires_grad_()
    t0 = time.perf_counter()
    out = h
    for block in trainer.parallel_model.stages[0].h.values():
        out = block(out)
    out.sum().backward()
    dt = time.perf_counter() - t0
    trainer.engine.zero_grad()
    return dt


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--models", nargs="+", default=list(MODELS), choices=list(MODELS))
    ap.add_argument("--rounds", type=int, default=10, help="timed rounds per model, after two warm-up rounds")
    ap.add_argument("--row", action="store_true", help=argparse.SUPPRESS)  # a child: measure one model, print JSON
    args = ap.parse_args(argv)
    if args.row:
        print(json.dumps(measure(args.models[0], args.rounds)))
        return 0
    rows = []
    for name in args.models:  # a process each, with an empty cache: a second model would reuse the first's compiled
        # code with dynamic shapes (dynamo's automatic dynamic), and its kernels and one-time costs
        env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=tempfile.mkdtemp(prefix=f"inductor-bench-{name}-"))
        child = subprocess.run([sys.executable, os.path.abspath(__file__), "--row", "--models", name, "--rounds",
                                str(args.rounds)], env=env, capture_output=True, text=True)
        if child.returncode:
            sys.exit(f"{name}: the measuring process failed:\n{child.stderr[-3000:]}")
        rows.append(json.loads(child.stdout.strip().splitlines()[-1]))
    cmd = "python bench/compile.py " + " ".join(argv if argv is not None else sys.argv[1:])
    print(f"\n{stamp(cmd.strip())}; {torch.get_num_threads()} thread(s), fp32, (1,1,1), median of {args.rounds} "
          "steps; each model in its own process with an empty inductor cache\n")
    print(table(rows, ["model", "batch×seq", "eager tok/s", "compile tok/s", "step speed-up", "blocks speed-up",
                       "blocks' share of eager step", "compile s", "graphs compiled", "loss rel diff"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
