"""Activation memory per transformer layer against Korthikanti et al. 2022 (`python bench/memory.py --activations`).

What a layer keeps for its backward, measured on every rank: the bytes still allocated (bench/memhook.c's malloc
counter) when a block's forward returns minus before it started, averaged over the rank's blocks, one micro-batch,
gradients on. A block's output is the next block's input, so each layer is charged one input, as in the paper. Every
rank runs its own stage's forward on a synthetic input (token ids on the first stage, hidden states of the right
shape after it), so tp peers run their collectives together and no pipeline is needed. The first forward pays one-time
allocations (oneDNN and gloo scratch space) and is not counted; a rank's value is the median over its blocks and the
next REPEATS forwards (an interpreter arena allocated, or a buffer freed, inside one block's window is an outlier).

The model is the paper's (section 4, Table 2), per layer, with s sequence, b micro-batch, h hidden, a heads, t tp:

    none        sbh·(R + S/t) + a·s²·b·A/t        R: replicated, S: sharded, A: attention-core (s²) terms
    selective   sbh·(R + S/t)                     the attention core is recomputed
    full        sbh·I + c                         the layer's input only (c: the checkpoint's own few KiB)
    sequence parallelism divides R and I by t as well

in the paper's 16-bit activations with 1-byte dropout masks R = 10, S = 24, A = 5, I = 2. These runs are fp32 on CPU:
every 2-byte term doubles, and torch's CPU dropout keeps its mask as the fp32 tensor it multiplies by (CUDA's fused
kernel keeps 1 byte), so R = 24 (LayerNorm inputs 8, qkv and fc inputs 8, two dropout masks 8), S = 48 (q, k, v 12,
the attention output 4, the fc output and the GELU output 16 each), A = 12 (softmax 4, its dropout mask 4, the
dropped-out probabilities 4: CPU SDPA with dropout runs the math kernel, which keeps them), I = 4.
"""

from __future__ import annotations

import gc
import itertools
import statistics

import torch

from bench.harness import Case, build_trainer, fmt_bytes, stamp, table

MODEL = dict(n_layer=4, n_embd=256, n_head=8, vocab=2048, seq_len=256, global_batch=8)
REPEATS = 4  # forwards measured after the first; each rank's value is the median over its blocks and these
DROPOUT = 0.1  # the paper's setting: its dropout masks are part of the formula (and CPU SDPA keeps the s² terms)
MODES = ("none", "selective", "full")
LAYOUTS = [dict(), dict(tp=2), dict(tp=4), dict(tp=2, pp=2, micro_batches=2), dict(tp=4, pp=2, micro_batches=2)]
PAPER_16BIT = dict(R=10, S=24, A=5, I=2)
CPU_FP32 = dict(R=24, S=48, A=12, I=4)


def cases() -> list[Case]:
    out = []
    for layout, mode, sp in itertools.product(LAYOUTS, MODES, (False, True)):
        if sp and layout.get("tp", 1) == 1:
            continue
        extra = dict(recompute=mode, sequence_parallel=sp, dropout=DROPOUT)
        out.append(Case(**layout, **MODEL, extra=extra))
    return out


def korthikanti(case: Case, coef: dict, checkpoint_bytes: float = 0.0) -> float:
    """Bytes one layer keeps for its backward, per the paper's formula with `coef` (module docstring);
    `checkpoint_bytes`: what a checkpointed block keeps whatever its size, added under full recomputation."""
    s, b, h, a, t = case.seq_len, case.micro_batch_size, case.n_embd, case.n_head, case.tp
    mode, sp = case.extra["recompute"], case.extra["sequence_parallel"]
    shard = t if sp else 1
    if mode == "full":
        return s * b * h * coef["I"] / shard + checkpoint_bytes
    total = s * b * h * (coef["R"] / shard + coef["S"] / t)
    if mode == "none":
        total += a * s * s * b * coef["A"] / t
    return total


