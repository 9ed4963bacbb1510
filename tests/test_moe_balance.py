"""The MoE balance where issue 42's fixes act, against formulas written here: padding never counts (the loads, the bias's
counts, the capacity, every balance loss and the z-loss equal their formulas over the real tokens only), the global-batch
loss counts the step's micro-batches so far (Megatron-core's running buffer), and --moe-aux-loss-coef means what
transformers' router_aux_loss_coef means (its load_balancing_loss_func, called here on the same router logits).
Layouts against the one-process run, with padding and the global loss: tests/test_parity.py's world of 4."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from test_moe import SPEC, _balance, _pooled_aux, block
from trainer3d.models.moe import Routing

E, K, H = SPEC.n_experts, SPEC.top_k, 32
B, T = 3, 10
LENGTHS = torch.tensor([10, 6, 3])  # each row's tokens before its padding


def _real() -> torch.Tensor:
    return torch.arange(T) < LENGTHS.unsqueeze(1)  # [B, T]


def _share(experts: torch.Tensor) -> torch.Tensor:
    """[N, k] choices -> f [E], the share of the N tokens that chose each expert (Σ f = k)."""
    return F.one_hot(experts, E).float().sum(1).mean(0)


def _formula(mode: str, routes: list[Routing], real: torch.Tensor) -> torch.Tensor:
    """Each loss as documented (parallel/moe_balance.py), over the tokens `real` [B, T] keeps: the balance losses at
    transformers' scale, their mean over the layers (transformers' pooled one pooling them), the z-loss summed."""
    flat = real.reshape(-1)
    if mode == "z":
        return sum(torch.logsumexp(r.logits[flat], -1).square().mean() for r in routes)
    if mode == "hf":
        return _pooled_aux([(r.scores[flat], r.experts[flat]) for r in routes])
    per_layer = []
    for r in routes:
        if mode == "global":
            per_layer.append(E * (_share(r.experts[flat]) * r.scores[flat].mean(0)).sum())
            continue
        scores, experts = r.scores.view(B, T, E), r.experts.view(B, T, K)
        per_layer.append(sum(E * (_share(experts[b][real[b]]) * scores[b][real[b]].mean(0)).sum()
                             for b in range(B)) / B)
    return sum(per_layer) / len(per_layer)


def _run(mode: str, coef: float, x: torch.Tensor, target: torch.Tensor, **flags):
    """Two blocks with the balance told the padding: the reported loss, the parameters' gradients, the balance."""
    flags = {"z": dict(moe_z_loss_coef=coef)}.get(mode, dict(moe_aux_loss_coef=coef, moe_aux_loss=mode)) | flags
    blocks = [block(seed=1, layer=1), block(seed=2, layer=2)]
    balance = _balance(blocks, **flags)
    real = _real()
    balance.begin_pass(real, int(real.sum()))
    out = blocks[1](blocks[0](x))
    params = [p for b in blocks for p in b.parameters()]
    grads = torch.autograd.grad((out * target * real.unsqueeze(-1)).sum(), params)
    return balance.losses[0 if mode != "z" else 1].item(), grads, blocks, balance


@pytest.mark.parametrize("mode", ["sequence", "global", "hf", "z"])
def test_padding_never_counts_in_a_loss(mode):
    """A padded batch's balance loss (value and the gradient it adds) equals the formula over its real tokens alone,
    the padding's positions holding other tokens; the same formula over every token (what counting the padding gave
    before) differs from it."""
    coef = 0.1
    x, target = torch.randn(B, T, H), torch.randn(B, T, H)
    reported, grads, blocks, _ = _run(mode, coef, x, target)
    for b in blocks:
        b.observer = None
    h = blocks[0](x)
    routes = [Routing(*blocks[0].gate(x.view(-1, H))), Routing(*blocks[1].gate(h.view(-1, H)))]
    real = _real()
    formula = _formula(mode, routes, real)
    params = [p for b in blocks for p in b.parameters()]
    ref_grads = torch.autograd.grad((blocks[1](h) * target * real.unsqueeze(-1)).sum() + coef * formula, params)
    assert reported == pytest.approx(coef * formula.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())
    counted_padding = _formula(mode, routes, torch.ones(B, T, dtype=torch.bool)).item()
    print(f"\n{mode}: padded {reported / coef:.6f}, formula over the real tokens {formula.item():.6f}, "
          f"over every token {counted_padding:.6f}")
    assert abs(counted_padding - formula.item()) > 1e-3 * abs(formula.item())


def test_padding_never_counts_in_the_loads_and_the_bias():
    """The step's loads (what metrics report and loss-free balancing's bias moves by) count the real tokens' choices
    only, and the bias moves by sign(mean load − load) of those."""
    x = torch.randn(B, T, H)
    blocks = [block(seed=1, layer=1), block(seed=2, layer=2)]
    balance = _balance(blocks, moe_bias_update_rate=0.01)
    real = _real()
    balance.begin_pass(real, int(real.sum()))
    blocks[1](blocks[0](x))
    loads = balance.loads.clone()
    for b in blocks:
        b.observer = None
    h = blocks[0](x)
    flat = real.reshape(-1)
    for row, (b, inp) in enumerate(((blocks[0], x), (blocks[1], h))):
        experts = Routing(*b.gate(inp.view(-1, H))).experts
        want = F.one_hot(experts[flat], E).sum((0, 1)).double()
        assert torch.equal(loads[row], want), (loads[row], want)
        assert not torch.equal(want, F.one_hot(experts, E).sum((0, 1)).double())  # the padding's would change them
    balance.end_step(stepped=True)
    for row, b in enumerate(blocks):
        assert torch.equal(b.gate.expert_bias, 0.01 * torch.sign(loads[row].mean() - loads[row]).float())


