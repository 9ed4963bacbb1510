"""The mixture-of-experts block on its own, against formulas written here from their papers: routing and experts
against a token-by-token loop, the grouped matmul against the per-expert loop, Megatron-core's capacity drop,
DeepSeek-V3's bias (selection only), and the balancing losses (DeepSeek-V3's per-sequence loss, the global-batch one,
transformers' pooled one, ST-MoE's z-loss) in value and in the gradient they add. Their layout-invariance:
tests/test_parity.py; against transformers trained: tests/test_llama_hf.py; padding and accumulation:
tests/test_moe_balance.py."""

from __future__ import annotations

import contextlib
import dataclasses
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

import trainer3d.models.moe as moe
from trainer3d.config.sections import MoEConfig
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


def token_by_token(m: MoE, x: torch.Tensor, keep: torch.Tensor | None = None) -> torch.Tensor:
    """Each token through its top-k experts by the textbook rule, one at a time: softmax scores, top-k, weights
    renormalized (where the spec says), Σ w·down(silu(gate(x))·up(x)); `keep` [N, E]: only the choices it marks."""
    flat = x.reshape(-1, x.shape[-1])
    scores = F.softmax(flat @ m.gate.weight.T, dim=-1)
    out = []
    for t in range(flat.shape[0]):
        w, idx = scores[t].topk(m.spec.top_k)
        w = w / w.sum() if m.spec.renormalize else w
        y = torch.zeros(flat.shape[-1])
        for weight, e in zip(w, idx.tolist()):
            if keep is not None and not keep[t, e]:
                continue
            gate, up = (m.experts.gate_up_proj[e] @ flat[t]).chunk(2)
            y = y + weight * (m.experts.down_proj[e] @ (F.silu(gate) * up))
        out.append(y)
    return torch.stack(out).view_as(x)


@pytest.mark.parametrize("hidden", [32, 30], ids=["grouped-mm", "per-expert-loop"])
def test_block_equals_token_by_token(hidden):
    """Forward and every gradient, on both of the experts' paths (30 floats a row break the grouped matmul's 16-byte
    rule)."""
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


def test_grouped_mm_rule_checks_dtype_and_gpu_architecture(monkeypatch):
    """fp64 (which torch._grouped_mm refuses) and mixed dtypes take the per-expert loop, and the block still equals the
    token-by-token reference there; on a GPU only bf16 on sm90/sm100 (the CUTLASS kernels) counts, judged from the
    device's capability (the CUDA check reached through a stand-in tensor, the machine having no GPU)."""
    m = block(hidden=32).double()
    x = torch.randn(2, 5, 32, dtype=torch.float64)
    assert not grouped_mm_applies(x.view(-1, 32), m.experts.gate_up_proj, m.experts.down_proj)
    torch.testing.assert_close(m(x), token_by_token(m, x).double(), rtol=1e-5, atol=1e-5)
    w = block(hidden=32).experts
    assert not grouped_mm_applies(x.view(-1, 32).float(), w.gate_up_proj.bfloat16(), w.down_proj.bfloat16())

    class OnGPU:  # the attributes grouped_mm_applies reads, on a CUDA device
        def __init__(self, dtype):
            self.shape, self.dtype, self.is_cuda, self.device = (4, 32), dtype, True, "cuda:0"

        def element_size(self):
            return torch.empty((), dtype=self.dtype).element_size()

    weights = (SimpleNamespace(shape=(8, 64, 32), dtype=torch.bfloat16),
               SimpleNamespace(shape=(8, 32, 32), dtype=torch.bfloat16))
    for major, want in ((8, False), (9, True), (10, True), (12, False)):
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device, m=major: (m, 0))
        assert grouped_mm_applies(OnGPU(torch.bfloat16), *weights) == want, major
    fp32 = tuple(SimpleNamespace(shape=w.shape, dtype=torch.float32) for w in weights)
    assert not grouped_mm_applies(OnGPU(torch.float32), *fp32)  # torch's fallback loop on every GPU


def _leave_empty_groups_unwritten(grouped_mm):
    """torch._grouped_mm as a kernel that never writes an empty group's block of a weight gradient (2-D × 2-D, groups
    along the contraction) leaves it: NaN here, what recycled memory can hold (pytorch#172439: Blackwell's kernel
    gives such experts non-zero gradients)."""

    def kernel(a, b, offs=None, **kw):
        out = grouped_mm(a, b, offs=offs, **kw)
        if a.dim() == 2 and b.dim() == 2:
            empty = torch.diff(offs, prepend=offs.new_zeros(1)) == 0
            out[empty] = float("nan")
        return out

    return kernel


