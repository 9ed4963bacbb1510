"""The vocab-parallel cross-entropy (Megatron's): per-token losses from logits sharded by vocabulary over the tp
ranks, with three all-reduces of per-token scalars and never the logits themselves; computed in chunks of tokens so
that no fp32 copy of a micro-batch's logits is ever held."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer3d.distributed.collectives import all_reduce


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
