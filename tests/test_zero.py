"""DeepSpeed ZeRO as the data-parallel axis (trainer3d/zero/), composed with TP and PP.

- Parity: per-step losses of every ZeRO stage (0-3), with and without CPU offload, under 1F1B and interleaved
  1F1B, equal the one-process reference within tests/helpers/parity.py's tolerances (fp32, 5 steps, clipping active):
  losses, grad norms and final parameters (gathered from ZeRO's fp32 masters). (DDP at the same layouts is
  tests/test_parity.py's.)
- Memory: under ZeRO-3 each rank holds 1/dp of its stage's parameters, gradients and optimizer states.
- ZeRO-Infinity: NVMe offload (nvme_path on local disk) trains, with the same parity.
- Config: the JSON's "auto" values, contradictions and bad input fail before any process group.
- Glue: the DeepSpeed internals trainer3d/zero/ relies on still exist (an upgrade that moves them fails here).

Each world is spawned once and runs the reference and all ZeRO cases (module-scoped fixtures).
DeepSpeed's JIT ops must be prebuilt (`python -m trainer3d.zero --build-ops`, which .ci/run does); tests never
build them (a killed build leaves a lock that hangs every later run).
"""

from __future__ import annotations

import copy
import json
import math
import os
import time
from pathlib import Path

import deepspeed  # noqa: F401 - required: a broken install fails here, not as skips
import pytest
import torch

from helpers.distributed import run_world
from helpers.ds_ops import nvme_op_available, require_ops
from helpers.parity import (
    LLAMA, LOSS_RTOL, MODEL_FLAGS, MOE, MOE_BALANCED, NORM_RTOL, PARAM_ATOL, SFT, VOCAB, FeatureWatch,
    max_rel as rel, parity_config, rows_of, step_batches, train_layout,
)
from trainer3d.zero import config as deepspeed_config
from trainer3d.zero import ops as zero_ops
from trainer3d.zero import glue as zero_glue
from trainer3d.config import parse_args
from trainer3d.errors import ConfigError
from trainer3d.train.setup import validate
from trainer3d.distributed.topology import Layout, Topology

# test_parity.STEPS_8: 2 steps past the warm-up (3 steps), the last at a decayed learning rate. (test_parity's worlds of
# 2 and 4 train 6 for its straggler check's three logging intervals of two, which has no counterpart here.)
STEPS = 5
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))




# ---- cases -----------------------------------------------------------------------------------------------------
def ds_config(stage: int, offload: str = "none", nvme_path: str | None = None, bf16: bool = False) -> dict:
    """fp32 (no bf16 section), buckets small enough that several fill per step (a stage has ~0.25-0.45M
    elements), every ZeRO-3 parameter partitioned (persistence threshold 0)."""
    z = {"stage": stage, "reduce_bucket_size": 100000, "allgather_bucket_size": 100000}
    if stage == 3:
        z.update(stage3_param_persistence_threshold=0, stage3_prefetch_bucket_size=100000)
    if offload in ("opt", "all"):
        z["offload_optimizer"] = {"device": "cpu"}
    if offload == "all":
        z["offload_param"] = {"device": "cpu"}
    if offload in ("nvme", "nvme-opt"):  # ZeRO-Infinity; max_in_cpu 0: every swappable parameter goes to disk
        z["offload_optimizer"] = {"device": "nvme", "nvme_path": nvme_path, "fast_init": False}
        z["offload_param"] = {"device": "cpu"}
    if offload == "nvme":
        z["offload_param"] = {"device": "nvme", "nvme_path": nvme_path, "buffer_count": 5, "buffer_size": 2**20, "max_in_cpu": 0}
    cfg = {
        "train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
        "gradient_clipping": "auto", "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
        "zero_optimization": z,
    }
    if bf16:
        cfg["bf16"] = {"enabled": True}
    if offload.startswith("nvme"):
        cfg["aio"] = {"block_size": 262144, "queue_depth": 4, "thread_count": 1, "single_submit": False, "overlap_events": True}
    return cfg


def layout(dp=2, tp=1, pp=1, schedule="1f1b"):
    v = 2 if schedule == "interleaved-1f1b" else 1
    return dict(dp=dp, tp=tp, pp=pp, schedule=schedule, virtual_stages=v, micro_batches=2)  # accumulation too


def label(lay: dict, ds: dict | None) -> str:
    name = f"{lay['dp']}x{lay['tp']}x{lay['pp']} {lay['schedule']}"
    if lay.get("cp", 1) > 1:
        name += f" cp={lay['cp']}"
    if lay.get("recompute", "none") != "none":
        name += f" recompute={lay['recompute']}"
    if lay.get("sequence_parallel"):
        name += " sequence-parallel"
    if lay.get("compile"):
        name += " compile"
    if "model" in lay:
        name += f" {lay['model']}"
    if "sft" in lay:
        name += f" sft {lay['sft']}"
    if "fp8" in lay:
        name += f" fp8 {lay['fp8']} (vs DDP with it)"
    if ds is None:
        return name + " DDP"
    z = ds["zero_optimization"]
    off = z.get("offload_optimizer", {}).get("device", "none")
    par = z.get("offload_param", {}).get("device", "none")
    return f"{name} ZeRO-{z['stage']} offload(opt={off},param={par})"


