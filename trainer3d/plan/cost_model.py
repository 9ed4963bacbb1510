"""The analytic cost model of trainer3d: communication bytes and memory per rank, shared by the planner
(trainer3d/plan.py) and the benchmarks that check it against measurements (bench/comm_volume.py,
bench/memory.py, tests/test_plan.py).

Everything here is a pure function of the model's sizes and the layout; nothing needs a process group.

Conventions
-----------
* "payload" is the tensor passed to the call: all_reduce / broadcast / send: the tensor; all_gather: the gathered
  output; reduce_scatter: the input. `ring_factor` turns a payload into the bytes a rank sends with a ring
  algorithm: all-reduce 2(n-1)/n, all-gather and reduce-scatter (n-1)/n, point-to-point 1. gloo does not expose
  what it sends on the wire, so the benchmark counts payloads and both sides are converted with the same factor.
* T = micro-batch size × sequence length: the tokens of one micro-batch.
* A precision says how many bytes each kind of tensor takes (see PRECISIONS).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import lru_cache

from trainer3d.model import GPTConfig
from trainer3d.parallel.tensor_parallel import padded_vocab_size


# ---- precision ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor, and of model state per parameter."""

    name: str
    resid: int  # residual stream: LayerNorm inputs, pipeline sends, the embedding output
    matmul: int  # matmul inputs/outputs: saved activations, TP forward all-reduces, logits
    tp_bwd: int  # TP backward all-reduces (gradients w.r.t. LayerNorm outputs)
    param: int  # model state per parameter (ZeRO paper: 2 + 2 + K with K = 12 in mixed precision)
    grad: int
    optim: int  # Adam's two moments, plus the fp32 master copy when params are 16-bit

    @property
    def state(self) -> int:
        return self.param + self.grad + self.optim


PRECISIONS = {
    # CPU runs and the tests: everything fp32; Adam keeps exp_avg and exp_avg_sq (4 + 4 + 8 bytes per param).
    "fp32": Precision("fp32", resid=4, matmul=4, tp_bwd=4, param=4, grad=4, optim=8),
    # trainer3d without DeepSpeed on a GPU: fp32 parameters under torch.autocast(bf16). Matmuls run in bf16 and
    # save bf16 inputs, but the residual stream (and so LayerNorm inputs, pipeline sends, and the gradients that
    # the column-parallel layers all-reduce) stays fp32. Same 16 bytes of state per parameter as the ZeRO paper's
    # mixed precision, split 4 + 4 + 8.
    "bf16-autocast": Precision("bf16-autocast", resid=4, matmul=2, tp_bwd=4, param=4, grad=4, optim=8),
    # The ZeRO paper's mixed-precision Adam (DeepSpeed "bf16": {"enabled": true}): 16-bit params and grads,
    # K = 12 bytes of optimizer state (fp32 master + two moments), 16-bit activations throughout.
    "bf16-mixed": Precision("bf16-mixed", resid=2, matmul=2, tp_bwd=2, param=2, grad=2, optim=12),
}


# ---- model sizes and stages --------------------------------------------------------------------------------
@dataclass(frozen=True)
class Dims:
    n_layer: int
    n_embd: int
    n_head: int
    vocab: int
    n_positions: int

    @classmethod
    def of(cls, cfg: GPTConfig) -> Dims:
        return cls(cfg.n_layer, cfg.n_embd, cfg.n_head, cfg.vocab_size, cfg.n_positions)

    def gpt_config(self) -> GPTConfig:
        return GPTConfig(
            vocab_size=self.vocab, n_positions=self.n_positions, n_embd=self.n_embd, n_layer=self.n_layer,
            n_head=self.n_head,
        )

    def num_params(self) -> int:
        return self.gpt_config().num_params()


@dataclass(frozen=True)
class Stage:
    stage_id: int
    layers: int
    first: bool  # holds the embedding
    last: bool  # holds final LayerNorm, LM head (a copy of the tied embedding unless `first`) and the loss


def n_stages(pp: int, schedule: str, virtual_stages: int) -> int:
    from trainer3d.parallel.pipeline import stages_per_rank

    return pp * stages_per_rank(schedule, virtual_stages)


def rank_stages(dims: Dims, pp: int, schedule: str, virtual_stages: int, pp_rank: int) -> list[Stage]:
    """The stages one pipeline rank owns, exactly as trainer3d.pipeline places and balances them."""
    return list(_rank_stages(dims, pp, schedule, virtual_stages, pp_rank))


