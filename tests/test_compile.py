"""--compile against the one-process eager run (fp32, dropout 0, same seed and data, 6 steps, losses, gradient norms
and final parameters within tests/parity.py's tolerances, and dynamo's compiled graphs counted) at (1,1,1), (1,2,2) 1F1B and tp 2 × cp 2 (the cp
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

from distributed import run_world
from parity import MOE, check, run_groups
from test_parity import case

STEPS = 6  # test_parity.STEPS
PARITY = [case(compile=True), case(1, 2, 2, compile=True), case(1, 2, cp=2, compile=True)]  # cp: attention eager
# Blocks share their compiled code (same code, same guards), so the parity model's 8 blocks cost one block's compile.
DROPOUT = [dict(tp=2, pp=2, micro_batches=4, dropout=0.2, compile=True, recompute=m) for m in ("selective", "full")]
EXPERTS = [case(2, ep=2, compile=True, **MOE)]


def test_compile_matches_eager_and_replays_dropout():
    grouped = run_world(4, run_groups, [({}, PARITY + DROPOUT), (MOE, EXPERTS)], STEPS, timeout=600)
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
