"""Sequence parallelism (--sequence-parallel; Korthikanti et al. 2022, Megatron-LM): outside the tensor-parallel
regions each tp rank holds its shard of the sequence instead of the whole, so the LayerNorms, the dropouts, the
residual stream and the pipeline's stage-boundary tensors shrink by tp.

Applied to a stage after tensor parallelism, in place:
  - the column-parallel layers and the LM head all-gather the sequence (backward: reduce-scatter) and the
    row-parallel layers and the vocab-parallel embedding reduce-scatter it (backward: all-gather), in place of
    the all-reduces (tensor_parallel.parallel_linear / leave_tp); the gathering matmuls save only the shard;
  - the position embedding returns the rows of this rank's positions;
  - dropout on sequence shards draws from the per-tp-rank stream (each shard its own mask), like the head-sharded
    attention dropout;
  - every tp-replicated parameter (LayerNorms, row-parallel biases, positions) sees only its shard's tokens, so
    it is marked `sequence_parallel` and the data-parallel engine sums its gradient over tp before the norm
    (engine.sum_sequence_parallel_grads), which keeps the tp copies identical.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.errors import LayoutError
from trainer3d.model import GPT
from trainer3d.parallel.tensor_parallel import (
    ColumnParallelLinear, RowParallelLinear, ShardedDropoutRNG, VocabParallelEmbedding, VocabParallelHead,
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

    def __init__(self, wpe: nn.Embedding, rank: int, size: int):
        super().__init__()
        self.weight = wpe.weight
        self.rank, self.size = rank, size

    def forward(self, positions: torch.Tensor) -> torch.Tensor:
        return F.embedding(positions.chunk(self.size)[self.rank], self.weight)


def apply_sequence_parallel(stage: GPT, rank: int, size: int, rng: ShardedDropoutRNG) -> GPT:
    """Switch one tensor-parallel stage to sequence shards (see the module docstring), in place."""
    for module in stage.modules():
        if isinstance(module, (ColumnParallelLinear, RowParallelLinear, VocabParallelEmbedding, VocabParallelHead)):
            module.sequence_parallel = True
    if stage.wpe is not None:
        stage.wpe = ShardedPositions(stage.wpe, rank, size)
        stage.drop = ShardedDropout(stage.drop.p, rng)
    for block in stage.h.values():
        block.attn.resid_dropout = ShardedDropout(block.attn.resid_dropout.p, rng)
        block.mlp.dropout = ShardedDropout(block.mlp.dropout.p, rng)
    for p in stage.parameters():
        if getattr(p, "tp_spec", None) is None:
            p.sequence_parallel = True
    return stage


def check_sequence_parallel(tp: int, seq_len: int) -> None:
    if tp == 1:
        raise LayoutError("--sequence-parallel splits the sequence over the tensor-parallel ranks; it needs --tp 2 or "
                          "more (drop the flag at --tp 1).")
    if seq_len % tp:
        raise LayoutError(f"--sequence-parallel splits --seq-len {seq_len} over --tp {tp} ranks; pick a --seq-len "
                          f"divisible by {tp}.")