@lru_cache(maxsize=65536)
def _rank_stages(dims: Dims, pp: int, schedule: str, virtual_stages: int, pp_rank: int) -> tuple[Stage, ...]:
    from trainer3d.parallel.pipeline import stage_ids

    n = n_stages(pp, schedule, virtual_stages)
    ranges = _balance(dims, n)
    return tuple(Stage(i, len(ranges[i]), i == 0, i == n - 1) for i in stage_ids(pp_rank, pp, schedule, virtual_stages))


@lru_cache(maxsize=4096)
def _balance(dims: Dims, n: int) -> tuple[range, ...]:
    from trainer3d.parallel.pipeline import balance_layers

    return tuple(balance_layers(dims.gpt_config(), n))


def block_params(dims: Dims, tp: int) -> int:
    """One block's parameters on one TP rank: column-parallel qkv and fc (weights and biases split), row-parallel
    projections (weights split, biases replicated), two replicated LayerNorms."""
    h = dims.n_embd
    return (12 * h * h + 7 * h) // tp + 6 * h


def stage_params(dims: Dims, tp: int, st: Stage) -> int:
    h, Vp = dims.n_embd, padded_vocab_size(dims.vocab, tp)
    n = st.layers * block_params(dims, tp)
    if st.first:
        n += Vp // tp * h + dims.n_positions * h  # vocab-parallel wte, replicated wpe
    if st.last:
        n += 2 * h + (0 if st.first else Vp // tp * h)  # ln_f, and the head's copy of wte when not on this module
    return n


def rank_params(dims: Dims, tp: int, stages: list[Stage]) -> int:
    return sum(stage_params(dims, tp, s) for s in stages)


def max_param_tensor(dims: Dims, tp: int, stages: list[Stage]) -> int:
    """Elements of the largest parameter on the rank (the vocab shard of wte, else an MLP weight)."""
    h = dims.n_embd
    biggest = 4 * h * h // tp if any(s.layers for s in stages) else 0
    if any(s.first or s.last for s in stages):
        biggest = max(biggest, padded_vocab_size(dims.vocab, tp) // tp * h)
    return biggest


# ---- communication -----------------------------------------------------------------------------------------
def ring_factor(op: str, n: int) -> float:
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


@dataclass(frozen=True)
class Layout:
    """Everything about a run that the cost model needs (one pipeline rank at a time)."""

    dims: Dims
    dp: int = 1
    tp: int = 1
    pp: int = 1
    schedule: str = "1f1b"
    virtual_stages: int = 1
    micro_batches: int = 1
    micro_batch_size: int = 1
    seq_len: int = 128
    precision: str = "fp32"
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_params: bool = False
    recompute: bool = False  # full activation checkpointing of every block
    # ZeRO-3 keeps parameters smaller than this unpartitioned (DeepSpeed's stage3_param_persistence_threshold)
    zero3_persistence: int | None = None  # None: 10 × hidden (plan.zero_buckets)
    zero_bucket_elems: int | None = None  # DeepSpeed reduce_bucket_size; None: hidden² (plan.zero_buckets)

    @property
    def tokens(self) -> int:  # T: tokens per micro-batch
        return self.micro_batch_size * self.seq_len

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batches * self.micro_batch_size

    def stages(self, pp_rank: int) -> list[Stage]:
        return rank_stages(self.dims, self.pp, self.schedule, self.virtual_stages, pp_rank)


def tied_copy_ranks(L: Layout) -> tuple[int, int]:
    from trainer3d.parallel.pipeline import last_stage_pp_rank

    return 0, last_stage_pp_rank(L.schedule, L.pp)


def analytic_comm(L: Layout, pp_rank: int) -> list[Transfer]:
    """What one rank at pipeline rank `pp_rank` passes to collectives and sends in one optimizer step (training
    only; evaluation and the first step's shape exchange excluded)."""
    d, h, m, T, P = L.dims, L.dims.n_embd, L.micro_batches, L.tokens, L.prec
    stages = L.stages(pp_rank)
    out: list[Transfer] = []
    if L.tp > 1:
        layers = sum(s.layers for s in stages)
        out.append(Transfer("tp", "all_reduce", T * h * P.matmul, 2 * layers * m, L.tp,
                            "2 per block forward: row-parallel attention and MLP projections (b·s·h)"))
        out.append(Transfer("tp", "all_reduce", T * h * P.tp_bwd, 2 * layers * m, L.tp,
                            "2 per block backward: column-parallel qkv and fc input gradients (b·s·h)"))
        if any(s.first for s in stages):
            out.append(Transfer("tp", "all_reduce", T * h * P.resid, m, L.tp,
                                "vocab-parallel embedding forward: each rank looks up its vocab slice (b·s·h)"))
        if any(s.last for s in stages):
            out.append(Transfer("tp", "all_reduce", T * h * P.resid, m, L.tp,
                                "vocab-parallel LM head backward: input gradient of the replicated hidden state (b·s·h)"))
            out.append(Transfer("tp", "all_reduce", T * 4, 3 * m, L.tp,
                                "vocab-parallel cross-entropy: max, target logit, sum of exps (b·s fp32 each)"))
    if L.pp > 1:
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
    n_local = rank_params(d, L.tp, stages)
    if L.dp > 1:
        g = P.grad
        if L.zero_stage == 0:
            out.append(Transfer("dp", "all_reduce", n_local * g, 1, L.dp,
                                "DDP: one all-reduce of the local gradient per step (no_sync on earlier micro-batches)"))
        else:
            rs_calls = m if L.zero_stage >= 2 else 1
            out.append(Transfer("dp", "reduce_scatter", n_local * g, rs_calls, L.dp,
                                "ZeRO: reduce-scatter of the gradient" + (" every micro-batch" if rs_calls > 1 else "")))
            if L.zero_stage < 3:
                out.append(Transfer("dp", "all_gather", n_local * P.param, 1, L.dp,
                                    "ZeRO-1/2: all-gather of the updated parameters after the step"))
            else:
                partitioned = n_local - _persistent_params(L, stages)
                out.append(Transfer("dp", "all_gather", partitioned * P.param, 2 * m, L.dp,
                                    "ZeRO-3: all-gather of the parameters before forward and before backward"))
    first_rank, last_rank = tied_copy_ranks(L)
    if L.pp > 1 and first_rank != last_rank and pp_rank in (first_rank, last_rank):
        Vp = padded_vocab_size(d.vocab, L.tp)
        shard = Vp // L.tp * h
        if L.zero_stage >= 3:
            # zero.py sums the copies' aligned ZeRO-3 partitions (fp32), not the whole gradient
            out.append(Transfer("embedding", "all_reduce", math.ceil(shard / L.dp) * 4, 1, 2,
                                "tied wte/lm_head: the two copies' ZeRO-3 gradient partitions summed"))
        else:
            out.append(Transfer("embedding", "all_reduce", shard * (4 if L.zero_stage else P.grad), 1, 2,
                                "tied wte/lm_head: gradient of the two copies summed (first and last stage)"))
    # Scalars: one per step, not part of the minimum.
    out.append(Transfer("world", "all_reduce", 4, 1, L.world, "loss for logging (one fp32 scalar)"))
    if L.zero_stage:  # zero.py: every rank sums the squares it owns over the whole world
        out.append(Transfer("world", "all_reduce", 4, 1, L.world, "global grad norm over all shards (one fp32 scalar)"))
    elif L.tp * L.pp > 1:
        out.append(Transfer("mp", "all_reduce", 4, 1, L.tp * L.pp, "global grad norm (one fp32 scalar)"))
    return [t for t in out if t.n > 1]


def _persistent_params(L: Layout, stages: list[Stage]) -> int:
    """Parameters ZeRO-3 leaves unpartitioned (each tensor below the persistence threshold)."""
    threshold = 10 * L.dims.n_embd if L.zero3_persistence is None else L.zero3_persistence
    if threshold <= 0 or L.zero_stage < 3:
        return 0
    h, t = L.dims.n_embd, L.tp
    small = 0
    per_block = [3 * h // t, h, 4 * h // t, h, h, h, h, h]  # biases and LayerNorm weights/biases
    per_block += [3 * h * h // t, h * h // t, 4 * h * h // t, 4 * h * h // t]
    for s in stages:
        small += s.layers * sum(n for n in per_block if n < threshold)
        if s.last and 2 * h:
            small += sum(n for n in (h, h) if n < threshold)
    return small


def layer_activation_bytes(L: Layout) -> float:
    """Bytes one block saves for backward per micro-batch (Korthikanti et al. 2022, for our block).

    Per token: replicated across TP: LayerNorm inputs (2h, residual dtype) and the two LayerNorm outputs that
    feed the column-parallel matmuls (2h, matmul dtype); sharded: q, k, v (3h/t), the attention output that is
    also the projection's input (h/t), the fc output / GELU input (4h/t) and the GELU output (4h/t), plus flash
    attention's log-sum-exp (a/t fp32) and LayerNorm statistics (4 fp32). In 16-bit this is 8 + 24/t bytes per
    h: Korthikanti's 10 + 24/t less the two dropout masks (dropout 0 here), and without the 5·a·s/h
    attention-matrix term, because scaled_dot_product_attention (flash / memory-efficient) never stores the
    s×s scores."""
    h, a, t, P = L.dims.n_embd, L.dims.n_head, L.tp, L.prec
    per_token = 2 * h * P.resid + 2 * h * P.matmul + 12 * h // t * P.matmul + a // t * 4 + 4 * 4
    return L.tokens * per_token


def stage_activation_bytes(L: Layout, st: Stage) -> float:
    """Bytes one stage holds per micro-batch in flight: saved activations plus the stage output that torch's
    PipelineStage keeps until that micro-batch's backward (the hidden state, or the logits on the last stage).
    With recomputation each block keeps only its input."""
    h, T, P, t = L.dims.n_embd, L.tokens, L.prec, L.tp
    Vp = padded_vocab_size(L.dims.vocab, t)
    per_layer = T * h * P.resid if L.recompute else layer_activation_bytes(L)
    total = st.layers * per_layer
    if st.first:
        total += T * (8 + (9 if t > 1 else 0))  # token ids (int64); under TP also the shard mask and local ids
    if st.last:
        total += T * (h * P.resid + h * P.matmul + 8)  # ln_f input, head input, the CE's local targets
        total += T * Vp // t * 4  # the cross-entropy keeps the fp32 softmax for its backward
        total += T * Vp // t * P.matmul  # the logits, held as the stage output until backward
    else:
        total += T * h * P.resid  # the stage output, held until backward
    return total


def inflight_microbatches(L: Layout, pp_rank: int) -> float:
    """Micro-batches whose activations a pipeline rank holds at its peak, in units of its whole share of the
    model (a chunk of an interleaved schedule counts 1/v), following torch's schedules' warmup rules."""
    p, r, m = L.pp, pp_rank, L.micro_batches
    if p == 1:
        return 1.0  # gradient accumulation runs micro-batches one at a time
    s = L.schedule
    if s == "gpipe":
        return float(m)
    if s == "1f1b":
        return float(min(p - r, m))
    if s == "looped-bfs":
        return float(m)
    if s in ("interleaved-1f1b", "interleaved-zb"):
        v = L.virtual_stages
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


def estimate_memory(L: Layout, pp_rank: int) -> MemoryEstimate:
    """Device memory of one rank at pipeline rank `pp_rank`."""
    P, d, h, T, m = L.prec, L.dims, L.dims.n_embd, L.tokens, L.micro_batches
    stages = L.stages(pp_rank)
    n = rank_params(d, L.tp, stages)
    e = MemoryEstimate(n_params=n)
    z, dp = L.zero_stage, L.dp

    # Model states, after the ZeRO paper (Rajbhandari et al. 2020): stage 1 partitions the optimizer state over
    # dp, stage 2 also the gradients, stage 3 also the parameters. DDP (stage 0) keeps Adam's two moments next
    # to the parameters (no master copy: they are fp32 already); DeepSpeed (stages 1-3) keeps K = 12 bytes per
    # parameter, an fp32 master partition plus the moments, even when training in fp32, and reduces gradients
    # into an fp32 partition (so its gradient is the partition from stage 1 on).
    zero_bucket = L.zero_bucket_elems if L.zero_bucket_elems is not None else h * h
    if z == 0:
        e.params, e.grads, e.optimizer = n * P.param, n * P.grad, n * P.optim
        if dp > 1:
            e.ddp_buckets = n * P.grad  # DDP's flat buckets are a second copy of the gradients
    else:
        e.params = n * P.param / (dp if z >= 3 else 1)
        e.grads = n * 4 / dp
        e.optimizer = n * 12 / dp
        largest = max_param_tensor(d, L.tp, stages)
        if L.offload_optimizer:  # ZeRO-Offload: master, moments and the fp32 gradient partition on the host
            e.offloaded += e.optimizer + e.grads
            e.optimizer = e.grads = 0.0
            if z < 3:
                # DeepSpeed's staging buffers (stage_1_and_2.py): a 16-bit copy of the parameter partition and a
                # largest-parameter gradient buffer on the host, the same gradient buffer and the gradient
                # partition on the device
                e.host_buffers += n / dp * P.param + largest * P.grad
                e.zero_buffers += largest * P.grad + n / dp * P.grad
        if L.offload_params and z >= 3:
            e.offloaded += e.params
            e.params = 0.0
        if z >= 3:
            e.params += _persistent_params(L, stages) * P.param  # small tensors ZeRO-3 never partitions
            # working set: at most two blocks' parameters gathered (stage3_max_live_parameters, as the planner
            # writes it), plus the largest tensor, which is gathered whole whatever the bound
            e.zero_buffers += (min(n, 2 * block_params(d, L.tp)) + largest) * P.param
        if dp > 1:
            e.zero_buffers += min(zero_bucket, n) * P.grad  # DeepSpeed's reduce (ipg) bucket

    # pipeline receive buffers: torch's PipelineStage allocates one per micro-batch, for the activation on every
    # non-first stage and for its gradient on every non-last stage
    if L.pp > 1:
        ids = {s.stage_id for s in stages}
        for s in stages:
            if not s.first and s.stage_id - 1 not in ids:
                e.pipeline_buffers += m * T * h * P.resid
            if not s.last and s.stage_id + 1 not in ids:
                e.pipeline_buffers += m * T * h * P.resid

    # activations: in-flight micro-batches × what a micro-batch keeps on this rank
    per_mb = sum(stage_activation_bytes(L, s) for s in stages)
    k = inflight_microbatches(L, pp_rank)
    e.inflight = k
    # A micro-batch beyond the in-flight window (or a later accumulation micro-batch) runs after the first
    # backward has allocated the gradients; the first ones run before (zero_grad(set_to_none) at step start).
    later = m > k or (L.pp == 1 and m > 1)
    # gradients held while later micro-batches run: DDP and ZeRO-1 accumulate the full gradient in p.grad;
    # ZeRO-2/3 reduce each bucket into the partition as soon as it is full
    accum = n * P.grad if z <= 1 else 0.0
    with_grads = accum + (k if later else max(k - 1, 0)) * per_mb
    without_grads = k * per_mb
    e.activations = k * per_mb
    # Transients on top of the activations, during the schedule:
    Vp = padded_vocab_size(d.vocab, L.tp)
    has_last = any(s.last for s in stages)
    # - the last stage's first backward: the head's weight gradient (the largest tensor) is allocated while
    #   every activation is still held; under autocast the loss gradient is also cast back to the logits' dtype
    t_head = Vp // L.tp * h * P.grad if has_last else 0.0
    t_head += T * Vp // L.tp * P.matmul if has_last and P.matmul != 4 else 0.0
    # - a block's backward: the gradients w.r.t. the GELU output and the fc output (4h/t each) live together
    t_block = 8 * T * h // L.tp * P.matmul + T * h * P.resid if any(s.layers for s in stages) else 0.0
    t_recompute = layer_activation_bytes(L) if L.recompute else 0.0
    t_sched = max(t_head, t_block + t_recompute)
    # After the schedule: the global norm squares the largest gradient (a temporary), and torch's foreach AdamW
    # builds one temporary per parameter of a group (sqrt of exp_avg_sq); DeepSpeed's optimizers do not.
    t_opt = 0.0 if L.offload_optimizer else (n if z == 0 else n / dp) * 4
    t_norm = max_param_tensor(d, L.tp, stages) * 4
    sched_peak = max(without_grads, with_grads) + t_sched
    opt_peak = (n * P.grad if z <= 1 else 0.0) + max(t_opt, t_norm)
    e.transient = t_sched if sched_peak >= opt_peak else max(t_opt, t_norm)
    # held through the step: params, optimizer state, buffers, and (ZeRO) the gradient partition
    base = e.params + e.optimizer + e.ddp_buckets + e.zero_buffers + e.pipeline_buffers + (e.grads if z else 0.0)
    e.peak = base + max(sched_peak, opt_peak)
    if L.recompute:
        e.notes.append("activation checkpointing is modelled but not yet a trainer3d flag")
    return e


def gib(x: float) -> float:
    return x / 2**30