@pytest.mark.parametrize("path", ["grouped-mm", "grouped-mm-unwritten", "per-expert-loop"])
def test_an_expert_with_no_token_gets_exact_zero_gradients(path, monkeypatch):
    """Guards: an expert that received no token gets gradients of exactly 0 (gate_up and down; before, the test only
    asked that a gradient exist), on the grouped matmul (CPU's kernel, which writes them unmasked; and a kernel that
    leaves an empty group's block unwritten, masked as on Blackwell, which failed before: NaN reached those experts'
    gradients) and on the per-expert loop, while the experts that
    received the token get non-zero ones."""
    hidden = 30 if path == "per-expert-loop" else 32
    if path == "grouped-mm-unwritten":
        monkeypatch.setattr(torch, "_grouped_mm", _leave_empty_groups_unwritten(torch._grouped_mm))
        monkeypatch.setattr(moe, "leaves_empty_groups", lambda out: True)  # as on Blackwell
    else:  # CPU's kernel writes the empty groups' zeros itself: nothing masks them here
        assert not moe.leaves_empty_groups(torch.zeros(1))
    m = block(hidden=hidden)
    x = torch.randn(1, 2, hidden)  # two tokens: at most 4 of the 8 experts receive one
    assert grouped_mm_applies(x.view(-1, hidden), m.experts.gate_up_proj, m.experts.down_proj) == (hidden == 32)
    chosen = set(Routing(*m.gate(x.view(-1, hidden))).experts.reshape(-1).tolist())
    (m(x) * torch.randn(1, 2, hidden)).sum().backward()
    for grad in (m.experts.gate_up_proj.grad, m.experts.down_proj.grad):
        for e in range(SPEC.n_experts):
            if e in chosen:
                assert grad[e].abs().sum() > 0, (path, e)
            else:
                assert torch.equal(grad[e], torch.zeros_like(grad[e])), (path, e, grad[e].abs().max())


def megatron_capacity_mask(logits: torch.Tensor, k: int, factor: float, renormalize: bool) -> torch.Tensor:
    """Megatron-core's token drop, written from its topk_softmax_with_capacity (drop_policy "probs", no padding):
    probs = the top-k softmax scores (renormalized over the k: its softmax after top-k; else its pre-softmax),
    scattered into [N, E]; capacity = ceil(N·k / E · factor) (get_capacity); each expert keeps the `capacity` tokens
    of highest prob (topk along the tokens) among those that chose it. Returns the kept [N, E] map."""
    n, e = logits.shape
    scores = logits.softmax(-1)
    probs, top = scores.topk(k, dim=-1)
    if renormalize:
        probs = probs / probs.sum(-1, keepdim=True)
    gates = torch.zeros_like(logits).scatter(1, top, probs)
    topk_map = torch.zeros_like(logits).scatter(1, top, 1).bool()
    capacity = math.ceil(n * k / e * factor)
    capacity_mask = torch.zeros_like(logits).scatter(0, gates.topk(capacity, dim=0).indices, 1).bool()
    return topk_map & capacity_mask


@pytest.mark.parametrize("renormalize", [True, False], ids=["renormalized", "raw-scores"])
def test_capacity_follows_megatrons_drop_rule(renormalize):
    """Guards: --moe-capacity-factor keeps exactly the choices Megatron-core's rule keeps (the reference above, written
    from its code, not trainer3d's), and the block's output is the token-by-token sum over those choices only. Before,
    trainer3d ranked an expert's tokens by their raw scores where Megatron ranks by the weights the outputs get: with
    renormalized weights (Qwen3's norm_topk_prob) 6 of the 80 choices here differed (3 kept that Megatron drops, 3
    dropped that it keeps) and this test failed."""
    spec = dataclasses.replace(SPEC, renormalize=renormalize)
    m = block(spec)
    x = torch.randn(1, 40, 32)
    flat = x.view(-1, 32)
    routing = Routing(*m.gate(flat))
    assert m.within_capacity(routing) is None  # dropless by default
    m.capacity_factor = 0.5
    kept = m.within_capacity(routing)
    reference = megatron_capacity_mask(flat @ m.gate.weight.T, 2, 0.5, renormalize)
    ours = torch.zeros(40, 8, dtype=torch.bool).scatter(1, routing.experts, kept)
    assert 0 < reference.sum() < 80 and reference.sum(0).max() == 5  # some dropped, the capacity reached
    assert torch.equal(ours, reference), (ours ^ reference).nonzero().tolist()
    torch.testing.assert_close(m(x), token_by_token(m, x, keep=reference), rtol=1e-5, atol=1e-5)


