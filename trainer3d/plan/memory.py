"""Device memory per rank: model states (ZeRO paper), saved activations (Korthikanti et al.), the buffers and
transients trainer3d and DeepSpeed add. bench/memory.py checks it against measured peaks (within 10%); the
derivation of each term is in bench/memory.md.

A mixture of experts adds (tests/test_plan.py measures the block's saved tensors): its experts' state divided by ep
and left out of DDP's buckets at ep > 1 (reduced over edp in flat buckets after the backward); per token the family's
activation formula (each token's k copies through experts of width I, the routing scores); per MoE layer, through
the schedule, the bf16 copies of the rank's experts that autocast's step casts once (models/moe.py); in a
block's backward the rows exchanged by the all-to-all; and the sum over tp of the gradients each tp rank holds a share
of (the router's and experts' at every tp > 1).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import inspect

from trainer3d.parallel.cross_entropy import LOSS_CHUNK_ELEMENTS
from trainer3d.parallel.ddp import all_reduce_grads
from trainer3d.parallel.param_counts import BlockParams, local_params
from trainer3d.parallel.tensor_parallel import padded_vocab_size
from trainer3d.zero.config import auto_buckets
from trainer3d.plan.candidate import (
    Candidate, Stage, block_params, expert_params, lora_expert_params, max_param_tensor, partition_params,
    matmul_params, persistent_params, rank_params, trainable_params, tp_summed_params,
)

EXPERT_BUCKET = inspect.signature(all_reduce_grads).parameters["bucket_elems"].default  # DDP's experts over edp


def layer_activation_bytes(cand: Candidate) -> float:
    """Bytes one block saves for backward per micro-batch: per token, the family's LayerActivations (GPT-2: 4h
    replicated, the two LayerNorms' inputs and outputs, and their statistics, split by t under sequence parallelism;
    12h/t sharded; flash attention's log-sum-exp). No s×s scores (scaled_dot_product_attention never stores them) and
    no dropout masks (dropout 0). Under context parallelism a rank has 1/cp of the tokens, and attention also keeps
    the keys and values it gathered, the whole sequence's (cp × its own; bench/long_context.py measures it). An
    attention that masks keys itself keeps per (query, key) pair what LayerActivations.pair_* say: each rank's
    queries (the whole of its cp share, sequence parallelism or not) against the whole sequence's keys."""
    A, t, P = cand.cfg.layer_activations(), cand.tp, cand.prec
    replicated = (A.resid * P.resid + A.matmul * P.matmul + A.fp32 * 4) / (t if cand.sequence_parallel else 1)
    gathered_kv = cand.cp * 2 * cand.cfg.kv_width // t * P.matmul if cand.cp > 1 else 0
    pairs = cand.tokens * cand.seq_len * (A.pair_matmul * P.matmul + A.pair_bytes)
    return cand.tokens * (replicated + A.sharded_matmul // t * P.matmul + A.sharded_fp32 // t * 4 + gathered_kv) + pairs


def hidden_tokens(cand: Candidate) -> float:
    """Tokens of a micro-batch's hidden state on one rank: the sequence shard under sequence parallelism."""
    return cand.tokens / (cand.tp if cand.sequence_parallel else 1)


def mtp_depth(cfg) -> int:
    """The model's multi-token prediction modules (DeepSeek-V3's D; 0 where it has none or the run builds none): the
    last stage holds 1 + D logits."""
    return getattr(cfg, "mtp_layers", 0) or 0


def stage_activation_bytes(cand: Candidate, st: Stage) -> float:
    """Bytes one stage holds per micro-batch in flight: saved activations plus the stage output that torch's
    PipelineStage keeps until that micro-batch's backward (the hidden state, or the logits on the last stage).
    With recomputation each block keeps only its input."""
    h, T, P, t = cand.cfg.n_embd, cand.tokens, cand.prec, cand.tp
    Th = hidden_tokens(cand) * h
    Vp = padded_vocab_size(cand.cfg.vocab_size, t)
    per_layer = Th * P.resid if cand.recompute else layer_activation_bytes(cand)
    total = st.layers * per_layer
    if st.first:
        total += T * (8 + (9 if t > 1 else 0))  # token ids (int64); under TP also the shard mask and local ids
    if st.last:
        total += Th * (P.resid + P.matmul) + T * 8  # final norm input, head input (shards under SP), the CE's targets
        total += T * (4 + 4 + 1)  # the CE's row scale and target exponential (fp32), its outside-the-shard mask
        # the logits (then their exponentials, then their gradient) until backward: the next token's and each MTP
        # depth's, whose module also keeps a block's activations
        D = mtp_depth(cand.cfg)
        total += (1 + D) * T * Vp // t * P.matmul + D * per_layer
    else:
        total += Th * P.send  # the stage output (cast for the wire), held until backward
    return total


def expert_weight_copies(cand: Candidate, blocks: range) -> float:
    """Under autocast (fp32 parameters, bf16 matmuls) each MoE layer casts this rank's experts to the matmul dtype
    itself (autocast does not reach the grouped matmul), once a step (models/moe.expert_casts_cached, as autocast
    caches a dense linear's cast), and the copies live through the schedule, whatever the micro-batches in flight.
    A LoRA base holds them in that dtype already (parallel/lora.hold_base_in): no copy."""
    P = cand.prec
    if P.param == P.matmul or cand.lora is not None:
        return 0.0
    return sum(b.experts(cand.ep) * k for b, k in local_params(cand.cfg, cand.tp).kinds(blocks)) * P.matmul


def mlp_backward_bytes(cand: Candidate, block: BlockParams) -> float:
    """What a block's MLP holds at once in its backward beyond the saved activations: the gradients w.r.t. its
    activation's output and input (a dense MLP: ffn/t wide per token; an MoE: k·I per token for the 1/t of the tokens
    each tp rank routes) and, under expert parallelism, the rows the all-to-all sends and receives (k·h each)."""
    cfg, T, t, P = cand.cfg, cand.tokens, cand.tp, cand.prec
    if not block.moe:
        return 2 * T * cfg.ffn_hidden // t * P.matmul
    k, width = cfg.moe.top_k, cfg.moe.expert_hidden
    exchanged = 2 * k * cfg.n_embd if cand.ep > 1 else 0
    return T / t * (2 * k * width + exchanged) * P.matmul


def inflight_microbatches(cand: Candidate, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its whole share of the
    model (a chunk of an interleaved schedule counts 1/v), following torch's schedules' warmup rules."""
    p, r, m = cand.pp, pp_rank, cand.micro_batches
    if p == 1:
        return 1.0  # gradient accumulation runs micro-batches one at a time
    s = cand.schedule
    if s == "gpipe":
        return float(m)
    if s == "1f1b":
        return float(min(p - r, m))
    if s == "looped-bfs":
        return float(m)
    if s in ("interleaved-1f1b", "interleaved-zb"):
        v = cand.virtual_stages
        rounds = max(1, m // p)
        per_round = m // rounds
        factor = 2 if s == "interleaved-1f1b" else 1
        warmup = min((v - 1) * per_round + factor * (p - 1 - r), m * v)
        return min(warmup + 1, m * v) / v
    if s in ("zbv", "dualpipev"):
        # chunk 0: 2(p-r)-1 + r forwards before its first backward; chunk 1: r + 1 (torch's ZBV warmup)
        return min(2 * p - r - 1 + r + 1, 2 * m) / 2
    raise ValueError(f"unknown schedule {s!r}")


@dataclass
class MemoryEstimate:
    """Bytes per rank. `peak` is device memory; `offloaded` and `host_buffers` live in host memory."""

    params: float = 0.0
    grads: float = 0.0
    optimizer: float = 0.0
    ddp_buckets: float = 0.0
    zero_buffers: float = 0.0
    pipeline_buffers: float = 0.0
    activations: float = 0.0  # at the peak: in-flight micro-batches × per-micro-batch activations
    transient: float = 0.0  # largest short-lived temporary on top (cross-entropy, optimizer step, recompute)
    offloaded: float = 0.0  # model state moved to the host (optimizer, fp32 gradient partition, parameters)
    host_buffers: float = 0.0  # DeepSpeed's host staging buffers for offload
    inflight: float = 0.0
    n_params: int = 0
    peak: float = 0.0  # the most device memory held at any point of a step
    notes: list[str] = field(default_factory=list)

    @property
    def model_states(self) -> float:
        return self.params + self.grads + self.optimizer

    @property
    def static(self) -> float:
        """Held between steps: model states, DDP's bucket copy of the gradients, pipeline receive buffers."""
        return self.model_states + self.ddp_buckets + self.zero_buffers + self.pipeline_buffers


def estimate_memory(cand: Candidate, pp_rank: int) -> MemoryEstimate:
    """Device memory of one rank at pipeline rank `pp_rank`: what it holds through the step, then the step's peak."""
    stages = cand.stages(pp_rank)
    e = MemoryEstimate(n_params=rank_params(cand.cfg, cand.tp, stages, cand.ep))
    _model_states(e, cand, stages)
    _pipeline_buffers(e, cand, stages)
    _step_peak(e, cand, pp_rank, stages)
    return e


def _model_states(e: MemoryEstimate, cand: Candidate, stages: list[Stage]) -> None:
    """Model states (ZeRO paper): stage 1 partitions the optimizer state over dp, stage 2 also the gradients,
    stage 3 also the parameters (under ep the experts over edp). DDP keeps Adam's two moments next to fp32 parameters; DeepSpeed keeps
    K = 12 bytes per parameter (fp32 master + moments) even in fp32, and an fp32 gradient partition."""
    P, cfg, h, n = cand.prec, cand.cfg, cand.cfg.n_embd, e.n_params
    z, dp = cand.zero_stage, cand.dp_cp  # ZeRO partitions over dp × cp
    if cand.lora is not None:  # LoRA: a frozen base (no gradient, no optimizer state) and its adapters
        _lora_states(e, cand, stages)
        return
    zero_bucket = cand.zero_bucket_elems
    if zero_bucket is None:
        zero_bucket = auto_buckets(h)["reduce_bucket_size"]
    if z == 0:
        e.params, e.grads, e.optimizer = n * P.param, n * P.grad, n * P.optim
        if dp > 1:  # DDP's flat buckets are a second copy of the gradients (experts split over ep are not in them)
            e.ddp_buckets = (n - (expert_params(cfg, cand.tp, stages, cand.ep) if cand.ep > 1 else 0)) * P.grad
        return
    part = partition_params(cand, stages)
    e.params = (part if z >= 3 else n) * P.param
    e.grads = part * 4
    e.optimizer = part * 12
    largest = max_param_tensor(cfg, cand.tp, stages, cand.ep)
    if cand.offload_optimizer:  # ZeRO-Offload: master, moments and the fp32 gradient partition on the host
        e.offloaded += e.optimizer + e.grads
        e.optimizer = e.grads = 0.0
        if z < 3:
            # DeepSpeed's staging buffers (stage_1_and_2.py): a 16-bit copy of the parameter partition and a
            # largest-parameter gradient buffer on the host, the same gradient buffer and the gradient
            # partition on the device
            e.host_buffers += part * P.param + largest * P.grad
            e.zero_buffers += largest * P.grad + part * P.grad
    if cand.offload_params and z >= 3:
        e.offloaded += e.params
        e.params = 0.0
    if z >= 3:
        e.params += persistent_params(cand, stages) * P.param  # small tensors ZeRO-3 never partitions
        # working set: at most two blocks' parameters gathered (stage3_max_live_parameters, as the planner
        # writes it), plus the largest tensor, which is gathered whole whatever the bound
        e.zero_buffers += (min(n, 2 * block_params(cfg, cand.tp, ep=cand.ep)) + largest) * P.param
    if dp > 1:
        e.zero_buffers += min(zero_bucket, n) * P.grad  # DeepSpeed's reduce (ipg) bucket


def _lora_states(e: MemoryEstimate, cand: Candidate, stages: list[Stage]) -> None:
    """A LoRA run's: the base as the engine holds it (DDP: whole, its matmul weights in the compute dtype, the rest
    as the precision keeps parameters; ZeRO: in the compute dtype, partitioned at stage 3), the adapters with
    gradients and AdamW state, partitioned as ZeRO partitions them."""
    P, z, n, t = cand.prec, cand.zero_stage, e.n_params, trainable_params(cand, stages)
    if z == 0:
        held = matmul_params(cand.cfg, cand.tp, stages, cand.ep)
        e.params = held * P.matmul + (n - held + t) * P.param
        e.grads, e.optimizer = t * P.grad, t * P.optim
        e.ddp_buckets = t * P.grad if cand.dp_cp > 1 else 0.0
        return
    e.params = (partition_params(cand, stages) if z >= 3 else n) * P.param + t * P.param
    experts = lora_expert_params(cand, stages)  # (partitioned over edp by the experts' own engine)
    part = (t - experts) / cand.dp_cp + experts / cand.edp
    e.grads, e.optimizer = part * 4, part * 12
    if z >= 3:
        e.zero_buffers += 2 * block_params(cand.cfg, cand.tp, ep=cand.ep) * P.param
    if cand.offload_optimizer:
        e.offloaded += e.optimizer + e.grads
        e.optimizer = e.grads = 0.0


def _pipeline_buffers(e: MemoryEstimate, cand: Candidate, stages: list[Stage]) -> None:
    """torch's PipelineStage allocates one receive buffer per micro-batch, for the activation on every non-first
    stage and for its gradient on every non-last stage."""
    if cand.pp == 1:
        return
    per_buffer = cand.micro_batches * hidden_tokens(cand) * cand.cfg.n_embd * cand.prec.send
    ids = {s.stage_id for s in stages}
    for s in stages:
        if not s.first and s.stage_id - 1 not in ids:
            e.pipeline_buffers += per_buffer
        if not s.last and s.stage_id + 1 not in ids:
            e.pipeline_buffers += per_buffer


def _step_peak(e: MemoryEstimate, cand: Candidate, pp_rank: int, stages: list[Stage]) -> None:
    """Activations of the micro-batches in flight, the largest transient on top of them (during the schedule or the
    optimizer step), and the peak over what the rank holds through the step."""
    P, m, n, z = cand.prec, cand.micro_batches, e.n_params, cand.zero_stage
    # activations: in-flight micro-batches × what a micro-batch keeps on this rank
    per_mb = sum(stage_activation_bytes(cand, s) for s in stages)
    k = inflight_microbatches(cand, pp_rank)
    e.inflight = k
    # A micro-batch beyond the in-flight window (or a later accumulation micro-batch) runs after the first
    # backward has allocated the gradients; the first ones run before (zero_grad(set_to_none) at step start).
    later = m > k or (cand.pp == 1 and m > 1)
    # gradients held while later micro-batches run: DDP and ZeRO-1 accumulate the full gradient in p.grad;
    # ZeRO-2/3 reduce each bucket into the partition as soon as it is full
    accum = trainable_params(cand, stages) * P.grad if z <= 1 else 0.0
    with_grads = accum + (k if later else max(k - 1, 0)) * per_mb
    without_grads = k * per_mb
    e.activations = k * per_mb
    t_sched = _schedule_transient(cand, stages)
    t_after = _after_schedule_transient(cand, stages, n)
    casts = sum(expert_weight_copies(cand, s.blocks) for s in stages)  # the experts' step casts, through the schedule
    sched_peak = max(without_grads, with_grads) + casts + t_sched
    opt_peak = (n * P.grad if z <= 1 else 0.0) + t_after
    e.transient = t_sched if sched_peak >= opt_peak else t_after
    # held through the step: params, optimizer state, buffers, and (ZeRO) the gradient partition
    base = e.params + e.optimizer + e.ddp_buckets + e.zero_buffers + e.pipeline_buffers + (e.grads if z else 0.0)
    e.peak = base + max(sched_peak, opt_peak)


def _schedule_transient(cand: Candidate, stages: list[Stage]) -> float:
    """The largest temporary on top of the activations during the schedule."""
    P, cfg, h, T = cand.prec, cand.cfg, cand.cfg.n_embd, cand.tokens
    Vp = padded_vocab_size(cfg.vocab_size, cand.tp)
    has_last = any(s.last for s in stages)
    # - the last stage: in its first backward the head's weight gradient (the largest tensor) while every activation
    #   is still held. The loss allocates none (its gradient lives in the logits' storage, which pipeline.py frees
    #   when the backward is done; low-precision logits add an fp32 chunk, cross_entropy.LOSS_CHUNK_ELEMENTS).
    shard = Vp // cand.tp
    t_loss = min(T * shard, LOSS_CHUNK_ELEMENTS) * 4 if P.matmul < 4 else 0.0
    t_head = max(t_loss, shard * h * P.grad) if has_last else 0.0
    # - a block's backward: the gradients w.r.t. the MLP's activation's output and input (GPT-2: 4h/t each) live
    # together, an MoE's exchanged rows with them (mlp_backward_bytes); under sequence parallelism a gathering
    # matmul's backward also holds the gathered input and its gradient
    t_gather = 2 * T * h * P.matmul if cand.sequence_parallel else 0.0
    kinds = {b for s in stages for b, _ in local_params(cfg, cand.tp).kinds(s.blocks)}
    t_block = max((mlp_backward_bytes(cand, b) for b in kinds), default=0.0)
    t_block += hidden_tokens(cand) * h * P.resid + t_gather if kinds else 0.0
    # - recomputation rebuilds one block's activations in its backward
    t_recompute = layer_activation_bytes(cand) if cand.recompute else 0.0
    # - a tied embedding with the head in the same stage (pp 1) gets its gradient from the head, first in the
    #   backward, and from the embedding, last: autograd holds the first in the weight's input buffer until the
    #   second arrives, so the head's weight gradient lives through every block's backward
    tied_held = shard * h * P.grad if cfg.tie_embeddings and any(s.first and s.last for s in stages) else 0.0
    return max(t_head, tied_held + t_block + t_recompute)


def _after_schedule_transient(cand: Candidate, stages: list[Stage], n: int) -> float:
    """The largest temporary after the schedule, the gradients held: the gradient reduction's flat copies (the
    gradients tp ranks hold shares of, summed in one fp32 all-reduce; DDP's experts over edp, a bucket at a time),
    the global norm's square of the largest gradient, and torch's foreach AdamW's one temporary per parameter of a
    group (sqrt of exp_avg_sq); DeepSpeed's optimizers make none."""
    P, z = cand.prec, cand.zero_stage
    t_opt = 0.0 if cand.offload_optimizer else (n if z == 0 else n / cand.dp_cp) * 4
    largest = max_param_tensor(cand.cfg, cand.tp, stages, cand.ep)
    t_tp_sum = sum(tp_summed_params(cand, stages)) * 4
    t_edp = 0.0
    if cand.ep > 1 and cand.edp > 1:
        t_edp = min(expert_params(cand.cfg, cand.tp, stages, cand.ep), EXPERT_BUCKET + largest) * P.grad
    return max(t_opt, largest * 4, t_tp_sum, t_edp)
