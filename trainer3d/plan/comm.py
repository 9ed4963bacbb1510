"""Analytic communication per rank and optimizer step: what the trainer passes to each collective and send.

bench/comm_volume.py counts the trainer's calls and compares them with `analytic_comm` (bench/README.md has the
per-group formulas). Bytes are payloads, what is passed to the call (all_reduce / broadcast / send: the tensor;
all_gather: the gathered output; reduce_scatter: the input); `ring_factor` converts a payload into the bytes a
rank sends with a ring algorithm. T = micro-batch size × sequence length.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer3d.parallel.pipeline import last_stage_pp_rank
from trainer3d.parallel.tensor_parallel import padded_vocab_size
from trainer3d.plan.candidate import Candidate, persistent_params, rank_params


def ring_factor(op: str, n: int) -> float:
    """All-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, point-to-point 1."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter"):
        return (n - 1) / n
    return 1.0  # send, broadcast


@dataclass(frozen=True)
class Transfer:
    """`calls` calls of one collective with `nbytes` payload each, on a group of `n` ranks."""

    group: str  # tp, pp, dp, embedding, mp, world
    op: str  # all_reduce, all_gather, reduce_scatter, send
    nbytes: float
    calls: int
    n: int
    why: str

    @property
    def payload(self) -> float:
        return self.nbytes * self.calls

    @property
    def wire(self) -> float:
        """Bytes this rank sends with a ring algorithm."""
        return self.payload * ring_factor(self.op, self.n)


def tied_copy_ranks(cand: Candidate) -> tuple[int, int]:
    """The pipeline ranks holding the embedding and the LM head's copy of it."""
    return 0, last_stage_pp_rank(cand.schedule, cand.pp)


def analytic_comm(cand: Candidate, pp_rank: int) -> list[Transfer]:
    """What one rank at pipeline rank `pp_rank` passes to collectives and sends in one optimizer step (training
    only; evaluation and the first step's shape exchange excluded)."""
    cfg, h, m, T, P = cand.cfg, cand.cfg.n_embd, cand.micro_batches, cand.tokens, cand.prec
    stages = cand.stages(pp_rank)
    out: list[Transfer] = []
    if cand.tp > 1:
        layers = sum(s.layers for s in stages)
        out.append(Transfer("tp", "all_reduce", T * h * P.matmul, 2 * layers * m, cand.tp,
                            "2 per block forward: row-parallel attention and MLP projections (b·s·h)"))
        out.append(Transfer("tp", "all_reduce", T * h * P.tp_bwd, 2 * layers * m, cand.tp,
                            "2 per block backward: column-parallel qkv and fc input gradients (b·s·h)"))
        if any(s.first for s in stages):
            out.append(Transfer("tp", "all_reduce", T * h * P.resid, m, cand.tp,
                                "vocab-parallel embedding forward: each rank looks up its vocab slice (b·s·h)"))
        if any(s.last for s in stages):
            out.append(Transfer("tp", "all_reduce", T * h * P.resid, m, cand.tp,
                                "vocab-parallel LM head backward: input gradient of the replicated hidden state (b·s·h)"))
            out.append(Transfer("tp", "all_reduce", T * 4, 3 * m, cand.tp,
                                "vocab-parallel cross-entropy: max, target logit, sum of exps (b·s fp32 each)"))
    if cand.pp > 1:
        ids = {s.stage_id for s in stages}
        # A boundary between two stages on the same rank (the V's turn) is a function call, not a send.
        fwd = sum(1 for s in stages if not s.last and s.stage_id + 1 not in ids)
        bwd = sum(1 for s in stages if not s.first and s.stage_id - 1 not in ids)
        if fwd:
            out.append(Transfer("pp", "send", T * h * P.resid, fwd * m, 2,
                                "activation to the next stage, per micro-batch and boundary (b·s·h)"))
        if bwd:
            out.append(Transfer("pp", "send", T * h * P.resid, bwd * m, 2,
                                "activation gradient to the previous stage, per micro-batch and boundary (b·s·h)"))
    n_local = rank_params(cfg, cand.tp, stages)
    if cand.dp > 1:
        g = P.grad
        if cand.zero_stage == 0:
            out.append(Transfer("dp", "all_reduce", n_local * g, 1, cand.dp,
                                "DDP: one all-reduce of the local gradient per step (no_sync on earlier micro-batches)"))
        else:
            rs_calls = m if cand.zero_stage >= 2 else 1
            out.append(Transfer("dp", "reduce_scatter", n_local * g, rs_calls, cand.dp,
                                "ZeRO: reduce-scatter of the gradient" + (" every micro-batch" if rs_calls > 1 else "")))
            if cand.zero_stage < 3:
                out.append(Transfer("dp", "all_gather", n_local * P.param, 1, cand.dp,
                                    "ZeRO-1/2: all-gather of the updated parameters after the step"))
            else:
                partitioned = n_local - persistent_params(cand, stages)
                out.append(Transfer("dp", "all_gather", partitioned * P.param, 2 * m, cand.dp,
                                    "ZeRO-3: all-gather of the parameters before forward and before backward"))
    first_rank, last_rank = tied_copy_ranks(cand)
    if cand.pp > 1 and first_rank != last_rank and pp_rank in (first_rank, last_rank):
        Vp = padded_vocab_size(cfg.vocab_size, cand.tp)
        shard = Vp // cand.tp * h
        if cand.zero_stage >= 3:
            # the ZeRO engine sums the copies' aligned ZeRO-3 partitions (fp32), not the whole gradient
            out.append(Transfer("embedding", "all_reduce", math.ceil(shard / cand.dp) * 4, 1, 2,
                                "tied wte/lm_head: the two copies' ZeRO-3 gradient partitions summed"))
        else:
            out.append(Transfer("embedding", "all_reduce", shard * (4 if cand.zero_stage else P.grad), 1, 2,
                                "tied wte/lm_head: gradient of the two copies summed (first and last stage)"))
    # Scalars: one per step, not part of the minimum.
    out.append(Transfer("world", "all_reduce", 4, 1, cand.world, "loss for logging (one fp32 scalar)"))
    if cand.zero_stage:  # the ZeRO engine: every rank sums the squares it owns over the whole world
        out.append(Transfer("world", "all_reduce", 4, 1, cand.world, "global grad norm over all shards (one fp32 scalar)"))
    elif cand.tp * cand.pp > 1:
        out.append(Transfer("mp", "all_reduce", 4, 1, cand.tp * cand.pp, "global grad norm (one fp32 scalar)"))
    return [t for t in out if t.n > 1]
