"""The parity matrix: every layout must reproduce the one-process run (same init, same data, fp32, dropout 0, clipping
active) for 6 steps (5 in the world of 8), within tests/helpers/parity.py's tolerances (per-step loss and gradient norm, final
parameters), with the tied embedding's copies bitwise identical under pp > 1.

Each world is spawned once and runs its reference and all its layouts in sequence (tests/helpers/parity.py)."""

from __future__ import annotations

from helpers import parity
from helpers.distributed import run_world
from helpers.parity import (
    LLAMA, LOSS_RTOL, MOE, MOE_BALANCED, MOE_GLOBAL, PARAM_ATOL, as_trained, check, compare, run_groups, run_layouts,
)
from trainer3d.config import RECOMPUTE_MODES
from trainer3d.parallel.batch import default_micro_batches
from trainer3d.parallel.pipeline import PIPELINING_BEFORE_2_13, SCHEDULES

# Steps cost more than the spawn here (8 processes on 2 cores: a world's time about halves from 10 steps to 5), so the
# worlds train past the warm-up (3 steps) and no further: 6 steps in the worlds of 2 and 4 (three logging intervals of
# two for the straggler check), 5 in the world of 8; every per-step loss and norm and the final parameters compared
STEPS = 6
STEPS_8 = 5
ALL_SCHEDULES = list(SCHEDULES)


def case(dp=1, tp=1, pp=1, schedule="1f1b", **features):
    info = SCHEDULES[schedule]
    v = 2 if info.multi_stage and not info.v_shape else 1
    micro = max(2, default_micro_batches(schedule, pp))  # the default, and at least 2 (accumulation)
    return dict(dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v, micro_batches=micro, **features)


def factorisations(world: int):
    for tp in (1, 2, 4, 8):
        for pp in (1, 2, 4, 8):
            if world % (tp * pp) == 0:
                yield world // (tp * pp), tp, pp


def allowed(c) -> bool:
    """What the parity model (8 blocks, 8 heads) allows: at most one block per stage."""
    info = SCHEDULES[c["schedule"]]
    stages = c["pp"] * (2 if info.v_shape else c["virtual_stages"])
    return stages <= 8


def full_matrix(world: int) -> list[dict]:
    cases = []
    for dp, tp, pp in factorisations(world):
        for s in ALL_SCHEDULES if pp > 1 else ["1f1b"]:
            c = case(dp, tp, pp, s)
            if allowed(c):
                cases.append(c)
    return cases


def world8_matrix() -> list[dict]:
    """All 10 factorisations of 8 with 1F1B and the deep pipelines' variants (every schedule at pp 2 and 4 beside dp
    or tp: the world of 4)."""
    cases = [case(dp, tp, pp) for dp, tp, pp in factorisations(8)]
    cases += [case(1, 2, 4, "interleaved-1f1b"), case(2, 1, 4, "zbv"), case(1, 1, 8, "gpipe")]
    # features against the same one-process reference without them (each mode at every layout of 4: dropout_cases)
    cases += [case(2, 2, 2, recompute="full"), case(1, 2, 4, "interleaved-1f1b", recompute="selective")]
    # sequence parallelism: with pp (stage boundaries carry sequence shards), interleaved with selective recomputation,
    # tp 4, and a split backward (zbv: the input and the weight pass both recompute)
    sp = dict(sequence_parallel=True)
    cases += [case(2, 2, 2, **sp), case(1, 2, 4, "interleaved-1f1b", recompute="selective", **sp), case(1, 4, 2, **sp)]
    if not PIPELINING_BEFORE_2_13:  # refused there (check_pipeline; test_layout)
        cases.append(case(2, 2, 2, "zbv", recompute="full", **sp))
    return cases + AUTO8


def world4_matrix() -> list[dict]:
    """Every layout of 4 processes, and sequence parallelism at (1,2,1); then --layout auto (AUTO4)."""
    return full_matrix(4) + [case(1, 2, 1, sequence_parallel=True)] + AUTO4


# --layout auto: the planner's pick for the world (plan/auto.py), free and with --pp 2 kept (it then picks the schedule,
# virtual stages and micro-batches); the free one with rank 3 slowed (parity.SLOW_S of batch fetch a step): a straggler
AUTO4 = [dict(layout="auto", world=4, slow_rank=3), dict(layout="auto", world=4, pp=2)]
AUTO8 = [dict(layout="auto", world=8)]


