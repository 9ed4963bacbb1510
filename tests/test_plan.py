"""The planner (trainer3d/plan/) and its cost model (candidate.py, memory.py, comm.py):

- infeasible layouts are refused, each for its reason;
- its memory estimate agrees within 10% with memory measured in a spawned gloo world (fp32, tiny model): the
  parameters/gradients/optimizer state the trainer reports, and the peak bytes per rank from a malloc counter
  preloaded into the workers (bench/memhook.c), for DDP layouts over dp, tp and pp (1F1B, GPipe, interleaved)
  and, when trainer3d/zero/ exists, ZeRO-1/2/3;
- its communication formulas are the ones the comm benchmark verifies (one world, counted collectives).
"""

from __future__ import annotations

import math
import re
from pathlib import Path


import pytest
import torch

from trainer3d.errors import ConfigError
from trainer3d.models import MODEL_PRESETS
from trainer3d.models.gpt2 import GPTConfig
from trainer3d.parallel.fp8 import RECIPES as FP8_RECIPES
from trainer3d.plan.candidate import Candidate, rank_params
from trainer3d.plan.cli import main
from trainer3d.plan.cluster import FP8_CAST_SHARE, Cluster
from trainer3d.plan.comm import analytic_comm
from trainer3d.plan.memory import estimate_memory
from trainer3d.plan.report import launch_command
from trainer3d.plan.search import enumerate_plans, evaluate, parse_layout

H100 = dict(gpus_per_node=8, gpu_memory_gib=80, peak_tflops=989, intra_node_gbps=360, inter_node_gbps=50)


@pytest.mark.parametrize("name", list(MODEL_PRESETS))
def test_family_formulas_count_what_the_model_builds(name):
    """A family's parameter formulas (MFU, balancing, the planner's memory) against the model it builds (meta device),
    and against the count the planner reads off the ParallelPlan, at tp 1 and tp 2 (whose shards add up)."""
    import dataclasses

    from trainer3d.models import build_model
    from trainer3d.parallel.param_counts import local_params

    cfg = MODEL_PRESETS[name]
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg, n_layer=4))
    built = sum(p.numel() for p in model.parameters())  # a tied head is one Parameter, counted once
    assert built == dataclasses.replace(cfg, n_layer=4).num_params()
    differ = cfg.moe is not None or hasattr(cfg, "block_kind")  # (blocks of two kinds: block_params per layer)
    for i in range(4):  # (qwen3-moe-tiny: a dense block, then MoE ones; Qwen3.5: three linear, one full attention)
        block = sum(p.numel() for p in model.blocks[str(i)].parameters())
        assert block == (cfg.block_params(i) if differ else cfg.block_params()) == local_params(cfg, 1).block(i).total()
        if cfg.n_head % 2 == 0 and getattr(cfg, "n_kv_heads", 2) % 2 == 0:
            halves = local_params(cfg, 2).block(i).pieces
            assert sum(p.n * (1 if p.replicated else 2) for p in halves) == block


def test_175b_does_not_fit_on_one_node_and_says_why():
    search = enumerate_plans(MODEL_PRESETS["gpt3-175b"], Cluster(nodes=1, **H100), 64, 2048, offload=False)
    assert search.plans == []
    assert search.refused["does not fit in GPU memory"] > 0


def test_every_refusal_has_a_reason():
    cfg = MODEL_PRESETS["gpt2-xl"]  # 25 heads: tp 2, 4, 8 impossible
    search = enumerate_plans(cfg, Cluster(nodes=1, **H100), 12, 1024)
    reasons = set(search.refused)
    assert "tp does not divide the attention heads" in reasons
    assert "global batch not divisible by dp" in reasons  # dp 8 does not divide 12
    assert any(r.startswith("pipeline rule") for r in reasons)
    for p in search.plans:  # what is kept is valid and fits
        c = p.candidate
        assert cfg.n_head % c.tp == 0 and 12 % c.dp == 0 and c.dp * c.tp * c.pp == 8
        assert p.memory <= Cluster(nodes=1, **H100).usable_bytes


def test_a_layout_that_does_not_fit_is_flagged():
    C = Cluster(nodes=1, **{**H100, "gpu_memory_gib": 12})  # ~13.8 GiB estimated
    cand = parse_layout("tp=1,pp=1,mbs=8", MODEL_PRESETS["gpt2-medium"], C, 64, 1024)
    assert any("does NOT fit" in n for n in evaluate(cand, C).notes)


def test_zero_divides_model_states_as_the_paper_says():
    cfg = MODEL_PRESETS["gpt2"]
    base = Candidate(cfg=cfg, dp=8, precision="bf16-mixed")
    n = rank_params(cfg, 1, base.stages(0))
    e = {z: estimate_memory(Candidate(cfg=cfg, dp=8, precision="bf16-mixed", zero_stage=z), 0) for z in (1, 2, 3)}
    assert e[1].optimizer == pytest.approx(12 * n / 8) and e[1].params == pytest.approx(2 * n)
    assert e[2].grads == pytest.approx(4 * n / 8)  # DeepSpeed's fp32 gradient partition
    assert e[3].params < 2 * n / 8 * 1.05 and e[3].zero_buffers > 0  # partition (+ persistent) and a working set
    assert e[1].peak > e[2].peak > e[3].peak


def test_tp_comm_formula_counts_what_the_trainer_sends():
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    cand = Candidate(cfg=cfg, tp=2, micro_batches=2, micro_batch_size=4, seq_len=32)
    T, h = 4 * 32, 64
    tp = sum(t.payload for t in analytic_comm(cand, 0) if t.group == "tp")
    # 4 all-reduces per block + embedding forward + head backward (b·s·h each) + 3 cross-entropy (b·s), fp32
    assert tp == 2 * ((4 * 4 + 2) * T * h * 4 + 3 * T * 4)


def test_sequence_parallel_comm_formula():
    """Each all-reduce becomes an all-gather and a reduce-scatter of the same payload; the gathering matmuls gather
    their saved shard again in the backward; the replicated gradients are summed once; pipeline sends shrink by tp."""
    cfg = GPTConfig(n_layer=4, n_embd=64, n_head=4, vocab_size=512, n_positions=64)
    base = dict(cfg=cfg, tp=2, pp=2, micro_batches=2, micro_batch_size=4, seq_len=32)
    plain, sp = Candidate(**base), Candidate(**base, sequence_parallel=True)
    T, h = 4 * 32, 64
    for rank, layers in ((0, 2), (1, 2)):
        def op_bytes(cand, op, group="tp"):
            return sum(t.payload for t in analytic_comm(cand, rank) if t.group == group and t.op == op)

        first, last = rank == 0, rank == 1
        gathers = (2 * layers + last) * 2 + 2 * layers + first  # forward + re-gather, backward of row/embedding
        assert op_bytes(sp, "all_gather") == 2 * gathers * T * h * 4
        assert op_bytes(sp, "reduce_scatter") == 2 * (4 * layers + last + first) * T * h * 4
        assert op_bytes(plain, "all_reduce") == 2 * (4 * layers + first + last) * T * h * 4 + last * 2 * 3 * T * 4
        assert op_bytes(sp, "send", "pp") * 2 == op_bytes(plain, "send", "pp") > 0


