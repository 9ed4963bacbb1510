"""A mixture-of-experts MLP any family can use: a router, experts as stacked weights, token-choice top-k routing.

Routing (fp32, whatever the compute dtype): scores = softmax or sigmoid of the router's logits; the top-k experts of
each token are chosen on scores + `expert_bias` (DeepSeek-V3's loss-free balancing: a bias that moves selection and
never the weights; zeros unless --moe-bias-update-rate trains it); the weights are the chosen scores, divided by their
sum where the family renormalizes. Dropless by default: every token reaches its k experts (a capacity factor, set by
the run, drops the overflow Megatron-core's way).

Experts are two stacked weights, `gate_up_proj` [E, 2·I, H] (gate rows, then up rows: transformers 5's in-memory
layout) and `down_proj` [E, H, I], applied as SwiGLU to the tokens each expert received, in one grouped matmul per
weight (`torch._grouped_mm`) where its alignment rules allow, a loop over experts otherwise.

What moves tokens to their experts is a `dispatcher` (`LocalDispatch`: this rank holds every expert; expert
parallelism installs its all-to-all one, parallel/expert_parallel.py), and what watches the routing (balancing losses,
loads, the bias's counts) and knows which tokens are padding (routed, but counted nowhere: not in a capacity, a load or
a loss) is an `observer` the trainer installs (parallel/moe_balance.py); the block itself holds no distributed code.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class MoESpec:
    """The shape and routing rules of one family's MoE layers."""

    n_experts: int
    top_k: int
    expert_hidden: int  # each expert's SwiGLU width (I)
    score: str = "softmax"  # "softmax" (Qwen, Mixtral) or "sigmoid" (DeepSeek-V3)
    renormalize: bool = True  # divide the top-k weights by their sum
    weights_fp32: bool = False  # keep the top-k weights in fp32 (Mixtral), else the activations' dtype (Qwen)
    shared_hidden: int = 0  # a shared expert's SwiGLU width, applied to every token (0: none)
    shared_gate: bool = False  # the shared expert's output times sigmoid(shared_expert_gate(x)) (Qwen2/3.5-MoE)
    # DeepSeek-V3's group-limited selection: the experts in `n_groups` equal groups, each group scored by the sum of
    # its two best selection scores, a token choosing its top-k among the experts of its `top_groups` best groups
    # (1 group: plain top-k)
    n_groups: int = 1
    top_groups: int = 1
    scale: float = 1.0  # the chosen weights times this (DeepSeek-V3's routed_scaling_factor), after renormalizing
    renorm_eps: float = 0.0  # added to the sum the weights are divided by (transformers' DeepSeek-V3 adds 1e-20)

    def check(self) -> None:
        if not 1 <= self.top_k <= self.n_experts:
            raise ValueError(f"top-k {self.top_k} must be between 1 and the {self.n_experts} experts")
        if self.score not in ("softmax", "sigmoid"):
            raise ValueError(f"router score {self.score!r} is not softmax or sigmoid")
        if self.n_groups > 1:
            per_group = self.n_experts // self.n_groups
            if self.n_experts % self.n_groups or per_group < 2:
                raise ValueError(f"{self.n_experts} experts do not split into {self.n_groups} equal groups of two or "
                                 "more (a group is scored by its two best experts)")
            if not 1 <= self.top_groups <= self.n_groups or self.top_k > self.top_groups * per_group:
                raise ValueError(f"top-k {self.top_k} from {self.top_groups} of {self.n_groups} groups of {per_group} "
                                 "experts cannot be chosen")


@dataclass
class Routing:
    """A layer's routing of N tokens: `logits` [N, E] and `scores` [N, E] in fp32, the chosen experts [N, k] and their
    weights [N, k]."""

    logits: torch.Tensor
    scores: torch.Tensor
    experts: torch.Tensor
    weights: torch.Tensor


