"""Topology order, layout validation (before any process group), stage balancing, TP shard maps and the
vocab-parallel cross-entropy against torch's, all in one process."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
import torch
import torch.nn.functional as F

from trainer3d.config import TrainConfig
from trainer3d.errors import ConfigError

from trainer3d.train.setup import validate
from trainer3d.models import MODEL_PRESETS
from trainer3d.parallel.pipeline import balance_layers, stage_ids
from trainer3d.parallel.cross_entropy import vocab_parallel_cross_entropy
from trainer3d.parallel.tensor_parallel import TPSpec, padded_vocab_size, shard_tensor, unshard_tensor
from trainer3d.distributed.topology import Layout, LayoutError, infer_layout

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_rank_order_tp_fastest_pp_outermost():
    L = Layout(dp=2, tp=2, pp=2)
    assert [L.coords(r)[:3] for r in range(8)] == [  # (pp, dp, tp)
        (0, 0, 0), (0, 0, 1), (0, 1, 0), (0, 1, 1), (1, 0, 0), (1, 0, 1), (1, 1, 0), (1, 1, 1),
    ]
    assert all(L.rank(*L.coords(r)) == r for r in range(8))


def test_rank_order_with_context_parallelism_tp_then_cp():
    """Megatron-LM's order: tp fastest, then cp, dp, pp; the dp×cp line of a (pp, tp) holds the same parameters."""
    L = Layout(dp=2, tp=2, pp=2, cp=2)
    assert L.world_size == 16 and L.dp_cp == 4
    assert [tuple(L.coords(r)) for r in range(4)] == [(0, 0, 0, 0), (0, 0, 1, 0), (0, 0, 0, 1), (0, 0, 1, 1)]
    assert L.coords(4) == (0, 1, 0, 0) and L.coords(8) == (1, 0, 0, 0)
    assert all(L.rank(*L.coords(r)) == r for r in range(16))
    assert infer_layout(16, tp=2, pp=2, cp=2) == L
    with pytest.raises(LayoutError, match="tp×cp×pp = 2×3×1 = 6"):
        infer_layout(8, tp=2, pp=1, cp=3)


def test_dp_is_inferred_and_bad_world_refused():
    assert infer_layout(8, tp=2, pp=2) == Layout(dp=2, tp=2, pp=2)
    with pytest.raises(LayoutError, match="not divisible by tp×pp"):
        infer_layout(6, tp=4, pp=1)


@pytest.mark.parametrize(
    "kwargs,world,message",
    [
        (dict(tp=3, n_head=4), 3, "must divide the model's 4 attention heads"),
        (dict(pp=8, n_layer=4), 8, "exceed the model's 4 layers"),
        (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=4, n_layer=4), 2, "exceed the model's 4 layers"),
        (dict(pp=2, virtual_stages=2, schedule="1f1b"), 2, "needs a multi-stage schedule"),
        (dict(pp=4, micro_batches=2, global_batch=16), 4, "1F1B needs at least pp=4 micro-batches"),
        (dict(pp=2, schedule="interleaved-1f1b", virtual_stages=2, micro_batches=3, global_batch=12), 2, "multiple of pp=2"),
        (dict(global_batch=10), 4, "does not split into dp=4"),
        (dict(seq_len=4096), 1, "exceeds the model's context"),
        (dict(global_batch_tokens=1000, seq_len=128), 1, "not a multiple of --seq-len"),
        (dict(model="gpt5"), 1, "Unknown --model"),
        (dict(n_embd=100, n_head=3), 1, "must be a multiple of --n-head"),
        # the Llama family: grouped-query attention under tp, and size flags of one family given to another
        (dict(model="llama-tiny", tp=4), 4, "must divide the model's 2 key/value heads"),
        (dict(model="llama-tiny", n_kv_heads=3), 1, "--n-head 4 must be a multiple of --n-kv-heads 3"),
        (dict(model="llama-tiny", tp=2, ffn_hidden=385), 2, "must divide the model's MLP width of 385"),
        (dict(model="tiny", n_kv_heads=2), 1, "--n-kv-heads does not apply to the gpt2 model"),
        # mixtures of experts: ep against the data-parallel ranks and the experts, the token split under tp, MoE flags
        (dict(model="qwen3-moe-tiny", ep=4), 2, "--ep 4 splits the experts over ranks carved from the 2"),
        (dict(model="qwen3-moe-tiny", ep=3), 3, "--ep 3 must divide the model's 8 experts"),
        (dict(model="llama-tiny", ep=2), 2, "this model has none; drop --ep"),
        (dict(model="qwen3-moe-tiny", tp=2, seq_len=63), 2, "pick a --seq-len divisible by 2"),
        (dict(model="qwen3-moe-tiny", top_k=9), 1, "--top-k 9 must be between 1 and the model's 8 experts"),
        (dict(model="llama-tiny", n_experts=8), 1, "--n-experts does not apply to the llama model"),
        (dict(model="tiny", moe_aux_loss_coef=0.01), 1, "mixture of experts"),
        (dict(model="qwen3-moe-tiny", moe_aux_loss="hf", moe_aux_loss_coef=0.01, pp=2), 2,
         "--moe-aux-loss hf pools every layer"),
    ],
)
def test_impossible_layouts_refused_with_one_sentence(kwargs, world, message):
    with pytest.raises((LayoutError, ConfigError), match=message) as err:
        validate(TrainConfig(**kwargs), world)
    assert str(err.value).count("\n") == 0


