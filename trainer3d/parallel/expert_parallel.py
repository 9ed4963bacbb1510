"""Mixtures of experts under the parallel axes (models/moe.py holds the block; this module only changes how tokens
reach the experts and how the experts are split).

Tensor parallelism: experts are not split over tp (Megatron's expert-tensor-parallel size 1, DeepSeek-V3's choice:
an expert's matmuls are small, and splitting them would add a collective per expert). Instead each tp rank routes
and computes 1/tp of the tokens: its sequence shard under sequence parallelism (the block already holds it), else a
slice of the replicated sequence taken on the way in and all-gathered on the way out (`TokenSplit`). The router,
the experts and a shared expert then see only this rank's tokens, so their gradients are per-rank shares summed over
tp by the engines (`tp_partial`), as torchtitan found the router's must be (#2416).

Expert parallelism (--ep N): the E experts are split over N ranks carved from the dp×cp line (parallel folding:
attention keeps dp×cp, experts use ep × edp). `AllToAllDispatch` sends each token to the rank holding each of its
experts and back: the counts per expert first (all_to_all), then the tokens with those splits (one host read of
the counts: the layer's only one), then a permutation to expert-major order for the grouped matmul, and the reverse.
An expert's gradient then holds the contributions of all N ranks' tokens: it is scaled by 1/N in the backward and
averaged over edp by the engines, which averages it over the whole dp×cp as every dense gradient is (torchtitan
#1551). A rank that receives no token still takes part in every exchange (zero-sized splits), so no rank waits on
another.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer3d.models.moe import Dispatched, MoE, expert_counts
from trainer3d.parallel.tensor_parallel import TPSpec, all_gather_sequence, to_compute_dtype

SEQ_DIM = 1


class _SplitSequence(torch.autograd.Function):
    """This tp rank's slice of a replicated [B, T, H] along T (forward); the slices' gradients all-gathered (backward:
    every rank needs the whole gradient of a replicated activation)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.group = group
        return x.chunk(size, dim=SEQ_DIM)[rank].contiguous()

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad.contiguous(), ctx.group), None, None, None


