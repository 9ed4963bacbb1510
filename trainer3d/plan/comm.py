"""Analytic communication per rank and optimizer step: what the trainer passes to each collective and send.

bench/comm_volume.py counts the trainer's calls and compares them with `analytic_comm` (bench/comm_volume.md has the
per-group formulas). Bytes are payloads, what is passed to the call (all_reduce / broadcast / send: the tensor;
all_gather: the gathered output; reduce_scatter: the input); `ring_factor` converts a payload into the bytes a
rank sends with a ring algorithm. T = micro-batch size × sequence length.

A mixture of experts adds, per MoE layer and micro-batch, expert parallelism's all-to-alls over the ep group (the
count exchange, then the tokens' dispatch and combine in the forward and their gradients' in the backward, again when
recomputed), assuming routing balanced over the ep ranks; its experts' gradients are reduced over edp (dp×cp/ep)
instead of dp×cp (DDP's all-reduce, ZeRO's reduce-scatter); at tp > 1 the gradients of its router and experts, which each tp rank holds a share of, are summed
over tp once per step, and without sequence parallelism its tokens are split over tp and gathered back.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from trainer3d.parallel.pipeline import last_stage_pp_rank
from trainer3d.parallel.tensor_parallel import padded_vocab_size
from trainer3d.parallel.param_counts import embedding_on_last, local_params
from trainer3d.plan.candidate import (
    Candidate, expert_params, persistent_params, tp_summed_pieces, trainable_params,
)


def ring_factor(op: str, n: int) -> float:
    """All-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, all-to-all (n-1)/n (the rest of the payload goes
    to the other ranks), point-to-point 1."""
    if n <= 1:
        return 0.0
    if op == "all_reduce":
        return 2 * (n - 1) / n
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return (n - 1) / n
    return 1.0  # send, broadcast


def ring_steps(op: str, n: int) -> int:
    """The messages one call sends one after another with a ring algorithm (what a per-message latency multiplies):
    all-reduce 2(n-1), all-gather, reduce-scatter and all-to-all n-1, point-to-point 1."""
    if n <= 1:
        return 0
    if op == "all_reduce":
        return 2 * (n - 1)
    if op in ("all_gather", "reduce_scatter", "all_to_all"):
        return n - 1
    return 1


@dataclass(frozen=True)
class Transfer:
    """`calls` calls of one collective with `nbytes` payload each, on a group of `n` ranks."""

    group: str  # tp, cp, pp, dp (over dp × cp), ep, edp (over dp × cp / ep), embedding, mp, world
    op: str  # all_reduce, all_gather, reduce_scatter, all_to_all, send
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
    gathers it again in the backward for its weight gradient (Korthikanti et al. 2022, section 4.2.2). An MoE block's
    only tp linears are its attention's; without sequence parallelism its tokens are split over tp and gathered back."""
    h, m, T, P, t = cand.cfg.n_embd, cand.micro_batches, cand.tokens, cand.prec, cand.tp
    kinds = [bk for s in stages for bk in local_params(cand.cfg, t).kinds(s.blocks)]
    rows = sum(b.row_layers * k for b, k in kinds)  # (GPT-2 and Llama: 2 of each per block, an MoE block 1)
    cols = sum(b.column_layers * k for b, k in kinds)
    moe_layers = sum(k for b, k in kinds if b.moe)
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
        if moe_layers:  # parallel/expert_parallel.TokenSplit (the output in the norm's dtype, the residual's)
            out.append(Transfer("tp", "all_gather", T * h * P.resid, 2 * moe_layers * m, t,
                                "MoE token split: the output gathered in the forward, its gradient in the backward "
                                "(b·s·h)"))
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
        width = getattr(cand.cfg, "sp_whole_sequence_width", None)  # (the family's: DSA's indexer inputs)
        widths = [w for s in stages for b in s.blocks if (w := width(b))] if width else []
        if widths:
            out.append(Transfer("tp", "all_gather", T * widths[0] * P.resid, len(widths) * m, t,
                                "forward, per block reading the whole sequence (a DSA indexer): its detached inputs "
                                "gathered (b·s·width)"))
        if first:
            out.append(Transfer("tp", "reduce_scatter", T * h * P.resid, m, t,
                                "vocab-parallel embedding forward: partial lookups reduce-scattered (b·s·h)"))
            out.append(Transfer("tp", "all_gather", T * h * P.resid, m, t,
                                "vocab-parallel embedding backward: the output gradient gathered (b·s·h)"))
    out += _tp_summed_grads(cand, stages)
    if last:
        out.append(Transfer("tp", "all_reduce", T * 4, m, t, "vocab-parallel cross-entropy: the max (b·s fp32)"))
        out.append(Transfer("tp", "all_reduce", 2 * T * 4, m, t,
                            "vocab-parallel cross-entropy: target logit and sum of exps, in one call (2·b·s fp32)"))
    return out