def test_split_backward_with_sequence_parallelism_refused_before_torch_2_13(monkeypatch):
    """torch 2.11's weight pass fails on sequence parallelism's autograd functions (docs/launching.md); 2.13 runs it."""
    from trainer3d.parallel import pipeline

    cfg = TrainConfig(tp=2, pp=2, schedule="zbv", micro_batches=4, global_batch=8, sequence_parallel=True)
    monkeypatch.setattr(pipeline, "PIPELINING_BEFORE_2_13", False)
    validate(cfg, 4)
    monkeypatch.setattr(pipeline, "PIPELINING_BEFORE_2_13", True)
    with pytest.raises(LayoutError, match="--schedule zbv with --sequence-parallel fails inside torch") as err:
        validate(cfg, 4)
    assert str(err.value).count("\n") == 0
    validate(TrainConfig(tp=2, pp=2, micro_batches=4, global_batch=8, sequence_parallel=True), 4)  # 1F1B runs


def test_gpt2_batch_in_tokens():
    cfg = TrainConfig(model="gpt2", seq_len=1024, global_batch_tokens=524288, micro_batches=8, tp=2, pp=2)
    setup = validate(cfg, 64)
    layout, plan = setup.layout, setup.plan
    assert (layout.dp, plan.global_batch, plan.micro_batches, plan.micro_batch_size) == (16, 512, 8, 4)


def test_cli_refuses_bad_layout_before_any_process_group():
    # RANK/WORLD_SIZE say 4 processes but nobody else exists: reaching init_process_group would hang.
    env = dict(os.environ, RANK="0", WORLD_SIZE="4", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="1")
    t0 = time.monotonic()
    out = subprocess.run(
        [sys.executable, os.path.join(ROOT, "launch", "train_gpt2.py"), "--tp", "3"],
        env=env, capture_output=True, text=True, timeout=120,
    )
    assert out.returncode == 2
    assert "World size 4 is not divisible by tp×pp = 3×1 = 3" in out.stderr
    assert time.monotonic() - t0 < 120


def test_balance_charges_the_head_to_the_last_stage():
    ranges = balance_layers(MODEL_PRESETS["gpt2"], 4, 1024)
    sizes = [len(r) for r in ranges]
    assert sum(sizes) == 12 and sizes[-1] < sizes[0]
    assert [r.start for r in ranges] == sorted(r.start for r in ranges)  # contiguous, in order
    assert stage_ids(1, 4, "interleaved-1f1b", 2) == [1, 5]
    assert stage_ids(1, 4, "zbv", 1) == [1, 6]


def test_vocab_padding():
    assert padded_vocab_size(50257, 1) == 50304
    assert padded_vocab_size(50257, 2) == 50432
    assert padded_vocab_size(50257, 8) % (128 * 8) == 0


def test_shard_unshard_roundtrip_fused_qkv_and_padded_vocab():
    qkv = torch.arange(3 * 8 * 4, dtype=torch.float32).reshape(24, 4)
    spec = TPSpec(0, (24, 4), fused=(8, 8, 8))
    shards = [shard_tensor(qkv, spec, r, 2) for r in range(2)]
    # each rank holds the same heads of q, k and v: rows 0-3 of each 8-row block on rank 0
    assert torch.equal(shards[0][:4], qkv[:4]) and torch.equal(shards[0][4:8], qkv[8:12])
    assert torch.equal(unshard_tensor(shards, spec), qkv)
    # grouped-query attention: q of 8 rows, k and v of 4 (two kv heads of 2 rows); each rank takes half of each block
    gqa = torch.arange(16 * 3, dtype=torch.float32).reshape(16, 3)
    gspec = TPSpec(0, (16, 3), fused=(8, 4, 4))
    gshards = [shard_tensor(gqa, gspec, r, 2) for r in range(2)]
    assert torch.equal(gshards[1], torch.cat([gqa[4:8], gqa[10:12], gqa[14:16]]))
    assert torch.equal(unshard_tensor(gshards, gspec), gqa)
    emb = torch.randn(500, 6)
    vspec = TPSpec(0, (500, 6), padded=padded_vocab_size(500, 4))
    vshards = [shard_tensor(emb, vspec, r, 4) for r in range(4)]
    assert vshards[0].shape == (128, 6) and torch.count_nonzero(vshards[3][500 - 384 :]) == 0
    assert torch.equal(unshard_tensor(vshards, vspec), emb)


