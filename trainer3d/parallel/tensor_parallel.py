"""Megatron-style tensor parallelism (Shoeybi et al. 2019) with plain tensors and explicit collectives.

Which linears of a block are column-parallel (output dim split: attention's q|k|v, the MLP's first layer; heads split
across ranks) and which row-parallel (input dim split, one all-reduce after: the projections back to the residual
stream) is the model family's ParallelPlan; so each block needs one all-reduce per half in forward and one in
backward. Embedding and LM head are vocab-parallel and the cross-entropy works on vocab
shards without ever gathering the logits (cross_entropy.py). Plain tensors (not DTensor) so DDP and DeepSpeed can
wrap the result.

Under sequence parallelism (Korthikanti et al. 2022; sequence_parallel.py sets `sequence_parallel` on the layers)
the activations between the regions are sequence shards: an all-gather of the sequence enters a column-parallel
region and a reduce-scatter of it leaves a row-parallel one, the same bytes as the all-reduce they replace.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.distributed.collectives import all_gather_into, all_reduce, group_size, reduce_scatter_into
from trainer3d.models.interface import CausalLM, ColumnParallel, find_module


# ---- the two conjugate collectives (Megatron's f and g) ---------------------------------------------------
class _CopyToTP(torch.autograd.Function):
    """Identity forward, all-reduce of the gradient backward: enters a column-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, grad):
        return all_reduce(grad.contiguous(), ctx.group), None


class _ReduceFromTP(torch.autograd.Function):
    """All-reduce forward, identity backward: leaves a row-parallel region."""

    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.contiguous(), group)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x, group):
    return _CopyToTP.apply(x, group) if group_size(group) > 1 else x


def reduce_from_tp(x, group):
    return _ReduceFromTP.apply(x, group) if group_size(group) > 1 else x


# ---- their sequence-parallel forms: activations [batch, seq, hidden] split along seq between the regions ----------
# torch's collectives concatenate along dim 0, so the sequence is moved there and back (one copy each way; Megatron
# avoids it by keeping activations [seq, batch, hidden] throughout).
SEQ_DIM = 1