def test_launch_command_and_ds_config(tmp_path, capsys, monkeypatch):
    """The pick's command reads the JSON --write-ds-config writes; without the flag the command names the default
    path, and a line says how to write it (nothing is written)."""
    ds = tmp_path / "ds.json"
    argv = ["--model", "gpt2-medium", "--nodes", "2", "--gpus-per-node", "8", "--gpu-memory-gib", "16",
            "--peak-tflops", "312", "--intra-node-gbps", "230", "--inter-node-gbps", "25", "--global-batch", "256",
            "--seq-len", "1024", "--zero-stages", "1", "--no-recompute", "--launcher", "sbatch", "--top", "3"]
    rc = main(argv + ["--write-ds-config", str(ds)])
    out = capsys.readouterr().out
    assert rc == 0 and "#1: fastest of" in out and "#SBATCH --nodes=2" in out
    assert f"--deepspeed_config {ds}" in out and ds.exists() and "add --write-ds-config" not in out
    monkeypatch.chdir(tmp_path)
    assert main(argv) == 0
    out = capsys.readouterr().out
    assert "--deepspeed_config plan_ds_config.json" in out
    assert "(the command reads plan_ds_config.json: add --write-ds-config plan_ds_config.json to write it)" in out
    assert not (tmp_path / "plan_ds_config.json").exists()
    import json

    cfg = json.loads(ds.read_text())
    assert cfg["zero_optimization"]["stage"] == 1 and cfg["train_batch_size"] == 256


def test_launch_flags_are_the_trainers(tmp_path):
    from trainer3d.config import parse_args
    from trainer3d.train.setup import validate

    C = Cluster(nodes=1, **H100)
    p = evaluate(parse_layout("tp=2,pp=2,schedule=interleaved-1f1b,v=2,mbs=2", MODEL_PRESETS["gpt2"], C, 32, 1024), C)
    cmd = launch_command(p, C, "torchrun", "gpt2", None)
    argv = cmd.split("launch/train_gpt2.py ")[1].split()
    setup = validate(parse_args(argv), 8)
    layout, plan = setup.layout, setup.plan
    assert (layout.dp, layout.tp, layout.pp, plan.micro_batches, plan.micro_batch_size) == (2, 2, 2, 8, 2)
    assert setup.cfg.sequence_parallel  # the planner's plans at tp > 1 use it, and say so in the command


# ---- memory: estimate against measurement ------------------------------------------------------------------------
@pytest.mark.timeout(300)
def test_memory_estimate_within_10_percent_of_measured():
    from bench.harness import Case, zero_available
    from bench.memory import MODEL, compare, ds_config, run

    m = dict(MODEL)
    cases = [
        (Case(**m), 0, False),
        (Case(dp=2, **m), 0, False),
        (Case(tp=2, **m), 0, False),
        (Case(pp=2, micro_batches=4, **m), 0, False),
        (Case(pp=2, micro_batches=4, schedule="gpipe", **m), 0, False),
        (Case(tp=2, pp=2, micro_batches=4, **m), 0, False),
        (Case(pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batches=4, **m), 0, False),
    ]
    if zero_available():
        from helpers.ds_ops import require_ops

        require_ops()  # DeepSpeed's CPU ops, built once into the checkout (tests/helpers/ds_ops.py)
        # ZeRO layouts span the whole world (ZeRO-3's set-up has a barrier on the world group)
        for base, stages in ((Case(dp=4, **m), (1, 2, 3)), (Case(dp=2, tp=2, **m), (1, 3))):
            for stage in stages:
                cases.append((Case(**{**base.__dict__, "deepspeed_config": ds_config(stage, False, base)}), stage, False))
    results = run(cases, world=4, timeout=280, steps=2)
    bad, lines = [], []
    for (case, z, off), measured in zip(cases, results):
        for r in compare(case, z, off, measured):
            meas, e = r["m"], r["e"]
            states = meas["params"] + meas["grads"] + meas["optimizer"]
            s_ratio = states / (e.model_states + e.offloaded)
            p_ratio = meas["peak"] / (e.peak + e.offloaded + e.host_buffers)  # a CPU host: one memory
            lines.append(f"{case.label():<34} ZeRO-{z} rank {r['coords']}: states {s_ratio:.3f} peak {p_ratio:.3f}")
            if not (0.9 <= s_ratio <= 1.1 and 0.9 <= p_ratio <= 1.1):
                bad.append(lines[-1])
    print("\n".join(lines))
    n_layouts = len({(c.label(), z) for c, z, _ in cases})
    assert n_layouts >= 6
    assert not bad, "estimate off by more than 10%:\n" + "\n".join(bad)


