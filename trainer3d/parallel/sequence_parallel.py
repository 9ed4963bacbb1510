"""Sequence parallelism (--sequence-parallel; Korthikanti et al. 2022, Megatron-LM): outside the tensor-parallel
regions each tp rank holds its shard of the sequence instead of the whole, so the LayerNorms, the dropouts, the
residual stream and the pipeline's stage-boundary tensors shrink by tp.

Applied to a stage after tensor parallelism, in place:
  - the column-parallel layers, the LM head and the tp entries (tensor_parallel.TPEntry: MLA's rope key) all-gather
    the sequence (backward: reduce-scatter) and the row-parallel layers and the vocab-parallel embedding
    reduce-scatter it (backward: all-gather), in place of
    the all-reduces (tensor_parallel.parallel_linear / leave_tp); the gathering matmuls save only the shard;
  - a learned position embedding (the family's ParallelPlan.positions) returns the rows of this rank's positions;
    rotary positions need nothing: attention runs on the gathered sequence;
  - every nn.Dropout of the stage works on sequence shards and draws from the per-tp-rank stream (each shard its own
    mask), like the head-sharded attention dropout (inside SDPA: no nn.Dropout);
  - every tp-replicated parameter (norms, row-parallel biases, positions) sees only its shard's tokens, so
    it is marked `tp_partial` and the data-parallel engine sums its gradient over tp before the norm
    (engine.sum_tp_partial_grads), which keeps the tp copies identical; but a module that reads the whole sequence
    (ParallelPlan.whole_sequence: DSA's indexer, its detached inputs all-gathered) keeps whole gradients.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.errors import LayoutError
from trainer3d.models.interface import CausalLM, find_module
from trainer3d.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, ShardedDropoutRNG, TPEntry, VocabParallelEmbedding, VocabParallelHead,
    WholeSequenceEntry,
)


class ShardedDropout(nn.Module):
    """nn.Dropout drawing from the per-tp-rank stream: activations here are this rank's shard of the sequence."""

    def __init__(self, p: float, rng: ShardedDropoutRNG):
        super().__init__()
        self.p, self.rng = p, rng

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.training or self.p == 0.0:
            return x
        with self.rng():
            return F.dropout(x, self.p, training=True)


class ShardedPositions(nn.Module):
    """The position embedding (same parameter, `weight`) returning the rows of this rank's sequence shard."""

    def __init__(self, positions: nn.Embedding, rank: int, size: int):
        super().__init__()
        self.weight = positions.weight
        self.rank, self.size = rank, size

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions.chunk(self.size, dim=-1)[self.rank], self.weight)


def apply_sequence_parallel(stage: CausalLM, rank: int, size: int, rng: ShardedDropoutRNG) -> CausalLM:
    """Switch one tensor-parallel stage to sequence shards (see the module docstring), in place."""
    for module in stage.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead,
                               TPEntry, WholeSequenceEntry)):
            module.sequence_parallel = True
    plan = stage.parallel_plan()
    positions = plan.positions
    if positions is not None and getattr(stage, positions) is not None:
        setattr(stage, positions, ShardedPositions(getattr(stage, positions), rank, size))
    dropouts = [(name, m) for name, m in stage.named_modules() if type(m) is nn.Dropout]
    for name, m in dropouts:
        stage.set_submodule(name, ShardedDropout(m.p, rng))
    whole = set()  # the parameters of modules that read the whole sequence
    for block in [*stage.blocks.values(), *stage.extra_blocks()]:
        for path in plan.whole_sequence.values():
            module = find_module(block, path)
            whole |= {id(p) for p in module.parameters()} if module is not None else set()
    for p in stage.parameters():
        if getattr(p, "tp_spec", None) is None and id(p) not in whole:
            p.tp_partial = True
    return stage


def check_sequence_parallel(tp: int, seq_len: int, cp: int = 1) -> None:
    """A rank's tokens (seq_len / cp under context parallelism) must split over tp."""
    if tp == 1:
        raise LayoutError("--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs --tp 2 or "
                          "more (drop the flag at --tp 1).")
    problem = sequence_split_problem(tp, seq_len, cp)
    if problem is not None:
        raise LayoutError(problem)


def sequence_split_problem(tp: int, seq_len: int, cp: int = 1) -> str | None:
    """THE rule of a sequence shard (checked here and by the planner): a rank's seq_len / cp tokens split over tp.
    The sentence naming the fix, or None."""
    if cp > 1 and (seq_len // cp) % tp:
        return (f"--sequence-parallel splits each cp rank's {seq_len // cp} tokens over --tp {tp}; pick a --seq-len "
                f"divisible by {cp * tp}.")
    if seq_len % tp:
        return f"--sequence-parallel splits --seq-len {seq_len} over --tp {tp} ranks; pick a --seq-len divisible by {tp}."
    return None