def _per_token_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    """The largest relative error of one token's row: max over tokens of |y_t − ref_t| / |ref_t|."""
    y, ref = y.reshape(-1, ref.shape[-1]).float(), ref.reshape(-1, ref.shape[-1])
    return ((y - ref).norm(dim=-1) / ref.norm(dim=-1)).max().item()


def test_experts_cast_once_a_step_under_autocast():
    """Guards: inside a step's region (expert_casts_cached, which Trainer opens with autocast) three micro-batches'
    forwards and backwards cast each expert weight to bf16 once, not three times (counted as aten._to_copy calls of
    the [E, ...] weights to bf16; their gradients' casts back stay one per backward, as a dense linear's), with bitwise the same gradients as casting every time; a no-grad pass in the region gets
    a copy of its own."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer3d.models.moe import expert_casts_cached

    class CountWeightCasts(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            to_bf16 = (kwargs or {}).get("dtype") == torch.bfloat16
            if func is torch.ops.aten._to_copy.default and args[0].dim() == 3 and to_bf16:  # a stacked weight's cast
                self.n += 1
            return func(*args, **(kwargs or {}))

    def run(cached: bool):
        m = block()
        torch.manual_seed(1)
        xs = [torch.randn(2, 6, 32) for _ in range(3)]
        with torch.autocast("cpu", dtype=torch.bfloat16), CountWeightCasts() as count:
            with expert_casts_cached() if cached else contextlib.nullcontext():
                for x in xs:
                    m(x).float().pow(2).sum().backward()
                with torch.no_grad():
                    m(xs[0])
        return count.n, [p.grad.clone() for p in m.parameters()]

    n_cached, cached = run(True)
    n_each, each = run(False)
    assert (n_cached, n_each) == (2 + 2, 2 * 3 + 2), (n_cached, n_each)  # gate_up and down: once, + the no-grad pass
    assert all(torch.equal(a, b) for a, b in zip(cached, each))


def test_split_backward_runs_each_expert_product_once():
    """Guards: torch's zero-bubble split (its stage_backward_input, then stage_backward_weight, what the schedules
    call) inside the passes the pipeline stage names (split_backward_pass) runs the experts' four backward grouped
    matmuls once in all (before: four in each pass, eight), with the plain backward's gradients."""
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight
    from torch.utils._python_dispatch import TorchDispatchMode

    from trainer3d.models.moe import split_backward_pass

    class CountGroupedMM(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.n += func is torch.ops.aten._grouped_mm.default
            return func(*args, **(kwargs or {}))

    m = block()
    x = torch.randn(2, 6, 32, requires_grad=True)
    target = torch.randn(2, 6, 32)
    ref = torch.autograd.grad((m(x) * target).sum(), [x, *m.parameters()])
    loss = (m(x) * target).sum()
    weights = list(m.parameters())
    with CountGroupedMM() as count:
        with split_backward_pass("input"):
            (dx,), groups = stage_backward_input([loss], None, [x], iter(weights))
        with split_backward_pass("weight"):
            stage_backward_weight(iter(weights), groups)
    assert count.n == 4, count.n
    torch.testing.assert_close(dx, ref[0], rtol=0, atol=0)
    for p, r in zip(weights, ref[1:]):
        torch.testing.assert_close(p.grad, r, rtol=1e-6, atol=1e-7)


def test_expert_gradient_scale_saves_no_view_of_the_weights():
    """Guards: expert parallelism's 1/ep on the experts' gradients is applied in their backward, not through a view of
    the weights: a saved view keeps ZeRO-3's gathered experts alive until the backward (it empties the parameter
    after the forward; the view still holds the storage). The block saves the parameters themselves, and its weight
    gradients are the unscaled ones times the scale, its input gradient unchanged."""
    m = block()
    x = torch.randn(2, 6, 32, requires_grad=True)
    plain = torch.autograd.grad(m(x).pow(2).sum(), [x, m.experts.gate_up_proj, m.experts.down_proj])
    m.experts.grad_scale = 0.25
    weights = (m.experts.gate_up_proj, m.experts.down_proj)
    saved = []
    with torch.autograd.graph.saved_tensors_hooks(lambda t: saved.append(t) or t, lambda t: t):
        y = m(x)
    assert any(t is w for t in saved for w in weights)
    assert not any(t._base is w for t in saved for w in weights)  # no view of a weight is kept
    scaled = torch.autograd.grad(y.pow(2).sum(), [x, *weights])
    torch.testing.assert_close(scaled[0], plain[0], rtol=0, atol=0)
    for g, p in zip(scaled[1:], plain[1:]):
        torch.testing.assert_close(g, 0.25 * p, rtol=1e-6, atol=0)


BF16_BOUND = 5e-2  # bf16 measured 1.0e-2 to 1.5e-2 (outputs, input gradients) on both paths; mutations 0.73 to 1.97


@pytest.mark.parametrize("hidden", [32, 30], ids=["grouped-mm", "per-expert-loop"])
def test_bf16_block_tracks_fp32_and_its_bound_catches_routing_errors(hidden):
    """Guards: the block under bf16 autocast (the experts' matmuls in bf16, the router in fp32) stays within 5e-2 of
    fp32 per token (relative norm of a token's output row, and of its input gradient's), and computed in bf16 (more
    than 1e-4 away), with a bound that the errors it must catch exceed: measured here, each token's output with the
    experts' output dropped is 1.0 away, with only its first choice 1.0, with each second choice replaced by the third
    1.5-2.0, and one token's second choice mis-routed 0.73 (bf16 itself: 1.0e-2 to 1.5e-2), and the test asserts
    that every one of these mutations lands above 10× the bound. (tests/test_precision.py's MoE row bounds a whole model's
    loss at 2e-3, which dropping the experts moved by only 1.4e-4.)"""
    m = block(hidden=hidden)
    x = torch.randn(4, 16, hidden, requires_grad=True)
    target = torch.randn(4, 16, hidden)
    ref = m(x)
    ref_dx = torch.autograd.grad((ref * target).sum(), x)[0]
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = m(x)
        dx = torch.autograd.grad((y.float() * target).sum(), x)[0]
        flat = x.detach().view(-1, hidden)
        r = Routing(*m.gate(flat))
        third = r.scores.topk(3).indices[:, 2]
        one_token = r.experts.clone()
        one_token[5, 1] = third[5]
        mutants = {"experts dropped": torch.zeros_like(flat),
                   "first choice only": m.routed(flat, r, torch.tensor([[True, False]]).expand(flat.shape[0], 2)),
                   "second choice mis-routed": m.routed(flat, Routing(r.logits, r.scores, torch.stack(
                       [r.experts[:, 0], third], 1), r.weights)),
                   "one token mis-routed": m.routed(flat, Routing(r.logits, r.scores, one_token, r.weights))}
    errors = {"output": _per_token_error(y, ref), "input gradient": _per_token_error(dx, ref_dx)}
    mutated = {name: _per_token_error(v.detach(), ref.detach()) for name, v in mutants.items()}
    print(f"\n{hidden}: bf16 {errors}, mutants {mutated}")
    assert all(1e-4 < e < BF16_BOUND for e in errors.values()), errors
    assert all(e > 10 * BF16_BOUND for e in mutated.values()), mutated


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


def _balance(blocks: list[MoE], micro_batches: int = 1, **flags) -> MoEBalance:
    """MoEBalance of one process (no group to reduce over) with `micro_batches` micro-batches (the test sets its
    `micro_batch` as the schedule's stages would)."""
    cfg = SimpleNamespace(moe=MoEConfig(**flags))  # the section MoEBalance reads
    topo = SimpleNamespace(layout=SimpleNamespace(tp=1, cp=1, dp_cp=1), tp_group=None, cp_group=None, tp_rank=0,
                           stage_group=None, world_group=None)
    mcfg = SimpleNamespace(moe_layers=[b.layer for b in blocks], moe=blocks[0].gate.spec)
    trainer = SimpleNamespace(cfg=cfg, topo=topo, mcfg=mcfg, device=torch.device("cpu"), loss_scale=None,
                              plan=SimpleNamespace(micro_batches=micro_batches),
                              parallel_model=SimpleNamespace(sequence=None))
    return MoEBalance(trainer, [torch.nn.ModuleList(blocks)])


def _shares(r: Routing) -> torch.Tensor:
    """[N, E] each token's router scores as shares summing to 1, the P the balance losses average: softmax scores as
    they are; sigmoid scores s_{i,t} / Σ_j s_{j,t} (DeepSeek-V3 report, eq. 19-20)."""
    return r.scores / r.scores.sum(-1, keepdim=True) if r.scores.sum(-1).sub(1).abs().max() > 1e-5 else r.scores


def _sequence_aux(scores: torch.Tensor, experts: torch.Tensor, B: int, T: int) -> torch.Tensor:
    """DeepSeek-V3's per-sequence loss (eq. 17-20) at transformers' scale: per sequence, f_e = |tokens choosing e| / T
    (Σ_e f_e = k), P_e = mean score; E·Σ_e f_e·P_e; the mean over sequences."""
    E, k = scores.shape[-1], experts.shape[-1]
    f = F.one_hot(experts.view(B, T * k), E).sum(1).float() / T
    return E * (f * scores.view(B, T, E).mean(1)).sum(-1).mean()


def _global_aux(scores: torch.Tensor, experts: torch.Tensor) -> torch.Tensor:
    """The global-batch loss of one micro-batch: f_e = |tokens choosing e| / N over the whole batch, P_e = mean score,
    E·Σ_e f_e·P_e."""
    E = scores.shape[-1]
    return E * (F.one_hot(experts, E).float().sum(1).mean(0) * scores.mean(0)).sum()


def _pooled_aux(layers: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    """transformers' load_balancing_loss_func: every layer's tokens pooled, E·Σ_e (choices of e / rows)·mean score."""
    scores = torch.cat([s for s, _ in layers])
    experts = torch.cat([e for _, e in layers])
    E = scores.shape[-1]
    share = F.one_hot(experts, E).float().sum(1).mean(0)
    return E * (share * scores.mean(0)).sum()


SIGMOID = MoESpec(n_experts=8, top_k=2, expert_hidden=24, score="sigmoid")


@pytest.mark.parametrize("mode,spec", [("sequence", SPEC), ("global", SPEC), ("hf", SPEC), ("z", SPEC),
                                       ("sequence", SIGMOID), ("global", SIGMOID), ("hf", SIGMOID)],
                         ids=["sequence", "global", "hf", "z", "sequence-sigmoid", "global-sigmoid", "hf-sigmoid"])
def test_balance_losses_have_their_papers_values_and_gradients(mode, spec):
    """Two MoE blocks in a row: the loss the balance adds has the formula's value (the balance losses: their mean over
    the layers, transformers' pooled one pooling them itself; the z-loss: the sum), and the blocks' gradients are
    those of (output + coef · formula), i.e. the loss was trained, not only reported. A sigmoid router's P is the
    mean of its per-token normalised scores (the formula reads `_shares`)."""
    coef = 0.1
    flags = {"z": dict(moe_z_loss_coef=coef)}.get(mode, dict(moe_aux_loss_coef=coef, moe_aux_loss=mode))
    blocks = [block(spec, seed=1, layer=1), block(spec, seed=2, layer=2)]
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
        formula = sum(_sequence_aux(_shares(r), r.experts, 3, 10) for r in routes) / 2
    elif mode == "global":
        formula = sum(_global_aux(_shares(r), r.experts) for r in routes) / 2
    elif mode == "hf":
        formula = _pooled_aux([(_shares(r), r.experts) for r in routes])
    else:
        formula = sum(torch.logsumexp(r.logits, -1).square().mean() for r in routes)
    ref_grads = torch.autograd.grad((out_ref * target).sum() + coef * formula, params)
    assert reported == pytest.approx(coef * formula.item(), rel=1e-6)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r, rtol=1e-5, atol=1e-6 * r.abs().max().item())
    router_grad_without = torch.autograd.grad((blocks[1](blocks[0](x)) * target).sum(), blocks[0].gate.weight)[0]
    assert (grads[0] - router_grad_without).abs().max() > 1e-6  # the loss moved the router's gradient


@pytest.mark.parametrize("mode", ["sequence", "global"])
def test_a_uniform_sigmoid_router_costs_coef_times_k(mode):
    """DeepSeek-V3's sigmoid router with every logit 0 (every score 0.5, the start of training): each token's shares
    are 1/E, so E·Σ_e f_e·P_e = Σ_e f_e = k whatever the choices, and coefficient 1 gives k = 2 at 8 experts (raw
    sigmoid scores gave E·0.5·k = 8); moving every logit down alike leaves it unchanged (raw scores: it fell)."""
    blocks = [block(SIGMOID, seed=1, layer=1)]
    balance = _balance(blocks, moe_aux_loss_coef=1.0, moe_aux_loss=mode)
    with torch.no_grad():
        blocks[0].gate.weight.zero_()
    blocks[0](torch.randn(3, 10, 32))
    assert balance.losses[0].item() == pytest.approx(2.0, rel=1e-6)
    balance = _balance(blocks, moe_aux_loss_coef=1.0, moe_aux_loss=mode)
    with torch.no_grad():  # every logit -3: inputs of ones, a weight of -3/32 (the scores 0.047)
        blocks[0].gate.weight.fill_(-3.0 / 32)
    blocks[0](torch.ones(3, 10, 32))
    assert balance.losses[0].item() == pytest.approx(2.0, rel=1e-6)


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
    from trainer3d.checkpoint.hf import load_hf_checkpoint
    from trainer3d.checkpoint.hf_save import save_hf_checkpoint
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