def checkpoint_overhead(counter) -> float:
    """Bytes one checkpointed block keeps whatever its size (torch's saved RNG state, our sharded stream's, Python
    bookkeeping): the median over 8 blocks × 4 forwards of a model with 8-wide blocks and one token."""
    from trainer3d.models.gpt2 import GPT, GPTConfig
    from trainer3d.parallel.recompute import apply_recompute
    from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG

    model = GPT(GPTConfig(vocab_size=16, n_positions=4, n_embd=8, n_head=1, n_layer=8, dropout=DROPOUT))
    rng = ShardedDropoutRNG(0, torch.device("cpu"))
    for block in model.h.values():
        block.attn.sharded_rng = rng
    apply_recompute(model, "full")
    x, kept = torch.randn(1, 1, 8, requires_grad=True), []
    for rep in range(5):
        y = x
        for block in model.h.values():
            start = counter.current()
            y = block(y)
            if rep:
                kept.append(counter.current() - start - y.nbytes)
        del y
    return statistics.median(kept)


def measure(rank: int, world: int, all_cases: list[Case]) -> list:
    """On every rank of a spawned world (under preloaded_memhook): bytes each block keeps (the median over its
    blocks and REPEATS forwards), and each rank's checkpoint_overhead first."""
    from bench.measure import MallocCounter, kept_per_block

    counter = MallocCounter()
    out = [checkpoint_overhead(counter)]
    for case in all_cases:
        topo, trainer = build_trainer(case)
        result = None
        if trainer is not None:
            torch.manual_seed(7)
            b, s, h = case.micro_batch_size, case.seq_len, case.n_embd
            hidden_s = s // case.tp if case.extra["sequence_parallel"] else s
            samples: list[int] = []
            with kept_per_block(trainer.parallel_model.stages, counter) as kept:
                for rep in range(REPEATS + 1):
                    kept.clear()
                    outputs = []
                    # each kept alive (its graph with it) until all are measured
                    for stage in trainer.parallel_model.stages:
                        gc.collect()
                        if stage.embedding is not None:
                            x = torch.randint(0, case.vocab, (b, s))
                        else:
                            x = torch.randn(b, hidden_s, h, requires_grad=True)
                        outputs.append(stage(x))
                    del outputs
                    if rep:
                        samples += kept
            result = dict(coords=(topo.pp_rank, topo.dp_rank, topo.tp_rank), per_layer=statistics.median(samples))
        topo.destroy()
        del trainer
        out.append(result)
    return out


def label(case: Case) -> str:
    e = case.extra
    return f"t{case.tp} p{case.pp} b{case.micro_batch_size} {e['recompute']}" + (" SP" if e["sequence_parallel"] else "")


def main(quick: bool = False) -> int:
    from bench.measure import preloaded_memhook
    from helpers.distributed import run_world

    all_cases = cases()
    if quick:
        all_cases = [c for c in all_cases if c.pp == 1]
    world = max(c.world for c in all_cases)
    with preloaded_memhook():
        per_rank = run_world(world, measure, all_cases, timeout=1800)
    overhead = statistics.mean(r[0] for r in per_rank)
    rows, ratios = [], []
    for i, case in enumerate(all_cases):
        measured = [r[i + 1]["per_layer"] for r in per_rank if r[i + 1] is not None]
        model, paper = korthikanti(case, CPU_FP32, overhead), korthikanti(case, PAPER_16BIT)
        lo, hi = min(measured) / model, max(measured) / model
        ratios.append((lo, hi))
        rows.append([label(case), len(measured), fmt_bytes(sum(measured) / len(measured)), fmt_bytes(model),
                     f"{lo:.3f}" if hi - lo < 5e-4 else f"{lo:.3f}-{hi:.3f}", fmt_bytes(paper)])
    s, h, a = MODEL["seq_len"], MODEL["n_embd"], MODEL["n_head"]
    print(f"per layer, one micro-batch of b sequences: s={s} h={h} a={a}, fp32, dropout {DROPOUT}; a checkpointed block "
          f"also keeps {fmt_bytes(overhead)} whatever its size (measured on its own: RNG states, bookkeeping)")
    print(table(rows, ["layout", "ranks", "measured (mean)", "model (CPU fp32)", "measured/model (all ranks)",
                       "paper's formula in 16-bit (a GPU run)"]))
    worst = max(max(abs(lo - 1), abs(hi - 1)) for lo, hi in ratios)
    print(f"\nworst rank's |measured/model - 1|: {worst:.3f}")
    print(stamp("python bench/memory.py --activations" + (" --quick" if quick else "")))
    return 0
