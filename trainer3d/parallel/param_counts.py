"""What one tensor-parallel rank holds of a model's parameters, read from the family's ParallelPlan on a one-block model
on the meta device: the planner's parameter, memory and communication counts come from here, for every family."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache

import torch

from trainer3d.models import build_model
from trainer3d.models.interface import ColumnParallel
from trainer3d.parallel.tensor_parallel import padded_vocab_size


@dataclass(frozen=True)
class LocalParams:
    """Elements per tensor on one tp rank, with whether the tensor is replicated over tp."""

    block: tuple[tuple[int, bool], ...]  # every parameter of one block
    embedding: int  # the token embedding's vocab shard (padded vocabulary / tp × d)
    first_extra: tuple[int, ...]  # the first stage's other parts (learned positions), replicated
    last_extra: tuple[int, ...]  # the last stage's parts besides the head (the final norm), replicated
    head: int  # the head's vocab shard: a separate weight unless the head is tied and on the embedding's stage
    column_layers: int  # column-parallel linears per block: each gathers (or all-reduces the gradient of) its input
    row_layers: int  # row-parallel linears per block: each all-reduces (or reduce-scatters) its output

    @property
    def block_total(self) -> int:
        return sum(n for n, _ in self.block)

    @property
    def block_replicated(self) -> list[int]:
        return [n for n, replicated in self.block if replicated]


@lru_cache(maxsize=256)
def local_params(cfg, tp: int) -> LocalParams:
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg, n_layer=1))
    plan = model.parallel_plan()
    block = []
    for name, p in model.blocks["0"].named_parameters():
        owner, _, kind = name.rpartition(".")
        style = plan.linears.get(owner)
        sharded = style is not None and (kind == "weight" or isinstance(style, ColumnParallel))
        block.append((p.numel() // tp if sharded else p.numel(), not sharded))
    shard = padded_vocab_size(cfg.vocab_size, tp) // tp * cfg.n_embd

    def extras(parts: tuple[str, ...], skip: str) -> tuple[int, ...]:
        return tuple(p.numel() for part in parts if part != skip for p in getattr(model, part).parameters())

    n_column = sum(isinstance(s, ColumnParallel) for s in plan.linears.values())
    return LocalParams(block=tuple(block), embedding=shard, first_extra=extras(model.FIRST_STAGE, model.EMBEDDING),
                       last_extra=extras(model.LAST_STAGE, model.HEAD), head=shard, column_layers=n_column,
                       row_layers=len(plan.linears) - n_column)
