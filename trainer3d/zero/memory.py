"""What a ZeRO engine holds, by category (parameters, gradients, optimizer states) and how much of each is offloaded,
read off DeepSpeed's own buffers: the same report the DDP engine gives, so metrics.jsonl reads alike for both.
`zero`: a ZeroEngine (its spec, engines, their parameters and device)."""

from __future__ import annotations

import os

import torch
import torch.distributed as dist

from trainer3d.zero.grads import base_optimizer_and_masters, grad_shares, is_zero_param


def _offloaded(zero, t: torch.Tensor, category_offloaded: bool) -> bool:
    if zero.device.type != "cpu":
        return t.device.type == "cpu"
    return category_offloaded  # a CPU host: what the config sends to the "host" side

def grad_bytes(zero) -> tuple[int, int]:
    """(bytes, offloaded bytes) of the gradients as held when the optimizer steps."""
    total = off = 0
    seen = set()
    if zero.spec.zero_stage == 3 and zero.spec.offload_optimizer != "none":
        # the fp32 gradient partitions the CPU optimizer steps on (in RAM, or swapped to NVMe between uses)
        for e in zero.engines:
            for flat in e.optimizer.fp32_partitioned_groups_flat:
                n = flat.numel() * 4
                total, off = total + n, off + n
        return total, off
    for e in zero.engines:
        for p in zero.params_of(e):
            if id(p) in seen or not p.requires_grad:  # (a frozen parameter, a LoRA base's, has no gradient)
                continue
            seen.add(id(p))
            tensors = [s.tensor for s in grad_shares(p, e.optimizer)]
            if p.grad is not None and not any(t is p.grad for t in tensors):
                tensors.append(p.grad)
            for t in tensors:
                n = t.numel() * t.element_size()
                total += n
                off += n if _offloaded(zero, t, zero.spec.offload_optimizer != "none") else 0
    return total, off

def report(zero, grad_mem: tuple[int, int] | None = None) -> dict:
    """Bytes this rank holds: parameters (its ZeRO-3 partition, else the whole stage), gradients (as held when
    the optimizer steps), optimizer states (fp32 master partitions + Adam moments), and how much of each is
    offloaded."""
    params = params_off = optim = optim_off = 0
    seen = set()
    off_p, off_o = zero.spec.offload_param != "none", zero.spec.offload_optimizer != "none"
    model_storages = set()  # a master "copy" that is the parameters' own storage (ZeRO-3 fp32) is no copy
    for e in zero.engines:
        for p in zero.params_of(e):
            if id(p) in seen:
                continue
            seen.add(id(p))
            held = [p.data] + ([p.ds_tensor] if is_zero_param(p) else [])
            for t in held:
                if t.numel():
                    model_storages.add(t.untyped_storage().data_ptr())
                n = t.numel() * t.element_size()
                params += n
                params_off += n if _offloaded(zero, t, off_p and t is not p.data) else 0
    for e in zero.engines:
        basic = base_optimizer_and_masters(e.optimizer)[0]
        # ZeRO keys the wrapped optimizer's state by its fp32 master partitions (its param_groups are
        # emptied between steps at stage 3), so walk the state, then any grouped tensor without state yet.
        masters = {id(q): q for q in basic.state} | {id(q): q for g in basic.param_groups for q in g["params"]}
        for q in masters.values():
            tensors = [q] if q.numel() and q.untyped_storage().data_ptr() not in model_storages else []
            tensors += [v for v in basic.state.get(q, {}).values() if torch.is_tensor(v)]
            for t in tensors:
                n = t.numel() * t.element_size()
                optim += n
                optim_off += n if _offloaded(zero, t, off_o) else 0
    grads, grads_off = grad_mem if grad_mem is not None else grad_bytes(zero)
    out = {
        "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim,
        "param_offloaded_bytes": params_off, "grad_offloaded_bytes": grads_off, "optim_offloaded_bytes": optim_off,
    }
    if "nvme" in (zero.spec.offload_param, zero.spec.offload_optimizer):
        out["nvme_bytes"] = nvme_bytes(zero)
    return out

def nvme_bytes(zero) -> int:
    """Bytes in this rank's ZeRO-Infinity swap files (DeepSpeed writes <nvme_path>/zero_stage_3/<kind>/rank<r>/):
    what is offloaded to NVMe rather than held in memory."""
    zero_cfg = zero.spec.ds_config["zero_optimization"]
    paths = {(zero_cfg.get(k) or {}).get("nvme_path") for k in ("offload_param", "offload_optimizer")} - {None}
    me, total = f"rank{dist.get_rank()}", 0
    for path in paths:
        for root, _, files in os.walk(path):
            if me in root.split(os.sep):
                total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
    return total
