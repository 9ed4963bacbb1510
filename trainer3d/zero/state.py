"""ZeRO's partitioned parameters and optimizer state as whole tensors: read for checkpoints, written back on resume.

checkpoint/save.py stores every parameter and its Adam state whole, under layout-free names, whatever engine owned the
dp axis. Under ZeRO a parameter's fp32 master value and Adam moments are partitioned over dp (ZeRO-1/2: fragments
of a flat partition per parameter group; ZeRO-3: each parameter on its own); DeepSpeed's safe_get/set_full_*
assemble them (an all-reduce over dp) and write this rank's part back, wherever the partition lives (device, CPU).

Saving asks, per parameter, for the fp32 master value and the Adam moments (safe_get_full_*). Loading has two
gaps to fill. Adam creates its state lazily at its first step, so a fresh engine gets it created in the
optimizer's own format and ZeRO-1/2's per-parameter views re-linked (`_create_optimizer_state`; DeepSpeed 0.19.8
also links them too early after a real first step, so saving re-links where a view is empty) before
safe_set_full_* write into it. Under NVMe optimizer offload the fp32 partitions are placeholders while swapped
out, so those engines are loaded sub-group by sub-group between a swap-in and a swap-out (`_load_swapped_states`).

Every function here is collective over dp: every dp rank calls it for the same parameters in the same order.
"""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer3d.optim import adam_step_state
from trainer3d.parallel.engine import Partition
from trainer3d.zero.grads import Holding, base_optimizer_and_masters, holding

ADAM_MOMENTS = ("exp_avg", "exp_avg_sq")


def _partitioned(engine) -> bool:
    """Does ZeRO hold the engine's fp32 masters and optimizer state in partitions (stages 1-3, or stage 0's bf16
    optimizer), rather than the client optimizer holding them whole?"""
    return holding(engine.optimizer) is not Holding.WHOLE


def _full_shape(engine, p: nn.Parameter) -> torch.Size:
    return p.ds_shape if holding(engine.optimizer) is Holding.PARTITION else p.shape


def _base_optimizer_and_masters(engine):
    return base_optimizer_and_masters(engine.optimizer)


def optimizer_step_count(engine) -> int | None:
    """Adam's step count (every master tensor steps together; ZeRO never skips a step in fp32/bf16), or None before
    the first step, when Adam has created no state yet."""
    base, masters = _base_optimizer_and_masters(engine)
    for m in masters:
        state = base.state.get(m)
        if state and "step" in state:
            return int(state["step"])
    return None


def _swaps_optimizer(engine) -> bool:
    """ZeRO-Infinity: ZeRO-3 with the optimizer (fp32 masters, Adam moments) swapped out to NVMe between steps."""
    return holding(engine.optimizer) is Holding.PARTITION and bool(engine.optimizer.swap_optimizer)


def _load_swapped_states(engine_of: dict, items) -> None:
    """load_param_states for ZeRO-3 engines whose optimizer lives on NVMe. A fresh engine's swapped-out fp32
    partitions are empty placeholders and Adam has no state yet, so DeepSpeed's per-parameter setters have nothing
    to write into. Sub-group by sub-group, as a step does: swap the fp32 partition in, give it Adam state, write the
    partition of every parameter in it (read from the checkpoint one at a time), swap it all out; the swapper then
    holds the state as after a first step. Every sub-group is visited once, so it moves to and from disk once."""
    by_group: dict[tuple[int, int], list] = {}
    for p, read_state, read_value in items:
        engine = engine_of[id(p)]
        group, offset, numel = engine.optimizer.grad_position[engine.optimizer.get_param_id(p)]
        by_group.setdefault((id(engine), group), []).append((engine, p, read_state, read_value, offset, numel))
    for (_, group), members in sorted(by_group.items(), key=lambda kv: kv[0][1]):
        opt = members[0][0].optimizer
        swap = opt._swappable_optimizer_subgroup(group)
        if swap:
            opt._optimizer_states_and_gradient_swap_in(group)
        master = opt.fp32_partitioned_groups_flat[group]
        for engine, p, read_state, read_value, offset, numel in members:
            flat = (numel * opt._get_param_partition_rank(p), numel)  # this rank's partition only
            master.data.narrow(0, offset, numel).copy_(read_value(flat=flat))
            state = read_state(flat=flat)
            if state:
                adam = _new_adam_state(opt.optimizer, master, int(state["step"].item()))
                for key in ADAM_MOMENTS:
                    adam[key].narrow(0, offset, numel).copy_(state[key])
        if swap:
            opt._optimizer_states_and_gradient_swap_out(group)