def _tp_summed_grads(cand: Candidate, stages) -> list[Transfer]:
    """Once per step, the gradients tp ranks hold shares of summed in one fp32 all-reduce (engine.sum_tp_partial_grads:
    norms, row-parallel biases and positions under SP; an MoE's router and experts at every tp > 1)."""
    summed = tp_summed_pieces(cand, stages)
    if not summed:
        return []

    def share(expert: bool) -> int:  # ZeRO-3 sums each parameter's own partition: an expert's over edp, else dp×cp
        return (cand.dp_cp // cand.ep if expert else cand.dp_cp) if cand.zero_stage == 3 else 1

    return [Transfer("tp", "all_reduce", sum(math.ceil(n / share(e)) for n, e in summed) * 4, 1, cand.tp,
                     "once per step: the gradients tp ranks hold shares of, summed (fp32)")]


def context_parallel_comm(cand: Candidate, stages) -> list[Transfer]:
    """The cp group's collectives (parallel/context_parallel.py): every block's attention all-gathers this rank's
    keys and values (its kv heads, /t under tp; or what the family gathers instead, `cp_gather_width`: MLA's latent)
    into the whole sequence's, and its backward reduce-scatters their gradients; full recomputation gathers them once
    more."""
    layers = sum(s.layers for s in stages)
    width = getattr(cand.cfg, "cp_gather_width", None)
    width = width(cand.tp, cand.sequence_parallel) if width else 2 * cand.cfg.kv_width // cand.tp
    gathered = cand.cp * cand.tokens * width * cand.prec.matmul
    calls = layers * cand.micro_batches
    return [
        Transfer("cp", "all_gather", gathered, calls * (2 if cand.recompute else 1), cand.cp,
                 "attention's keys and values gathered over cp, per block" + (" (again when recomputed)"
                                                                             if cand.recompute else "")),
        Transfer("cp", "reduce_scatter", gathered, calls, cand.cp,
                 "their gradients reduce-scattered back to their ranks, per block"),
    ]


def expert_parallel_comm(cand: Candidate, stages) -> list[Transfer]:
    """The ep group's all-to-alls (parallel/expert_parallel.AllToAllDispatch), per MoE layer and micro-batch: the
    tokens per expert (int64), then the rows of this rank's tokens (the 1/t each tp rank routes), k per token in the
    matmul dtype, to their experts' ranks and back; the backward sends the rows' gradients both ways, and a recomputed
    forward exchanges again."""
    spec, P = cand.cfg.moe, cand.prec
    lp = local_params(cand.cfg, cand.tp)
    layers = sum(k for s in stages for b, k in lp.kinds(s.blocks) if b.moe)
    calls = layers * cand.micro_batches * (2 if cand.recompute else 1)  # forward passes
    rows = cand.tokens / cand.tp * spec.top_k * cand.cfg.n_embd * P.matmul
    return [
        Transfer("ep", "all_to_all", spec.n_experts * 8, calls, cand.ep, "MoE: tokens per expert exchanged (int64)"),
        Transfer("ep", "all_to_all", rows, 2 * calls, cand.ep,
                 "MoE forward: the tokens' rows dispatched to their experts and combined back (k·b·s·h/t)"),
        Transfer("ep", "all_to_all", rows, 2 * layers * cand.micro_batches, cand.ep,
                 "MoE backward: the rows' gradients, both ways (k·b·s·h/t)"),
    ]


def analytic_comm(cand: Candidate, pp_rank: int) -> list[Transfer]:
    """What one rank at pipeline rank `pp_rank` passes to collectives and sends in one optimizer step (training
    only; evaluation and the first step's shape exchange excluded)."""
    h, m, T, P = cand.cfg.n_embd, cand.micro_batches, cand.tokens, cand.prec
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
    if cand.ep > 1:
        out += expert_parallel_comm(cand, stages)
    out += data_parallel_comm(cand, stages)
    out += _tied_and_scalars(cand, pp_rank)
    return [t for t in out if t.n > 1]


def data_parallel_comm(cand: Candidate, stages) -> list[Transfer]:
    """Gradients reduced over dp × cp (DDP's all-reduce, ZeRO's reduce-scatter and all-gather); under ep the experts
    over their edp group instead (DDP: all-reduced after the backward, parallel/ddp.py; ZeRO: their own engine's
    partitions, zero/experts.py)."""
    n_local = trainable_params(cand, stages)  # (under LoRA the adapters' only, the experts frozen)
    out: list[Transfer] = []
    if cand.ep > 1 and cand.lora is None:
        experts = expert_params(cand.cfg, cand.tp, stages, cand.ep)
        n_local -= experts
        out += _reduction(cand, "edp", cand.edp, experts, 0)
    return out + _reduction(cand, "dp", cand.dp_cp, n_local, persistent_params(cand, stages))


def _reduction(cand: Candidate, group: str, size: int, n: int, persistent: int) -> list[Transfer]:
    """What one gradient reduction over `size` ranks costs a step: DDP's all-reduce, or ZeRO's reduce-scatter (every
    micro-batch at stage 2-3) and all-gather of the parameters (once after the step at stage 1-2; before forward and
    backward of every micro-batch at stage 3, the `persistent` small tensors excepted)."""
    if size <= 1 or n == 0:
        return []
    P, m, g = cand.prec, cand.micro_batches, cand.prec.grad
    if cand.zero_stage == 0:
        return [Transfer(group, "all_reduce", n * g, 1, size,
                         "DDP: one all-reduce of the local gradient per step (no_sync on earlier micro-batches)")]
    rs_calls = m if cand.zero_stage >= 2 else 1
    out = [Transfer(group, "reduce_scatter", n * g, rs_calls, size,
                    "ZeRO: reduce-scatter of the gradient" + (" every micro-batch" if rs_calls > 1 else ""))]
    if cand.zero_stage < 3:
        out.append(Transfer(group, "all_gather", n * P.param, 1, size,
                            "ZeRO-1/2: all-gather of the updated parameters after the step"))
    else:
        out.append(Transfer(group, "all_gather", (n - persistent) * P.param, 2 * m, size,
                            "ZeRO-3: all-gather of the parameters before forward and before backward"))
    return out


def _tied_and_scalars(cand: Candidate, pp_rank: int) -> list[Transfer]:
    """The tied embedding's two copies summed, and the step's scalars."""
    cfg, P, dp = cand.cfg, cand.prec, cand.dp_cp
    out: list[Transfer] = []
    first_rank, last_rank = tied_copy_ranks(cand)
    if embedding_on_last(cfg) and cand.pp > 1 and first_rank != last_rank and pp_rank in (first_rank, last_rank):
        Vp = padded_vocab_size(cfg.vocab_size, cand.tp)
        shard = Vp // cand.tp * cfg.n_embd
        if cand.zero_stage >= 3:
            # the ZeRO engine sums the copies' aligned ZeRO-3 partitions (fp32), not the whole gradient
            out.append(Transfer("embedding", "all_reduce", math.ceil(shard / dp) * 4, 1, 2,
                                "tied embedding/head: the two copies' ZeRO-3 gradient partitions summed"))
        else:
            out.append(Transfer("embedding", "all_reduce", shard * (4 if cand.zero_stage else P.grad), 1, 2,
                                "tied embedding/head: gradient of the two copies summed (first and last stage)"))
    # Scalars: one per step, not part of the minimum.
    out.append(Transfer("world", "all_reduce", 4 * (2 + cand.world), 1, cand.world,
                        "loss for logging, the count of stop requests and each rank's step time (fp32)"))
    if cand.zero_stage:  # the ZeRO engine: every rank sums the squares it owns over the whole world
        out.append(Transfer("world", "all_reduce", 4, 1, cand.world, "global grad norm over all shards (one fp32 scalar)"))
    elif cand.tp * cand.pp > 1:
        out.append(Transfer("mp", "all_reduce", 4, 1, cand.tp * cand.pp, "global grad norm (one fp32 scalar)"))
    return out
