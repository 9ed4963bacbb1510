"""Data parallelism over the dp group (torch DDP), and the two gradient steps that span the other axes:
the tied-embedding all-reduce between first and last pipeline stage, and the global gradient norm.

torch's pipeline stages know DDP: they run every micro-batch but the last under `no_sync`, so the dp
all-reduce happens once per step. (DeepSpeed ZeRO as the dp engine lives in zero.py.)
"""

from __future__ import annotations

import math
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from trainer3d.parallel.tensor_parallel import all_reduce, group_size


def wrap_ddp(module: nn.Module, dp_group, device: torch.device) -> nn.Module:
    if group_size(dp_group) == 1:
        return module
    # Expected with find_unused_parameters (below): every parameter is used; the flag is there for buckets.
    warnings.filterwarnings("ignore", message="find_unused_parameters=True was specified")
    return DistributedDataParallel(
        module,
        process_group=dp_group,
        device_ids=[device.index] if device.type == "cuda" else None,
        # The pipeline stage runs every forward under no_sync and arms the reducer by hand before the last
        # backward, so DDP's forward never gets to rebuild its buckets and its first-iteration bookkeeping
        # overflows (reducer.cpp "rebuilt parameter indices size"). With find_unused_parameters the reducer
        # does not rebuild buckets at all; the graph walk it costs is small next to a stage's backward.
        find_unused_parameters=True,
    )


def all_reduce_grads(params: list[nn.Parameter], dp_group, bucket_elems: int = 25_000_000) -> None:
    """Average gradients over dp in flat buckets: for the zero-bubble schedules, whose weight-gradient pass DDP
    cannot see. Same arithmetic as DDP (sum, then divide by the dp size)."""
    n = group_size(dp_group)
    if n == 1:
        return
    grads = [p.grad for p in params if p.grad is not None]
    bucket: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        bucket.append(g)
        if sum(b.numel() for b in bucket) >= bucket_elems or i == len(grads) - 1:
            flat = torch._utils._flatten_dense_tensors(bucket)
            dist.all_reduce(flat, group=dp_group)
            flat.div_(n)
            for b, reduced in zip(bucket, torch._utils._unflatten_dense_tensors(flat, bucket)):
                b.copy_(reduced)
            bucket = []


def unwrap(module: nn.Module) -> nn.Module:
    return module.module if isinstance(module, DistributedDataParallel) else module


def tied_copies(stage_modules: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's copies of the tied embedding: the first stage's wte and the last stage's lm_head weight
    (the same Parameter when one module holds both)."""
    out: list[nn.Parameter] = []
    for m in map(unwrap, stage_modules):
        for part in (m.wte, m.lm_head):
            if part is not None and not any(part.weight is p for p in out):
                out.append(part.weight)
    return out


def is_tied_duplicate(module: nn.Module, param: nn.Parameter) -> bool:
    """The last stage's lm_head copy when the embedding lives on another stage: same values as wte, so it
    must be counted once in the gradient norm (and saved once in checkpoints)."""
    m = unwrap(module)
    return m.lm_head is not None and m.wte is None and param is m.lm_head.weight


def sync_tied_embedding_grads(stage_modules: list[nn.Module], embedding_group) -> None:
    """Sum the gradients of every copy of the tied embedding (on this rank and across the embedding group)
    and give each copy the sum, so that the optimizer keeps the copies bitwise identical."""
    copies = tied_copies(stage_modules)
    in_group = group_size(embedding_group) > 1
    if not copies or (len(copies) == 1 and not in_group):
        return  # middle stage, or pp=1 where one shared Parameter already received both gradients
    total = torch.zeros_like(copies[0])
    for p in copies:
        if p.grad is not None:
            total += p.grad
    if in_group:
        all_reduce(total, embedding_group)
    for p in copies:
        if p.grad is None:
            p.grad = total.clone()
        else:
            p.grad.copy_(total)


def global_grad_norm(stage_modules: list[nn.Module], tp_rank: int, mp_group) -> torch.Tensor:
    """L2 norm of the whole model's gradient: squares of tp shards and pp stages summed over the model-parallel
    group, each parameter counted once (replicated ones on tp rank 0 only, the tied head copy not at all).
    Gradients are already averaged over dp by DDP, so dp needs no reduction here."""
    squares = []
    for module in stage_modules:
        for p in module.parameters():
            if p.grad is None or is_tied_duplicate(module, p):
                continue
            if getattr(p, "tp_spec", None) is None and tp_rank != 0:
                continue
            squares.append(p.grad.detach().float().pow(2).sum())
    device = next(stage_modules[0].parameters()).device
    total = torch.stack(squares).sum() if squares else torch.zeros((), device=device)
    return all_reduce(total, mp_group).sqrt()


def clip_grads_(stage_modules: list[nn.Module], total_norm: torch.Tensor, max_norm: float) -> None:
    """Same rule as torch.nn.utils.clip_grad_norm_, applied with the global norm."""
    if max_norm <= 0 or not math.isfinite(total_norm.item()):
        return
    coef = torch.clamp(max_norm / (total_norm + 1e-6), max=1.0)
    grads = [p.grad for m in stage_modules for p in m.parameters() if p.grad is not None]
    if grads:
        torch._foreach_mul_(grads, coef.to(grads[0].device))
