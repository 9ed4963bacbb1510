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
from trainer3d.parallel.param_counts import local_params
from trainer3d.plan.candidate import Candidate, persistent_params, rank_params, replicated_params


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

    group: str  # tp, cp, pp, dp (over dp × cp), embedding, mp, world
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


def tensor_parallel_comm(cand: Candidate, stages) -> list[Transfer]:
    """The tp group's collectives. Without sequence parallelism: an all-reduce per row-parallel output (forward) and
    per column-parallel input gradient (backward). With it each all-reduce becomes its two halves, an all-gather and
    a reduce-scatter, moving the same bytes; and each column-parallel layer, which saved only its input's shard,
    gathers it again in the backward for its weight gradient (Korthikanti et al. 2022, section 4.2.2)."""
    h, m, T, P, t = cand.cfg.n_embd, cand.micro_batches, cand.tokens, cand.prec, cand.tp
    layers = sum(s.layers for s in stages)
    lp = local_params(cand.cfg, t)
    rows, cols = lp.row_layers * layers, lp.column_layers * layers  # (GPT-2 and Llama: 2 of each per block)
    first, last = any(s.first for s in stages), any(s.last for s in stages)
    act = T * h * P.matmul  # b·s·h in the matmul dtype: what the tp collectives move
    out: list[Transfer] = []
    if not cand.sequence_parallel:
        out.append(Transfer("tp", "all_reduce", act, rows * m, t,
                            "forward, per row-parallel layer: the attention and MLP output projections (b·s·h)"))
        out.append(Transfer("tp", "all_reduce", act, cols * m, t,
                            "backward, per column-parallel layer: the qkv and MLP-input gradients (b·s·h)"))
        if first:
            out.append(Transfer("tp", "all_reduce", T * h * P.resid, m, t,
                                "vocab-parallel embedding forward: each rank looks up its vocab slice (b·s·h)"))
        if last:
            out.append(Transfer("tp", "all_reduce", act, m, t,
                                "vocab-parallel LM head backward: input gradient of the replicated hidden state (b·s·h)"))
    else:
        n_gather = cols + (1 if last else 0)  # qkv and the MLP input of every block, and the LM head
        out.append(Transfer("tp", "all_gather", act, n_gather * m, t,
                            "forward: the sequence gathered into qkv, the MLP input (and the LM head) (b·s·h)"))
        out.append(Transfer("tp", "reduce_scatter", act, rows * m, t,
                            "forward: row-parallel outputs reduce-scattered onto sequence shards (b·s·h)"))
        out.append(Transfer("tp", "reduce_scatter", act, n_gather * m, t,
                            "backward: input gradients of qkv, the MLP input (and the LM head) reduce-scattered (b·s·h)"))
        out.append(Transfer("tp", "all_gather", act, rows * m, t,
                            "backward: gradients of the row-parallel outputs gathered (b·s·h)"))
        out.append(Transfer("tp", "all_gather", act, n_gather * m, t,
                            "backward: the saved input shards gathered again for the weight gradients (b·s·h)"))
        if first:
            out.append(Transfer("tp", "reduce_scatter", T * h * P.resid, m, t,
                                "vocab-parallel embedding forward: partial lookups reduce-scattered (b·s·h)"))
            out.append(Transfer("tp", "all_gather", T * h * P.resid, m, t,
                                "vocab-parallel embedding backward: the output gradient gathered (b·s·h)"))
        share = cand.dp_cp if cand.zero_stage == 3 else 1  # ZeRO-3 sums each parameter's own dp×cp partition
        out.append(Transfer("tp", "all_reduce", sum(math.ceil(n / share) for n in replicated_params(cand.cfg, stages)) * 4,
                            1, t, "once per step: gradients of the norms, row-parallel biases and positions summed "
                            "(fp32)"))
    if last:
        out.append(Transfer("tp", "all_reduce", T * 4, m, t, "vocab-parallel cross-entropy: the max (b·s fp32)"))
        out.append(Transfer("tp", "all_reduce", 2 * T * 4, m, t,
                            "vocab-parallel cross-entropy: target logit and sum of exps, in one call (2·b·s fp32)"))
    return out