def all_gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T/tp, ...] shards -> [B, T, ...], rank order along the sequence."""
    shards = x.movedim(SEQ_DIM, 0).contiguous()
    out = shards.new_empty((group_size(group) * shards.shape[0],) + tuple(shards.shape[1:]))
    all_gather_into(out, shards, group)
    return out.movedim(0, SEQ_DIM).contiguous()


def reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    """[B, T, ...] partial sums -> this rank's [B, T/tp, ...] shard of their sum."""
    full = x.movedim(SEQ_DIM, 0).contiguous()
    out = full.new_empty((full.shape[0] // group_size(group),) + tuple(full.shape[1:]))
    reduce_scatter_into(out, full, group)
    return out.movedim(0, SEQ_DIM).contiguous()


class _ReduceScatterSequence(torch.autograd.Function):
    """Reduce-scatter forward, all-gather backward: leaves a row-parallel region onto sequence shards."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return all_gather_sequence(grad, ctx.group), None


class _SequenceGatheredLinear(torch.autograd.Function):
    """F.linear(all-gathered sequence, weight, bias), saving only this rank's shard of the input: the backward
    gathers it again for the weight gradient and reduce-scatters the input gradient, so the saved input of every
    column-parallel layer shrinks by tp too (Korthikanti et al. 2022, section 4.2.2; Megatron's
    LinearWithGradAccumulationAndAsyncCommunication). A plain gather before F.linear would save the whole sequence."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return F.linear(all_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        x_full = all_gather_sequence(x, ctx.group).to(grad.dtype)  # under autocast grad is bf16, the weight fp32
        grad_x = reduce_scatter_sequence(grad.matmul(weight.to(grad.dtype)), ctx.group)
        grad_2d = grad.reshape(-1, grad.shape[-1])
        grad_w = grad_2d.t().matmul(x_full.reshape(-1, x_full.shape[-1]))
        return grad_x, grad_w, grad_2d.sum(0) if ctx.has_bias else None, None


def to_compute_dtype(x: torch.Tensor) -> torch.Tensor:
    """Under autocast, the input of a tensor-parallel matmul in the matmul's dtype: autocast would cast it there anyway,
    and cast before the collective it crosses the wire in bf16, its gradient too (fp32 otherwise)."""
    device = x.device.type
    if torch.is_autocast_enabled(device):
        return x.to(torch.get_autocast_dtype(device))
    return x


def parallel_linear(x, weight, bias, group, sequence_parallel: bool, fp8=None):
    """The matmul that enters a tensor-parallel region (a column-parallel layer, the LM head): every rank needs the
    whole sequence (all-gathered from its shards under sequence parallelism). `fp8`: the layer's FP8 matmul
    (parallel/fp8.py), under sequence parallelism after a plain gather (torchao saves its own input)."""
    x = to_compute_dtype(x)
    if fp8 is not None:
        x = _GatherSequenceRegion.apply(x.contiguous(), group) if sequence_parallel else copy_to_tp(x, group)
        y = fp8(x, weight)
        return y if bias is None else y + bias.to(y.dtype)
    if sequence_parallel:
        return _SequenceGatheredLinear.apply(x, weight, bias, group)
    return F.linear(copy_to_tp(x, group), weight, bias)


class _GatherSequenceRegion(torch.autograd.Function):
    """All-gather of the sequence forward, reduce-scatter of its gradient backward: a sequence shard entering a
    region where every rank uses the whole sequence for its own heads (their gradient shares summed)."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return all_gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return reduce_scatter_sequence(grad.contiguous(), ctx.group), None


class TPEntry(nn.Module):
    """Where a replicated activation enters the head-sharded region without a linear (ParallelPlan.tp_entries):
    identity forward and the all-reduce of its gradient (each rank's heads give a share), or under sequence
    parallelism the all-gather of the sequence and the reduce-scatter of its gradient."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.sequence_parallel = False

    def forward(self, x):
        if self.sequence_parallel:
            return _GatherSequenceRegion.apply(x.contiguous(), self.group)
        return copy_to_tp(x, self.group)


class WholeSequenceEntry(nn.Module):
    """Where detached activations reach a replicated module that computes on the whole sequence on every rank
    (ParallelPlan.whole_sequence: DSA's indexer): identity, or under sequence parallelism the all-gather of the
    sequence. Nothing flows back (the inputs are detached), so no backward collective."""

    def __init__(self, group):
        super().__init__()
        self.group = group
        self.sequence_parallel = False

    def forward(self, x):
        return all_gather_sequence(x, self.group) if self.sequence_parallel else x


def leave_tp(x, group, sequence_parallel: bool):
    """Out of a region whose outputs are partial sums (a row-parallel layer, the vocab-parallel embedding)."""
    return _ReduceScatterSequence.apply(x, group) if sequence_parallel else reduce_from_tp(x, group)


# ---- how a full parameter maps onto its shards --------------------------------------------------------------
@dataclass(frozen=True)
class TPSpec:
    """A parameter split along `dim`. `full_shape` is the unsharded, unpadded shape; `fused`: the sizes of the blocks
    stacked along `dim` (q|k|v, gate|up), each split separately so each rank gets whole heads of each; `padded` is the
    full length along `dim` after padding (the vocab), filled with zeros. `axis`: the parallelism it is split over,
    "tp", or "ep" for stacked experts (parallel/expert_parallel.py); the shard arithmetic is the same."""

    dim: int
    full_shape: tuple[int, ...]
    fused: tuple[int, ...] | None = None
    padded: int | None = None
    axis: str = "tp"


def shard_tensor(full: torch.Tensor, spec: TPSpec, rank: int, size: int) -> torch.Tensor:
    if spec.padded is not None and spec.padded > full.shape[spec.dim]:
        pad = list(full.shape)
        pad[spec.dim] = spec.padded - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=spec.dim)
    blocks = full.split(list(spec.fused), dim=spec.dim) if spec.fused else [full]
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], spec: TPSpec) -> torch.Tensor:
    local = [n // len(shards) for n in spec.fused] if spec.fused else [shards[0].shape[spec.dim]]
    per_rank = [s.split(local, dim=spec.dim) for s in shards]
    full = torch.cat([torch.cat([p[c] for p in per_rank], dim=spec.dim) for c in range(len(local))], dim=spec.dim)
    return full.narrow(spec.dim, 0, spec.full_shape[spec.dim]).contiguous()


# ---- layers ------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local; the output stays sharded along its last dim."""

    def __init__(self, in_features, out_features, group, size, bias=True, fused=None, device=None):
        super().__init__()
        self.group = group
        self.sequence_parallel = False
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features, device=device))
        self.weight.tp_spec = TPSpec(0, (out_features, in_features), fused)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // size, device=device))
            self.bias.tp_spec = TPSpec(0, (out_features,), fused)
        self.fp8 = None  # --fp8: an FP8Matmul (parallel/fp8.py)
        self.lora = None  # --lora-rank: its adapter pairs, added to this rank's output columns (parallel/lora.py)

    def forward(self, x):
        y = parallel_linear(x, self.weight, self.bias, self.group, self.sequence_parallel, self.fp8)
        return y if self.lora is None else y + self.lora(x)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b; the input arrives sharded along its last dim."""

    def __init__(self, in_features, out_features, group, size, bias=True, device=None):
        super().__init__()
        self.group = group
        self.sequence_parallel = False
        self.weight = nn.Parameter(torch.empty(out_features, in_features // size, device=device))
        self.weight.tp_spec = TPSpec(1, (out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features, device=device)) if bias else None  # replicated, added once
        self.fp8 = None  # --fp8: an FP8Matmul (parallel/fp8.py)
        self.lora = None  # --lora-rank: its adapter pair, a partial sum joining the base's (parallel/lora.py)

    def forward(self, x):
        y = F.linear(x, self.weight) if self.fp8 is None else self.fp8(to_compute_dtype(x), self.weight)
        if self.lora is not None:
            y = y + self.lora(x)
        y = leave_tp(y, self.group, self.sequence_parallel)
        return y if self.bias is None else y + self.bias


def vocab_parallel_weight(vocab_size, padded_vocab, dim, size, device=None) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(padded_vocab // size, dim, device=device))
    weight.tp_spec = TPSpec(0, (vocab_size, dim), padded=padded_vocab)
    return weight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the (padded) vocabulary; ids outside it contribute zeros."""

    def __init__(self, vocab_size, padded_vocab, dim, group, rank, size, device=None):
        super().__init__()
        self.group = group
        self.sequence_parallel = False
        per_rank = padded_vocab // size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = vocab_parallel_weight(vocab_size, padded_vocab, dim, size, device)

    def forward(self, ids):
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return leave_tp(out, self.group, self.sequence_parallel)