class _GatherSequence(torch.autograd.Function):
    """The slices all-gathered into the replicated [B, T, H] (forward); this rank's slice of its gradient (backward:
    the gradient of a replicated activation is the same on every tp rank)."""

    @staticmethod
    def forward(ctx, x, group, rank, size):
        ctx.rank, ctx.size = rank, size
        return all_gather_sequence(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad.chunk(ctx.size, dim=SEQ_DIM)[ctx.rank].contiguous(), None, None, None


class TokenSplit:
    """Tensor parallelism without sequence parallelism: the block's replicated tokens split over tp around the MoE."""

    def __init__(self, group, rank: int, size: int):
        self.group, self.rank, self.size = group, rank, size

    def around(self, fn, x: torch.Tensor) -> torch.Tensor:
        part = _SplitSequence.apply(x, self.group, self.rank, self.size)
        return _GatherSequence.apply(fn(part), self.group, self.rank, self.size)


class _AllToAll(torch.autograd.Function):
    """Rows [sum(sent), H] exchanged over `group` with uneven splits (`received[i]` rows come from rank i); the
    backward sends the gradients back the same way. (torch.distributed.nn's autograd all_to_all is deprecated.)"""

    @staticmethod
    def forward(ctx, rows, received, sent, group):
        ctx.received, ctx.sent, ctx.group = received, sent, group
        out = rows.new_empty(sum(received), rows.shape[1])
        dist.all_to_all_single(out, rows.contiguous(), received, sent, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        out = grad.new_empty(sum(ctx.sent), grad.shape[1])
        dist.all_to_all_single(out, grad.contiguous(), ctx.sent, ctx.received, group=ctx.group)
        return out, None, None, None


class AllToAllDispatch:
    """Tokens to the ranks holding their experts and back, over the ep group (see the module docstring)."""

    def __init__(self, group, rank: int, size: int, n_experts: int):
        self.group, self.size = group, size
        self.n_local = n_experts // size
        self.first_expert = rank * self.n_local

    def dispatch(self, x: torch.Tensor, token_of: torch.Tensor, expert_of: torch.Tensor, n_experts: int,
                 dropping: bool = False) -> Dispatched:
        """models/moe.LocalDispatch's contract: the rows arrive from every ep rank, grouped by local expert. One host
        read: the per-expert counts sent and received (the all-to-all's splits, the kept rows and the experts' sizes)."""
        order = torch.argsort(expert_of, stable=True)  # by global expert: by destination rank, then its experts
        counts = expert_counts(expert_of, n_experts)  # (a dropped choice, expert id n_experts, sorts last)
        received = torch.empty_like(counts)  # [source rank, local expert]
        dist.all_to_all_single(received, counts, group=self.group)
        sent, got = torch.stack([counts, received]).view(2, self.size, self.n_local).tolist()  # the one read
        sent_by, received_from = [sum(r) for r in sent], [sum(r) for r in got]
        order = order[:sum(sent_by)]
        rows = to_compute_dtype(x)[token_of[order]]  # bf16 on the wire under autocast
        arrived = _AllToAll.apply(rows, received_from, sent_by, self.group)
        per_source = received.view(self.size, self.n_local)
        perm = expert_major(per_source, arrived.shape[0])
        sizes = [sum(col) for col in zip(*got)]
        return Dispatched(arrived[perm], per_source.sum(0), sizes, order, (perm, sent_by, received_from))

    def combine(self, y: torch.Tensor, state) -> torch.Tensor:
        """y [M, H] in local-expert order -> this rank's rows, in the order they were sent."""
        perm, sent_by, received_from = state
        by_source = torch.empty_like(y)
        by_source[perm] = y
        return _AllToAll.apply(by_source, sent_by, received_from, self.group)


def expert_major(per_source: torch.Tensor, rows: int) -> torch.Tensor:
    """The permutation that takes `rows` rows grouped by source rank, then by local expert (what the all-to-all
    delivers, `per_source` [sources, experts] rows each), to rows grouped by expert, then by source rank: a stable
    sort on (expert, source), on the device (no host read; `rows` is known on the host already)."""
    sources, experts = per_source.shape
    run = torch.repeat_interleave(torch.arange(sources * experts, device=per_source.device), per_source.reshape(-1),
                                  output_size=rows)  # each row's (source, expert) run
    return torch.argsort((run % experts) * sources + run // experts, stable=True)


def apply_expert_parallel(stage: nn.Module, tp_group, tp_rank: int, tp: int, sequence_parallel: bool, ep_group,
                          ep_rank: int, ep: int) -> nn.Module:
    """Install on every MoE block of `stage` (in place, on the meta device, before materialization): the token split
    over tp (without sequence parallelism), the per-rank gradient shares of its parameters over tp, and under
    expert parallelism this rank's experts (`tp_spec` with axis "ep": checkpoints, initialisation and gathers cut
    them as they cut tp shards), the all-to-all dispatch and the 1/ep gradient scale."""
    for moe in (m for m in stage.modules() if isinstance(m, MoE)):
        if tp > 1:
            if not sequence_parallel:
                moe.tokens = TokenSplit(tp_group, tp_rank, tp)
            for p in moe.parameters():
                p.tp_partial = True
        if ep > 1:
            _split_experts(moe, ep)
            moe.dispatcher = AllToAllDispatch(ep_group, ep_rank, ep, moe.spec.n_experts)
            moe.experts.grad_scale = 1.0 / ep
    return stage


def _split_experts(moe: MoE, ep: int) -> None:
    """This rank's experts of every stacked parameter [E, ...] under the experts (their LoRA pairs too)."""
    experts = moe.experts
    for name, p in list(experts.named_parameters()):
        full = tuple(p.shape)
        local = nn.Parameter(torch.empty((full[0] // ep,) + full[1:], device=p.device), requires_grad=p.requires_grad)
        local.tp_spec = TPSpec(0, full, axis="ep")
        local.expert = True  # reduced over the edp group, counted once per expert in the norm (engines)
        if getattr(p, "tp_partial", False):
            local.tp_partial = True
        owner, _, leaf = name.rpartition(".")
        setattr(experts.get_submodule(owner) if owner else experts, leaf, local)


def check_expert_parallel(cfg, ep: int, tp: int, seq_len: int, cp: int) -> str | None:
    """Why a model and layout cannot run its experts so (one sentence), or None: the rules trainer3d's expert
    parallelism and token split rest on. `cfg`: the model's config."""
    spec = cfg.moe
    if spec is None:
        return f"--ep {ep} splits a mixture of experts, and this model has none; drop --ep." if ep > 1 else None
    if spec.n_experts % ep:
        return (f"--ep {ep} must divide the model's {spec.n_experts} experts (each rank holds whole experts); pick a "
                f"divisor of {spec.n_experts}.")
    if tp > 1 and (seq_len // cp) % tp:
        return (f"A mixture of experts splits each rank's {seq_len // cp} tokens over --tp {tp} (experts are not split "
                f"over tp); pick a --seq-len divisible by {cp * tp}.")
    return None