def test_vocab_parallel_cross_entropy_matches_torch_with_padding_masked():
    """Losses and gradients as F.cross_entropy's over the unpadded columns; with gradients the loss takes the logits'
    storage for them (Megatron's in-place loss), without gradients it leaves the logits alone."""
    torch.manual_seed(0)
    V, Vp = 500, 512
    base = torch.randn(3, 7, Vp, dtype=torch.float64)
    target = torch.randint(0, V, (3, 7))
    ref_in = base.clone().requires_grad_()
    ref = F.cross_entropy(ref_in[..., :V].reshape(-1, V), target.reshape(-1), reduction="none").reshape(3, 7)
    g_ref, = torch.autograd.grad(ref.sum(), ref_in)
    logits = base.clone().requires_grad_()
    ours = vocab_parallel_cross_entropy(logits, target, None, 0, V)
    torch.testing.assert_close(ours, ref)
    g_ours, = torch.autograd.grad(ours.sum(), logits)
    torch.testing.assert_close(g_ours, g_ref)
    assert torch.count_nonzero(g_ours[..., V:]) == 0 and g_ours.data_ptr() == logits.data_ptr()
    kept = base.clone()
    with torch.no_grad():
        torch.testing.assert_close(vocab_parallel_cross_entropy(kept.requires_grad_(), target, None, 0, V), ref)
    assert torch.equal(kept, base)
    twice = vocab_parallel_cross_entropy(base.clone().requires_grad_(), target, None, 0, V).sum()
    twice.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="ran twice"):
        twice.backward()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cross_entropy_in_chunks_equals_one_chunk(dtype):
    """Chunks of 1, 5 and 8 tokens (a last chunk cut short) give bitwise the losses and gradients of one chunk of
    all 21 tokens, with padding columns (tp > 1 runs it in the parity tests)."""
    torch.manual_seed(0)
    target = torch.randint(0, 500, (3, 7))
    base = torch.randn(3, 7, 512).to(dtype)
    out = {}
    for chunk in (21, 1, 5, 8):
        logits = base.clone().requires_grad_()
        loss = vocab_parallel_cross_entropy(logits, target, None, 0, 500, chunk_tokens=chunk)
        grad, = torch.autograd.grad((loss * torch.arange(21.0).view(3, 7)).sum(), logits)
        out[chunk] = (loss, grad)
    for chunk in (1, 5, 8):
        assert torch.equal(out[chunk][0], out[21][0]) and torch.equal(out[chunk][1], out[21][1]), chunk
    assert out[21][1].dtype == dtype and torch.count_nonzero(out[21][1][..., 500:]) == 0


def test_cross_entropy_bf16_gradient_keeps_a_confident_target():
    """bf16 logits: the gradient is within bf16's rounding of the float64 one, the target column of a confident
    prediction included (p = 1 - 2e-3: p - 1 computed in bf16 would be 0 or off by half; it is computed from the fp32
    exponential)."""
    torch.manual_seed(0)
    base = torch.randn(64, 512, dtype=torch.float64)
    target = torch.randint(0, 512, (64,))
    base[torch.arange(64), target] = 13.0
    lo = base.to(torch.bfloat16).requires_grad_()
    exact_in = lo.detach().double().requires_grad_()  # before the loss takes lo's storage
    grad, = torch.autograd.grad(vocab_parallel_cross_entropy(lo, target, None, 0, 512).sum(), lo)
    exact, = torch.autograd.grad(F.cross_entropy(exact_in, target, reduction="sum"), exact_in)
    rel = ((grad.double() - exact).abs() / exact.abs().clamp_min(1e-30)).max()
    assert rel < 2 ** -7, rel
    at_target = grad[torch.arange(64), target].double()
    assert (exact[torch.arange(64), target] > -4e-3).all() and ((at_target / exact[torch.arange(64), target]) - 1).abs().max() < 2 ** -8


def test_gpt3_presets_match_the_paper_and_n_positions_opens_the_context():
    """Brown et al. 2020, Table 2.1: parameter counts within 3% (vocabulary 50257, context 2048); --n-positions
    lets any preset train on longer sequences."""
    published = {"gpt3-125m": 125e6, "gpt3-350m": 350e6, "gpt3-760m": 760e6, "gpt3-1.3b": 1.3e9, "gpt3-2.7b": 2.7e9,
                 "gpt3-6.7b": 6.7e9, "gpt3-13b": 13e9, "gpt3-175b": 175e9}
    for name, n in published.items():
        cfg = MODEL_PRESETS[name]
        assert cfg.n_positions == 2048 and cfg.n_embd % cfg.n_head == 0, name
        assert abs(cfg.num_params() / n - 1) < 0.03, (name, cfg.num_params())
    assert validate(TrainConfig(model="gpt3-125m", n_layer=1, seq_len=2048), 1).plan.global_batch == 8
    with pytest.raises(ConfigError, match="exceeds the model's context of 1024 positions"):
        validate(TrainConfig(model="gpt2", n_layer=1, seq_len=2048), 1)
    setup = validate(TrainConfig(model="gpt2", n_layer=1, seq_len=2048, n_positions=2048), 1)
    assert setup.model_config(50257).n_positions == 2048