def test_evaluate_string_is_checked_with_one_sentence(capsys):
    """--evaluate takes key=value pairs; anything else is one sentence and exit code 2, before the search runs."""
    from trainer3d.plan.cli import main

    for bad, expected in (("dp16 tp8", "key=value pairs"), ("tp=eight", "whole numbers"), ("tp=3", "divide the 8 GPUs"),
                          ("tp=2,schedule=fast", "schedule=fast is none of"), ("tp=8,pp=1,mbs=5", "does not split"),
                          ("ep=2", "this model has none"), ("ep=16", "must divide dp×cp")):
        assert main(["--model", "gpt2", "--nodes", "1", "--global-batch", "64", "--evaluate", bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("trainer3d: error: --evaluate") and expected in err and len(err.splitlines()) == 1, err


def test_context_parallel_in_the_cost_model():
    """cp divides a rank's tokens (its activations, tp and pp bytes) but adds the gathered keys and values; ZeRO and
    the gradient reduction span dp×cp (dp 2 × cp 2 holds what dp 4 holds); cp's collectives are counted per block."""
    from trainer3d.plan.memory import layer_activation_bytes

    cfg = MODEL_PRESETS["llama3.1-8b"]
    base = dict(cfg=cfg, tp=2, micro_batches=1, seq_len=32768, sequence_parallel=True, precision="bf16-mixed")
    one, four = Candidate(**base), Candidate(**base, cp=4)
    gathered = 32768 * 2 * cfg.kv_width // 2 * 2  # the whole sequence's keys and values, this tp rank's heads, bf16
    assert layer_activation_bytes(four) == layer_activation_bytes(one) // 4 + gathered
    comm = {t.why.split(",")[0]: t for t in analytic_comm(four, 0) if t.group == "cp"}
    assert {t.op for t in comm.values()} == {"all_gather", "reduce_scatter"}
    assert all(t.calls == cfg.n_layer and t.n == 4 and t.nbytes == gathered for t in comm.values())
    z = dict(cfg=cfg, tp=2, seq_len=32768, zero_stage=3, precision="bf16-mixed")
    a, b = estimate_memory(Candidate(**z, dp=2, cp=2), 0), estimate_memory(Candidate(**z, dp=4), 0)
    assert (a.params, a.grads, a.optimizer) == (b.params, b.grads, b.optimizer)
    dp_group = [t for t in analytic_comm(Candidate(**z, dp=2, cp=2), 0) if t.group == "dp"]
    assert dp_group and all(t.n == 4 for t in dp_group)


def test_llama3_405b_long_context_plan(capsys):
    """Llama 3.1 405B at 131,072 tokens, 16M tokens a step, on 16,384 H100s: the planner's best layouts use cp, the
    paper's (tp 8, cp 16, pp 16, dp 8) is evaluated beside them, and a cp outside what the GPUs allow is refused."""
    argv = ["--model", "llama3.1-405b", "--nodes", "2048", "--seq-len", "131072", "--global-batch-tokens", "16777216",
            "--evaluate", "tp=8,cp=16,pp=16,schedule=interleaved-1f1b,v=4,mbs=1,zero=1", "--top", "3"]
    assert main(argv) == 0
    out = capsys.readouterr().out
    table = out.split("#1:")[0]
    assert table.count(" cp") >= 3 and " tp8 " in table
    assert "dp8 tp8 pp16 cp16 interleaved-1f1b v4" in out.split("evaluated:")[1]
    assert "--cp 32" in out.split("launch/train_gpt2.py")[-1]
    assert main(argv[:-3] + ["tp=8,cp=3,pp=16"]) == 2


def test_model_states_against_the_zero_paper():
    """The ZeRO paper's Table 1 (Rajbhandari et al. 2020: Ψ = 7.5B parameters, Nd = 64, K = 12, mixed precision):
    120, 31.4, 16.6 and 1.9 GB per device for the baseline, P_os, P_os+g and P_os+g+p. The planner charges exactly the
    paper's bytes plus DeepSpeed's one difference, documented in plan/memory.py: it keeps the gradient partition in
    fp32, beside ZeRO-1's whole 16-bit gradient (4Ψ/Nd more) and in place of ZeRO-2/3's 16-bit one (2Ψ/Nd more)."""
    psi, nd = 7.5e9, 64
    paper = {0: (2 + 2 + 12) * psi, 1: 2 * psi + 2 * psi + 12 * psi / nd, 2: 2 * psi + (2 + 12) * psi / nd,
             3: (2 + 2 + 12) * psi / nd}
    assert [round(v / 1e9, 1) for v in paper.values()] == [120.0, 31.4, 16.6, 1.9]
    cfg = GPTConfig(vocab_size=51200, n_positions=2048, n_embd=4096, n_layer=36, n_head=32)
    for z, expected in paper.items():
        cand = Candidate(cfg=cfg, dp=nd, seq_len=2048, precision="bf16-mixed", zero_stage=z, zero3_persistence=0)
        e = estimate_memory(cand, 0)
        n = e.n_params
        states = e.params + e.grads + e.optimizer + (n * 2 if z == 1 else 0)  # ZeRO-1 also holds the bf16 gradient
        deepspeed_extra = {0: 0, 1: 4 * n / nd}.get(z, 2 * n / nd)
        assert states == pytest.approx(expected * n / psi + deepspeed_extra, rel=1e-9), z


def test_published_megatron_layouts_fit_and_land_near_their_throughput():
    """Narayanan et al. 2021, Table 1: GPT-3 175B at (t 8, p 8) on 1024 A100-80GB and the 1T model at (t 8, p 64) on
    3072, both with full recomputation and micro-batch 1, at 138 and 163 TFLOP/s per GPU (recomputation counted).
    The planner must find both layouts fit in 80 GB and put them within 25% of the published speed at its default
    50% kernel efficiency (129 and 124 now: bench/planner.md)."""
    from trainer3d.plan.cli import cluster_from_preset
    from trainer3d.plan.report import model_flops_utilization

    for model, nodes, gb, tp, pp, published in (("gpt3-175b", 128, 1536, 8, 8, 138), ("megatron-1t", 384, 3072, 8, 64, 163)):
        cfg = MODEL_PRESETS[model]
        C = cluster_from_preset("a100-80g", nodes)
        p = evaluate(parse_layout(f"tp={tp},pp={pp},schedule=1f1b,mbs=1,zero=1,recompute=1", cfg, C, gb, 2048), C)
        assert not p.notes, (model, p.notes)
        hardware_tflops = model_flops_utilization(p, C) * C.peak_tflops * 4 / 3  # Megatron counts the recomputed forward
        assert 0.75 <= hardware_tflops / published <= 1.25, (model, hardware_tflops)


@pytest.mark.timeout(300)
def test_last_stage_frees_logits_after_their_backward():
    """torch's schedules keep the last forward's output until the next forward; the loss's gradient lives in the
    logits' storage, which pipeline.py frees once the backward (with a split backward, the weight pass) is done.
    Measured with the free patched out ("kept") and as it is, on the last stage (bench/last_stage_memory.py)."""
    from bench.last_stage_memory import run

    one_f_one_b, zero_bubble = (2, "1f1b", 1), (2, "interleaved-zb", 2)
    by = run([one_f_one_b, zero_bubble], timeout=280)
    kept, freed = by[(one_f_one_b, False)], by[(one_f_one_b, True)]
    assert kept["used_alive"] == kept["logits"]  # one micro-batch's used logits alive through the next forward
    assert freed["used_alive"] == 0
    assert kept["peak"] - freed["peak"] > 0.25 * kept["logits"]
    assert by[(zero_bubble, True)]["used_alive"] == 0


# ---- mixtures of experts -------------------------------------------------------------------------------------------
def _trainer_ranks(cfg, tp: int, ep: int, pp: int, schedule: str, v: int, seq_len: int) -> list[tuple[int, int, int]]:
    """(parameters, experts, parameters whose gradient tp ranks hold shares of) of each pipeline rank's stages as the
    trainer builds them (parallelize.py's steps 1-3, on the meta device, at one tp and ep coordinate)."""
    from trainer3d.models import build_model
    from trainer3d.parallel import pipeline
    from trainer3d.parallel.expert_parallel import apply_expert_parallel
    from trainer3d.parallel.sequence_parallel import apply_sequence_parallel
    from trainer3d.parallel.tensor_parallel import apply_tensor_parallel

    with torch.device("meta"):
        model = build_model(cfg)
    n = pp * pipeline.stages_per_rank(schedule, v)
    ranges, out = pipeline.balance_layers(cfg, n, seq_len), []
    for r in range(pp):
        stages = [apply_tensor_parallel(model.stage(ranges[i], i == 0, i == n - 1), None, 0, tp, None)
                  for i in pipeline.stage_ids(r, pp, schedule, v)]
        stages = [apply_sequence_parallel(s, 0, tp, None) for s in stages] if tp > 1 else stages
        stages = [apply_expert_parallel(s, None, 0, tp, True, None, 0, ep) for s in stages]
        ps = [p for s in stages for p in s.parameters()]
        out.append((sum(p.numel() for p in ps), sum(p.numel() for p in ps if getattr(p, "expert", False)),
                    sum(p.numel() for p in ps if getattr(p, "tp_partial", False)) if tp > 1 else 0))
    return out


@pytest.mark.parametrize("name,tp,ep,pp,schedule,v", [
    ("qwen3-moe-tiny", 2, 2, 2, "1f1b", 1), ("qwen3-moe-tiny", 1, 4, 1, "1f1b", 1), ("qwen3-moe-tiny", 2, 1, 2, "zbv", 1),
    ("mixtral-tiny", 2, 2, 2, "interleaved-1f1b", 2), ("mixtral-8x7b", 1, 8, 4, "interleaved-1f1b", 2),
    ("qwen3-30b-a3b", 2, 8, 3, "1f1b", 1), ("qwen3-30b-a3b", 4, 16, 4, "zbv", 1)])
def test_moe_params_per_rank_are_what_the_trainer_builds(name, tp, ep, pp, schedule, v):
    """Per pipeline rank, the planner's parameters, experts and tp-summed gradients (its memory and dp, edp and tp
    traffic) equal what the trainer's parallelization holds, with dense and MoE blocks counted layer by layer
    (qwen3-moe-tiny's block 0 is dense) over balance_layers' stages, experts whole and divided by ep."""
    from trainer3d.plan.candidate import expert_params, tp_summed_params

    cfg = MODEL_PRESETS[name]
    cand = Candidate(cfg=cfg, dp=ep, tp=tp, pp=pp, ep=ep, schedule=schedule, virtual_stages=v, seq_len=4096,
                     sequence_parallel=tp > 1)
    planned = [(rank_params(cfg, tp, cand.stages(r), ep), expert_params(cfg, tp, cand.stages(r), ep) if ep > 1 else 0,
                sum(tp_summed_params(cand, cand.stages(r)))) for r in range(pp)]
    assert planned == _trainer_ranks(cfg, tp, ep, pp, schedule, v, 4096)


def test_moe_totals_over_ranks_are_the_published_ones():
    """Qwen3-30B-A3B: 30.5B parameters, 3.3B activated (Qwen3 technical report, Table 2 / the model card:
    https://huggingface.co/Qwen/Qwen3-30B-A3B); Mixtral 8x7B: 47B total, 13B active (Jiang et al. 2024,
    https://arxiv.org/abs/2401.04088; 46.7B / 12.9B on https://mistral.ai/news/mixtral-of-experts). The pipeline
    ranks' stages, with each ep rank's share of the experts, add up to the whole model, and the active count (what the
    FLOPs and MFU use) is a token's."""
    from trainer3d.plan.candidate import expert_params

    for name, total, active in (("qwen3-30b-a3b", 30.53, 3.35), ("mixtral-8x7b", 46.70, 12.88)):
        cfg = MODEL_PRESETS[name]
        for ep, pp in ((1, 1), (8, 4), (4, 6)):
            cand = Candidate(cfg=cfg, dp=ep, pp=pp, ep=ep, seq_len=4096)
            held = sum(rank_params(cfg, 1, cand.stages(r), ep) + (ep - 1) * expert_params(cfg, 1, cand.stages(r), ep)
                       for r in range(pp))
            assert held == cfg.num_params() and round(held / 1e9, 2) == total, (name, ep, pp)
        assert round(cfg.num_params(active=True) / 1e9, 2) == active


def _saved_bytes(module, x, keep=lambda t: True) -> int:
    """Bytes autograd keeps for the backward of `module(x)` under bf16 autocast (each storage once; parameters and
    the input excluded; only the tensors `keep` names)."""
    kept, skip = {}, {p.data_ptr() for p in module.parameters()} | {x.data_ptr()}

    def pack(t):
        if t.data_ptr() not in skip and keep(t):
            kept[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t), torch.autocast("cpu", dtype=torch.bfloat16):
        module(x)
    return sum(kept.values())


def test_moe_activations_are_what_the_block_saves():
    """Measured (CPU, bf16 autocast, the tensors autograd keeps): per token, an MoE block keeps more than a dense
    block with the same attention by exactly what the planner's per-layer bytes say (the family's formula); and its
    MLP keeps, whatever the number of tokens, the bf16 copy of its experts that the planner charges once per MoE layer
    a step (memory.expert_weight_copies; every micro-batch's saved tensors share it: test_moe's cast-once test)."""
    import dataclasses

    from trainer3d.models import build_model
    from trainer3d.models.llama import LlamaConfig
    from trainer3d.plan.memory import expert_weight_copies, layer_activation_bytes

    moe = MODEL_PRESETS["mixtral-tiny"]
    dense = LlamaConfig(**{f.name: getattr(moe, f.name) for f in dataclasses.fields(LlamaConfig)})
    measured, planned = {}, {}
    for cfg in (moe, dense):
        torch.manual_seed(0)
        model = build_model(dataclasses.replace(cfg, n_layer=1))
        model.init_tables(torch.device("cpu"))
        for p in model.parameters():
            torch.nn.init.normal_(p, std=0.02)
        sizes = {T: _saved_bytes(model.blocks["0"], torch.randn(1, T, cfg.n_embd, requires_grad=True)) for T in (256, 512)}
        measured[cfg.family] = (sizes[512] - sizes[256]) / 256
        planned[cfg.family] = layer_activation_bytes(Candidate(cfg=cfg, seq_len=512, precision="bf16-autocast")) / 512
        if cfg.moe is not None:
            mlp = {T: _saved_bytes(model.blocks["0"].mlp, torch.randn(1, T, cfg.n_embd, requires_grad=True))
                   for T in (256, 512)}
            kept_anyway = 2 * mlp[256] - mlp[512]  # the intercept of bytes against tokens
            copies = expert_weight_copies(Candidate(cfg=cfg, precision="bf16-autocast"), range(1))
            assert copies == 4 * 3 * 96 * 128 * 2 and kept_anyway == pytest.approx(copies, rel=0.01)
    assert measured["mixtral"] - measured["llama"] == pytest.approx(planned["mixtral"] - planned["llama"], abs=8)
    assert measured["mixtral"] - measured["llama"] > 0.05 * measured["mixtral"]  # (the MoE part is not negligible)


def test_moe_all_to_alls_are_what_the_dispatcher_sends(monkeypatch):
    """The planner's ep traffic per MoE layer and micro-batch against the trainer's AllToAllDispatch on one rank of
    ep 2, the all-to-all faked (every rank routing as this one, so sent and received rows agree: the planner's balanced
    routing, forced here by a router that sends each token to one expert of each ep rank): one count exchange, then
    the rows both ways in the forward and their gradients both ways in the backward, k rows of h per token in bf16."""
    import dataclasses

    import torch.distributed as dist

    from trainer3d.models import build_model
    from trainer3d.parallel.expert_parallel import apply_expert_parallel

    sent = []

    def fake_all_to_all(output, input, output_split_sizes=None, input_split_sizes=None, group=None):
        counts = input.dtype == torch.int64
        sent.append(("counts" if counts else "rows", input.numel() * input.element_size()))
        if counts:  # both ranks send this rank's counts for the first rank's experts
            output.copy_(input[: output.numel() // 2].repeat(2))
        else:
            output.zero_()

    monkeypatch.setattr(dist, "all_to_all_single", fake_all_to_all)
    cfg = dataclasses.replace(MODEL_PRESETS["mixtral-tiny"], n_layer=1)  # 4 experts, top 2, h 128
    torch.manual_seed(0)
    model = apply_expert_parallel(build_model(cfg), None, 0, 1, False, None, 0, 2)
    model.init_tables(torch.device("cpu"))
    for p in model.parameters():
        torch.nn.init.normal_(p, std=0.02)
    gate = model.blocks["0"].mlp.gate.weight.data
    gate[1::2] = -gate[0]
    gate[2] = gate[0]  # experts 0 and 2 (one on each ep rank) score alike, 1 and 3 likewise
    T = 64
    with torch.autocast("cpu", dtype=torch.bfloat16):
        model(torch.randint(0, cfg.vocab_size, (1, T))).float().square().mean().backward()
    cand = Candidate(cfg=cfg, dp=2, ep=2, seq_len=T, precision="bf16-autocast")
    planned = [t for t in analytic_comm(cand, 0) if t.group == "ep"]
    assert sum(t.calls for t in planned) == len(sent) == 5
    assert sum(t.payload for t in planned if "int64" in t.why) == sum(b for kind, b in sent if kind == "counts")
    assert sum(t.payload for t in planned if "int64" not in t.why) == sum(b for kind, b in sent if kind == "rows") \
        == 4 * T * 2 * 128 * 2


def test_moe_memory_divides_expert_state_by_ep_and_zero_by_edp():
    """At ep 8 a rank holds an eighth of each MoE layer's experts (parameters, gradients and Adam's moments), DDP's
    buckets leave them out (they are all-reduced over edp after the backward); ZeRO partitions the dense state over
    dp×cp and the experts' over edp (zero/experts.py), and the search offers ZeRO at ep > 1 as the trainer runs it."""
    from trainer3d.plan.candidate import expert_params, tp_summed_pieces

    cfg = MODEL_PRESETS["mixtral-8x7b"]
    base = dict(cfg=cfg, dp=8, pp=4, micro_batches=8, seq_len=4096, precision="bf16-autocast", recompute=True)
    one, eight = (estimate_memory(Candidate(**base, ep=ep), 1) for ep in (1, 8))
    experts = expert_params(cfg, 1, Candidate(**base).stages(1))  # the rank's 8 layers' 8 experts each
    assert experts == 8 * 8 * 3 * 4096 * 14336 and one.n_params - eight.n_params == experts * 7 // 8
    assert (one.params - eight.params, one.optimizer - eight.optimizer) == (4 * experts * 7 // 8, 8 * experts * 7 // 8)
    assert one.ddp_buckets == 4 * one.n_params and eight.ddp_buckets == 4 * (eight.n_params - experts // 8)
    for ep, edp in ((1, 8), (2, 4), (8, 1)):  # ZeRO-1: 12 bytes of fp32 master + moments per parameter, partitioned
        z = estimate_memory(Candidate(**base, ep=ep, zero_stage=1), 1)
        dense = z.n_params - experts // ep
        assert z.optimizer == pytest.approx(12 * (dense / 8 + experts / ep / edp), rel=1e-6), (ep, edp)
    search = enumerate_plans(MODEL_PRESETS["qwen3-moe-tiny"], Cluster(nodes=1, **H100), 16, 1024, offload=False)
    eps = {p.candidate.ep for p in search.plans}
    assert eps == {1, 2, 4, 8}
    assert {p.candidate.zero_stage for p in search.plans if p.candidate.ep > 1} == {0, 1, 2, 3}
    plan = parse_layout("ep=2,zero=1", MODEL_PRESETS["qwen3-moe-tiny"], Cluster(nodes=1, **H100), 16, 1024)
    assert (plan.ep, plan.zero_stage) == (2, 1)
    # ZeRO-3 at tp 2: the gradients tp ranks hold shares of are summed over tp on each rank's own partition, an
    # expert's over edp (2 here), the rest over dp×cp (4)
    z3 = Candidate(**dict(base, dp=4, pp=1, micro_batches=1), tp=2, ep=2, zero_stage=3)
    pieces = tp_summed_pieces(z3, z3.stages(0))
    summed = next(t for t in analytic_comm(z3, 0) if t.group == "tp" and t.why.startswith("once per step"))
    assert any(e for _, e in pieces) and any(not e for _, e in pieces)
    assert summed.nbytes == 4 * sum(math.ceil(n / (2 if e else 4)) for n, e in pieces)


def test_moe_groups_are_priced_on_the_links_the_topology_builds(monkeypatch):
    """The ep and edp groups the planner prices (stride and size in rank order) are the ones topology.Topology
    builds, for layouts with and without cp; an all-to-all within a node runs at the intra-node bandwidth, and one
    whose group spans nodes sends the share for other nodes over the inter-node one."""
    import torch.distributed as dist

    from trainer3d.distributed import topology
    from trainer3d.plan.step_time import all_to_all_seconds, group_links

    for dp, tp, cp, pp, ep in ((8, 2, 1, 2, 4), (4, 2, 2, 1, 8), (4, 1, 2, 2, 2)):
        L = topology.Layout(dp=dp, tp=tp, pp=pp, cp=cp, ep=ep)
        built = []
        monkeypatch.setattr(dist, "is_initialized", lambda: True)
        monkeypatch.setattr(dist, "get_world_size", lambda: L.world_size)
        monkeypatch.setattr(dist, "get_rank", lambda: 0)
        monkeypatch.setattr(topology.Topology, "_build", lambda self, lines: built.append(sorted(map(sorted, lines))))
        topology.Topology(L, last_stage_pp_rank=pp - 1)
        links = group_links(Candidate(cfg=MODEL_PRESETS["qwen3-moe-tiny"], dp=dp, tp=tp, pp=pp, cp=cp, ep=ep))
        for g in ("ep", "edp"):
            stride, size = links[g]
            lines = {tuple(r - (r // stride % size) * stride + stride * j for j in range(size)) for r in range(L.world_size)}
            assert sorted(map(list, lines)) in built, (g, dp, tp, cp, pp, ep)
    C = Cluster(nodes=2, **H100)
    assert all_to_all_seconds(8e9, 1, 8, C) == pytest.approx(8e9 * 7 / 8 / 360e9)  # one node
    assert all_to_all_seconds(8e9, 2, 8, C) == pytest.approx(8e9 * 4 / 8 / 50e9)  # half of the peers elsewhere


def test_published_megatron_moe_layout_lands_near_its_throughput():
    """Megatron-Core's MoE README (https://github.com/NVIDIA/Megatron-LM/blob/main/megatron/core/transformer/moe/README.md,
    also https://docs.nvidia.com/megatron-core/developer-guide/latest/api-guide/moe.html): "468 TFLOPS for Mixtral 8X7B
    bf16 training" (MCore v0.9), and its reference parallel mapping for Mixtral 8x7B (dropless, all-to-all, BF16): 64
    H100 80GB (8 per node, 8x400 Gbit/s InfiniBand), seq 4096, TP 1, EP 8, PP 4, VP 8, micro-batch 1, global batch
    256, no recomputation. Megatron counts model FLOPs as the planner does (6 per active parameter, 12·L·h·s for
    attention; checked below). As published under DDP the planner lands within 25% of 468 (413 now) and it fits
    trainer3d (~73 GiB of 78: it did not, ~82, while each micro-batch in flight kept its own bf16 copy of the experts;
    they are cast once a step now, models/moe.expert_casts_cached). Under ZeRO-1 (Megatron's distributed optimizer:
    the experts' state over edp) it takes less (~56 GiB) and lands within 25% (426 now); with full recomputation under
    DDP it fits (~45 GiB) and its hardware FLOP rate (the recomputed forward counted) lands within 25% of 468 (423
    now)."""
    from trainer3d.plan.cli import cluster_from_preset
    from trainer3d.plan.report import model_flops_utilization

    cfg, C, published = MODEL_PRESETS["mixtral-8x7b"], cluster_from_preset("h100", 8), 468
    h, s, L, I, a, g = 4096, 4096, 32, 14336, 32, 8  # Megatron's num_floating_point_operations (router left out)
    megatron = 12 * s * L * h * h * ((1 + g / a + s / h) + I / h * 2 * 1.5 + 32000 / (2 * L * h)) / s
    assert cfg.flops_per_token(s) == pytest.approx(megatron, rel=1e-3)
    layout = "tp=1,pp=4,ep=8,schedule=interleaved-1f1b,v=8,mbs=1"
    as_published = evaluate(parse_layout(layout, cfg, C, 256, s), C)
    assert not as_published.notes and 70 * 2**30 < as_published.memory < 78 * 2**30
    assert 0.75 <= model_flops_utilization(as_published, C) * C.peak_tflops / published <= 1.25
    distributed = evaluate(parse_layout(layout + ",zero=1", cfg, C, 256, s), C)
    assert not distributed.notes and distributed.memory < as_published.memory
    assert 0.75 <= model_flops_utilization(distributed, C) * C.peak_tflops / published <= 1.25
    recomputed = evaluate(parse_layout(layout + ",recompute=1", cfg, C, 256, s), C)
    assert not recomputed.notes
    assert 0.75 <= model_flops_utilization(recomputed, C) * C.peak_tflops * 4 / 3 / published <= 1.25


# ---- calibration (plan/calibrate.py) -------------------------------------------------------------------------------
def test_latency_is_priced_per_ring_step_of_every_call():
    """A per-step latency adds calls × ring steps × latency to each group's time, nothing where there is no call."""
    from dataclasses import replace

    from trainer3d.plan.comm import ring_steps

    cfg = MODEL_PRESETS["gpt2"]
    C = Cluster(nodes=1, **H100)
    cand = parse_layout("tp=4,pp=2,mbs=1,sp=0", cfg, C, 8, 1024)
    slow = replace(C, intra_node_latency_s=1e-3)
    base, lat = evaluate(cand, C).times, evaluate(cand, slow).times
    steps = {g: sum(t.calls * ring_steps(t.op, t.n) for t in analytic_comm(cand, 0) if t.group == g)
             for g in ("tp", "pp")}
    assert steps["tp"] > 0 and steps["pp"] > 0
    assert lat["tp comm"] - base["tp comm"] >= steps["tp"] * 1e-3 - 1e-9  # the busiest pp rank: at least rank 0's
    assert lat["compute"] == base["compute"] and lat["dp comm"] == base["dp comm"] == 0.0  # dp 1: no dp traffic
    assert [ring_steps(op, 4) for op in ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send")] == \
        [6, 3, 3, 3, 1] and ring_steps("all_reduce", 1) == 0


def test_each_call_is_priced_by_its_own_measured_link():
    """A calibration's numbers for one kind of call (here send/recv, the pipeline's) change the time of that call only;
    a reduce-scatter takes the all-gather's (the same ring), and an op nothing measured keeps the link's."""
    from dataclasses import replace

    from trainer3d.plan.comm import ring_steps

    cfg = MODEL_PRESETS["gpt2"]
    C = Cluster(nodes=1, **H100)
    cand = parse_layout("tp=4,pp=2,mbs=1,sp=0", cfg, C, 8, 1024)
    slow_send = replace(C, op_links=(("intra", "send", C.intra_node_gbps, 1e-3),))
    base, lat = evaluate(cand, C).times, evaluate(cand, slow_send).times
    sends = sum(t.calls * ring_steps(t.op, t.n) for t in analytic_comm(cand, 0) if t.op == "send")
    assert sends > 0 and lat["pp comm"] - base["pp comm"] >= sends * 1e-3 - 1e-9
    assert lat["tp comm"] == base["tp comm"] and lat["compute"] == base["compute"]
    gather = replace(C, op_links=(("intra", "all_gather", 1.0, 0.0),))
    assert gather.link(False, "reduce_scatter") == (1.0, 0.0) == gather.link(False, "all_gather")
    assert gather.link(False, "all_reduce") == (C.intra_node_gbps, 0.0)
    assert gather.link(True, "all_gather") == (C.inter_node_gbps, 0.0)


def _calibrate(rank: int, world: int) -> int:
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.plan.calibrate import run

    return run(MODEL_PRESETS["tiny"], 64)


def test_calibration_measures_caches_and_replaces_the_assumed_constants(tmp_path, monkeypatch, capsys):
    """A world of 2 measures this machine (`python -m trainer3d.plan --calibrate`'s body), rank 0 caches it; the
    planner's --calibrated then plans with the measured speed, bandwidth, latency and overlap instead of its
    assumptions."""
    from helpers.distributed import run_world

    from trainer3d.plan import calibrate

    monkeypatch.setenv("TRAINER3D_CALIBRATION", str(tmp_path))
    assert run_world(2, _calibrate, timeout=120) == [0, 0]
    calib = calibrate.load(torch.device("cpu"), 2, "fp32")
    assert calib is not None and calib.nodes == 1 and calib.inter is None
    assert 1e-4 < calib.matmul_tflops < 10 and 0.0 <= calib.overlap <= 1.0
    assert list(calib.intra) == ["all_reduce", "all_gather", "send"]
    assert all(1e-7 < v.latency_s < 1.0 and 1e-3 < v.gbps < 1e3 for v in calib.intra.values()), calib.intra
    C = calibrate.apply(Cluster(nodes=1, **dict(H100, gpus_per_node=2)), calib)
    reduce = calib.intra["all_reduce"]
    assert (C.peak_tflops, C.mfu, C.intra_node_gbps, C.intra_node_latency_s, C.overlap, C.ranks_per_processor) == (
        calib.matmul_tflops, 1.0, reduce.gbps, reduce.latency_s, calib.overlap, calib.ranks_per_processor)
    assert 1.0 <= calib.ranks_per_processor <= 2.0  # 2 ranks: at most both on one core
    assert C.adam_params_per_s == calib.adam_params_per_s and 1e5 < calib.adam_params_per_s < 1e11
    for op, priced_as in (("all_reduce", "all_reduce"), ("all_gather", "all_gather"),
                          ("reduce_scatter", "all_gather"), ("send", "send")):
        assert C.link(False, op) == (calib.intra[priced_as].gbps, calib.intra[priced_as].latency_s)
    assert C.inter_node_gbps == H100["inter_node_gbps"]  # nothing measured across nodes: the assumption stays
    capsys.readouterr()
    assert main(["--model", "tiny", "--seq-len", "64", "--gpus-per-node", "2", "--global-batch", "8",
                 "--calibrated", "--top", "1"]) == 0
    out = capsys.readouterr().out
    assert f"calibration: {calib.describe()}" in out and f"{calib.matmul_tflops:g} TFLOP/s peak at 100%" in out
    monkeypatch.setenv("TRAINER3D_CALIBRATION", str(tmp_path / "none"))
    assert main(["--model", "tiny", "--gpus-per-node", "2", "--calibrated"]) == 2
    assert re.match(r"trainer3d: error: no calibration at .*run `torchrun --nproc_per_node 2 -m trainer3d.plan "
                    "--calibrate", capsys.readouterr().err)


def test_fp8_runs_its_matmuls_at_twice_the_rate():
    """--fp8's plans: the linears of blocks 1 to L-2 (GPT-2: 12·d² weights a block) at twice the bf16 peak, plus
    torchao's casts (2·(in + out) elements a token of each such linear: GPT-2's 3d+d, d+d, d+4d, 4d+d), the rest and
    the memory as bf16's; tensorwise's casts at FP8_CAST_SHARE's share of rowwise's; the launch command carries the
    recipe, and --evaluate's fp8= takes one."""
    from trainer3d.plan.step_time import step_times

    cfg = MODEL_PRESETS["gpt2-medium"]
    C = Cluster(nodes=1, **H100)
    base = Candidate(cfg=cfg, micro_batches=16, seq_len=1024, precision="bf16-autocast")
    fp8 = Candidate(**{**base.__dict__, "fp8": "rowwise"})
    fp8_flops = 6 * (cfg.n_layer - 2) * 12 * cfg.n_embd**2 * 16 * 1024  # a step's, in the FP8 linears
    all_flops = cfg.flops_per_token(1024) * 16 * 1024
    times = step_times(fp8, C)
    ratio = times["compute"] / step_times(base, C)["compute"]
    assert math.isclose(ratio, 1 - fp8_flops / all_flops / 2, rel_tol=1e-9), ratio
    casts = 2 * (cfg.n_layer - 2) * 16 * cfg.n_embd * 16 * 1024 * C.fp8_cast_s
    assert math.isclose(times["fp8 casts"], casts, rel_tol=1e-9), (times["fp8 casts"], casts)
    assert "fp8 casts" not in step_times(base, C)
    assert estimate_memory(fp8, 0).peak == estimate_memory(base, 0).peak
    plan = evaluate(fp8, C)
    assert "--fp8 rowwise" in launch_command(plan, C, "torchrun", "gpt2-medium", None)
    tensorwise = Candidate(**{**base.__dict__, "fp8": "tensorwise"})
    tw_times = step_times(tensorwise, C)
    assert tw_times["compute"] == times["compute"]  # the same matmuls, cheaper casts
    assert math.isclose(tw_times["fp8 casts"], casts * FP8_CAST_SHARE["tensorwise"], rel_tol=1e-9)
    assert FP8_CAST_SHARE["tensorwise"] < 1 and set(FP8_CAST_SHARE) == set(FP8_RECIPES)  # every recipe priced
    assert "--fp8 tensorwise" in launch_command(evaluate(tensorwise, C), C, "torchrun", "gpt2-medium", None)
    for text, recipe in (("fp8=1", "rowwise"), ("fp8=tensorwise", "tensorwise"), ("fp8=0", None)):
        assert parse_layout(text, cfg, C, 16, 1024).fp8 == recipe, text
    with pytest.raises(ConfigError, match="fp8=mxfp8 is none of"):
        parse_layout("fp8=mxfp8", cfg, C, 16, 1024)


def test_full_recomputation_under_a_split_backward_runs_the_forward_twice():
    """The input-gradient pass and the weight pass each recompute a block (measured at (1,1,2): zbv 2.4x its time
    without recomputation, 1F1B 1.5x): the compute of zbv with it is 5/3 of without, 1F1B's 4/3."""
    from trainer3d.plan.step_time import step_times

    cfg = MODEL_PRESETS["gpt2-medium"]
    C = Cluster(nodes=1, **H100)
    for schedule, factor in (("zbv", 5 / 3), ("1f1b", 4 / 3)):
        plain = Candidate(cfg=cfg, pp=2, schedule=schedule, micro_batches=8, seq_len=1024, precision="bf16-autocast")
        ratio = step_times(Candidate(**{**plain.__dict__, "recompute": True}), C)["compute"] / \
            step_times(plain, C)["compute"]
        assert math.isclose(ratio, factor, rel_tol=1e-9), (schedule, ratio)


def test_fp8_step_ratio_against_the_gpu_round():
    """The planner's FP8/bf16 step-time ratio against the GPU round's measured one (bench/results/gpu_mfu.json: the
    trainer compiled, bf16 and --fp8 rowwise, one H200): within 15% at gpt2-medium, llama3.2-1b and llama3.2-3b (the
    cast cost was fitted to these three: the bound keeps the fit and its use in step_times together), and FP8 a loss
    where the round measured one (gpt2-medium 1.21x the bf16 step); at d = 4096 (the third round) FP8 pays, as the
    planner says; at llama3.1-70b's width the model has FP8 pay."""
    import dataclasses
    import json

    from trainer3d.plan.cluster import CLUSTERS
    from trainer3d.plan.step_time import step_times

    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu_mfu.json").read_text())
    trainer = {(r["model"], r["fp8"]): r for r in rows if r["runner"] == "trainer3d" and r["compiled"]}

    def step(cand, C):  # the single-GPU step the round measured: everything but the optimizer
        return sum(v for k, v in step_times(cand, C).items() if k != "optimizer")

    predicted = {}
    for model in ("gpt2-medium", "llama3.2-1b", "llama3.2-3b"):
        bf16, fp8 = trainer[(model, None)], trainer[(model, "rowwise")]
        assert bf16["micro_batch"] == fp8["micro_batch"] and "H200" in bf16["device"], (bf16, fp8)
        # the bf16 step at its measured MFU: compute is then the whole single-GPU step, as measured
        C = Cluster(nodes=1, **{**CLUSTERS["h200"], "gpus_per_node": 1, "mfu": bf16["mfu"]})
        base = Candidate(cfg=MODEL_PRESETS[model], micro_batches=1, micro_batch_size=bf16["micro_batch"],
                         seq_len=bf16["seq"], precision="bf16-autocast")
        with_fp8 = Candidate(**{**base.__dict__, "fp8": "rowwise"})
        ratio = step(with_fp8, C) / step(base, C)
        measured = bf16["tokens_per_s"] / fp8["tokens_per_s"]
        predicted[model] = ratio
        assert abs(ratio / measured - 1) < 0.15, (model, ratio, measured)
    assert predicted["gpt2-medium"] > 1.1, predicted
    # the third round (bench/results/gpu_round3): llama3.1-8b's first 8 layers (d = 4096), 4 micro-batches of 8, where
    # FP8 paid (rowwise 0.93 of the bf16 step); outside the fit, the planner within 15% and on the same side of 1
    rows = json.loads((Path(__file__).resolve().parents[1] / "bench" / "results" / "gpu_round3" / "gpu_mfu.json")
                      .read_text())
    wide = {r["fp8"]: r for r in rows if r["model"] == "llama3.1-8b/8" and r["runner"] == "trainer3d"
            and r["grad_accum"] == 4}
    bf16 = wide[None]
    C = Cluster(nodes=1, **{**CLUSTERS["h200"], "gpus_per_node": 1, "mfu": bf16["mfu"]})
    cfg = dataclasses.replace(MODEL_PRESETS["llama3.1-8b"], n_layer=8, vocab_size=50304)
    base = Candidate(cfg=cfg, micro_batches=4, micro_batch_size=8, seq_len=1024, precision="bf16-autocast")
    for recipe in ("rowwise", "tensorwise"):  # tensorwise: 0.83 of the step measured, its casts FP8_CAST_SHARE's
        ratio = step(Candidate(**{**base.__dict__, "fp8": recipe}), C) / step(base, C)
        measured = bf16["tokens_per_s"] / wide[recipe]["tokens_per_s"]
        assert abs(ratio / measured - 1) < 0.15 and ratio < 1 and measured < 1, (recipe, ratio, measured)
    big = Candidate(cfg=MODEL_PRESETS["llama3.1-70b"], micro_batch_size=1, seq_len=8192, precision="bf16-autocast",
                    tp=8)
    C = Cluster(nodes=1, **CLUSTERS["h200"])
    fp8_times, bf16_times = step_times(Candidate(**{**big.__dict__, "fp8": "rowwise"}), C), step_times(big, C)
    assert fp8_times["compute"] + fp8_times["fp8 casts"] < 0.85 * bf16_times["compute"], (fp8_times, bf16_times)


@pytest.mark.parametrize("tp, model, targets", [(1, "llama-tiny", "q_proj,v_proj,o_proj,gate_up_proj"),
                                                 (2, "llama-tiny", "q_proj,v_proj,o_proj,gate_up_proj"),
                                                 (2, "qwen3-moe-tiny", "qkv_proj,o_proj,experts"),
                                                 (2, "deepseek-v3-tiny", "all-linear,experts")])
def test_lora_counts_the_adapters_the_trainer_builds(tp, model, targets):
    """Under LoRA the planner's trainable parameters are the adapters parallel/lora.py builds on a tp rank (a
    column-parallel target's A whole and B split, a row-parallel one's A split, a replicated one's (MLA's latents, a
    shared expert) both whole), and only they take gradients and
    AdamW state: a ZeRO-3 rank holds its 1/dp of their fp32 gradient and 12-byte state beside the base's partition."""
    from trainer3d.models import build_model
    from trainer3d.parallel.expert_parallel import apply_expert_parallel
    from trainer3d.parallel.lora import LoRASpec, apply_lora, is_adapter
    from trainer3d.parallel.tensor_parallel import apply_tensor_parallel
    from trainer3d.plan.candidate import trainable_params

    cfg, spec, ep = MODEL_PRESETS[model], LoRASpec(8, 16.0, targets=tuple(targets.split(","))), 2
    with torch.device("meta"):
        stage = apply_lora(apply_tensor_parallel(build_model(cfg), None, 0, tp, None), spec, None, tp, None)
        stage = apply_expert_parallel(stage, None, 0, tp, False, None, 0, ep)  # (a dense model: nothing to split)
    built = sum(p.numel() for name, p in stage.named_parameters() if is_adapter(name))
    experts = sum(p.numel() for name, p in stage.named_parameters() if is_adapter(name) and ".experts." in name)
    cand = Candidate(cfg, dp=4, tp=tp, zero_stage=3, lora=spec, ep=ep if cfg.moe is not None else 1)
    assert built > 0 and trainable_params(cand, cand.stages(0)) == built
    full, lora = estimate_memory(Candidate(cfg, dp=4, tp=tp, zero_stage=3, ep=cand.ep), 0), estimate_memory(cand, 0)
    part = (built - experts) / 4 + experts / (4 // cand.ep)  # ZeRO's partitions: dp×cp, the experts' edp
    assert lora.grads == part * 4 and lora.optimizer == part * 12 and (experts > 0) == (cfg.moe is not None)
    assert lora.params >= full.params and lora.model_states < full.model_states / 4  # the base without its state
    searched = enumerate_plans(cfg, Cluster(nodes=1, **H100), 8, 128, lora=spec)
    assert searched.plans and all(p.candidate.lora == spec for p in searched.plans)
