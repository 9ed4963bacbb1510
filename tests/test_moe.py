"""The mixture-of-experts block on its own, against formulas written here from their papers: routing and experts
against a token-by-token loop, the grouped matmul against the per-expert loop, Megatron-core's capacity drop,
DeepSeek-V3's bias (selection only), and the balancing losses (DeepSeek-V3's per-sequence loss, transformers' pooled
one, ST-MoE's z-loss) in value and in the gradient they add. Their layout-invariance: tests/test_parity.py; against
transformers trained: tests/test_llama_hf.py."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from trainer3d.models.moe import MoE, MoESpec, Routing, grouped_mm_applies
from trainer3d.parallel.moe_balance import MoEBalance

SPEC = MoESpec(n_experts=8, top_k=2, expert_hidden=24)


def block(spec: MoESpec = SPEC, hidden: int = 32, seed: int = 0, layer: int = 1) -> MoE:
    torch.manual_seed(seed)
    m = MoE(hidden, spec, layer)
    with torch.no_grad():
        for p in m.parameters():
            p.normal_(0, 0.3)
    m.gate.init_tables(torch.device("cpu"))
    return m


def token_by_token(m: MoE, x: torch.Tensor) -> torch.Tensor:
    """Each token through its top-k experts by the textbook rule, one at a time: softmax scores, top-k, weights
    renormalized, Σ w·down(silu(gate(x))·up(x))."""
    flat = x.reshape(-1, x.shape[-1])
    scores = F.softmax(flat @ m.gate.weight.T, dim=-1)
    out = []
    for t in range(flat.shape[0]):
        w, idx = scores[t].topk(m.spec.top_k)
        w = w / w.sum()
        y = 0
        for weight, e in zip(w, idx.tolist()):
            gate, up = (m.experts.gate_up_proj[e] @ flat[t]).chunk(2)
            y = y + weight * (m.experts.down_proj[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("hidden", [32, 30], ids=["grouped-mm", "per-expert-loop"])
def test_block_equals_token_by_token(hidden):
    """Forward and every gradient, on both of the experts' paths (30 floats a row break the grouped matmul's 16-byte
    rule); an expert that receives no token still gets a (zero) gradient."""
    m = block(hidden=hidden)
    x = torch.randn(3, 10, hidden, requires_grad=True)
    assert grouped_mm_applies(x.view(-1, hidden), m.experts.gate_up_proj, m.experts.down_proj) == (hidden == 32)
    ours = m(x)
    ref = token_by_token(m, x)
    torch.testing.assert_close(ours, ref, rtol=1e-5, atol=1e-5)
    target = torch.randn_like(ours)
    grads = torch.autograd.grad((ours * target).sum(), [x, *m.parameters()])
    ref_grads = torch.autograd.grad((ref * target).sum(), [x, *m.parameters()])
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-4, atol=1e-5)
    x_few = torch.randn(1, 1, hidden)  # one token: 6 of the 8 experts receive nothing
    m(x_few).sum().backward()
    assert m.experts.gate_up_proj.grad is not None


def test_capacity_drops_each_experts_lowest_scores():
    """Megatron-core's drop: an expert keeps at most ceil(factor·N·k/E) of the N tokens, those of highest score for it;
    dropped choices contribute nothing (the kept ones keep their weights)."""
    m = block()
    x = torch.randn(1, 40, 32)
    flat = x.view(-1, 32)
    routing = Routing(*m.gate(flat))
    assert m.within_capacity(routing) is None  # dropless by default
    m.capacity_factor = 0.5
    kept = m.within_capacity(routing)
    capacity = -(-0.5 * 40 * 2 // 8)  # ceil: 5
    chosen_score = routing.scores.gather(-1, routing.experts)
    for e in range(8):
        mine = routing.experts == e
        scores, keep = chosen_score[mine], kept[mine]
        assert keep.sum() == min(capacity, mine.sum())
        if (~keep).any():
            assert scores[keep].min() >= scores[~keep].max()  # the best kept, the rest dropped
    assert 0 < (~kept).sum() < kept.numel()
    expected = m.routed(flat, routing, kept)
    zeroed = routing.weights * kept  # the dropped choices' weights zeroed, everything else as dropless
    dropless = m.routed(flat, type(routing)(routing.logits, routing.scores, routing.experts, zeroed))
    torch.testing.assert_close(expected, dropless, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(m(x).view(-1, 32), expected)


def test_selection_bias_moves_choices_not_weights():
    """DeepSeek-V3's loss-free balancing: top-k on score + bias, the weights the unbiased scores."""
    m = block(MoESpec(n_experts=8, top_k=2, expert_hidden=24, score="sigmoid", renormalize=False))
    flat = torch.randn(50, 32)
    m.gate.expert_bias = torch.zeros(8)
    m.gate.expert_bias[5] = 10.0  # expert 5 wins every token's selection
    routing = Routing(*m.gate(flat))
    assert (routing.experts == 5).any(1).all()
    scores = torch.sigmoid(flat @ m.gate.weight.T)
    torch.testing.assert_close(routing.weights, scores.gather(-1, routing.experts))