class VocabParallelHead(nn.Module):
    """The LM head on the same vocab slice as the embedding (tied): logits stay sharded by vocab."""

    def __init__(self, weight: nn.Parameter, group):
        super().__init__()
        self.group = group
        self.sequence_parallel = False
        self.weight = weight

    def forward(self, x):
        return parallel_linear(x, self.weight, None, self.group, self.sequence_parallel)


# ---- dropout RNG ---------------------------------------------------------------------------------------------
class ShardedDropoutRNG:
    """A separate RNG stream for dropout on sharded activations (attention probabilities, split by head), seeded
    per TP rank so each rank's heads get independent masks, while dropout on replicated activations keeps using
    the default generator, seeded identically on TP peers so their masks agree (Megatron's RNG tracker)."""

    def __init__(self, seed: int, device: torch.device):
        self.devices = [device] if device.type == "cuda" else []
        with torch.random.fork_rng(devices=self.devices):
            torch.manual_seed(seed)
            self.state = self._get()

    def _get(self):
        return torch.cuda.get_rng_state(self.devices[0]) if self.devices else torch.get_rng_state()

    def _set(self, state):
        torch.cuda.set_rng_state(state, self.devices[0]) if self.devices else torch.set_rng_state(state)

    @contextlib.contextmanager
    def __call__(self):
        with torch.random.fork_rng(devices=self.devices):
            self._set(self.state)
            yield
            self.state = self._get()