def assert_straggler_named(run: dict, rank: int, every: int = 2, intervals: int = 3) -> None:
    """The step times the loss all-reduce gathered name `rank`, slowed, from its `intervals`-th logging interval of
    `every` steps on, and only it (factor 3: a slowed forward takes 7-60 times an unslowed one on 2 shared cores;
    the other ranks' jitter stays well below 3 times the median)."""
    from trainer3d.train.stragglers import StragglerWatch

    watch, named = StragglerWatch(3.0, intervals), []
    times = run["rank_step_times"]
    assert len(times) == STEPS and all(len(t) == 4 for t in times)
    for k in range(0, STEPS, every):
        for t in times[k:k + every]:
            watch.add(t)
        report = watch.report()
        assert report["step_time_max"] > parity.SLOW_S > 3 * report["step_time_median"], report
        named.append(sorted(report.get("stragglers", {})))
    print(f"\nstragglers by logging interval: {named}; {watch.lines()}")
    assert named == [[]] * (intervals - 1) + [[f"rank{rank}"]] * (STEPS // every - intervals + 1), named


def llama_matrix() -> list[dict]:
    """Llama where its parts meet the parallelism, against the one-process Llama run: grouped-query attention and
    rotary positions under tp (2 of its 4 kv heads per rank at tp 2, one at tp 4) and sequence parallelism, the fused
    q|k|v and gate|up under tp, the untied head on the last stage, an interleaved schedule with recomputation and a
    zero-bubble one (ZeRO-3 + CPU offload: tests/test_zero.py's world 8). (Its row at (2,2,2) ZBV with full
    recomputation, the world's slowest with GPT-2's, was dropped: a split backward whose passes both recompute is
    GPT-2's (2,2,2) ZBV row, Llama's blocks under a split backward dualpipev here, under full recomputation
    tests/test_context_parallel.py's interleaved cp 2 row.)"""
    return [case(2, 4, 1, sequence_parallel=True, **LLAMA),
            case(1, 2, 4, "interleaved-1f1b", recompute="selective", sequence_parallel=True, **LLAMA),
            case(2, 1, 4, "dualpipev", **LLAMA)]


def sft_matrix() -> list[dict]:
    """Supervised fine-tuning's rows (tests/helpers/parity.py: SFT) against the one-process packed run: tp 2 × pp 2 and dp 2 ×
    cp 2 packed (each micro-batch, dp rank and cp chunk holding its own count of supervised targets), and the same
    conversations one per row (--no-pack) at one process and at dp 2 × pp 2: packed equals unpacked."""
    return [case(1, 2, 2, sft="packed"), case(2, 1, 1, cp=2, sft="packed"), case(1, sft="unpacked"),
            case(2, 1, 2, sft="unpacked")]


# A mixture of experts on SFT's padded rows (tests/helpers/parity.py: SFT): the padding counted in no load or balance loss
MOE_PADDED = dict(MOE_BALANCED, sft="packed")
MOE_GLOBAL_PADDED = dict(MOE_GLOBAL, sft="packed")


def moe_padding_matrix() -> list[dict]:
    """The per-sequence balance on padded rows against the one-process run: cp 2 × tp 2 (a sequence's real length
    kept whole where cp and tp split its tokens) and dp 2 × pp 2 (padding that differs between micro-batches)."""
    return [case(1, 2, cp=2, ep=2, **MOE_PADDED), case(2, 1, 2, ep=2, **MOE_PADDED)]


def moe_global_matrix() -> list[dict]:
    """The global-batch balance loss on padded rows, one micro-batch a dp rank as the one-process run has (with
    accumulation micro-batch m counts micro-batches 0..m: parallel/moe_balance.py): dp 4 × ep 2 and dp 2 × tp 2 (SP)
    × ep 2, the loads all-reduced over every rank of the stage."""
    return [dict(case(4, ep=2, **MOE_GLOBAL_PADDED), micro_batches=1),
            dict(case(2, 2, ep=2, sequence_parallel=True, **MOE_GLOBAL_PADDED), micro_batches=1)]


def moe_global_accumulating_matrix() -> list[dict]:
    """... and with accumulation against the one-process run of the same 2 micro-batches (micro-batch m's loads those
    of micro-batches 0..m): tp 2 × pp 2, the loads summed over each pipeline rank's tp pair."""
    return [case(1, 2, 2, **MOE_GLOBAL_PADDED)]


def test_loss_parity_world4_and_sft():
    groups = [({}, world4_matrix()), ({"sft": "packed"}, sft_matrix()), (MOE_PADDED, moe_padding_matrix()),
              (MOE_GLOBAL_PADDED, moe_global_matrix()),
              (dict(MOE_GLOBAL_PADDED, micro_batches=2), moe_global_accumulating_matrix())]
    results = run_world(4, run_groups, groups, STEPS, timeout=900)
    failures = []
    for g, (reference, matrix) in enumerate(groups):
        print(f"\nreference: {reference or 'GPT-2'}")
        failures += check([r[g] for r in results], as_trained([r[g] for r in results], matrix))
    assert not failures, "\n".join(failures)
    slowed = world4_matrix().index(AUTO4[0]) + 1
    assert_straggler_named(results[0][0][slowed], 3)
    assert results[0][0][slowed]["layout_choice"]["pick"].startswith("dp4 tp1 pp1")  # the plan's ranking on CPU
    assert results[0][0][slowed + 1]["resolved"]["pp"] == 2  # --pp 2 kept


def test_loss_parity_world2_and_the_check_catches_a_gradient_scale_error():
    """Every layout of 2 processes; and, in the same world, (2,1,1) clipped at every step (at 0.1), once as it is and
    once with every gradient doubled (what a missing 1/dp gives): the clip normalizes a constant scale away, so the
    doubled run stays within the loss and parameter bounds, which were all the check compared before the gradient
    norm, and the norm catches it."""
    matrix = full_matrix(2)
    clipped = case(2, grad_clip=0.1)
    injected = dict(clipped, grad_scale_error=2.0)
    results = run_world(2, run_layouts, matrix + [clipped, injected], STEPS, timeout=900)
    failures = check(results, matrix)
    assert not failures, "\n".join(failures)
    n = len(matrix)
    clean = next(r[n + 1] for r in results if r[n + 1] is not None and "params" in r[n + 1])
    bad = compare([r[n + 2] for r in results if r[n + 2] is not None], clean, injected)
    print(f"doubled gradients against the same run without the error: {bad}")
    assert bad.loss <= LOSS_RTOL and bad.param <= PARAM_ATOL and bad.tied_ok, bad  # the old check passed it
    assert bad.norm > 0.9 and not bad.ok, bad  # the norm doubles: caught


def moe_matrix() -> list[dict]:
    """A mixture of experts where it meets every axis, against the one-process run: experts split over ep 2 and 4
    (all-to-all), ep carved from cp, 1F1B, interleaved (recomputing selectively) and zero-bubble pipelines, a stage
    holding only the dense block (pp 8: block 0). tp with sequence parallelism (each tp rank routing its own tokens)
    and full recomputation over a pipeline are balanced_matrix's rows at the same layouts: the same model with the
    balancing losses added, which run everything these rows ran."""
    return [case(2, ep=2, **MOE), case(4, ep=4, **MOE), case(1, cp=2, ep=2, **MOE),
            case(2, 1, 2, "interleaved-1f1b", ep=2, recompute="selective", **MOE), case(2, 1, 2, "zbv", ep=2, **MOE),
            case(1, 1, 8, **MOE)]


def balanced_matrix() -> list[dict]:
    """The balancing losses (a sequence's statistics counted alike whatever splits it) at layouts that split a
    sequence (cp, tp) or its batch (dp, micro-batches, pipelines), recomputing."""
    return [case(2, 2, ep=2, sequence_parallel=True, **MOE_BALANCED), case(1, 2, cp=2, ep=2, **MOE_BALANCED),
            case(2, 1, 2, ep=2, recompute="full", **MOE_BALANCED)]


def test_loss_parity_world8_gpt2_llama_and_moe():
    """One world of 8 runs every group against its own one-process reference: GPT-2's matrix, Llama's, the mixture
    of experts' and the balancing features'."""
    groups = [({}, world8_matrix()), (LLAMA, llama_matrix()), (MOE, moe_matrix()), (MOE_BALANCED, balanced_matrix())]
    results = run_world(8, run_groups, groups, STEPS_8, timeout=1200)
    llama = results[0][1][0]["params"]
    assert "self_attn.qkv_proj" in " ".join(llama) and "lm_head.weight" in llama
    assert "layers.1.mlp.experts.gate_up_proj" in results[0][2][0]["params"]  # the MoE model has its experts
    assert len(results[0][3][0]["tables"]) == 7  # every MoE layer's selection bias is a table (compared bitwise)
    failures = []
    for g, (reference, matrix) in enumerate(groups):
        print(f"\nreference: {reference or 'GPT-2'}")
        failures += check([r[g] for r in results], as_trained([r[g] for r in results], matrix))
    assert not failures, "\n".join(failures)


MODES = RECOMPUTE_MODES


def dropout_cases() -> list[dict]:
    """(1,2,2) 1F1B with dropout 0.2 (replicated and head-sharded masks, four micro-batches in flight): the same
    run with recompute none, selective and full; then again under sequence parallelism (every dropout outside
    attention on sequence shards, drawn from the per-tp-rank stream)."""
    return [dict(tp=2, pp=2, micro_batches=4, dropout=0.2, recompute=m, sequence_parallel=sp)
            for sp in (False, True) for m in MODES]


def test_recompute_replays_dropout_masks():
    """Recomputation draws every dropout mask again; the losses must not move (bitwise: same masks, same math)."""
    results = run_world(4, run_layouts, dropout_cases(), 6, timeout=600)
    losses = [next(r[i] for r in results if r[i] is not None)["losses"] for i in range(1, 7)]
    for name, runs in (("", losses[:3]), (" sequence-parallel", losses[3:])):
        print(f"\nrecompute none/selective/full with dropout 0.2 at 1x2x2{name}: "
              + " ".join(f"{run[-1]:.6f}" for run in runs))
        assert runs[0] != results[0][0]["losses"]  # dropout is on: not the dropout-free reference
        assert runs[1] == runs[0] and runs[2] == runs[0], runs
    # sequence parallelism draws its masks per sequence shard: other masks, the same loss to within dropout's noise
    assert losses[3] != losses[0] and abs(losses[3][-1] - losses[0][-1]) < 0.05 * losses[0][-1]
