"""Activation recomputation (--recompute): keep less of the forward, recompute it in the backward.

  full       each transformer block keeps only its input; the whole block runs again in the backward
  selective  only the attention core (softmax, dropout, attention over values: Korthikanti et al. 2022; the module
             the family's ParallelPlan names as `attention`, its `core`), whose
             activations grow with the sequence squared while its FLOPs are few, is recomputed

torch.utils.checkpoint (non-reentrant) replays the default generator, so replicated dropout masks come out the same.
Head-sharded attention dropout draws from our own per-tp-rank stream (tensor_parallel.ShardedDropoutRNG), which
torch does not know: `_ReplayShardedStream` records that stream's state when the forward runs and hands it to the
recomputation, restoring the live stream afterwards, so the recomputed masks are the original ones and the stream
goes on exactly as without recomputation (Megatron's CheckpointFunction does the same for its RNG tracker).
"""

from __future__ import annotations

import torch.nn as nn
from torch.utils.checkpoint import checkpoint

from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG

class _ReplayShardedStream:
    """checkpoint's context_fn: (forward context, recomputation context) for one checkpointed call. Both are plain
    re-enterable objects: a split-backward (zero-bubble) schedule recomputes twice, for its input- and its
    weight-gradient pass, and gets the same masks both times. `held`: the block's own forward state (its mixer's
    `recompute_state`, with snapshot() and swap(): DSA's shared selections), replayed the same way."""

    def __init__(self, rng, held=None):
        self.rng = rng if isinstance(rng, ShardedDropoutRNG) else None
        self.held, self.held_state, self.held_live = held, None, None
        self.state = self.live = None

    def __call__(self):
        return _Enter(self.record), _Enter(self.replay, self.restore)

    def record(self):
        if self.rng is not None:
            self.state = self.rng.state.clone()
        if self.held is not None:
            self.held_state = self.held.snapshot()

    def replay(self):
        global _recomputing
        _recomputing += 1
        if self.rng is not None:
            self.live, self.rng.state = self.rng.state, self.state.clone()
        if self.held is not None:
            self.held_live = self.held.swap(self.held_state)

    def restore(self):
        global _recomputing
        _recomputing -= 1
        if self.rng is not None:
            self.rng.state = self.live
        if self.held is not None:
            self.held.swap(self.held_live)


_recomputing = 0  # recomputations under way (nested: a block's and its attention core's)


def recomputing() -> bool:
    """Is a forward running again inside a backward? What observes a forward (routing statistics: moe_balance.py)
    counts each forward once."""
    return _recomputing > 0


class _Enter:
    def __init__(self, on_enter, on_exit=None):
        self.on_enter, self.on_exit = on_enter, on_exit

    def __enter__(self):
        self.on_enter()

    def __exit__(self, *exc):
        if self.on_exit is not None:
            self.on_exit()
        return False


class Checkpointed:
    """`fn` under torch's checkpoint, with the sharded stream replayed. `fn` is what runs in the forward and again in
    the recomputation: --compile (compile.py) compiles it in place, so both run the same code and save the same
    tensors (non-reentrant checkpoint matches them by order)."""

    def __init__(self, fn, rng, held=None):
        self.fn, self.rng, self.held = fn, rng, held

    def __call__(self, *args):
        return checkpoint(self.fn, *args, use_reentrant=False, context_fn=_ReplayShardedStream(self.rng, self.held))


def apply_recompute(stage: nn.Module, mode: str) -> nn.Module:
    """Wrap this stage's blocks (full) or their attention cores (selective), in place."""
    if mode == "none":
        return stage
    plan = stage.parallel_plan()
    for block in stage.blocks.values():
        attn = plan.mixer(block)
        if mode == "full":
            block.forward = Checkpointed(block.forward, attn.sharded_rng, getattr(attn, "recompute_state", None))
        elif mode == "selective":
            attn.core = Checkpointed(attn.core, attn.sharded_rng)
        else:
            raise ValueError(f"unknown recompute mode {mode!r}")
    return stage