def _new_adam_state(base, master: torch.Tensor, step: int) -> dict:
    """Adam's state for one fp32 master tensor, created (zero moments) if it has none yet, with its step set, in the
    optimizer's own format (torch Adam: a float tensor step; DeepSpeedCPUAdam: an int)."""
    from deepspeed.ops.adam import DeepSpeedCPUAdam

    cpu_adam = isinstance(base, DeepSpeedCPUAdam)
    state = base.state.setdefault(master, {})
    if not state:
        dtype = master.dtype if cpu_adam and not base.fp32_optimizer_states else torch.float32
        state["exp_avg"] = torch.zeros_like(master, dtype=dtype)
        state["exp_avg_sq"] = torch.zeros_like(master, dtype=dtype)
    state["step"] = step if cpu_adam else adam_step_state(step, master, base)
    return state


def _create_optimizer_state(engine, step: int) -> None:
    """Give a freshly built engine the optimizer state Adam would have after `step` steps (`_new_adam_state` for
    each master tensor), and link ZeRO-1/2's per-parameter views to it, as DeepSpeed's universal-checkpoint loader
    does. Adam creates state lazily at its first step, so until then DeepSpeed's safe_set_full_optimizer_state has
    nothing to write into."""
    base, masters = _base_optimizer_and_masters(engine)
    for m in masters:
        _new_adam_state(base, m, step)
    _link_optimizer_state(engine)


def _link_optimizer_state(engine) -> None:
    """(Re)point ZeRO-1/2's (and the bf16 optimizer's) per-parameter views at Adam's flat state. DeepSpeed 0.19.8
    links them after stepping the first parameter group, before Adam has created the other groups' state, and never
    again: the no-decay group's views stay empty and safe_get_full_optimizer_state fails on its parameters."""
    opt = engine.optimizer
    if holding(opt) is Holding.FRAGMENT:
        opt._hp_optimizer_states_linked = False
        opt._lazy_init_hp_params_optimizer_state()


def full_param(engine, p: nn.Parameter) -> torch.Tensor:
    """The full fp32 value of a parameter (this rank's tp shard), from ZeRO's master copy."""
    from deepspeed.utils import safe_get_full_fp32_param

    frozen = not p.requires_grad  # (a LoRA base: no master copy; ZeRO-1/2 hold it whole, ZeRO-3 see partition_of)
    value = safe_get_full_fp32_param(p) if _partitioned(engine) and not frozen else p.data
    return value.detach().float().reshape(_full_shape(engine, p))


def optimizer_state_of(engine, p: nn.Parameter) -> dict[str, torch.Tensor]:
    """AdamW's state of `p` as the DDP path holds it (exp_avg, exp_avg_sq: full over dp, this tp shard; step: a
    float tensor); {} before the first step."""
    from deepspeed.utils import safe_get_full_optimizer_state

    base, _ = _base_optimizer_and_masters(engine)
    step = optimizer_step_count(engine)
    if step is None:
        return {}
    if not _partitioned(engine):  # ZeRO-0 in fp32: the client optimizer, keyed by the parameter itself
        return {k: v for k, v in base.state.get(p, {}).items() if torch.is_tensor(v)}
    if holding(engine.optimizer) is Holding.FRAGMENT and p._hp_mapping is not None and not p._hp_mapping.optim_fragment:
        _link_optimizer_state(engine)
    state = {k: safe_get_full_optimizer_state(p, k).float().reshape(_full_shape(engine, p)) for k in ADAM_MOMENTS}
    state["step"] = torch.tensor(float(step))
    return state


def partition_of(engine, p: nn.Parameter, moments: bool) -> Partition | None:
    """This rank's fp32 master and Adam moments of `p` as ZeRO holds them (views, no collective): ZeRO-3's
    partition in its sub-group's flat master; ZeRO-1/2's (and stage 0 bf16's) fragment. None where nothing is
    partitioned (stage 0 in fp32) or the optimizer lives on NVMe (the assembled path then reads it through
    DeepSpeed). `moments`: Adam has stepped (its state exists)."""
    kind = holding(engine.optimizer)
    if not p.requires_grad:  # a frozen parameter (a LoRA base) has no master: ZeRO-3's partition of its data
        if kind is not Holding.PARTITION:
            return None
        start, numel, _ = _partition(engine, p)
        return Partition(start, tuple(p.ds_shape), {"param": p.ds_tensor.reshape(-1).narrow(0, 0, numel)})
    if kind is Holding.WHOLE or _swaps_optimizer(engine):
        return None
    if kind is Holding.PARTITION:
        opt = engine.optimizer
        group, offset, _ = opt.grad_position[opt.get_param_id(p)]
        start, numel, _ = _partition(engine, p)
        master = opt.fp32_partitioned_groups_flat[group]
        tensors = {"param": master.narrow(0, offset, numel)}
        if moments:
            state = opt.optimizer.state[master]
            tensors.update({k: state[k].narrow(0, offset, numel) for k in ADAM_MOMENTS})
        return Partition(start, tuple(p.ds_shape), tensors)
    mapping = p._hp_mapping
    if mapping is None:  # another rank's partition holds all of it
        return Partition(0, tuple(p.shape), {"param": torch.empty(0)})
    if moments and not mapping.optim_fragment:
        _link_optimizer_state(engine)
    tensors = {"param": mapping.hp_fragment}
    if moments:
        tensors.update({k: mapping.get_optim_state_fragment(k) for k in ADAM_MOMENTS})
    return Partition(mapping.lp_fragment_address.start, tuple(p.shape), tensors)


