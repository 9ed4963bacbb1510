"""The vocab-parallel cross-entropy (Megatron's): per-token losses from logits sharded by vocabulary over the tp
ranks, with two all-reduces of per-token scalars and never the logits themselves.

When the logits need a gradient, the loss consumes them, as Megatron's does: their storage becomes the exponentials
and, in the backward, the gradient. Nothing logits-sized is allocated from the loss's forward to the end of its
backward, and no softmax is recomputed (bench/loss_memory.md: the memory and the loss's time; bench/revisions.md:
the whole step 1.21× faster than with the recomputing loss)."""

from __future__ import annotations

import functools

import torch
import torch.distributed as dist

from trainer3d.distributed.collectives import all_reduce


# Elements of the logits per chunk; low-precision logits take one chunk of fp32 temporaries. On a GPU 256 MiB: the GPU
# round found 16 MiB chunks (83 tokens at GPT-2's vocabulary) cost ~3,000 kernel launches a step and made the step
# host-bound (bench/gpu_round.md). On a CPU 16 MiB, which stays in cache (bench/loss_memory.md).
LOSS_CHUNK_ELEMENTS = 1 << 26
CPU_LOSS_CHUNK_ELEMENTS = 1 << 22


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy from vocab-sharded logits; padded vocab columns (>= vocab_size) are masked out.

    Each rank exponentiates its shard against its own row maximum m_r (one pass, chunk by chunk); then one all-reduce
    finds the global maximum M and one sums [the target logit, Σ exp(x - m_r) · exp(m_r - M)]. With `consume`, the
    exponentials are written over the logits (in place when the logits are fp32; through one chunk of fp32 otherwise)
    and the backward scales them by g · exp(m_r - M) / S in place, the target column from its fp32 exponential, so
    that p - 1 does not lose the digits of a confident prediction to the logits' dtype."""

    @staticmethod
    def forward(ctx, logits, target, group, vocab_start, vocab_size, chunk, consume, stats, scale):
        n_local = logits.shape[-1]
        n_valid = max(0, min(n_local, vocab_size - vocab_start))
        flat, tgt = logits.view(-1, n_local), target.reshape(-1)
        n, acc, device = flat.shape[0], torch.promote_types(logits.dtype, torch.float32), logits.device
        outside = (tgt < vocab_start) | (tgt >= vocab_start + n_local)
        local_target = torch.where(outside, 0, tgt - vocab_start)
        local_max = torch.full((n,), float("-inf"), dtype=acc, device=device)
        sums = torch.zeros(2, n, dtype=acc, device=device)  # [target logit, sum of exps]: one all-reduce for both
        target_exp = torch.zeros(n, dtype=acc, device=device)
        for a, b in _spans(n, chunk):
            x = flat[a:b]
            if n_valid == 0:  # a shard made only of padding
                if consume:
                    x.zero_()
                continue
            local_max[a:b], sums[0, a:b], sums[1, a:b], target_exp[a:b] = stats(
                x, local_target[a:b], outside[a:b], n_valid, consume)
        global_max = all_reduce(local_max.clone(), group, dist.ReduceOp.MAX)
        rescale = torch.exp(local_max - global_max)  # 0 on a padding-only shard (m_r = -inf)
        sums[1] *= rescale
        target_logit, sum_exp = all_reduce(sums, group)
        if consume:  # exactly when autograd will call the backward (vocab_parallel_cross_entropy)
            ctx.save_for_backward(logits, rescale / sum_exp, target_exp, local_target, outside)
        ctx.chunk, ctx.scale, ctx.backward_ran = chunk, scale, False
        return (torch.log(sum_exp) + global_max - target_logit).view(target.shape)

    @staticmethod
    def backward(ctx, grad_loss):
        if ctx.backward_ran:
            raise RuntimeError("vocab_parallel_cross_entropy's backward ran twice: its gradient lives in the logits")
        ctx.backward_ran = True
        logits, row_scale, target_exp, local_target, outside = ctx.saved_tensors
        exps = logits.view(-1, logits.shape[-1])
        g = grad_loss.reshape(-1).to(row_scale.dtype)
        row = row_scale * g  # softmax_j · g = exp_j · row
        rows = torch.arange(exps.shape[0], device=exps.device)
        target_grad = torch.where(outside, exps[rows, local_target].to(row.dtype) * row,
                                  (target_exp * row_scale - 1.0) * g)
        # chunks again: an in-place op that mixes dtypes, or CPU's scatter_ on bf16, makes a logits-sized fp32 copy
        for a, b in _spans(exps.shape[0], ctx.chunk):
            ctx.scale(exps[a:b], row[a:b])
        exps[rows, local_target] = target_grad.to(exps.dtype)
        return logits, None, None, None, None, None, None, None, None


