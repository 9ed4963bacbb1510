"""Full (layout-free) values <-> this rank's shards of the parameters: building a stage's parameters from a function
of full tensors or a checkpoint's shards (`materialize`, `from_full`), and the full value back from a tp group's
shards (`gather_full`). The shards themselves (which rows or columns a tp rank holds) are tensor_parallel.py's."""

from __future__ import annotations

from typing import Callable

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer3d.distributed.collectives import group_size
from trainer3d.parallel.tensor_parallel import TPSpec, shard_tensor, unshard_tensor

# What the parallel passes mark on a parameter: its tp split, and (sequence parallelism) that each tp rank holds only
# its sequence shard's share of a replicated parameter's gradient (the engines sum them over tp).
PARAM_ATTRIBUTES = ("tp_spec", "tp_partial", "expert")

def materialize(module: nn.Module, device: torch.device, shard_value, coords: dict[str, tuple[int, int]],
                after_module: Callable[[nn.Module], None] | None = None) -> None:
    """Replace every (meta) parameter of `module` by `shard_value(name, tp_spec, local_shape, rank, size)`: this
    rank's shard of the parameter's layout-free value (a checkpoint reads only the shard; `from_full` makes one from
    a function of full tensors, such as the initialisation), (rank, size) this rank's coordinate on the axis the spec
    splits it over (`coords`: Topology.coords_by_axis). Parameters shared between modules (a tied embedding and
    head) stay shared. `after_module(m)`: called as soon as a module's own new parameters exist (ZeRO-3 partitions
    them there)."""
    memo: dict[int, nn.Parameter] = {}
    for prefix, mod in module.named_modules():
        created = False
        for key, p in list(mod._parameters.items()):
            if p is None:
                continue
            if id(p) not in memo:
                created = True
                name = f"{prefix}.{key}" if prefix else key
                spec = getattr(p, "tp_spec", None)
                value = shard_value(name, spec, tuple(p.shape), *coords[spec.axis if spec is not None else "tp"])
                new = nn.Parameter(value.to(device=device, dtype=torch.float32), requires_grad=p.requires_grad)
                for attr in PARAM_ATTRIBUTES:
                    if hasattr(p, attr):
                        setattr(new, attr, getattr(p, attr))
                memo[id(p)] = new
            mod._parameters[key] = memo[id(p)]
        if created and after_module is not None:
            after_module(mod)


def from_full(full_value):
    """A `shard_value` hook (materialize) from `full_value(name, full_shape)`, which returns whole tensors."""

    def shard_value(name, spec, local_shape, rank, size):
        if spec is None:
            return full_value(name, tuple(local_shape))
        return shard_tensor(full_value(name, spec.full_shape), spec, rank, size)

    return shard_value


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
