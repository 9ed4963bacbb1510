"""Long context: activation memory per rank against sequence length, with and without context parallelism.

    python bench/long_context.py                 # 4K to 64K tokens, cp 1/2/4, tp 2 + sequence parallelism or not,
                                                  # no / selective / full recomputation (~15 min on 2 cores)
    python bench/long_context.py --lengths 4096 16384

What a block keeps for its backward, measured on every rank as bench/activations.py does (bench/memhook.c's malloc
counter: bytes still allocated when a block's forward returns minus before it started, the median over the rank's
blocks), for one sequence (b = 1) of the tiny GPT-2 below, fp32, dropout 0. Each rank runs its stage's forward on its
own s/cp tokens, so the cp ranks gather keys and values together as in training.

The model is Korthikanti et al.'s per-layer formula on a rank's s/cp tokens, plus what context parallelism adds:
attention keeps the keys and values of the whole sequence it gathered (2·s·h values, all of them, whatever cp is),
and each later chunk's output once more (the chunks' outputs are concatenated for the output projection):

    none        (s/cp)·h·(R/t' + S/t) + cp>1: 2·s·h·4/t + (s/cp)·h·4/t       t' = t with sequence parallelism, else 1
    selective   (s/cp)·h·(R/t' + S/t)                                           the attention core (gather included)
                                                                                is recomputed: nothing of cp is kept
    full        (s/cp)·h·I/t'                                                   the block's input only

with the CPU fp32 coefficients at dropout 0: R = 16 (two LayerNorm inputs, the qkv and fc inputs), S = 48 (q, k, v,
the attention output, the fc output and GELU's), I = 4; SDPA's flash kernel keeps no s² scores. The last table turns
the measured bytes per layer into the longest sequence whose activations fit 24 GiB per rank, for a 32-layer model
of the same width, at cp 1 and cp 4.
"""

from __future__ import annotations

import argparse
import gc
import itertools
import os
import statistics
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.harness import Case, build_trainer, fmt_bytes, stamp, table  # noqa: E402

MODEL = dict(n_layer=2, n_embd=64, n_head=4, vocab=512, global_batch=1)
LENGTHS = (4096, 8192, 16384, 32768, 65536)
LAYOUTS = [dict(cp=1), dict(cp=2), dict(cp=4), dict(tp=2, cp=1), dict(tp=2, cp=2), dict(tp=2, cp=4)]
MODES = ("none", "selective", "full")
COEF = dict(R=16, S=48, I=4)
BUDGET = 24 * 2**30
LAYERS_FOR_BUDGET = 32


def cases(lengths) -> list[Case]:
    out = []
    for s, layout, mode in itertools.product(lengths, LAYOUTS, MODES):
        sp = layout.get("tp", 1) > 1
        out.append(Case(**layout, **MODEL, seq_len=s, extra=dict(recompute=mode, sequence_parallel=sp, n_positions=s)))
    return out


def model_bytes(case: Case) -> float:
    """Bytes one layer keeps on a rank (module docstring)."""
    s, h, t, cp = case.seq_len, case.n_embd, case.tp, case.cp
    mode, sp = case.extra["recompute"], case.extra["sequence_parallel"]
    shard = t if sp else 1
    local = s // cp
    if mode == "full":
        return local * h * COEF["I"] / shard
    total = local * h * (COEF["R"] / shard + COEF["S"] / t)
    if mode == "none" and cp > 1:
        total += 2 * s * h * 4 / t + local * h * 4 / t
    return total


def measure(rank: int, world: int, all_cases: list[Case]) -> list:
    """On every rank of a spawned world (under preloaded_memhook): the median bytes a block keeps."""
    from bench.measure import MallocCounter, kept_per_block

    counter = MallocCounter()
    out = []
    for case in all_cases:
        topo, trainer = build_trainer(case)
        result = None
        if trainer is not None:
            with kept_per_block(trainer.parallel_model.stages, counter) as kept:
                gc.collect()
                torch.manual_seed(7)
                x = torch.randint(0, case.vocab, (1, case.seq_len // case.cp))
                y = trainer.parallel_model.stages[0](x)
                del y
            result = dict(coords=(topo.pp_rank, topo.dp_rank, topo.tp_rank, topo.cp_rank),
                          per_layer=statistics.median(kept))
        topo.destroy()
        del trainer
        gc.collect()
        out.append(result)
    return out


def label(case: Case) -> str:
    return f"cp{case.cp} tp{case.tp}{' SP' if case.extra['sequence_parallel'] else ''} {case.extra['recompute']}"


def longest(per_token_per_layer: float, cp: int) -> int:
    """The longest sequence (a multiple of 2·cp·1024) whose activations on one rank fit BUDGET in a
    LAYERS_FOR_BUDGET-layer model, at `per_token_per_layer` bytes per token of the sequence and layer."""
    s = int(BUDGET / (per_token_per_layer * LAYERS_FOR_BUDGET))
    step = 2 * cp * 1024
    return s // step * step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--lengths", type=int, nargs="+", default=list(LENGTHS))
    args = ap.parse_args(argv)
    from bench.measure import preloaded_memhook
    from helpers.distributed import run_world

    all_cases = cases(args.lengths)
    world = max(c.world for c in all_cases)
    with preloaded_memhook():
        per_rank = run_world(world, measure, all_cases, timeout=3600)
    rows, ratios, slope = [], [], {}
    for i, case in enumerate(all_cases):
        measured = [r[i]["per_layer"] for r in per_rank if r[i] is not None]
        model = model_bytes(case)
        lo, hi = min(measured) / model, max(measured) / model
        ratios.append((lo, hi))
        mean = sum(measured) / len(measured)
        rows.append([case.seq_len, label(case), len(measured), fmt_bytes(mean), fmt_bytes(model),
                     f"{lo:.3f}" if hi - lo < 5e-4 else f"{lo:.3f}-{hi:.3f}"])
        slope[(label(case), case.seq_len)] = max(measured) / case.seq_len
    h = MODEL["n_embd"]
    print(f"activations one block keeps per rank, one sequence (b=1), GPT-2 h={h} a={MODEL['n_head']}, fp32, dropout 0")
    print(table(rows, ["s", "layout", "ranks", "measured (mean)", "model", "measured/model (all ranks)"]))
    worst = max(max(abs(lo - 1), abs(hi - 1)) for lo, hi in ratios)
    print(f"\nworst rank's |measured/model - 1|: {worst:.3f}")
    s_max = max(args.lengths)
    fit = []
    for name in sorted({label(c) for c in all_cases}):
        per_token = slope.get((name, s_max))
        if per_token is None:
            continue
        cp = int(name.split()[0][2:])
        fit.append([name, f"{per_token:.1f} B", f"{longest(per_token, cp):,}"])
    print(f"\nlongest sequence whose activations fit {BUDGET / 2**30:.0f} GiB per rank, {LAYERS_FOR_BUDGET} layers of "
          f"width {h}, from the measured bytes per token and layer at s={s_max} (the worst rank):")
    print(table(fit, ["layout", "bytes per token per layer", "longest s"]))
    print(stamp("python bench/long_context.py" + ("" if args.lengths == list(LENGTHS) else
                                                    " --lengths " + " ".join(map(str, args.lengths)))))
    return 0


if __name__ == "__main__":
    sys.exit(main())