def _chunk_stats(x: torch.Tensor, local_target: torch.Tensor, outside: torch.Tensor, n_valid: int, consume: bool):
    """One chunk of rows: (row max m, target logit, Σ exp(x - m), the target's exponential), in fp32 or wider; with
    `consume` the exponentials (0 on padded columns) are written over `x`. Eager, each step is a pass over the chunk
    (an fp32 copy of a low-precision one first); under --compile inductor fuses the element-wise steps into the
    reductions' passes (the GPU round found the eager passes ~10% of a GPT-2 step on an H200, bench/gpu_round.md)."""
    acc = torch.promote_types(x.dtype, torch.float32)
    m = x[:, :n_valid].max(dim=-1)[0].to(acc)
    target_logit = x.gather(-1, local_target[:, None]).squeeze(-1).to(acc).masked_fill(outside, 0.0)
    in_place = consume and x.dtype == acc
    e = (x if in_place else x.to(acc, copy=True)).sub_(m.unsqueeze(-1)).exp_()
    e[:, n_valid:].zero_()  # a kernel; `= 0.0` would copy a host number (tests/test_host_syncs.py)
    target_exp = e.gather(-1, local_target[:, None]).squeeze(-1).masked_fill(outside, 0.0)
    if consume and not in_place:
        x.copy_(e)
    return m, target_logit, e.sum(dim=-1), target_exp


def _scale_chunk(exps: torch.Tensor, row: torch.Tensor) -> None:
    """The backward's pass over one chunk: exponentials times their row's g · exp(m_r - M) / S, in place. Eager, on
    low-precision logits, this mixed-dtype in-place op takes PyTorch's generic element-wise kernel (the H100 round:
    0.28 ms a 64M-element bf16 chunk, ~0.9 TB/s); compiled, one vectorised pass."""
    exps.mul_(row.unsqueeze(-1))


@functools.cache
def _compiled_chunk_kernels(backend: str):
    """(_chunk_stats, _scale_chunk) under torch.compile, built once per process and backend (their graphs are shared
    by every chunk and trainer); dynamic: one graph for every chunk height and shard width."""
    return (torch.compile(_chunk_stats, dynamic=True, backend=backend),
            torch.compile(_scale_chunk, dynamic=True, backend=backend))


def _spans(n: int, chunk: int) -> list[tuple[int, int]]:
    return [(a, min(a + chunk, n)) for a in range(0, n, max(1, chunk))]


def vocab_parallel_cross_entropy(
    logits, target, group, vocab_start: int, vocab_size: int, chunk_tokens: int | None = None,
    compiled: str | None = None
) -> torch.Tensor:
    """Per-token losses (shape of `target`); `logits` is this rank's vocab slice starting at `vocab_start`.
    Where autograd will differentiate them, the logits are overwritten (then hold the gradient): pass a copy to
    keep them. `chunk_tokens`: tokens per chunk (default: LOSS_CHUNK_ELEMENTS elements of this shard, on a CPU
    CPU_LOSS_CHUNK_ELEMENTS). `compiled` (--compile's backend, or None): each chunk's passes, forward and backward,
    as compiled graphs."""
    budget = CPU_LOSS_CHUNK_ELEMENTS if logits.device.type == "cpu" else LOSS_CHUNK_ELEMENTS
    chunk = chunk_tokens or max(1, budget // logits.shape[-1])
    consume = torch.is_grad_enabled() and logits.requires_grad
    stats, scale = _compiled_chunk_kernels(compiled) if compiled else (_chunk_stats, _scale_chunk)
    return _VocabParallelCrossEntropy.apply(logits.contiguous(), target, group, vocab_start, vocab_size, chunk,
                                            consume, stats, scale)


class _VocabParallelEntropy(torch.autograd.Function):
    """H = −Σ p log p of the softmax over vocab-sharded logits, per token: log S + M − Σ e·x / S from this shard's
    max, exp-sum and exp-weighted sum, all-reduced over tp (padded columns left out). Backward: ∂H/∂x = −p (log p + H)
    on this shard, from p saved in fp32 (never a view of the logits, which the cross-entropy may overwrite after)."""

    @staticmethod
    def forward(ctx, logits, group, vocab_start, vocab_size):
        n_valid = max(0, min(logits.shape[-1], vocab_size - vocab_start))
        x = logits[..., :n_valid].float()
        local_max = x.amax(dim=-1) if n_valid else torch.full(x.shape[:-1], -torch.inf, device=x.device)
        m = all_reduce(local_max, group, dist.ReduceOp.MAX)
        e = torch.exp(x - m.unsqueeze(-1))
        sums = all_reduce(torch.stack([e.sum(dim=-1), (e * x).sum(dim=-1)]), group)
        entropy = torch.log(sums[0]) + m - sums[1] / sums[0]
        if ctx.needs_input_grad[0]:
            ctx.save_for_backward(e.div_(sums[0].unsqueeze(-1)), entropy)
            ctx.shape, ctx.dtype, ctx.n_valid = logits.shape, logits.dtype, n_valid
        return entropy

    @staticmethod
    def backward(ctx, grad):
        p, entropy = ctx.saved_tensors
        out = torch.zeros(ctx.shape, dtype=torch.float32, device=p.device)
        out[..., :ctx.n_valid] = -(torch.special.xlogy(p, p) + p * entropy.unsqueeze(-1)) * grad.unsqueeze(-1)
        return out.to(ctx.dtype), None, None, None


def vocab_parallel_entropy(logits: torch.Tensor, group, vocab_start: int, vocab_size: int) -> torch.Tensor:
    """[..., T] entropy (fp32) of each position's distribution over the vocabulary, from this rank's vocab shard of
    the logits (collective over tp); differentiable (an RL loss's entropy bonus): compute it before the cross-entropy,
    which consumes the logits."""
    return _VocabParallelEntropy.apply(logits, group, vocab_start, vocab_size)

