"""A parameter's gradient as ZeRO holds it after the dp reduction, whatever the stage: a writable view of the flat
partition (ZeRO-1/2), this rank's per-parameter partition (ZeRO-3, possibly swapped to NVMe) or the whole
all-reduced gradient (ZeRO-0). The engine's tied-embedding sum, global norm and clip work on these shares."""

from __future__ import annotations

import enum
from dataclasses import dataclass

import torch
import torch.nn as nn


class Holding(enum.Enum):
    """How a ZeRO optimizer holds its parameters' fp32 masters, gradients and Adam state."""

    PARTITION = "ZeRO-3: each parameter partitioned on its own over dp"
    FRAGMENT = "ZeRO-1/2, and stage 0's bf16 optimizer: fragments of a flat partition per parameter group"
    WHOLE = "stage 0 in fp32: the client optimizer holds every parameter whole"


def is_zero_param(p: nn.Parameter) -> bool:
    """A parameter zero.Init partitioned (ZeRO-3): DeepSpeed's own test."""
    from deepspeed.runtime.zero.utils import is_zero_param as partitioned

    return partitioned(p)


def holding(optimizer) -> Holding:
    """Decided by the class of the optimizer DeepSpeed built, never by which attributes a parameter happens to
    carry: a DeepSpeed that renames one of them then fails where it is read, instead of passing for another kind."""
    from deepspeed.runtime.bf16_optimizer import BF16_Optimizer
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if isinstance(optimizer, DeepSpeedZeroOptimizer_Stage3):
        return Holding.PARTITION
    if isinstance(optimizer, (DeepSpeedZeroOptimizer, BF16_Optimizer)):
        return Holding.FRAGMENT
    return Holding.WHOLE


def base_optimizer_and_masters(optimizer):
    """The Adam inside a ZeRO optimizer and the fp32 tensors it keys its state by: the flat master partitions (one
    per parameter group, or sub-group at ZeRO-3), or for stage 0's plain client optimizer itself and its parameters."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    kind = holding(optimizer)
    if kind is Holding.PARTITION:
        return optimizer.optimizer, list(optimizer.fp32_partitioned_groups_flat)
    if kind is Holding.FRAGMENT:
        masters = optimizer.single_partition_of_fp32_groups if isinstance(optimizer, DeepSpeedZeroOptimizer) \
            else optimizer.fp32_groups_flat_partition
        return optimizer.optimizer, list(masters)
    return optimizer, [p for group in optimizer.param_groups for p in group["params"]]


@dataclass
class GradShare:
    """A piece of one parameter's gradient held by this rank after the dp reduction."""

    tensor: torch.Tensor  # ZeRO-0/1/2: a view (writable in place); ZeRO-3: read-only (may be a copy)
    dp_replicated: bool  # True: every dp rank holds the same values (ZeRO-0); False: dp-disjoint partition


def grad_shares(param: nn.Parameter, optimizer) -> list[GradShare]:
    """This rank's share of `param`'s (dp-reduced) gradient, as `optimizer` (the ZeRO optimizer owning it) holds it.
    Valid between the last backward epilogue of a step and engine.step()."""
    from deepspeed.utils import safe_get_local_grad

    kind = holding(optimizer)
    if kind is Holding.PARTITION:  # each parameter partitioned on its own over dp (write: z3_set_local_grad)
        g = safe_get_local_grad(param)
        return [] if g is None else [GradShare(g, False)]
    if kind is Holding.FRAGMENT:  # a fragment of the flat partition (mapping None: owned by another rank)
        if param._hp_mapping is None:
            return []
        try:
            frag = param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)
        except ValueError:  # "only available immediately after backward": none held right now
            return []
        address = param._hp_mapping.lp_fragment_address
        if frag.numel() == param.numel() and address.numel < param.numel():  # a full buffer: keep the owned part
            frag = frag.reshape(-1).narrow(0, address.start, address.numel)
        return [GradShare(frag, False)]
    if param.grad is not None:  # ZeRO-0: DeepSpeed all-reduced the full gradient
        return [GradShare(param.grad, True)]
    return []


def z3_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """deepspeed.utils.safe_set_local_grad, which in 0.19.8 asserts on the size of `param.ds_tensor`, a 1-element
    placeholder while the parameter itself is swapped out to NVMe; the write it guards goes to the optimizer's
    fp32 gradient partition, which exists either way. Same steps, without that assertion."""
    from deepspeed.utils import safe_set_local_grad

    if param.ds_tensor.numel() == value.numel():
        safe_set_local_grad(param, value)
        return
    opt = param._z3_optimizer
    if opt.offload_optimizer:
        opt.norm_for_param_grads[opt.get_param_id(param)] = opt._constant_buffered_norm2(value)
    grad, group = opt._get_fp32_grad_state_partition(param=param, release_swap_buffers=False)
    grad.data.copy_(value.flatten().data)
    if opt._swappable_optimizer_subgroup(group):
        opt._writeback_swap_state(group, write_opt_state=False, write_gradients=True)