def load_param_states(engine_of: dict, items) -> None:
    """Write a checkpoint's fp32 values and AdamW states into this rank's partitions. `items`: (parameter,
    read_state, read_value), the readers returning the tp shard (full over dp) of the Adam state (`step`,
    `exp_avg`, `exp_avg_sq`; {} if saved before the first step) and of the fp32 value, or with `flat=(start,
    numel)` only that range of it: a ZeRO-3 rank reads only its own partition. The value goes into ZeRO's master
    copy: the module, built from the same value, holds it only in bf16 under bf16. `engine_of`: id of a parameter
    -> the engine that owns it."""
    swapped = [item for item in items if _swaps_optimizer(engine_of[id(item[0])])]
    with_state: set[int] = set()  # engines whose Adam state exists (created once per engine, not per parameter)
    for p, read_state, read_value in items:
        engine = engine_of[id(p)]
        if _swaps_optimizer(engine):
            continue
        kind = holding(engine.optimizer)
        if kind is Holding.PARTITION:  # ZeRO-3: this rank's partition only
            start, numel, size = _partition(engine, p)
            state = {k: _padded(v, size) if k in ADAM_MOMENTS else v
                     for k, v in read_state(flat=(start, numel)).items()}
            value = _padded(read_value(flat=(start, numel)), size)
        elif kind is Holding.FRAGMENT:  # ZeRO-1/2: read only this rank's fragment, set through the full setter
            flat, shape = _fragment(p), p.shape
            state = {k: _placed(v, flat, shape) if k in ADAM_MOMENTS else v for k, v in read_state(flat=flat).items()}
            value = _placed(read_value(flat=flat), flat, shape)
        else:
            state, value = read_state(), read_value()
        if state and id(engine) not in with_state:
            _create_optimizer_state(engine, int(state["step"].item()))
            with_state.add(id(engine))
        _load_param_state(engine, p, state, value)
    if swapped:
        _load_swapped_states(engine_of, swapped)


def _partition(engine, p: nn.Parameter) -> tuple[int, int, int]:
    """(start, numel, size) of this rank's ZeRO-3 partition of `p` in its flattened tp shard: partitions are equal
    slices in dp-rank order, the last one padded up to `size`."""
    size = p.ds_tensor.ds_numel
    start = size * engine.optimizer._get_param_partition_rank(p)
    return start, max(0, min(size, p.ds_numel - start)), size


def _fragment(p: nn.Parameter) -> tuple[int, int]:
    """(start, numel) of the fragment of `p` whose fp32 master and moments this rank's ZeRO-1/2 partition holds
    (DeepSpeed's per-parameter mapping; none: (0, 0))."""
    mapping = p._hp_mapping
    if mapping is None:
        return 0, 0
    address = mapping.lp_fragment_address
    return address.start, address.numel


def _placed(fragment: torch.Tensor, flat: tuple[int, int], shape) -> torch.Tensor:
    """A full-shaped tensor holding `fragment` at `flat` (zeros elsewhere: safe_set_full_* reads only the fragment)."""
    out = torch.zeros(shape, dtype=torch.float32)
    out.view(-1).narrow(0, flat[0], flat[1]).copy_(fragment)
    return out


def _padded(flat: torch.Tensor, size: int) -> torch.Tensor:
    out = torch.zeros(size, dtype=torch.float32)
    out[: flat.numel()] = flat
    return out


def _load_param_state(engine, p: nn.Parameter, state: dict[str, torch.Tensor], value: torch.Tensor) -> None:
    """One parameter of an engine whose Adam state exists (if `state` is not empty); a ZeRO-3 parameter's `value`
    and moments are its partition, any other's the whole tp shard."""
    from deepspeed.utils import (
        safe_set_full_fp32_param, safe_set_full_optimizer_state, safe_set_local_fp32_param,
        safe_set_local_optimizer_state,
    )

    kind = holding(engine.optimizer)
    local = kind is Holding.PARTITION
    set_value = safe_set_local_fp32_param if local else safe_set_full_fp32_param
    set_state = safe_set_local_optimizer_state if local else safe_set_full_optimizer_state
    if kind is not Holding.WHOLE:
        set_value(p, value.to(torch.float32))
    if not state:
        return
    if kind is not Holding.WHOLE:
        for key in ADAM_MOMENTS:
            set_state(p, state[key].to(torch.float32), key)
    else:
        base, _ = _base_optimizer_and_masters(engine)
        base.state[p] = {k: adam_step_state(v, p, base) if k == "step" else v.to(p.device, torch.float32)
                         for k, v in state.items()}