def context_parallel_comm(cand: Candidate, stages) -> list[Transfer]:
    """The cp group's collectives (parallel/context_parallel.py): every block's attention all-gathers this rank's
    keys and values (its kv heads, /t under tp) into the whole sequence's, and its backward reduce-scatters their
    gradients; full recomputation gathers them once more."""
    layers = sum(s.layers for s in stages)
    gathered = cand.cp * cand.tokens * 2 * cand.cfg.kv_width // cand.tp * cand.prec.matmul
    calls = layers * cand.micro_batches
    return [
        Transfer("cp", "all_gather", gathered, calls * (2 if cand.recompute else 1), cand.cp,
                 "attention's keys and values gathered over cp, per block" + (" (again when recomputed)"
                                                                             if cand.recompute else "")),
        Transfer("cp", "reduce_scatter", gathered, calls, cand.cp,
                 "their gradients reduce-scattered back to their ranks, per block"),
    ]


def analytic_comm(cand: Candidate, pp_rank: int) -> list[Transfer]:
    """What one rank at pipeline rank `pp_rank` passes to collectives and sends in one optimizer step (training
    only; evaluation and the first step's shape exchange excluded)."""
    cfg, h, m, T, P = cand.cfg, cand.cfg.n_embd, cand.micro_batches, cand.tokens, cand.prec
    stages = cand.stages(pp_rank)
    out: list[Transfer] = []
    if cand.tp > 1:
        out += tensor_parallel_comm(cand, stages)
    if cand.pp > 1:
        ids = {s.stage_id for s in stages}
        # A boundary between two stages on the same rank (the V's turn) is a function call, not a send.
        fwd = sum(1 for s in stages if not s.last and s.stage_id + 1 not in ids)
        bwd = sum(1 for s in stages if not s.first and s.stage_id - 1 not in ids)
        sent = T // (cand.tp if cand.sequence_parallel else 1) * h * P.send  # sequence parallelism: a shard
        if fwd:
            out.append(Transfer("pp", "send", sent, fwd * m, 2,
                                "activation to the next stage, per micro-batch and boundary (b·s·h, /t with SP)"))
        if bwd:
            out.append(Transfer("pp", "send", sent, bwd * m, 2,
                                "activation gradient to the previous stage, per micro-batch and boundary (b·s·h, /t with SP)"))
    if cand.cp > 1:
        out += context_parallel_comm(cand, stages)
    n_local = rank_params(cfg, cand.tp, stages)
    dp = cand.dp_cp  # gradients are reduced, and ZeRO partitions, over dp × cp
    if dp > 1:
        g = P.grad
        if cand.zero_stage == 0:
            out.append(Transfer("dp", "all_reduce", n_local * g, 1, dp,
                                "DDP: one all-reduce of the local gradient per step (no_sync on earlier micro-batches)"))
        else:
            rs_calls = m if cand.zero_stage >= 2 else 1
            out.append(Transfer("dp", "reduce_scatter", n_local * g, rs_calls, dp,
                                "ZeRO: reduce-scatter of the gradient" + (" every micro-batch" if rs_calls > 1 else "")))
            if cand.zero_stage < 3:
                out.append(Transfer("dp", "all_gather", n_local * P.param, 1, dp,
                                    "ZeRO-1/2: all-gather of the updated parameters after the step"))
            else:
                partitioned = n_local - persistent_params(cand, stages)
                out.append(Transfer("dp", "all_gather", partitioned * P.param, 2 * m, dp,
                                    "ZeRO-3: all-gather of the parameters before forward and before backward"))
    first_rank, last_rank = tied_copy_ranks(cand)
    if cfg.tie_embeddings and cand.pp > 1 and first_rank != last_rank and pp_rank in (first_rank, last_rank):
        Vp = padded_vocab_size(cfg.vocab_size, cand.tp)
        shard = Vp // cand.tp * h
        if cand.zero_stage >= 3:
            # the ZeRO engine sums the copies' aligned ZeRO-3 partitions (fp32), not the whole gradient
            out.append(Transfer("embedding", "all_reduce", math.ceil(shard / dp) * 4, 1, 2,
                                "tied embedding/head: the two copies' ZeRO-3 gradient partitions summed"))
        else:
            out.append(Transfer("embedding", "all_reduce", shard * (4 if cand.zero_stage else P.grad), 1, 2,
                                "tied embedding/head: gradient of the two copies summed (first and last stage)"))
    # Scalars: one per step, not part of the minimum.
    out.append(Transfer("world", "all_reduce", 8, 1, cand.world,
                        "loss for logging and the count of stop requests (two fp32 scalars)"))
    if cand.zero_stage:  # the ZeRO engine: every rank sums the squares it owns over the whole world
        out.append(Transfer("world", "all_reduce", 4, 1, cand.world, "global grad norm over all shards (one fp32 scalar)"))
    elif cand.tp * cand.pp > 1:
        out.append(Transfer("mp", "all_reduce", 4, 1, cand.tp * cand.pp, "global grad norm (one fp32 scalar)"))
    return [t for t in out if t.n > 1]
