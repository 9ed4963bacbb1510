"""Mixed precision: bf16 autocast and fp16 with dynamic loss scaling, at (1,1,1) and composed with tp and pp, and a
mixture of experts in bf16 at ep 2 × tp 2, stay close to the fp32 one-process run of their model; an fp16 overflow
skips the step on every rank and halves the scale."""

from __future__ import annotations

import math

import torch

from helpers.distributed import run_world
from helpers.parity import MOE, VOCAB, global_batches, parity_config, run_groups
from trainer3d.train.setup import validate
from trainer3d.train.trainer import Trainer

LAYOUTS = [
    dict(precision="bf16"),
    dict(precision="fp16"),
    dict(dp=1, tp=2, pp=2, precision="bf16", micro_batches=2),
    dict(dp=1, tp=2, pp=2, precision="fp16", micro_batches=2),
    dict(dp=1, tp=2, cp=2, sequence_parallel=True, precision="bf16", micro_batches=2),  # cp's kernels in bf16
]
# the router in fp32 under autocast, the experts' grouped matmul and the all-to-all's rows in bf16
MOE_LAYOUTS = [dict(dp=2, tp=2, ep=2, sequence_parallel=True, precision="bf16", **MOE)]


def test_mixed_precision_tracks_fp32():
    """Within 2e-3 of fp32, and not equal to it: the modules computed in the precision asked for (the dtypes their
    outputs had in the first step), and the losses moved by more than five times fp32's parity noise (every fp32 layout
    is within 2e-7 of the one-process run: tests/helpers/parity.py's tables)."""
    groups = [({}, LAYOUTS), (MOE, MOE_LAYOUTS)]
    results = run_world(4, run_groups, groups, 6, timeout=600)
    rows = [(g, i, layout) for g, (_, layouts) in enumerate(groups) for i, layout in enumerate(layouts, start=1)]
    assert all(results[0][g][0]["dtypes"] == set() for g in range(len(groups)))  # fp32: not watched
    for g, i, layout in rows:
        ref = results[0][g][0]["losses"]
        run = next(r[g][i] for r in results if r[g][i] is not None)
        rel = max(abs(a - b) / b for a, b in zip(run["losses"], ref))
        dtype = {"bf16": "bfloat16", "fp16": "float16"}[layout["precision"]]
        print(f"{layout}: {rel:.1e} from fp32, computed in {sorted(run['dtypes'])}")
        assert all(math.isfinite(x) for x in run["losses"])
        assert dtype in run["dtypes"], f"{layout}: no module computed in {dtype} ({run['dtypes']})"
        assert 1e-6 < rel < 2e-3, f"{layout}: {rel:.2e} from fp32"  # fp32's layouts agree to 2e-7


def _overflow(rank, world_size):
    cfg = parity_config(precision="fp16", n_layer=2)
    setup = validate(cfg, 1, VOCAB)
    trainer = Trainer(setup, setup.topology(), torch.device("cpu"), cfg.model_config(VOCAB))
    batch = global_batches(1)[0]
    before = {k: v.clone() for k, v in trainer.engine.stage_modules[0].state_dict().items()}
    trainer.loss_scale.scale = 2.0**120  # fp16 overflows: max is 65504
    rec = trainer.train_step(batch)
    unchanged = all(torch.equal(before[k], v) for k, v in trainer.engine.stage_modules[0].state_dict().items())
    return rec, unchanged


def test_fp16_overflow_skips_step_and_halves_scale():
    rec, unchanged = run_world(1, _overflow, timeout=300)[0]
    assert rec["skipped"] and unchanged and rec["loss_scale"] == 2.0**119
    assert not math.isfinite(rec["grad_norm"])


def test_norm_rule_rows_and_one_kernel_agree():
    """parallel/engine.py's sum_of_squares, both readings: rows of NORM_CHUNK (CPU: within 1e-8 of a float64 sum on
    3.2M elements, where torch's norm of the whole drifts by 1e-4) and one foreach norm per dtype (what CUDA runs,
    forced here), on float32 and bf16 gradients (summed in float32) with an empty one among them."""
    from trainer3d.parallel.engine import sum_of_squares

    g = torch.Generator().manual_seed(0)
    small = [torch.randn(n, generator=g) for n in (1, 7, 4096, 4100)] + [torch.empty(0)] + \
        [torch.randn(48, 64, generator=g).bfloat16()]
    exact = sum(float(t.double().square().sum()) for t in small)
    cpu = torch.device("cpu")
    rows, one_kernel = sum_of_squares(small, cpu, foreach=False), sum_of_squares(small, cpu, foreach=True)
    assert rows.dtype == one_kernel.dtype == torch.float64
    assert abs(rows.item() / exact - 1) < 1e-6 and abs(one_kernel.item() / exact - 1) < 1e-6, (rows, one_kernel, exact)
    big = torch.randn(3_200_000, generator=g)
    exact = float(big.double().square().sum())
    assert abs(sum_of_squares([big], cpu).item() / exact - 1) < 1e-8  # 2.4e-9 here
    # torch's own norm of the whole tensor (get_total_norm's) drifts by 1.3e-4 here: what the rows are for
    assert abs(float(torch.linalg.vector_norm(big)) ** 2 / exact - 1) > 1e-5
