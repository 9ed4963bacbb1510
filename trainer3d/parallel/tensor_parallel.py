"""Megatron-style tensor parallelism (Shoeybi et al. 2019) with plain tensors and explicit collectives.

Attention QKV and MLP fc are column-parallel (output dim split, heads split across ranks), attention and MLP
projections row-parallel (input dim split, one all-reduce after), so each block needs one all-reduce per half
in forward and one in backward. Embedding and LM head are vocab-parallel and the cross-entropy works on vocab
shards without ever gathering the logits. Plain tensors (not DTensor) so DDP and DeepSpeed can wrap the result.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.dist.collectives import all_reduce, group_size
from trainer3d.errors import LayoutError
from trainer3d.model import GPT


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


# ---- how a full parameter maps onto its shards --------------------------------------------------------------
@dataclass(frozen=True)
class TPSpec:
    """A parameter split along `dim`. `full_shape` is the unsharded, unpadded shape; `chunks` > 1 for the fused
    q|k|v weight, whose three blocks are split separately so each rank gets whole heads of each; `padded` is the
    full length along `dim` after padding (the vocab), filled with zeros."""

    dim: int
    full_shape: tuple[int, ...]
    chunks: int = 1
    padded: int | None = None


def shard_tensor(full: torch.Tensor, spec: TPSpec, rank: int, size: int) -> torch.Tensor:
    if spec.padded is not None and spec.padded > full.shape[spec.dim]:
        pad = list(full.shape)
        pad[spec.dim] = spec.padded - full.shape[spec.dim]
        full = torch.cat([full, full.new_zeros(pad)], dim=spec.dim)
    blocks = full.chunk(spec.chunks, dim=spec.dim)
    return torch.cat([b.chunk(size, dim=spec.dim)[rank] for b in blocks], dim=spec.dim).contiguous()


def unshard_tensor(shards: list[torch.Tensor], spec: TPSpec) -> torch.Tensor:
    per_rank = [s.chunk(spec.chunks, dim=spec.dim) for s in shards]
    full = torch.cat([torch.cat([p[c] for p in per_rank], dim=spec.dim) for c in range(spec.chunks)], dim=spec.dim)
    return full.narrow(spec.dim, 0, spec.full_shape[spec.dim]).contiguous()


# ---- layers ------------------------------------------------------------------------------------------------
class ColumnParallelLinear(nn.Module):
    """y_local = x W_local^T + b_local; the output stays sharded along its last dim."""

    def __init__(self, in_features, out_features, group, rank, size, bias=True, chunks=1, device=None):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features // size, in_features, device=device))
        self.weight.tp_spec = TPSpec(0, (out_features, in_features), chunks)
        self.bias = None
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features // size, device=device))
            self.bias.tp_spec = TPSpec(0, (out_features,), chunks)

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight, self.bias)


class RowParallelLinear(nn.Module):
    """y = all_reduce(x_local W_local^T) + b; the input arrives sharded along its last dim."""

    def __init__(self, in_features, out_features, group, rank, size, device=None):
        super().__init__()
        self.group = group
        self.weight = nn.Parameter(torch.empty(out_features, in_features // size, device=device))
        self.weight.tp_spec = TPSpec(1, (out_features, in_features))
        self.bias = nn.Parameter(torch.empty(out_features, device=device))  # replicated, added once

    def forward(self, x):
        return reduce_from_tp(F.linear(x, self.weight), self.group) + self.bias


def vocab_parallel_weight(vocab_size, padded_vocab, dim, size, device=None) -> nn.Parameter:
    weight = nn.Parameter(torch.empty(padded_vocab // size, dim, device=device))
    weight.tp_spec = TPSpec(0, (vocab_size, dim), padded=padded_vocab)
    return weight


class VocabParallelEmbedding(nn.Module):
    """Each rank holds a contiguous slice of the (padded) vocabulary; ids outside it contribute zeros."""

    def __init__(self, vocab_size, padded_vocab, dim, group, rank, size, device=None):
        super().__init__()
        self.group = group
        per_rank = padded_vocab // size
        self.vocab_start, self.vocab_end = rank * per_rank, (rank + 1) * per_rank
        self.weight = vocab_parallel_weight(vocab_size, padded_vocab, dim, size, device)

    def forward(self, ids):
        if group_size(self.group) == 1:
            return F.embedding(ids, self.weight)
        outside = (ids < self.vocab_start) | (ids >= self.vocab_end)
        local = torch.where(outside, 0, ids - self.vocab_start)
        out = F.embedding(local, self.weight).masked_fill(outside.unsqueeze(-1), 0.0)
        return reduce_from_tp(out, self.group)


class VocabParallelHead(nn.Module):
    """The LM head on the same vocab slice as the embedding (tied): logits stay sharded by vocab."""

    def __init__(self, weight: nn.Parameter, group):
        super().__init__()
        self.group = group
        self.weight = weight

    def forward(self, x):
        return F.linear(copy_to_tp(x, self.group), self.weight)


LOSS_CHUNK_ELEMENTS = 1 << 22  # fp32 temporaries of the loss: 16 MiB per chunk of tokens at most


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits: all-reduces of the max, the target logit and the sum
    of exps, never the logits themselves. Padded vocab columns (>= vocab_size) are masked out.

    Chunked over tokens: the fp32 temporaries (shifted logits, exps) never exceed `chunk` tokens, and only the logits
    (already held as the stage output), the max and the sum are saved; the backward recomputes each chunk's softmax.
    Unchunked, a micro-batch of 8 × 1024 tokens at GPT-2's vocab holds 1.6 GB of fp32 softmax from the loss to its
    backward (bench/README.md, "The loss in chunks")."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, chunk):
        n_local = logits.shape[-1]
        n_valid = max(0, min(n_local, vocab_size - vocab_start))
        flat, tgt = logits.reshape(-1, n_local), target.reshape(-1)
        n, spans = flat.shape[0], _spans(flat.shape[0], chunk)
        logits_max = torch.full((n,), float("-inf"), device=logits.device)
        if n_valid > 0:  # else a shard made only of padding
            for a, b in spans:
                logits_max[a:b] = flat[a:b, :n_valid].max(dim=-1)[0].float()
        logits_max = all_reduce(logits_max, group, dist.ReduceOp.MAX)

        outside = (tgt < vocab_start) | (tgt >= vocab_start + n_local)
        local_target = torch.where(outside, 0, tgt - vocab_start)
        sums = torch.empty(2, n, device=logits.device)  # [target logit, sum of exps]: one all-reduce for both
        for a, b in spans:
            shifted = _shifted(flat[a:b], logits_max[a:b], n_valid)  # fp32 softmax under mixed precision
            sums[0, a:b] = shifted.gather(-1, local_target[a:b].unsqueeze(-1)).squeeze(-1).masked_fill(outside[a:b], 0.0)
            sums[1, a:b] = shifted.exp_().sum(dim=-1)
        target_logit, sum_exp = all_reduce(sums, group)
        ctx.save_for_backward(logits, logits_max, sum_exp, local_target, outside)
        ctx.n_valid, ctx.chunk = n_valid, chunk
        return (torch.log(sum_exp) - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        logits, logits_max, sum_exp, local_target, outside = ctx.saved_tensors
        flat, g = logits.reshape(-1, logits.shape[-1]), grad_loss.reshape(-1)
        grad = torch.empty_like(flat)
        for a, b in _spans(flat.shape[0], ctx.chunk):
            softmax = _shifted(flat[a:b], logits_max[a:b], ctx.n_valid).exp_().div_(sum_exp[a:b].unsqueeze(-1))
            softmax.scatter_add_(-1, local_target[a:b].unsqueeze(-1), -(~outside[a:b]).unsqueeze(-1).to(softmax.dtype))
            grad[a:b] = softmax.mul_(g[a:b].unsqueeze(-1))
        return grad.view_as(logits), None, None, None, None, None


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, max(1, chunk))]


def _shifted(logits: torch.Tensor, logits_max: torch.Tensor, n_valid: int) -> torch.Tensor:
    shifted = logits.float() - logits_max.unsqueeze(-1)
    if n_valid < shifted.shape[-1]:
        shifted[:, n_valid:] = float("-inf")
    return shifted


def vocab_parallel_cross_entropy(
    logits, target, group, vocab_start: int, vocab_size: int, chunk_tokens: int | None = None
) -> torch.Tensor:
    """Per-token losses (shape of `target`); `logits` is this rank's vocab slice starting at `vocab_start`.
    `chunk_tokens`: tokens per chunk (default: LOSS_CHUNK_ELEMENTS fp32 elements of this shard's logits)."""
    chunk = chunk_tokens or max(1, LOSS_CHUNK_ELEMENTS // logits.shape[-1])
    return _VocabParallelCrossEntropy.apply(logits, target, group, vocab_start, vocab_size, chunk)


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


def apply_tensor_parallel(model: GPT, group, rank: int, size: int, dropout_rng: ShardedDropoutRNG | None) -> GPT:
    """Swap the plain Linear/Embedding modules of `model` (a pipeline stage, usually on the meta device) for
    their sharded forms. Applied at tp=1 too: the vocab is then still padded and one code path runs everywhere.
    A last stage without the embedding gets its own copy of the tied weight (kept in sync by the pipeline)."""
    cfg = model.cfg
    dev = next(model.parameters()).device
    d, V = cfg.n_embd, cfg.vocab_size
    Vp = padded_vocab_size(V, size)
    for block in model.h.values():
        attn, mlp = block.attn, block.mlp
        attn.c_attn = ColumnParallelLinear(d, 3 * d, group, rank, size, chunks=3, device=dev)
        attn.c_proj = RowParallelLinear(d, d, group, rank, size, device=dev)
        mlp.c_fc = ColumnParallelLinear(d, 4 * d, group, rank, size, device=dev)
        mlp.c_proj = RowParallelLinear(4 * d, d, group, rank, size, device=dev)
        if dropout_rng is not None:
            attn.sharded_rng = dropout_rng
    if model.wte is not None:
        model.wte = VocabParallelEmbedding(V, Vp, d, group, rank, size, device=dev)
    if model.lm_head is not None:
        weight = model.wte.weight if model.wte is not None else vocab_parallel_weight(V, Vp, d, size, dev)
        model.lm_head = VocabParallelHead(weight, group)
    return model


def check_tensor_parallel(cfg, tp: int) -> None:
    if cfg.n_head % tp:
        raise LayoutError(f"--tp {tp} must divide the model's {cfg.n_head} attention heads; pick a divisor of {cfg.n_head}.")


# ---- full (layout-free) values <-> this rank's shards ----------------------------------------------------------
def materialize(module: nn.Module, device: torch.device, full_value, rank: int, size: int) -> None:
    """Replace every (meta) parameter of `module` by this rank's shard of `full_value(name, full_shape)`.

    Parameters shared between modules (the tied wte/lm_head) stay shared. Used for initialisation (full_value
    = model.init_value) and for loading layout-free weights (checkpoints, Hugging Face)."""
    memo: dict[int, nn.Parameter] = {}
    for prefix, mod in module.named_modules():
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                spec = getattr(p, "tp_spec", None)
                name = f"{prefix}.{key}" if prefix else key
                full = full_value(name, spec.full_shape if spec else tuple(p.shape))
                value = shard_tensor(full, spec, rank, size) if spec else full
                new = nn.Parameter(value.to(device=device, dtype=torch.float32), requires_grad=p.requires_grad)
                if spec is not None:
                    new.tp_spec = spec
                memo[id(p)] = new
            mod._parameters[key] = memo[id(p)]


def gather_full(t: torch.Tensor, spec: TPSpec | None, group) -> torch.Tensor:
    """The full value of a tensor sharded like a parameter with `spec` (a weight, its grad, an Adam moment)."""
    if spec is None:
        return t.detach().clone()
    shards = [torch.empty_like(t) for _ in range(group_size(group))]
    if len(shards) == 1:
        shards[0] = t.detach().clone()
    else:
        dist.all_gather(shards, t.detach().contiguous(), group=group)
    return unshard_tensor(shards, spec)