class Router(nn.Module):
    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.spec = spec
        self.weight = nn.Parameter(torch.empty(spec.n_experts, hidden))
        self.expert_bias: torch.Tensor | None = None  # fp32 [E], a table (init_tables), not a parameter

    def init_tables(self, device: torch.device) -> None:
        if self.expert_bias is None or self.expert_bias.device != device:
            self.expert_bias = torch.zeros(self.spec.n_experts, dtype=torch.float32, device=device)

    def saved_tables(self) -> dict[str, torch.Tensor]:
        return {"expert_bias": self.expert_bias}

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """x [N, H] -> the routing of its tokens: Routing's fields, as a tuple of tensors (ZeRO-3 finds the tensors
        a module returns to hook its backward, and sees none inside a dataclass)."""
        spec = self.spec
        with torch.autocast(x.device.type, enabled=False):  # routing in fp32 under autocast too
            logits = F.linear(x.float(), self.weight.float())
        scores = logits.softmax(-1) if spec.score == "softmax" else logits.sigmoid()
        chosen = scores if self.expert_bias is None else scores + self.expert_bias
        if spec.n_groups > 1:
            chosen = self._within_best_groups(chosen)
        experts = chosen.topk(spec.top_k, dim=-1).indices
        weights = scores.gather(-1, experts)
        if spec.renormalize:
            total = weights.sum(-1, keepdim=True)
            weights = weights / (total + spec.renorm_eps if spec.renorm_eps else total)
        if spec.scale != 1.0:
            weights = weights * spec.scale
        return logits, scores, experts, weights if spec.weights_fp32 else weights.to(x.dtype)

    def _within_best_groups(self, chosen: torch.Tensor) -> torch.Tensor:
        """The selection scores [N, E] with every expert outside a token's `top_groups` best groups at -inf; a group's
        score is the sum of its two best selection scores (DeepSeek-V3's node-limited routing, transformers' rule)."""
        spec = self.spec
        grouped = chosen.view(-1, spec.n_groups, spec.n_experts // spec.n_groups)
        best = grouped.topk(2, dim=-1).values.sum(-1).topk(spec.top_groups, dim=-1).indices
        keep = torch.zeros(grouped.shape[:2], dtype=torch.bool, device=chosen.device).scatter_(1, best, True)
        return grouped.masked_fill(~keep.unsqueeze(-1), float("-inf")).view_as(chosen)


class Dispatched(NamedTuple):
    """What a dispatcher hands the experts: `rows` [M, H] grouped by this rank's experts, `counts` rows per local expert
    (int64, on the device), `sizes` the same on the host where the dispatcher read them anyway (else None), `order`
    the rows it took from this rank (indices into the choices, a dropped choice never among them), `state` for
    combine."""

    rows: torch.Tensor
    counts: torch.Tensor
    sizes: list[int] | None
    order: torch.Tensor
    state: object


def expert_counts(expert_of: torch.Tensor, n_experts: int) -> torch.Tensor:
    """Rows per expert (int64 [n_experts]) on the device, with no host read: torch.bincount reads the largest id to size
    its output, a scatter_add_ does not (transformers and torchtitan count so). A choice of expert `n_experts` (one the
    capacity dropped) counts nowhere."""
    counts = expert_of.new_zeros(n_experts + 1)
    return counts.scatter_add_(0, expert_of, torch.ones_like(expert_of))[:n_experts]


class LocalDispatch:
    """Every expert on this rank: rows (a token's copy for one of its experts) sorted by expert (stably).

    A dispatcher's contract: `dispatch(x, token_of, expert_of, E, dropping)` -> `Dispatched` (a choice of expert id E
    was dropped by the capacity: it sorts last and is sent nowhere); `combine(y, state)` -> the experts' outputs back on
    this rank, row i that of choice `order[i]` (so the block weights and sums them without putting them back in
    order first). Host reads: none, but where choices were dropped (how many rows remain, one read)."""

    def dispatch(self, x: torch.Tensor, token_of: torch.Tensor, expert_of: torch.Tensor, n_experts: int,
                 dropping: bool = False) -> Dispatched:
        order = torch.argsort(expert_of, stable=True)
        counts, sizes = expert_counts(expert_of, n_experts), None
        if dropping:
            sizes = counts.tolist()  # the layer's one host read: the rows kept
            order = order[:sum(sizes)]
        return Dispatched(x[token_of[order]], counts, sizes, order, None)

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        return y


class Experts(nn.Module):
    """E SwiGLU experts as two stacked weights (of this rank's experts only, under expert parallelism)."""

    STACKED = ("gate_up_proj", "down_proj")  # the stacked weights by name, for what sits beside them (LoRA's pairs)

    def __init__(self, hidden: int, spec: MoESpec):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(spec.n_experts, 2 * spec.expert_hidden, hidden))
        self.down_proj = nn.Parameter(torch.empty(spec.n_experts, hidden, spec.expert_hidden))
        self.grad_scale = 1.0  # what the weights' gradients are multiplied by (expert parallelism: 1/ep)
        self.lora = None  # --lora-targets experts: the per-expert pairs, which run the SwiGLU (parallel/lora.py)

    @property
    def dims(self) -> tuple[int, int, int]:
        """(experts held, hidden, expert hidden)."""
        return tuple(self.down_proj.shape)

    # Eager under --compile: the row count is data-dependent (a graph break at the dispatch anyway) and dynamo's fake
    # torch._grouped_mm accepts bf16 only, where the eager kernel also runs fp32 (CPU).
    @torch.compiler.disable
    def forward(self, x: torch.Tensor, counts: torch.Tensor, sizes: list[int] | None = None) -> torch.Tensor:
        """x [M, H] sorted by expert, `counts` [E_local] tokens per expert (`sizes`: the same on the host, where the
        dispatcher has read them) -> [M, H]."""
        gate_up, down = self.gate_up_proj, self.down_proj
        if torch.is_autocast_enabled(x.device.type):  # autocast does not reach the grouped matmul: cast as it would
            dtype = torch.get_autocast_dtype(x.device.type)
            x, (gate_up, down) = x.to(dtype), self._cast(gate_up, down, dtype)
        elif x.dtype != gate_up.dtype:  # a module held in bf16 (DeepSpeed's engine) computes in it
            x = x.to(gate_up.dtype)
        if self.lora is not None:
            return self.lora(x, gate_up, down, counts, sizes, self.grad_scale)
        return _SwiGLUExperts.apply(x, gate_up, down, counts, sizes, grouped_mm_applies(x, gate_up, down),
                                    self.grad_scale)

    def _cast(self, gate_up: torch.Tensor, down: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
        """The weights in `dtype`: inside `expert_casts_cached` once for all its micro-batches (as autocast caches a
        dense linear's cast for its region: every micro-batch's backward flows through the one cast), else per call.
        Keyed on grad mode, so a copy cast without a graph never serves a pass that needs one."""
        key = (id(self), dtype, torch.is_grad_enabled())
        if _CASTS is None or key not in _CASTS:
            cast = (gate_up.to(dtype), down.to(dtype))
            if _CASTS is None:
                return cast
            _CASTS[key] = cast
        return _CASTS[key]


_CASTS: dict | None = None  # the experts' low-precision copies of the region open (expert_casts_cached)


@contextlib.contextmanager
def expert_casts_cached():
    """Cast the experts to autocast's dtype once for the region (a training step: the weights do not change inside
    it) instead of once per micro-batch; the copies are dropped when it closes, as autocast drops its own."""
    global _CASTS
    outer = _CASTS
    _CASTS = {} if outer is None else outer
    try:
        yield
    finally:
        _CASTS = outer


GROUPED_MM_DTYPES = (torch.float32, torch.bfloat16, torch.float16)  # what torch._grouped_mm takes at all
GROUPED_MM_CUDA_MAJORS = (9, 10)  # Hopper and Blackwell: the CUTLASS kernels; elsewhere a loop that reads offs to host


def grouped_mm_applies(x: torch.Tensor, gate_up: torch.Tensor, down: torch.Tensor) -> bool:
    """torch._grouped_mm's rules: one of its dtypes on all three, rows of 16-byte multiples, and at least one token
    (its backward refuses none). On a GPU only its fast path counts (bf16 on sm90/sm100): anywhere else torch falls
    back to a per-group loop that copies the offsets to the host, which the per-expert loop here does as well."""
    if not hasattr(torch, "_grouped_mm") or x.shape[0] == 0:
        return False
    if x.dtype not in GROUPED_MM_DTYPES or gate_up.dtype != x.dtype or down.dtype != x.dtype:
        return False
    if x.is_cuda and (x.dtype != torch.bfloat16
                      or torch.cuda.get_device_capability(x.device)[0] not in GROUPED_MM_CUDA_MAJORS):
        return False
    size = x.element_size()
    return (x.shape[1] * size) % 16 == 0 and (gate_up.shape[1] * size) % 16 == 0 and (down.shape[2] * size) % 16 == 0


def per_expert(x: torch.Tensor, w: torch.Tensor, counts: list[int], offsets) -> torch.Tensor:
    """Each expert's rows of x [M, K] times its weight transposed (w [E, N, K]) -> [M, N]."""
    if offsets is not None:
        return torch._grouped_mm(x, w.transpose(-2, -1), offs=offsets)
    parts, start = [], 0
    for e, n in enumerate(counts):
        parts.append(x[start:start + n] @ w[e].T)
        start += n
    return torch.cat(parts)


def leaves_empty_groups(out: torch.Tensor) -> bool:
    """Whether torch._grouped_mm may leave an empty group's block of a weight gradient unwritten: Blackwell's kernel
    does (pytorch#172439: non-zero gradients for experts with no token); CPU's and Hopper's write the empty sum's
    zeros (tests/test_moe.py checks CPU's). Masking there costs a pass over the weight gradients (3% of a CPU block)."""
    return out.is_cuda and torch.cuda.get_device_capability(out.device)[0] >= 10


def _weight_grads(dy: torch.Tensor, x: torch.Tensor, counts: list[int], offsets) -> torch.Tensor:
    """Σ over each expert's rows of dy^T x (dy [M, N], x [M, K]) -> [E, N, K] (zeros for an expert with no row)."""
    if offsets is not None:
        out = torch._grouped_mm(dy.t(), x, offs=offsets)
        if leaves_empty_groups(out):  # an expert with no row: exact zeros, whatever the kernel left there
            empty = torch.diff(offsets, prepend=offsets.new_zeros(1)) == 0
            out.masked_fill_(empty.view(-1, 1, 1), 0)
        return out
    out, start = dy.new_zeros(len(counts), dy.shape[1], x.shape[1]), 0
    for e, n in enumerate(counts):
        out[e] = dy[start:start + n].T @ x[start:start + n]
        start += n
    return out


class _SwiGLUExperts(torch.autograd.Function):
    """The experts' SwiGLU, y = down_e(silu(gate_e x) · up_e x) for each row's expert e, with its backward written
    out. It saves the weights themselves, never a view of them: ZeRO-3 empties a parameter after the forward and
    fills it again before the module's backward, which a saved transpose would not see (DeepSpeed's own linear does
    the same). One grouped matmul per product where `grouped` (torch._grouped_mm's rules hold), a loop otherwise."""

    @staticmethod
    def forward(ctx, x, gate_up, down, counts, sizes, grouped, grad_scale):
        offsets = torch.cumsum(counts, 0, dtype=torch.int32) if grouped else None
        if not grouped and sizes is None:  # the loop's one host read, where the dispatcher read none
            sizes = counts.tolist()
        sizes = None if grouped else sizes
        h = per_expert(x, gate_up, sizes, offsets)
        gate, up = h.chunk(2, dim=-1)
        ctx.save_for_backward(x, gate_up, down, h, offsets if grouped else counts)
        ctx.grouped, ctx.sizes, ctx.grad_scale = grouped, sizes, grad_scale
        return per_expert(F.silu(gate) * up, down, sizes, offsets)

    @staticmethod
    def backward(ctx, dy):
        """The zero-bubble schedules split the backward into an input pass (d_x) and a later weight pass (d_gate_up,
        d_down), and torch runs this node in both: each computes only its own gradients, and the input pass keeps d_h
        for the weight pass, so the four products run once in all (`split_backward_pass` names the pass)."""
        x, gate_up, down, h, offsets = ctx.saved_tensors
        offsets, sizes, dy = (offsets if ctx.grouped else None), ctx.sizes, dy.contiguous()
        need_x, need_weights = _PASS != "weight", _PASS != "input"
        gate, up = h.chunk(2, dim=-1)
        d_h = getattr(ctx, "d_h", None)  # the input pass's, kept for this weight pass
        act = F.silu(gate) if need_weights or d_h is None else None
        d_down = _weight_grads(dy, act * up, sizes, offsets) if need_weights else None
        if d_h is None:  # [d gate | d up], written in place: no concatenated copy
            d_act = per_expert(dy, down.transpose(-2, -1), sizes, offsets)
            d_h = torch.empty_like(h)
            d_gate, d_up = d_h.chunk(2, dim=-1)
            torch.mul(d_act, act, out=d_up)
            del act
            torch.ops.aten.silu_backward.grad_input(d_act.mul_(up), gate, grad_input=d_gate)
            del d_act
        ctx.d_h = d_h if _PASS == "input" else None
        d_x = per_expert(d_h, gate_up.transpose(-2, -1), sizes, offsets) if need_x else None
        if not need_weights:
            return d_x, None, None, None, None, None, None
        d_gate_up = _weight_grads(d_h, x, sizes, offsets)
        if ctx.grad_scale != 1.0:  # here, not through a view of the weights: ZeRO-3 frees what it gathered
            d_down.mul_(ctx.grad_scale), d_gate_up.mul_(ctx.grad_scale)
        return d_x, d_gate_up, d_down, None, None, None, None


_PASS: str | None = None  # "input" or "weight": the pass of a split backward running (split_backward_pass)


@contextlib.contextmanager
def split_backward_pass(kind: str):
    """Run a zero-bubble schedule's input ("input") or weight ("weight") pass: the experts then compute only that
    pass's gradients (the pipeline stage opens it around each)."""
    global _PASS
    outer, _PASS = _PASS, kind
    try:
        yield
    finally:
        _PASS = outer


class SwiGLUExpert(nn.Module):
    """A shared expert: every token through one SwiGLU of its own width."""

    def __init__(self, hidden: int, width: int):
        super().__init__()
        self.gate_up_proj = nn.Linear(hidden, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, hidden, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class MoE(nn.Module):
    """The MoE MLP of one block: x [B, T, H] -> [B, T, H]. `layer`: the block's global index (what observers and
    checkpoints name it by)."""

    def __init__(self, hidden: int, spec: MoESpec, layer: int):
        super().__init__()
        spec.check()
        self.spec, self.layer = spec, layer
        self.gate = Router(hidden, spec)
        self.experts = Experts(hidden, spec)
        self.shared_expert = SwiGLUExpert(hidden, spec.shared_hidden) if spec.shared_hidden else None
        self.shared_expert_gate = nn.Linear(hidden, 1, bias=False) if spec.shared_gate else None
        self.dispatcher = LocalDispatch()
        self.observer = None  # parallel/moe_balance.py's, on a training run
        self.tokens = None  # tensor parallelism's token split (parallel/expert_parallel.py), if any
        self.capacity_factor: float | None = None  # None: dropless (a run's --moe-capacity-factor sets it)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.tokens is not None:
            return self.tokens.around(self._route_and_compute, x)
        return self._route_and_compute(x)

    def _route_and_compute(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        routing = Routing(*self.gate(flat))
        real = self.observer.real_tokens(self, flat.shape[0]) if self.observer is not None else None
        kept = self.within_capacity(routing, real)
        out = self.routed(flat, routing, kept)
        if self.shared_expert is not None:
            shared = self.shared_expert(flat)
            if self.shared_expert_gate is not None:
                shared = torch.sigmoid(self.shared_expert_gate(flat)) * shared
            out = out + shared
        if self.observer is not None:
            out = self.observer.observe(self, routing, kept, shape, out, real)
        return out.view(shape)

    def routed(self, x: torch.Tensor, routing: Routing, kept: torch.Tensor | None = None) -> torch.Tensor:
        """Σ_k weight_k · expert_k(x) of every token, x [N, H], over the kept choices (`kept` [N, k]; None: all)."""
        n, k = routing.experts.shape
        token_of = torch.arange(n, device=x.device).repeat_interleave(k)
        expert_of, weight = routing.experts.reshape(-1), routing.weights.reshape(-1)
        if kept is not None:  # a dropped choice goes to expert n_experts: none (no data-dependent shape here)
            expert_of = expert_of.masked_fill(~kept.reshape(-1), self.spec.n_experts)
        sent = self.dispatcher.dispatch(x, token_of, expert_of, self.spec.n_experts, dropping=kept is not None)
        y = self.dispatcher.combine(self.experts(sent.rows, sent.counts, sent.sizes), sent.state)  # row i: order[i]'s
        out = torch.zeros(n, x.shape[-1], dtype=y.dtype, device=x.device)
        # (index_put_ accumulating keeps only the indices for its backward, index_add_ also its source)
        return out.index_put_((token_of[sent.order],), y * weight[sent.order].unsqueeze(-1).to(y.dtype),
                              accumulate=True).to(x.dtype)

    def within_capacity(self, routing: Routing, real: torch.Tensor | None = None) -> torch.Tensor | None:
        """Megatron-core's token drop (drop policy "probs"): each expert takes at most ceil(N·k / E · capacity_factor)
        of this rank's N tokens' choices, those of the highest routing weight (the probability its output is weighted
        by, after any renormalization); a [N, k] mask of the choices kept (None: dropless). No host read.
        `real` [N] bool: the tokens that are not padding (None: all): N counts only them, and a padding token's
        choices rank after every real one, so padding never takes a real token's place."""
        if self.capacity_factor is None:
            return None
        n, k = routing.experts.shape
        flat_e, flat_w = routing.experts.reshape(-1), routing.weights.float().reshape(-1)
        if real is None:
            capacity = math.ceil(n * k / self.spec.n_experts * self.capacity_factor)  # Megatron's get_capacity
        else:  # the same rule on the device (float64, as Python's), from the real tokens' count
            capacity = torch.ceil(real.sum().double() * k / self.spec.n_experts * self.capacity_factor)
            flat_w = flat_w.masked_fill(~real.repeat_interleave(k), -1.0)  # weights are >= 0: below every real one
        by_weight = torch.argsort(flat_w, descending=True, stable=True)  # within an expert, the best first
        order = by_weight[torch.argsort(flat_e[by_weight], stable=True)]  # grouped by expert
        counts = expert_counts(flat_e, self.spec.n_experts)
        starts = torch.cumsum(counts, 0) - counts
        rank_in_expert = torch.empty_like(flat_e)
        rank_in_expert[order] = torch.arange(flat_e.numel(), device=flat_e.device) - starts[flat_e[order]]
        return (rank_in_expert < capacity).view(n, k)


def moe_init_std(name: str, n_layer: int) -> float | None:
    """The initial std of an MoE parameter (N(0, 0.02), the projections back to the residual stream scaled by
    1/sqrt(2·layers) as the dense MLP's), or None for a name that is no MoE parameter."""
    if ".experts.down_proj" in name or ".shared_expert.down_proj" in name:
        return 0.02 / math.sqrt(2 * n_layer)
    if ".experts.gate_up_proj" in name or ".shared_expert.gate_up_proj" in name or name.endswith(
            (".gate.weight", ".shared_expert_gate.weight")):
        return 0.02
    return None