# ---- what runs inside the spawned world -------------------------------------------------------------------------
def train_zero(world_size: int, lay: dict, ds: dict, steps: int) -> dict | None:
    from deepspeed.utils import z3_leaf_module
    from trainer3d.models import canonical_name
    from trainer3d.parallel.engine import is_tied_duplicate
    from trainer3d.parallel.parallelize import named_full_params
    from trainer3d.parallel.shards import gather_full
    from trainer3d.train.trainer import Trainer
    from trainer3d.zero.experts import over_edp

    lay = dict(lay)
    sft = lay.pop("sft", None)
    n = lay.get("tp", 1) * lay.get("pp", 1) * lay.get("cp", 1) * lay.pop("dp", 1)
    cfg = parity_config(**lay, **SFT.get(sft, {}), deepspeed_config=copy.deepcopy(ds))
    setup = validate(cfg, n, VOCAB)
    L, plan = setup.layout, setup.plan
    topo = setup.topology(list(range(n)))
    result = None
    if topo.active:
        t0 = time.perf_counter()
        trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(VOCAB), boundary=VOCAB)
        t_init = time.perf_counter() - t0
        per = plan.global_batch // L.dp
        losses, norms, records = [], [], []
        t0 = time.perf_counter()
        watch = FeatureWatch(trainer, dtypes=False, compiled=cfg.compile)
        for batch in step_batches(steps, sft=sft):
            rec = trainer.train_step(rows_of(batch, topo.dp_rank, per))
            losses.append(rec["loss"])
            norms.append(rec["grad_norm"])
            records.append(rec)
            watch.stop()
        t_steps = time.perf_counter() - t0
        zdp = trainer.engine
        # final parameters from ZeRO's fp32 masters (collective over dp, then tp)
        params = {}
        for name, (p, spec) in named_full_params(trainer.parallel_model).items():
            params[name] = gather_full(zdp.param_value(p), spec, topo.shard_group(spec))
        head_copy = {}
        for m in trainer.parallel_model.stages:
            if m.head is not None and is_tied_duplicate(m, m.head.weight):
                w = m.head.weight
                head_copy[canonical_name(m.cfg, f"{m.HEAD}.weight")] = gather_full(zdp.param_value(w), w.tp_spec,
                                                                                 topo.tp_group)
        # the memory formula: this rank's stage parameters, each partitioned on its own over dp×cp (ZeRO-3), an
        # expert under ep over edp (zero/experts.py)
        seen, numel, part = set(), 0, 0
        for e in zdp.engines:
            for p in zdp.params_of(e):
                if id(p) not in seen:
                    seen.add(id(p))
                    full = p.ds_numel if hasattr(p, "ds_numel") else p.numel()
                    numel += full
                    part += -(-full // (L.edp if over_edp(L, getattr(p, "tp_spec", None)) else L.dp_cp))
        mem = {k: v for k, v in records[-1].items() if k.endswith("_bytes")}
        nvme = (ds["zero_optimization"].get("offload_optimizer") or {}).get("nvme_path")
        swapped = {"optimizer": 0, "params": 0}  # ZeRO-Infinity: this rank's swap files (.../<kind>/rank<r>/)
        if nvme:
            for root, _, files in os.walk(nvme):
                parts = root.split(os.sep)
                if f"rank{torch.distributed.get_rank()}" in parts:
                    kind = "optimizer" if "optimizer" in parts else "params"
                    swapped[kind] += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        result = {
            "losses": losses, "grad_norms": norms, "coords": (topo.pp_rank, topo.dp_rank, topo.tp_rank),
            "module_dtypes": sorted({str(p.dtype) for e in zdp.engines for p in zdp.params_of(e)}),
            "compiled_graphs": watch.graphs,
            "memory": mem, "stage_numel": numel, "partition_numel": part, "init_s": t_init, "step_s": t_steps / steps,
            "nvme_swap": swapped, "shm_op": deepspeed.comm.comm.cdb.shm_comm_op is not None,
            "leaf_blocks": [z3_leaf_module(b) for m in trainer.parallel_model.stages for b in m.blocks.values()],
        }
        if topo.tp_rank == 0 and topo.dp_rank == 0:
            result.update(params=params, head_copy=head_copy)
        for e in zdp.engines:
            e.destroy()
    topo.destroy()
    return result


def other_models(cases: list) -> list[dict]:
    """The model flags of cases that train another model than the default GPT-2 (each needs its own reference)."""
    out = []
    for lay, _ in cases:
        model = {k: lay[k] for k in MODEL_FLAGS if k in lay}
        if model and model not in out:
            out.append(model)
    return out


def run_cases(rank: int, world_size: int, cases: list, steps: int) -> list:
    """The one-process reference first, then every (layout, ds config or None for DDP) case, then the one-process
    reference of each other model the cases train (other_models)."""
    out = [train_layout(world_size, {}, steps)]
    for lay, ds in cases:
        if ds is None:
            res = train_layout(world_size, lay, steps)
            if res is not None and not lay.get("fp8"):  # a DDP row is a reference only for FP8 (check_world)
                res.pop("params", None)
        else:
            res = train_zero(world_size, lay, ds, steps)
        out.append(res)
    return out + [train_layout(world_size, model, steps) for model in other_models(cases)]


# ---- checking -------------------------------------------------------------------------------------------------------
def check_world(results: list, cases: list) -> tuple[list[str], list[str]]:
    refs = {(): results[0][0]}
    models = other_models(cases)
    for j, model in enumerate(models):  # last in the world's list (after any cases the world ran beyond `cases`)
        refs[tuple(model.items())] = results[0][len(results[0]) - len(models) + j]
    assert all(max(r["grad_norms"]) > 0.5 for r in refs.values()), "clipping (at 0.5) should be active in the references"
    ddp_fp8 = {json.dumps(lay, sort_keys=True): results[0][i] for i, (lay, ds) in enumerate(cases, start=1)
               if ds is None and lay.get("fp8")}
    table, failures = [], []
    for i, (lay, ds) in enumerate(cases, start=1):
        per_rank = [r[i] for r in results if r[i] is not None]
        losses = per_rank[0]["losses"]
        name = label(lay, ds)
        model = tuple((k, lay[k]) for k in MODEL_FLAGS if k in lay)
        ref = ddp_fp8[json.dumps(lay, sort_keys=True)] if ds is not None and lay.get("fp8") else refs[model]
        if ds is None and lay.get("fp8"):
            continue  # the reference of the next row
        if not all(r["losses"] == losses for r in per_rank):
            failures.append(f"{name}: ranks disagree on the loss")
        vs_ref = rel(losses, ref["losses"])
        vs_norm = rel(per_rank[0]["grad_norms"], ref["grad_norms"])
        params, head = {}, {}
        for r in per_rank:
            params.update(r.get("params", {}))
            head.update(r.get("head_copy", {}))
        dparam = max((params[k] - ref["params"][k]).abs().max().item() for k in ref["params"])
        tied = max([(head[k] - params[k]).abs().max().item() for k in head] or [0.0])
        if lay["pp"] > 1 and not head and not model:
            tied = math.inf  # a last stage without the (tied GPT-2) embedding must hold a copy
        table.append(
            f"{name:<58} loss vs 1-proc {vs_ref:.1e}  grad_norm {vs_norm:.1e}  "
            f"param {dparam:.1e}  tied {tied:.0e}  init {per_rank[0]['init_s']:.1f}s  step {per_rank[0]['step_s']:.2f}s"
        )
        if set(params) != set(ref["params"]):
            failures.append(f"{name}: parameters missing after gathering")
        loss_tol, norm_tol, param_tol = (FP8_RTOL, 10 * FP8_RTOL, 10 * FP8_RTOL) if lay.get("fp8") else \
            (LOSS_RTOL, NORM_RTOL, PARAM_ATOL)
        if vs_ref > loss_tol or vs_norm > norm_tol or dparam > param_tol or tied > 1e-6:
            failures.append(
                f"{name}: loss rel diff vs 1-proc {vs_ref:.2e}, grad norm {vs_norm:.2e}, "
                f"param {dparam:.2e}, tied copies {tied:.2e}"
            )
    return table, failures


def check_memory(results: list, cases: list) -> list[str]:
    """ZeRO-3: parameters, gradients and optimizer states (fp32 master + 2 Adam moments) are 1/dp of the stage
    (each parameter padded to a multiple of dp); offloaded ones are reported as such."""
    lines, failures = [], []
    for i, (lay, ds) in enumerate(cases, start=1):
        if ds is None or ds["zero_optimization"]["stage"] != 3:
            continue
        z = ds["zero_optimization"]
        for r in (r[i] for r in results if r[i] is not None):
            m, P, N = r["memory"], 4 * r["partition_numel"], 4 * r["stage_numel"]
            expect = {"param_bytes": P, "grad_bytes": P}
            ok = all(m[k] == v for k, v in expect.items()) and 3 * P <= m["optim_bytes"] <= 3 * P + 64
            if z.get("offload_param"):
                ok &= m["param_offloaded_bytes"] == m["param_bytes"]
            if z.get("offload_optimizer"):
                ok &= m["optim_offloaded_bytes"] == m["optim_bytes"] and m["grad_offloaded_bytes"] == m["grad_bytes"]
            else:
                ok &= m["optim_offloaded_bytes"] == 0
            lines.append(
                f"{label(lay, ds):<58} rank(pp,dp,tp)={r['coords']} stage {N} B, formula 1/dp {P} B: "
                f"params {m['param_bytes']} grads {m['grad_bytes']} optim {m['optim_bytes']} "
                f"(offloaded {m['param_offloaded_bytes']}/{m['grad_offloaded_bytes']}/{m['optim_offloaded_bytes']})"
            )
            if not ok:
                failures.append(lines[-1])
    return lines, failures


# ---- the worlds -----------------------------------------------------------------------------------------------------
FP8_RTOL = 1e-3  # test_fp8.py's bound of FP8 against bf16, here of ZeRO-3 with FP8 against DDP with FP8


def world2_cases():
    lay = layout(2)
    cases = [(lay, ds_config(s)) for s in (0, 1, 2, 3)]
    cases += [(lay, ds_config(1, "opt")), (lay, ds_config(3, "all"))]  # ZeRO-2 + offload: worlds 4 and 8
    cases += [(dict(lay, compile=True), ds_config(3))]  # ZeRO-3 gathering around compiled blocks
    cases += [(dict(lay, sft="packed"), ds_config(3))]  # supervised fine-tuning's rows (tests/helpers/parity.py: SFT)
    # FP8 matmuls on ZeRO-3's gathered parameters (emulated), against DDP with FP8 at the same layout (a rowwise scale
    # over a dp rank's tokens differs from one over all of them: FP8 at dp 2 is not the one-process FP8 run), within
    # FP8_RTOL: ZeRO-3's reduce-scatter sums in another order (1e-8 in the weights), and a weight that close to a float8
    # rounding boundary casts to the neighbouring value (a 1e-3 change of its gradient); ZeRO-1 equals DDP exactly
    cases += [(dict(lay, fp8="rowwise"), None), (dict(lay, fp8="rowwise"), ds_config(3))]
    return cases


# DeepSpeed swaps only tensors of at least 1 MiB (swap_tensor/utils.py MIN_AIO_BYTES): the ZeRO-Infinity cases
# use a model whose embedding partition (8192 x 128 / dp) and optimizer sub-groups are larger than that.
NVME_MODEL = dict(n_embd=128, vocab_size=8192, n_layer=2)


def nvme_cases(nvme_path: str):
    """fp32: optimizer (and its fp32 gradients) on NVMe, parameters on CPU -- parity with DDP. bf16: parameters
    and optimizer on NVMe -- equal to the same bf16 run with CPU offload (DeepSpeed 0.19.8 cannot swap fp32
    parameters on a CPU host, see deepspeed_config.resolve_deepspeed)."""
    lay, lay16 = dict(layout(2), **NVME_MODEL), dict(layout(2), precision="auto", **NVME_MODEL)
    paths = [os.path.join(nvme_path, kind) for kind in ("fp32", "bf16")]  # one per run: swap files are counted
    for path in paths:
        os.makedirs(path, exist_ok=True)
    return [
        (lay, None),
        (lay, ds_config(3, "nvme-opt", paths[0])),
        (lay16, ds_config(3, "all", bf16=True)),
        (lay16, ds_config(3, "nvme", paths[1], bf16=True)),
    ]


def world4_cases():
    cases = []
    a, b, c = layout(2, tp=2), layout(2, pp=2), layout(2, pp=2, schedule="interleaved-1f1b")
    # each stage over tp and over pp (ZeRO-1 over a pipeline: the interleaved rows below)
    cases += [(a, ds_config(s)) for s in (1, 3)]
    cases += [(b, ds_config(s)) for s in (2, 3)] + [(b, ds_config(2, "opt"))]
    cases += [(c, ds_config(1)), (c, ds_config(3, "all"))]
    # context parallelism: gradients reduced and ZeRO's partitions cut over dp×cp (4 ranks), and cp with a pipeline
    cases += [(dict(layout(2), cp=2), ds_config(3, "all")), (dict(layout(1, pp=2), cp=2), ds_config(3, "all"))]
    # a mixture of experts with its experts over ep 2: their state partitioned over edp 2 (ZeRO-3 with offload) and
    # whole per edp rank under tp 2 (ZeRO-1), the rest over dp (zero/experts.py)
    cases += [(dict(layout(4), ep=2, **MOE), ds_config(3, "all")), (dict(layout(2, tp=2), ep=2, **MOE), ds_config(1))]
    return cases


def world8_cases():
    a, c = layout(2, tp=2, pp=2), layout(2, tp=2, pp=2, schedule="interleaved-1f1b")
    # ZeRO-1, 2 and 3 at dp × tp × pp: the sequence-parallel and interleaved rows (each stage alone, and ZeRO-3 with
    # offload under an interleaved pipeline: world 4)
    cases = [(a, ds_config(3)), (c, ds_config(2, "opt"))]
    # activation recomputation under ZeRO-3 with CPU offload (checked against the DDP run of the same layout)
    # and sequence parallelism (its tp sum of the LayerNorm, bias and position gradients on ZeRO's partitions)
    sp = dict(a, sequence_parallel=True)
    cases += [(dict(sp, recompute="full"), ds_config(3, "all")), (sp, ds_config(1))]
    # Llama (grouped-query attention, rotary, untied head) under ZeRO-3 with CPU offload, sequence parallelism on
    llama = dict(sp, **LLAMA)
    # a mixture of experts over ep 2 with tp 2 (each tp rank routing its sequence shard) and 2 stages, the balancing
    # losses on, ZeRO-3 with CPU offload (its experts' engine over edp: zero/experts.py)
    moe = dict(sp, ep=2, **MOE_BALANCED)
    return cases + [(llama, ds_config(3, "all")), (moe, ds_config(3, "all"))]


def _run(world, cases, timeout, steps=STEPS):
    t0 = time.perf_counter()
    results = run_world(world, run_cases, cases, steps, timeout=timeout)
    return results, time.perf_counter() - t0


@pytest.fixture(scope="module")
def world2(tmp_path_factory):
    """One 2-process world: the dp2 matrix, then (if async_io is built) the ZeRO-Infinity cases."""
    require_ops()
    cases = world2_cases()
    extra = nvme_cases(str(tmp_path_factory.mktemp("nvme"))) if nvme_op_available() else []
    results, wall = _run(2, cases + extra, timeout=900)
    return cases, results, wall, extra


def _report(title, table, wall):
    print(f"\n{title} ({wall:.0f} s)\n" + "\n".join(table))


def test_parity_world2(world2):
    cases, results, wall, _ = world2
    table, failures = check_world(results, cases)
    _report("ZeRO parity, world 2", table, wall)
    assert not failures, "\n".join(failures)
    compiled = [[r[i]["compiled_graphs"] for r in results] for i, (lay, _) in enumerate(cases, 1) if lay.get("compile")]
    assert compiled and all(min(g) > 0 for g in compiled), compiled  # --compile acted under ZeRO-3
    # ZeRO-3 gathers each block's parameters as one (zero/engine.gather_by_block); ZeRO-0/1/2 hold them whole
    leaves = {stage: [] for stage in range(4)}
    for i, (_, ds) in enumerate(cases, 1):
        if ds:
            leaves[ds["zero_optimization"]["stage"]] += [b for r in results if r[i] for b in r[i]["leaf_blocks"]]
    assert leaves[3] and all(leaves[3]) and not any(leaves[0] + leaves[1] + leaves[2]), leaves
    # DeepSpeed's CPU backend neither built nor loaded its inference all-reduce op (zero/ops.skip_inference_shm_op)
    shm = [r[i]["shm_op"] for r in results for i in range(1, len(cases) + 1) if r[i] and "shm_op" in r[i]]
    assert shm and not any(shm), shm


def test_zero3_memory_world2(world2):
    cases, results, _, _ = world2
    lines, failures = check_memory(results, cases)
    print("\n" + "\n".join(lines))
    assert lines and not failures, "\n".join(failures)


@pytest.mark.needs("libaio")
def test_nvme_offload(world2):
    """ZeRO-Infinity: optimizer states (and parameters) swapped to an nvme_path on local disk; same losses. (Without
    libaio the NVMe configs are still validated: test_shipped_configs_resolve, test_config_errors.)"""
    cases, results, _, extra = world2
    assert extra, "libaio is here but DeepSpeed's async_io op was not built"
    first = len(cases) + 1
    runs = [[r[first + k] for r in results] for k in range(len(extra))]
    losses = [run[0]["losses"] for run in runs]
    swap = [[r.get("nvme_swap") for r in run] for run in runs]
    print(f"\nZeRO-Infinity (per rank, bytes in swap files after {STEPS} steps): fp32 optimizer on NVMe {swap[1]}, "
          f"bf16 parameters + optimizer on NVMe {swap[3]}")
    print(f"fp32 NVMe vs DDP: {rel(losses[1], losses[0]):.1e}; bf16 NVMe vs bf16 CPU offload: "
          f"{rel(losses[3], losses[2]):.1e}; bf16 vs fp32: {rel(losses[3], losses[0]):.1e}")
    assert rel(losses[1], losses[0]) <= 1e-5
    assert rel(losses[3], losses[2]) <= 1e-6 and 1e-6 < rel(losses[3], losses[0]) < 1e-2
    # the bf16 runs hold their modules in bf16 (DeepSpeed's bf16 engine), the fp32 one in fp32 (runs[0] is DDP's)
    assert [run[0]["module_dtypes"] for run in runs[1:]] == [["torch.float32"]] + [["torch.bfloat16"]] * 2
    assert all(s["optimizer"] > 0 for s in swap[1]) and all(s["optimizer"] > 0 and s["params"] > 0 for s in swap[3])
    # and the step record says so (memory: bytes in this rank's swap files)
    assert all(r["memory"]["nvme_bytes"] == s["optimizer"] + s["params"] for r, s in zip(runs[3], swap[3]))


def test_parity_world4():
    require_ops()
    cases = world4_cases()
    results, wall = _run(4, cases, timeout=900)
    table, failures = check_world(results, cases)
    _report("ZeRO parity, world 4", table, wall)
    lines, mem_failures = check_memory(results, cases)
    print("\n".join(lines))
    assert not failures + mem_failures, "\n".join(failures + mem_failures)


def test_parity_world8():
    require_ops()
    cases = world8_cases()
    results, wall = _run(8, cases, timeout=900)  # 5 steps, as test_parity's world of 8 (2:32 at 10 here)
    table, failures = check_world(results, cases)
    _report("ZeRO parity, world 8", table, wall)
    lines, mem_failures = check_memory(results, cases)
    print("\n".join(lines))
    assert not failures + mem_failures, "\n".join(failures + mem_failures)


# ---- configuration (no process group) ---------------------------------------------------------------------------
def _write(tmp_path, obj, name="ds.json"):
    path = tmp_path / name
    path.write_text(obj if isinstance(obj, str) else json.dumps(obj))
    return str(path)


def test_shipped_configs_resolve(tmp_path):
    """Every ds_configs/*.json resolves at a dp2×tp2×pp2 layout; "auto" filled from the flags and the layout."""
    names = sorted(os.listdir(os.path.join(REPO, "ds_configs")))
    assert {"ddp.json", "zero1.json", "zero2.json", "zero3.json", "zero3_offload.json", "zero3_nvme.json"} <= set(names)
    for name in names:
        path = os.path.join(REPO, "ds_configs", name)
        if name == "zero3_nvme.json":  # point it at a directory that exists here
            data = json.load(open(path))
            for k in ("offload_optimizer", "offload_param"):
                data["zero_optimization"][k]["nvme_path"] = str(tmp_path)
            path = _write(tmp_path, data, name)
        flags = ["--tp", "2", "--pp", "2", "--global-batch", "32", "--lr", "3e-4", "--deepspeed_config", path]
        cfg = parse_args(flags + ["--precision", "bf16"])  # "bf16": {"enabled": "auto"} follows --precision
        if name == "zero3_nvme.json" and not zero_ops.aio_available():  # no libaio here: refused, clearly
            with pytest.raises(ConfigError, match="libaio"):
                validate(cfg, 8)
            continue
        setup = validate(cfg, 8)
        plan = setup.plan
        spec = setup.deepspeed
        ds = spec.ds_config
        assert (ds["train_batch_size"], ds["gradient_accumulation_steps"]) == (32, plan.micro_batches), name
        assert ds["train_micro_batch_size_per_gpu"] * plan.micro_batches * 2 == 32, name
        assert spec.cfg.lr == 3e-4 and spec.cfg.grad_clip == 1.0 and ds["gradient_clipping"] == 0.0, name
        assert spec.cfg.precision == "bf16" and ds["bf16"]["enabled"] is True and "optimizer" not in ds, name
        if not torch.cuda.is_available():  # --precision auto is fp32 on a CPU host, and so is "auto" in the JSON
            if name == "zero3_nvme.json":  # fp32 parameters swapped to NVMe crash DeepSpeed on a CPU host: refused
                with pytest.raises(ConfigError, match="pass --precision bf16"):
                    validate(parse_args(flags), 8)
            else:
                fp32 = validate(parse_args(flags), 8).deepspeed
                assert fp32.cfg.precision == "fp32" and fp32.ds_config["bf16"]["enabled"] is False, name
        explicit = json.load(open(path))  # a user's explicit value still wins, and still contradicts a typed flag
        explicit["bf16"]["enabled"] = True
        explicit_flags = flags[:-1] + [_write(tmp_path, explicit, "explicit-" + name)]
        assert validate(parse_args(explicit_flags), 8).deepspeed.cfg.precision == "bf16", name
        with pytest.raises(ConfigError, match="trains in bf16 but --precision is fp32"):
            validate(parse_args(explicit_flags + ["--precision", "fp32"]), 8)
        assert not [k for k, v in deepspeed_config._walk(ds) if v == "auto"], name
    assert validate(parse_args(flags + ["--adam-eps", "3e-7"]), 8).deepspeed.eps == 3e-7  # ZeRO's AdamW takes it


def test_json_batch_wins_without_flags(tmp_path):
    path = _write(tmp_path, {"train_micro_batch_size_per_gpu": 2, "gradient_accumulation_steps": 4, "zero_optimization": {"stage": 1}})
    setup = validate(parse_args(["--pp", "2", "--deepspeed", path]), 4)
    plan = setup.plan
    assert (plan.global_batch, plan.micro_batches, plan.micro_batch_size) == (16, 4, 2)
    path = _write(tmp_path, {"train_batch_size": 24, "train_micro_batch_size_per_gpu": 3, "zero_optimization": {"stage": 2}})
    setup = validate(parse_args(["--deepspeed-config", path]), 4)
    plan = setup.plan
    assert (plan.global_batch, plan.micro_batches, plan.micro_batch_size) == (24, 2, 3)


@pytest.mark.parametrize(
    "flags,world,ds,message",
    [
        ([], 4, "{not json", "is not valid JSON"),
        ([], 4, "[1, 2]", "JSON object"),
        (["--global-batch", "16"], 4, {"train_batch_size": 32}, "train_batch_size=32"),
        (["--micro-batches", "2"], 4, {"gradient_accumulation_steps": 4}, "gradient_accumulation_steps=4"),
        ([], 4, {"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2}, "train_batch_size 30 !="),
        (["--lr", "1e-3"], 2, {"optimizer": {"type": "AdamW", "params": {"lr": 5e-4}}}, "lr=0.0005"),
        (["--grad-clip", "0.5"], 2, {"gradient_clipping": 2.0}, "gradient_clipping=2.0"),
        (["--precision", "fp32"], 2, {"bf16": {"enabled": True}}, "set bf16.enabled"),
        ([], 2, {"fp16": {"enabled": True}}, "use a \"bf16\" section"),
        ([], 2, {"scheduler": {"type": "WarmupLR"}}, "scheduler"),
        ([], 2, {"optimizer": {"type": "Lamb"}}, "not supported"),
        ([], 2, {"zero_optimization": {"stage": 4}}, "must be 0, 1, 2 or 3"),
        ([], 2, {"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}, "only ZeRO stage 3"),
        ([], 2, {"zero_optimization": {"stage": 0, "offload_optimizer": {"device": "cpu"}}}, "stage 0"),
        ([], 2, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/no/such/dir"}}}, "does not exist"),
        ([], 2, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme"}}}, "no nvme_path"),
        ([], 2, {"zero_optimization": {"stage": 3, "offload_param": {"device": "nvme", "nvme_path": "/tmp"}}}, "enable bf16"),
        ([], 2, {"zero_optimization": {"stage": 1, "offload_optimizer": {"device": "nvme", "nvme_path": "/tmp"}}}, "needs ZeRO stage 3"),
        (["--pp", "2", "--schedule", "zbv"], 4, {"zero_optimization": {"stage": 1}}, "splits backward"),
        ([], 2, {"zero_optimization": {"stage": 1, "sub_group_size": "auto"}}, "cannot be \"auto\""),
    ],
)
def test_config_errors(tmp_path, flags, world, ds, message):
    path = _write(tmp_path, ds)
    with pytest.raises(ConfigError, match=".*" + __import__("re").escape(message)):
        validate(parse_args(flags + ["--deepspeed_config", path]), world)


def test_missing_config(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        validate(parse_args(["--deepspeed_config", str(tmp_path / "nope.json")]), 2)


@pytest.mark.needs("not-root")
def test_unwritable_nvme_path(tmp_path):
    ro = tmp_path / "ro"
    ro.mkdir()
    ro.chmod(0o500)
    path = _write(tmp_path, {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": str(ro)}}})
    try:
        with pytest.raises(ConfigError, match="not writable"):
            validate(parse_args(["--deepspeed_config", path]), 2)
    finally:
        ro.chmod(0o700)


def test_main_reports_config_error(tmp_path, capsys):
    """A bad JSON fails in train.main before any process group, with a one-line error."""
    from trainer3d.train.loop import main

    path = _write(tmp_path, {"train_batch_size": 7, "train_micro_batch_size_per_gpu": 2})
    assert main(["--deepspeed_config", path]) == 2
    assert "train_batch_size" in capsys.readouterr().err


# ---- the glue contract ------------------------------------------------------------------------------------------
def test_glue_contract():
    """The DeepSpeed internals trainer3d/zero/ patches or calls exist in the installed version, and the version is in the
    pinned range; a version outside it is refused with a message naming the fix."""
    zero_ops.check_deepspeed_version()
    zero_glue.check_glue()
    with pytest.raises(ConfigError, match="not supported"):
        zero_ops.check_deepspeed_version("0.20.0")
    with pytest.raises(ConfigError, match="not supported"):
        zero_ops.check_deepspeed_version("0.19.7")
    zero_ops.check_deepspeed_version("0.19.9+abc")
    pyproject = open(os.path.join(REPO, "pyproject.toml")).read()
    assert '"deepspeed>=0.19.8,<0.20"' in pyproject


def test_mpu_over_topology():
    """The mpu hands DeepSpeed our sub-groups (no process group needed to check the mapping of ranks)."""
    topo = Topology.__new__(Topology)
    topo.layout, topo.pp_rank, topo.dp_rank, topo.tp_rank = Layout(dp=2, tp=4, pp=3), 2, 1, 3
    topo.dp_group = topo.tp_group = topo.pp_group = None
    mpu = zero_glue.TopologyMPU(topo)
    assert (mpu.get_data_parallel_world_size(), mpu.get_data_parallel_rank()) == (2, 1)
    assert (mpu.get_model_parallel_world_size(), mpu.get_tensor_model_parallel_rank()) == (4, 3)
    assert (mpu.get_pipeline_model_parallel_world_size(), mpu.get_pipeline_model_parallel_rank()) == (3, 2)


def test_ops_build_recovers_from_a_killed_build(tmp_path):
    """A build killed half-way leaves torch's `lock` file, on which every later load of the op would wait forever;
    the next build (holding the checkout's flock, so no live builder can own that lock) removes it and loads. In a
    copy of the built ops (torch finds them built there too): the suite's other worker loads the checkout's own, and
    each load takes and drops torch's lock, which would race a lock planted there."""
    import shutil
    import subprocess
    import sys

    require_ops()
    ext = tmp_path / "torch_extensions"
    shutil.copytree(zero_ops.default_extensions_dir(), ext, ignore=shutil.ignore_patterns(".trainer3d-build.lock"))
    lock = os.path.join(ext, "cpu_adam", "lock")
    open(lock, "w").close()
    env = dict(os.environ, TORCH_EXTENSIONS_DIR=str(ext))
    out = subprocess.run([sys.executable, "-m", "trainer3d.zero", "--build-ops"], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "left by a build that was killed" in out.stderr and not os.path.exists(lock)
    assert "CPUAdamBuilder: ok" in out.stdout


def test_ops_are_built_without_debug_info(tmp_path):
    """The checkout's ops compile without DeepSpeed's -g (23-40% of their compile time), with torch/extension.h
    reduced to torch/python.h (the installed header still skips torch/all.h on that macro, and no other torch header
    reads it), async_io with the precompiled header (its .gch gone after the build) in the units that include torch,
    and an op built otherwise (a checkout's from before) counts as missing, so that --build-ops rebuilds it rather
    than the first run."""
    import torch.utils.cpp_extension as cpp_extension

    require_ops(nvme=nvme_op_available())
    macro = zero_ops.LIGHT_TORCH_HEADER.removeprefix("-D")
    torch_include = Path(cpp_extension.include_paths()[0])  # torch's include directory: the others lie under it
    readers = [h for h in torch_include.rglob("*.h") if macro in h.read_text("latin-1")]
    assert [h.name for h in readers] == ["extension.h"], readers
    assert f"#ifndef {macro}\n// All pure C++ headers for the C++ frontend.\n#include <torch/all.h>" in readers[0].read_text()
    ext = Path(zero_ops.default_extensions_dir())
    for name in zero_ops.ops_needed(nvme=nvme_op_available()):
        cflags = zero_ops._cflags(str(ext / zero_ops.OP_DIRS[name]))
        assert "-fopenmp" in cflags and "-g" not in cflags, (name, cflags)  # DeepSpeed's, less -g
        assert zero_ops.LIGHT_TORCH_HEADER in cflags, (name, cflags)
        assert ("-include" in cflags) == (zero_ops.OP_DIRS[name] in zero_ops.PRECOMPILED), (name, cflags)
    assert not list(ext.glob("*/*.gch"))  # 785 MB, needed only while building
    if nvme_op_available():  # async_io's three units in aio/common include no torch header: built without it
        zero_ops.build_ops(("AsyncIOBuilder",))  # a load (a few seconds: built) writes build.ninja again
        lines = (ext / "async_io" / "build.ninja").read_text().splitlines()
        unit = zero_ops.UNIT_CFLAGS
        plain = sorted(Path(lines[i - 1].split()[-1]).name for i, ln in enumerate(lines) if ln.startswith(unit))
        assert plain == ["deepspeed_aio_common.cpp", "deepspeed_aio_types.cpp", "deepspeed_aio_utils.cpp"], plain
        assert all("-include" not in ln for ln in lines if ln.startswith(unit))
    light, both = zero_ops.LIGHT_TORCH_HEADER, ["CPUAdamBuilder", "AsyncIOBuilder"]
    old_flags = (("cpu_adam", f"-O3 -g {light}"), ("async_io", f"-O0 {light}"))  # -g; no -include where one belongs
    for op, flags in old_flags:
        old = tmp_path / op
        old.mkdir()
        (old / f"{op}.so").write_bytes(b"")
        (old / "build.ninja").write_text(f"cflags = -DTORCH_EXTENSION_NAME={op} {flags} -Wno-reorder\n")
    assert zero_ops.missing_ops(both, path=str(tmp_path)) == both
    (tmp_path / "cpu_adam" / "build.ninja").write_text("cflags = -DTORCH_EXTENSION_NAME=cpu_adam -O3 -Wno-reorder\n")
    (tmp_path / "async_io" / "build.ninja").write_text(f"cflags = -O0 {light} -include {zero_ops.PCH_HEADER}\n")
    assert zero_ops.missing_ops(both, path=str(tmp_path)) == ["CPUAdamBuilder"]  # built with all of torch/all.h
    (tmp_path / "cpu_adam" / "build.ninja").write_text(f"cflags = -DTORCH_EXTENSION_NAME=cpu_adam -O3 {light}\n")
    assert zero_ops.missing_ops(both, path=str(tmp_path)) == []
