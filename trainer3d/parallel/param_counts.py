"""What one tensor-parallel rank holds of a model's parameters, read from the family's ParallelPlan on a small model on
the meta device: the planner's parameter, memory and communication counts come from here, for every family.

Blocks differ where a family mixes dense and mixture-of-experts MLPs (Qwen3-MoE's mlp_only_layers) or two kinds of
attention (Qwen3.5): each kind is read off one block of that kind, and `LocalParams.block(layer)` answers for any
layer. An MoE block is left whole by tensor
parallelism (parallel/expert_parallel.py): its router, experts and shared expert are replicated over tp, each tp rank
holds only its tokens' share of their gradients, and the experts are split over ep (`Piece.on_rank`).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from functools import lru_cache
from typing import NamedTuple

import torch

from trainer3d.models import build_model
from trainer3d.models.interface import ColumnParallel
from trainer3d.models.moe import MoE, Experts
from trainer3d.parallel.tensor_parallel import padded_vocab_size


class Piece(NamedTuple):
    """One parameter of a block as one tp rank holds it."""

    n: int  # elements on one tp rank (an expert tensor: all the layer's experts; a rank holds 1/ep of them)
    replicated: bool  # the same on every tp rank
    partial: bool = False  # its gradient is a per-tp-rank share summed over tp at every tp > 1 (an MoE block's
    # parameters, Qwen3's q/k norms); sequence parallelism makes every replicated piece so
    expert: bool = False  # split over ep (reduced over edp)

    def on_rank(self, ep: int = 1) -> int:
        return self.n // ep if self.expert else self.n


@dataclass(frozen=True)
class BlockParams:
    """One block's parameters on one tp rank, and the tensor-parallel linears it runs."""

    pieces: tuple[Piece, ...]
    column_layers: int  # column-parallel linears: each gathers (or all-reduces the gradient of) its input
    row_layers: int  # row-parallel linears: each all-reduces (or reduce-scatters) its output
    moe: bool = False  # a mixture of experts' block

    def total(self, ep: int = 1) -> int:
        return sum(p.on_rank(ep) for p in self.pieces)

    def experts(self, ep: int = 1) -> int:
        return sum(p.on_rank(ep) for p in self.pieces if p.expert)


@dataclass(frozen=True)
class LocalParams:
    """Elements per tensor on one tp rank."""

    blocks: tuple[BlockParams, ...]  # each layer's (the blocks of one kind share one)
    embedding: int  # the token embedding's vocab shard (padded vocabulary / tp × d)
    first_extra: tuple[int, ...]  # the first stage's other parts (learned positions), replicated
    last_extra: tuple[int, ...]  # the last stage's parts besides the head (the final norm), replicated
    head: int  # the head's vocab shard: a separate weight unless the head is tied and on the embedding's stage

    def block(self, layer: int) -> BlockParams:
        return self.blocks[layer]

    def kinds(self, layers) -> list[tuple[BlockParams, int]]:
        """(block, how many of `layers` are of its kind), for the kinds present, in order of first appearance."""
        counts: dict[int, list] = {}
        for i in layers:
            counts.setdefault(id(self.blocks[i]), [self.blocks[i], 0])[1] += 1
        return [(b, k) for b, k in counts.values()]


def embedding_on_last(cfg) -> bool:
    """Whether a last stage without the embedding holds a copy of it (CausalLM.shares_embedding: a tied head, or
    multi-token prediction's inputs), summed with it each step and saved once."""
    return bool(cfg.tie_embeddings or getattr(cfg, "mtp_layers", 0))


def moe_layers(cfg) -> frozenset[int]:
    """The blocks whose MLP is a mixture of experts (none for a family without `is_moe_layer`)."""
    if cfg.moe is None:
        return frozenset()
    return frozenset(i for i in range(cfg.n_layer) if cfg.is_moe_layer(i))


def block_kinds(cfg) -> list:
    """Each block's kind, what makes two blocks' parameters alike: the config's `block_kind(layer)` (a hybrid
    family's: its mixer and MLP), else whether the block's MLP is a mixture of experts."""
    kind = getattr(cfg, "block_kind", None)
    if kind is not None:
        return [kind(i) for i in range(cfg.n_layer)]
    moe = moe_layers(cfg)
    return [i in moe for i in range(cfg.n_layer)]


@lru_cache(maxsize=256)
def local_params(cfg, tp: int) -> LocalParams:
    kinds = block_kinds(cfg)
    first = {}
    for i, kind in enumerate(kinds):
        first.setdefault(kind, i)
    with torch.device("meta"):
        model = build_model(dataclasses.replace(cfg, n_layer=1 + max(first.values())))
    plan = model.parallel_plan()
    shard = padded_vocab_size(cfg.vocab_size, tp) // tp * cfg.n_embd

    def extras(parts: tuple[str, ...], skip: str) -> tuple[int, ...]:
        return tuple(p.numel() for part in parts if part != skip for p in getattr(model, part).parameters())

    read = {kind: _block_params(model.blocks[str(i)], plan, tp) for kind, i in first.items()}
    return LocalParams(blocks=tuple(read[kind] for kind in kinds), embedding=shard,
                       first_extra=extras(model.FIRST_STAGE, model.EMBEDDING),
                       last_extra=extras(model.LAST_STAGE, model.HEAD), head=shard)


def _block_params(block: torch.nn.Module, plan, tp: int) -> BlockParams:
    """A block's pieces under the plan: a linear of the plan that the block has is split (column-parallel whole,
    row-parallel its weight); everything else is replicated, an MoE's parameters with per-rank gradient shares."""
    linears = {path: style for path, style in plan.linears.items() if _has(block, path)}
    in_moe = {id(p) for m in block.modules() if isinstance(m, MoE) for p in m.parameters()}
    experts = {id(p) for m in block.modules() if isinstance(m, Experts) for p in m.parameters(recurse=False)}
    pieces = []
    for name, p in block.named_parameters():
        owner, _, kind = name.rpartition(".")
        style = linears.get(owner)
        sharded = (style is not None and (kind == "weight" or isinstance(style, ColumnParallel))) or \
            name in plan.sharded
        pieces.append(Piece(p.numel() // tp if sharded else p.numel(), not sharded,
                            partial=id(p) in in_moe or name in plan.head_shared, expert=id(p) in experts))
    n_column = sum(isinstance(s, ColumnParallel) for s in linears.values())
    return BlockParams(tuple(pieces), column_layers=n_column, row_layers=len(linears) - n_column, moe=bool(in_moe))


def _has(block: torch.nn.Module, path: str) -> bool:
    try:
        block.get_submodule(path)
    except AttributeError:
        return False
    return True
