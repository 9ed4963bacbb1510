"""--compile against the one-process eager run (fp32, dropout 0, same seed and data, 6 steps, losses, gradient norms
and final parameters within tests/helpers/parity.py's tolerances, and dynamo's compiled graphs counted) at (1,1,1), (1,2,2) 1F1B and tp 2 × cp 2 (the cp
attention and positions run eagerly between the compiled graphs); and, with dropout 0.2
at (1,2,2), recomputation under --compile draws the same masks again: selective (its checkpointed attention core runs
eagerly between compiled graphs) and full (the checkpoint runs the compiled block) give bitwise the same losses (and
the same as no recomputation: checked when this was written, left out to save a compile).

The loss's chunk passes (parallel/cross_entropy.py: the forward's statistics, the backward's scaling) run compiled:
dynamo holds a graph for each after the first compiled case (PARITY[0], one process: its last stage), none after the eager reference.

A mixture of experts at dp 2 × ep 2 compiles too (the dispatch's all-to-all and its one host read of the splits run
eagerly between the compiled graphs) and matches its own one-process eager run.

One 4-process world for all of it. Its ranks build 109 C++ kernels (~1 CPU-second of g++ each) into the test
session's own empty inductor cache (tests/conftest.py), as CI's clean machine does: 266 CPU-seconds alone, against
~150 with the kernels cached by an earlier run."""

from __future__ import annotations

import torch

from helpers.distributed import run_world
from helpers.parity import MOE, MOE_BALANCED, MOE_GLOBAL, check, run_groups, train_layout
from test_parity import case

STEPS = 6  # test_parity.STEPS
PARITY = [case(compile=True), case(1, 2, 2, compile=True), case(1, 2, cp=2, compile=True)]  # cp: attention eager
# Blocks share their compiled code (same code, same guards), so the parity model's 8 blocks cost one block's compile.
DROPOUT = [dict(tp=2, pp=2, micro_batches=4, dropout=0.2, compile=True, recompute=m) for m in ("selective", "full")]
EXPERTS = [case(2, ep=2, compile=True, **MOE)]


def test_compile_matches_eager_and_replays_dropout():
    # 524 s on a 2.0 GHz AMD EPYC under the suite's load; past 600 s with one more job on the machine
    grouped = run_world(4, run_groups, [({}, PARITY + DROPOUT), (MOE, EXPERTS)], STEPS, timeout=1200)
    results, experts = [r[0] for r in grouped], [r[1] for r in grouped]
    failures = check(results, PARITY) + check(experts, EXPERTS)
    assert not failures, "\n".join(failures)
    for runs, cases in ((results, PARITY + DROPOUT), (experts, EXPERTS)):
        for i, c in enumerate(cases, start=1):  # dynamo compiled graphs on every rank: --compile acted
            graphs = [r[i]["compiled_graphs"] for r in runs if r[i] is not None]
            assert min(graphs) > 0, (c, graphs)
        assert runs[0][0]["compiled_graphs"] == 0  # the eager reference compiled nothing
    assert results[0][0]["loss_graphs"] == 0  # (the first run of each process: nothing compiled before it)
    last_stage = [r[1]["loss_graphs"] for r in results if r[1] is not None]
    assert last_stage and min(last_stage) > 0, last_stage  # the loss's chunk passes ran compiled
    ref = results[0][0]["losses"]
    first = 1 + len(PARITY)
    dropout = [next(r[i] for r in results if r[i] is not None)["losses"] for i in range(first, first + len(DROPOUT))]
    print(f"compile, dropout 0.2 at 1x2x2, recompute selective/full: {[x[-1] for x in dropout]}")
    assert dropout[0] != ref  # dropout is on
    assert dropout[1] == dropout[0], dropout


# qwen3-moe-tiny's first block is dense: 2 and 7 MoE layers. SFT's padded rows at 2 micro-batches: the observer looks
# up the running micro-batch's padding as well as each layer's counts (and, in the global mode, its loads so far).
DEPTHS = (3, 8)
ROUTED = [dict(balance, n_layer=n, sft="unpacked", micro_batches=2, compile=True, compile_backend="eager")
          for balance in (MOE_BALANCED, MOE_GLOBAL) for n in DEPTHS]


def _graphs(rank, world_size):
    out = []
    for layout in ROUTED:
        torch._dynamo.reset()  # each depth compiles from nothing
        out.append(train_layout(world_size, layout, 2)["compiled_graphs"])
    return out


def test_moe_blocks_share_their_graphs_at_any_depth():
    """A mixture of experts' blocks share dynamo's graphs as dense blocks do: the graphs compiled do not grow with the
    number of MoE layers. The balancing observer's lookups by layer and by micro-batch run eagerly
    (parallel/moe_balance.py); traced, dynamo took each layer's index for a constant and compiled the block's tail again
    per layer, until its recompile limit (8) left the deeper layers uncompiled. Dynamo's own graphs (the eager
    backend: no kernels built), one process."""
    graphs, = run_world(1, _graphs, timeout=300)
    for i in range(0, len(graphs), len(DEPTHS)):
        shallow, deep = graphs[i:i + len(DEPTHS)]
        assert 0 < shallow == deep, (ROUTED[i].get("moe_aux_loss", "sequence"), graphs)