def test_padding_takes_no_capacity():
    """With a capacity, the real tokens keep exactly the choices they keep without the padding in the batch (the
    capacity counted from the real tokens, the padding's choices ranked after every real one); counting the padding
    (before) keeps others, and the dropped share counts real choices only."""
    m = block(layer=1)
    balance = _balance([m], moe_capacity_factor=1.0)
    x = torch.randn(B, T, H)
    real = _real().reshape(-1)
    routing = Routing(*m.gate(x.view(-1, H)))
    kept = m.within_capacity(routing, real)
    alone = m.within_capacity(Routing(*(t[real] for t in (routing.logits, routing.scores, routing.experts,
                                                            routing.weights))))
    assert torch.equal(kept[real], alone)
    assert not torch.equal(m.within_capacity(routing)[real], alone)
    balance.begin_pass(_real(), int(real.sum()))
    m(x)
    assert balance.dropped.item() == (~alone).sum().item() and balance.choices.item() == real.sum().item() * K


def test_global_loss_counts_the_step_so_far():
    """Two micro-batches in one process: micro-batch m's f is that of micro-batches 0..m (Megatron-core's running
    buffer), its P its own; L = E/N·Σ_m Σ_e f_e^(≤m)·S_e^m over the step's N tokens, the mean over the layers; in value
    and in the gradient it adds."""
    coef = 0.1
    blocks = [block(seed=1, layer=1), block(seed=2, layer=2)]
    balance = _balance(blocks, micro_batches=2, moe_aux_loss_coef=coef, moe_aux_loss="global")
    xs, targets = torch.randn(2, B, T, H), torch.randn(2, B, T, H)
    params = [p for b in blocks for p in b.parameters()]
    grads = [torch.zeros_like(p) for p in params]
    for m in range(2):
        balance.micro_batch = m
        out = blocks[1](blocks[0](xs[m]))
        for g, d in zip(grads, torch.autograd.grad((out * targets[m]).sum(), params)):
            g += d
    reported = balance.losses[0].item()
    for b in blocks:
        b.observer = None
    total, formula = 2 * B * T, 0.0
    outs = []
    for layer in range(2):
        counts = torch.zeros(E)
        for m in range(2):
            h = xs[m] if layer == 0 else blocks[0](xs[m])
            r = Routing(*blocks[layer].gate(h.reshape(-1, H)))
            counts = counts + F.one_hot(r.experts, E).float().sum((0, 1))
            f = counts / ((m + 1) * B * T)  # the share of micro-batches 0..m's tokens
            formula = formula + E * (f * r.scores.sum(0)).sum() / total / 2  # the mean over the 2 layers
    for m in range(2):
        outs.append((blocks[1](blocks[0](xs[m])) * targets[m]).sum())
    ref_grads = torch.autograd.grad(sum(outs) + coef * formula, params)
    assert reported == pytest.approx(coef * formula.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())


@pytest.mark.parametrize("mode", ["hf", "sequence", "global"])
def test_the_coefficient_means_transformers_router_aux_loss_coef(mode):
    """trainer3d's aux loss for one batch equals router_aux_loss_coef × transformers' load_balancing_loss_func on the
    same router logits: --moe-aux-loss hf for two layers and a padded batch (its attention_mask); the per-sequence and
    the global-batch loss for one layer and one unpadded sequence, where all three count the same tokens. (Before,
    the per-sequence loss was 1/k of it per layer and summed the layers: L/k times transformers'.)"""
    from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func

    coef = 1e-3
    n_layers, batch = (2, B) if mode == "hf" else (1, 1)
    blocks = [block(seed=1 + i, layer=1 + i) for i in range(n_layers)]
    balance = _balance(blocks, moe_aux_loss_coef=coef, moe_aux_loss=mode)
    mask = _real() if mode == "hf" else torch.ones(batch, T, dtype=torch.bool)
    balance.begin_pass(mask, int(mask.sum()))
    h, logits = torch.randn(batch, T, H), []
    for b in blocks:
        logits.append(Routing(*b.gate(h.reshape(-1, H))).logits.detach())
        h = b(h)
    theirs = coef * load_balancing_loss_func(tuple(logits), E, K, mask.long()).item()
    print(f"\n{mode}: trainer3d {balance.losses[0].item():.9f}, transformers {theirs:.9f}")
    assert balance.losses[0].item() == pytest.approx(theirs, rel=1e-6)


@pytest.mark.parametrize("mode", ["sequence", "global", "hf"])
def test_padding_adds_no_host_read(mode):
    """The padding's masks are applied on the device: a layer's forward and backward in a padded pass reads the host
    as often as an unpadded one (tests/test_moe_reads.py): never on the grouped path, once with a capacity (the rows
    it keeps)."""
    from test_moe_reads import _layer_reads

    for factor, expected in ((None, 0), (0.5, 1)):
        m = block(layer=1)
        balance = _balance([m], moe_aux_loss_coef=0.01, moe_aux_loss=mode, moe_z_loss_coef=0.001)
        m.capacity_factor = factor
        balance.begin_pass(_real(), int(_real().sum()))
        reads = _layer_reads(m, torch.randn(B, T, H))[0]
        assert len(reads) == expected, (mode, factor, reads)