def _balance(blocks: list[MoE], **flags) -> MoEBalance:
    """MoEBalance of one process (no group to reduce over) with one micro-batch."""
    cfg = SimpleNamespace(**{**dict(moe_aux_loss_coef=0.0, moe_aux_loss="sequence", moe_z_loss_coef=0.0,
                                    moe_bias_update_rate=0.0, moe_capacity_factor=None), **flags})
    topo = SimpleNamespace(layout=SimpleNamespace(tp=1, cp=1, dp_cp=1), tp_group=None, cp_group=None)
    mcfg = SimpleNamespace(moe_layers=[b.layer for b in blocks], moe=SPEC)
    trainer = SimpleNamespace(cfg=cfg, topo=topo, mcfg=mcfg, device=torch.device("cpu"), loss_scale=None,
                              plan=SimpleNamespace(micro_batches=1))
    return MoEBalance(trainer, [torch.nn.ModuleList(blocks)])


def _sequence_aux(scores: torch.Tensor, experts: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """DeepSeek-V3 (eq. 17-20): per sequence, f_e = E/(k·T)·|tokens choosing e|, P_e = mean score; Σ_e f_e·P_e; the
    mean over sequences."""
    E, k = scores.shape[-1], experts.shape[-1]
    f = F.one_hot(experts.view(B, T * k), E).sum(1).float() * E / (k * T)
    return (f * scores.view(B, T, E).mean(1)).sum(-1).mean()


def _pooled_aux(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """transformers' load_balancing_loss_func: every layer's tokens pooled, E·Σ_e (choices of e / rows)·mean score."""
    scores = torch.cat([s for s, _ in layers])
    experts = torch.cat([e for _, e in layers])
    E = scores.shape[-1]
    share = F.one_hot(experts, E).float().sum(1).mean(0)
    return E * (share * scores.mean(0)).sum()


@pytest.mark.parametrize("mode", ["sequence", "hf", "z"])
def test_balance_losses_have_their_papers_values_and_gradients(mode):
    """Two MoE blocks in a row: the loss the balance adds has the formula's value, and the blocks' gradients are those
    of (output + coef · formula), i.e. the loss was trained, not only reported."""
    coef = 0.1
    flags = {"z": dict(moe_z_loss_coef=coef)}.get(mode, dict(moe_aux_loss_coef=coef, moe_aux_loss=mode))
    blocks = [block(seed=1, layer=1), block(seed=2, layer=2)]
    balance = _balance(blocks, **flags)
    x = torch.randn(3, 10, 32)
    target = torch.randn(3, 10, 32)

    out = blocks[1](blocks[0](x))
    params = [p for b in blocks for p in b.parameters()]
    grads = torch.autograd.grad((out * target).sum(), params)
    reported = balance.losses[0 if mode != "z" else 1].item()

    for b in blocks:
        b.observer = None
    h = blocks[0](x)
    routes = [Routing(*blocks[0].gate(x.view(-1, 32))), Routing(*blocks[1].gate(h.view(-1, 32)))]
    out_ref = blocks[1](h)
    if mode == "sequence":
        formula = sum(_sequence_aux(r.scores, r.experts, 3, 10) for r in routes)
    elif mode == "hf":
        formula = _pooled_aux([(r.scores, r.experts) for r in routes])
    else:
        formula = sum(torch.logsumexp(r.logits, -1).square().mean() for r in routes)
    ref_grads = torch.autograd.grad((out_ref * target).sum() + coef * formula, params)
    assert reported == pytest.approx(coef * formula.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())
    router_grad_without = torch.autograd.grad((blocks[1](blocks[0](x)) * target).sum(), blocks[0].gate.weight)[0]
    assert (grads[0] - router_grad_without).abs().max() > 1e-6  # the loss moved the router's gradient


@pytest.mark.parametrize("preset,total,active", [("qwen3-30b-a3b", 30.53, 3.35), ("qwen3-235b-a22b", 235.09, 22.19),
                                                 ("mixtral-8x7b", 46.70, 12.88), ("mixtral-8x22b", 140.63, 39.16)])
def test_presets_have_the_published_sizes(preset, total, active):
    """Total and active (top-k experts of a token) parameters, in billions, as the model cards state them (Qwen3's:
    30.5B/3.3B, 235B/22B; Mixtral's paper: 46.7B/12.9B; 8x22B's card: 141B/39B), and as the model built on the
    meta device holds them."""
    from trainer3d.models import MODEL_PRESETS, build_model

    cfg = MODEL_PRESETS[preset]
    assert cfg.num_params() / 1e9 == pytest.approx(total, abs=0.01)
    assert cfg.num_params(active=True) / 1e9 == pytest.approx(active, abs=0.01)
    with torch.device("meta"):
        built = build_model(dataclasses.replace(cfg, n_layer=2))
    small = dataclasses.replace(cfg, n_layer=2)
    assert sum(p.numel() for p in built.parameters()) == small.num_params()


def _hf_models():
    import transformers

    qwen_moe = transformers.Qwen3MoeConfig(
        vocab_size=300, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=24, num_experts=8, num_experts_per_tok=2,
        mlp_only_layers=[0], norm_topk_prob=True)
    mixtral = transformers.MixtralConfig(vocab_size=300, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                                         num_experts_per_tok=2)
    qwen = transformers.Qwen3Config(vocab_size=300, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=24, tie_word_embeddings=True)
    return {"qwen3_moe": (transformers.Qwen3MoeForCausalLM, qwen_moe), "mixtral": (transformers.MixtralForCausalLM,
            mixtral), "qwen3": (transformers.Qwen3ForCausalLM, qwen)}


@pytest.mark.parametrize("name", ["qwen3_moe", "mixtral", "qwen3"])
def test_transformers_logits_and_round_trip(name, tmp_path):
    """A random transformers model (every weight perturbed): trainer3d's model read from its directory gives its logits,
    and the directory trainer3d writes back loads into transformers with the same logits."""
    from trainer3d.checkpoint.hf import load_hf_checkpoint, save_hf_checkpoint
    from trainer3d.models import plain_model

    cls, config = _hf_models()[name]
    torch.manual_seed(0)
    hf = cls(config).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.add_(torch.randn_like(p) * 0.02)
    hf.save_pretrained(tmp_path / "hf")
    cfg, state = load_hf_checkpoint(str(tmp_path / "hf"))
    assert (cfg.moe is not None) == (name != "qwen3")
    ours = plain_model(cfg, state, torch.device("cpu"), torch.float32)
    x = torch.randint(0, 300, (2, 20), generator=torch.Generator().manual_seed(1))
    save_hf_checkpoint(cfg, state, str(tmp_path / "back"))
    back = cls.from_pretrained(tmp_path / "back").eval()
    with torch.no_grad():
        expected = hf(x).logits
        assert (ours(x) - expected).abs().max() < 1e-5
        assert torch.equal(back(x).logits, expected)


def test_expert_major_regroups_rows_by_expert_then_source():
    """What the all-to-all delivers (rows by source rank, then local expert) regrouped for the grouped matmul (by
    expert, then source), each run kept in order."""
    from trainer3d.parallel.expert_parallel import expert_major

    per_source = torch.tensor([[2, 0, 1], [1, 3, 0]])  # 2 sources × 3 local experts
    label = [(s, e) for s in range(2) for e in range(3) for _ in range(int(per_source[s, e]))]
    perm = expert_major(per_source, len(label))
    assert [label[i] for i in perm] == sorted(label, key=lambda se: (se[1], se[0]))
    assert perm.tolist() == [0, 1, 3, 4, 5, 6, 2]


def test_configs_survive_a_checkpoints_json():
    """meta.json stores the model config: Qwen3-MoE's tuple of dense layers comes back a tuple (equal, hashable)."""
    import json

    from trainer3d.models import MODEL_PRESETS, config_from_dict, config_to_dict

    for name in ("qwen3-moe-tiny", "mixtral-tiny", "qwen3-tiny"):
        cfg = MODEL_PRESETS[name]
        back = config_from_dict(cfg.family, json.loads(json.dumps(config_to_dict(cfg))))
        assert back == cfg and hash(back) == hash(cfg)