# ---- applying TP to the plain model ----------------------------------------------------------------------------
def padded_vocab_size(vocab_size: int, tp: int, multiple: int = 128) -> int:
    step = multiple * tp
    return -(-vocab_size // step) * step


def apply_tensor_parallel(model: CausalLM, group, rank: int, size: int,
                          dropout_rng: ShardedDropoutRNG | None) -> CausalLM:
    """Swap the linears the model's ParallelPlan names, and its embedding and head, for their sharded forms (`model`
    is a pipeline stage, usually on the meta device). Applied at tp=1 too: the vocab is then still padded and one code
    path runs everywhere. A last stage whose tied embedding lives on another stage gets its own copy of the weight
    (the engines keep the copies in sync), as does a last stage's own embedding copy (multi-token prediction); the
    blocks outside the stack (CausalLM.extra_blocks: an MTP module's) are split as the stack's."""
    cfg, plan = model.cfg, model.parallel_plan()
    dev = next(model.parameters()).device
    for block in [*model.blocks.values(), *model.extra_blocks()]:
        for path, style in plan.linears.items():
            old = linear_at(block, path)
            if old is None:  # a mixture of experts in this block (parallel/expert_parallel.py splits it)
                continue
            bias = old.bias is not None
            if isinstance(style, ColumnParallel):
                new = ColumnParallelLinear(old.in_features, old.out_features, group=group, size=size, bias=bias,
                                           fused=style.fused, device=dev)
            else:
                new = RowParallelLinear(old.in_features, old.out_features, group=group, size=size, bias=bias,
                                        device=dev)
            block.set_submodule(path, new)
        for path in plan.tp_entries:
            block.set_submodule(path, TPEntry(group))
        for path in plan.whole_sequence:
            if find_module(block, path) is not None:
                block.set_submodule(path, WholeSequenceEntry(group))
        if dropout_rng is not None:
            plan.mixer(block).sharded_rng = dropout_rng
        for path, style in plan.sharded.items():
            _shard_parameter(block, path, style, size)
        for path in plan.head_shared:  # each rank applies it to its heads only: its gradient is a share
            if find_module(block, path.rpartition(".")[0]) is not None:
                block.get_parameter(path).tp_partial = True
    V, d = cfg.vocab_size, cfg.n_embd
    Vp = padded_vocab_size(V, size)
    for slot, held in ((model.EMBEDDING, model.embedding), (model.EMBEDDING_COPY, model.embedding_copy)):
        if held is not None:
            setattr(model, slot, VocabParallelEmbedding(V, Vp, d, group=group, rank=rank, size=size, device=dev))
    if model.head is not None:
        tied_here = cfg.tie_embeddings and model.embedding is not None
        weight = model.embedding.weight if tied_here else vocab_parallel_weight(V, Vp, d, size, dev)
        setattr(model, model.HEAD, VocabParallelHead(weight, group))
    return model


def _shard_parameter(block: nn.Module, path: str, style: ColumnParallel, size: int) -> None:
    """Replace the parameter at `path` (if the block has it) by this rank's empty share of dim 0 (ParallelPlan.sharded);
    materialization fills it from the full value as it fills a column-parallel weight."""
    owner, _, leaf = path.rpartition(".")
    module = find_module(block, owner)
    if module is None:
        return
    old = getattr(module, leaf)
    local = nn.Parameter(torch.empty(old.shape[0] // size, *old.shape[1:], device=old.device, dtype=old.dtype))
    local.tp_spec = TPSpec(0, tuple(old.shape), style.fused)
    setattr(module, leaf, local)


def linear_at(block: nn.Module, path: str, kinds: tuple[type, ...] = (nn.Linear,)) -> nn.Module | None:
    """The linear (an nn.Linear, or one of `kinds`) at `path` in a block, or None where the path leads to something
    else (a mixture of experts in place of the dense MLP holds its experts' weights as stacked parameters, not layers)
    or nowhere (a hybrid stack's blocks hold one kind of attention each)."""
    owner, _, leaf = path.rpartition(".")
    module = find_module(block, owner) if owner else block
    found = getattr(module, leaf, None)
    return found if isinstance(found, kinds) else None
