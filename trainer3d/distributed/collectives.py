"""The few collectives every layer shares: sizes of possibly-absent groups, a differentiation-free all-reduce, object
gathers that work with one process, and "agree on an error" so that every rank raises the same sentence and none is
left waiting in the next collective."""

from __future__ import annotations

import torch
import torch.distributed as dist

from trainer3d.private_api import require


def group_size(group) -> int:
    return dist.get_world_size(group) if group is not None else 1


def group_world_size(group) -> int:
    """Like group_size, but 1 before any process group exists (offline tools, one-process tests)."""
    return group_size(group) if dist.is_initialized() else 1


def host_values(values: list[float], device: torch.device) -> torch.Tensor:
    """A float32 vector of host numbers on `device` without waiting for the device: a plain copy from pageable memory
    (or `t[i] = float`) synchronizes the stream, which stalled every CUDA step until its backward had run (the GPU
    then idled while the host launched the rest: bench/gpu_round.md, the fifth round). From pinned memory the copy
    is queued like a kernel; torch's pinned allocator keeps the buffer until the copy has run."""
    t = torch.tensor(values, dtype=torch.float32)
    if device.type != "cuda":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)


def all_reduce(t: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if group_size(group) > 1:
        dist.all_reduce(t, op=op, group=group)
    return t


def all_gather_into(out: torch.Tensor, shard: torch.Tensor, group, async_op: bool = False):
    """All-gather `shard` from every rank into `out` (rank order along dim 0): torch 2.13's all_gather_single, whose
    older name all_gather_into_tensor warns there and is the only one before. Looked up at each call, so that a
    wrapper of either (bench/measure.py counts bytes) sees it."""
    fn = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    return fn(out, shard, group=group, async_op=async_op)


def reduce_scatter_into(out: torch.Tensor, full: torch.Tensor, group):
    """Sum `full` over the ranks and keep this rank's dim-0 shard in `out`: torch 2.13's reduce_scatter_single (its
    older name reduce_scatter_tensor warns there)."""
    fn = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor
    return fn(out, full, group=group)


def rendezvous_store():
    """The store every rank met in (torchrun's agent's, or rank 0's): small keys that need no collective, with no
    collective's timeout. None with one process."""
    if not dist.is_initialized() or dist.get_world_size() == 1:
        return None
    require("distributed/collectives.py")
    return dist.distributed_c10d._get_default_store()


def all_gather_object(obj, group) -> list:
    if group_world_size(group) == 1:
        return [obj]
    out = [None] * dist.get_world_size(group)
    dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src_global_rank: int, group):
    if group_world_size(group) == 1:
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=src_global_rank, group=group)
    return box[0]


def agree_on_error(error: str | None, group, error_type: type[Exception]) -> None:
    """Collective: every rank passes its own error message (or None); if any rank has one, every rank raises the
    first one as `error_type`."""
    first = next((e for e in all_gather_object(error, group) if e), None)
    if first:
        raise error_type(first)
