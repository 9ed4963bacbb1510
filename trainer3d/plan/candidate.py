"""A layout candidate of the planner and what it puts on one pipeline rank: stages and parameter counts.

Pure functions of the model's config and the candidate; nothing needs a process group. The stages come from
trainer3d.parallel.pipeline itself (placement and balancing) and the parameters from the family's ParallelPlan
(trainer3d.parallel.param_counts), so the planner counts what the trainer builds, for every family. A stage knows
which blocks it holds, so a mixture of experts is counted layer by layer (dense and MoE blocks differ), its experts
divided by ep (each ep rank holds n_experts/ep of them whole, replicated over tp).
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache

from trainer3d.parallel.lora import expert_targets, targets_by_linear
from trainer3d.parallel.param_counts import embedding_on_last, local_params
from trainer3d.parallel.pipeline import balance_layers, stage_ids, stages_per_rank
from trainer3d.zero.config import auto_buckets


# ---- precision ---------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Precision:
    """Bytes per element of each kind of tensor, and of model state per parameter."""

    name: str
    resid: int  # residual stream: LayerNorm inputs, the embedding output
    matmul: int  # matmul inputs/outputs: saved activations, TP collectives (forward and backward), logits
    send: int  # pipeline sends (the residual stream crosses stages in the compute dtype) and their gradients
    param: int  # model state per parameter (ZeRO paper: 2 + 2 + K with K = 12 in mixed precision)
    grad: int
    optim: int  # Adam's two moments, plus the fp32 master copy when params are 16-bit

    @property
    def state(self) -> int:
        return self.param + self.grad + self.optim


PRECISIONS = {
    # CPU runs and the tests: everything fp32; Adam keeps exp_avg and exp_avg_sq (4 + 4 + 8 bytes per param).
    "fp32": Precision("fp32", resid=4, matmul=4, send=4, param=4, grad=4, optim=8),
    # trainer3d without DeepSpeed on a GPU: fp32 parameters under torch.autocast(bf16). Matmuls run in bf16 and
    # save bf16 inputs; the residual stream (LayerNorm inputs, the embedding output) stays fp32 inside a stage, but
    # what crosses the wire is bf16: TP collectives (inputs cast before the collective) and pipeline sends (cast at
    # the stage boundary). Same 16 bytes of state per parameter as the ZeRO paper's mixed precision, 4 + 4 + 8.
    "bf16-autocast": Precision("bf16-autocast", resid=4, matmul=2, send=2, param=4, grad=4, optim=8),
    # The ZeRO paper's mixed-precision Adam (DeepSpeed "bf16": {"enabled": true}): 16-bit params and grads,
    # K = 12 bytes of optimizer state (fp32 master + two moments), 16-bit activations throughout.
    "bf16-mixed": Precision("bf16-mixed", resid=2, matmul=2, send=2, param=2, grad=2, optim=12),
}


# ---- stages ------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Stage:
    stage_id: int
    layers: int
    first: bool  # holds the embedding
    last: bool  # holds final LayerNorm, LM head (a copy of the tied embedding unless `first`) and the loss
    start: int = 0  # the global index of its first block

    @property
    def blocks(self) -> range:
        return range(self.start, self.start + self.layers)


def n_stages(pp: int, schedule: str, virtual_stages: int) -> int:
    return pp * stages_per_rank(schedule, virtual_stages)


@lru_cache(maxsize=4096)
def balanced_ranges(cfg, n: int, seq_len: int) -> tuple[range, ...]:
    """trainer3d.parallel.pipeline.balance_layers, cached: the search asks for the same split many times."""
    return tuple(balance_layers(cfg, n, seq_len))


def rank_stages(cfg, pp: int, schedule: str, virtual_stages: int, pp_rank: int, seq_len: int) -> list[Stage]:
    """The stages one pipeline rank owns, exactly as trainer3d.parallel.pipeline places and balances them."""
    return list(_rank_stages(cfg, pp, schedule, virtual_stages, pp_rank, seq_len))


@lru_cache(maxsize=65536)
def _rank_stages(cfg, pp: int, schedule: str, virtual_stages: int, pp_rank: int, seq_len: int) -> tuple[Stage, ...]:
    n = n_stages(pp, schedule, virtual_stages)
    ranges = balanced_ranges(cfg, n, seq_len)
    return tuple(Stage(i, len(ranges[i]), i == 0, i == n - 1, ranges[i].start)
                 for i in stage_ids(pp_rank, pp, schedule, virtual_stages))


# ---- the candidate -------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Candidate:
    """One run the planner considers: model, (dp, tp, pp, cp) grid, schedule, batch split, precision and ZeRO options;
    everything the cost model needs (one pipeline rank at a time). Not trainer3d.distributed.topology.Layout, which is
    only the grid of a running job."""

    cfg: object  # the model's config (any family's)
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
    sequence_parallel: bool = False  # --sequence-parallel (tp > 1): activations outside the tp regions split by tp
    cp: int = 1  # context parallelism: each sequence split over cp ranks (its keys and values all-gathered)
    # ZeRO-3 keeps parameters smaller than this unpartitioned (DeepSpeed's stage3_param_persistence_threshold)
    zero3_persistence: int | None = None  # None: the "auto" value (zero.config.auto_buckets)
    zero_bucket_elems: int | None = None  # DeepSpeed reduce_bucket_size; None: the "auto" value
    ep: int = 1  # expert parallelism: each MoE layer's experts split over ep ranks of the dp×cp line
    fp8: str | None = None  # --fp8's recipe: the eligible block linears' matmuls at twice the bf16 rate (parallel/fp8.py)
    lora: object | None = None  # --lora-rank's LoRASpec: only its adapters take gradients and AdamW state

    @property
    def tokens(self) -> int:  # T: a rank's tokens of a micro-batch (its 1/cp share of every sequence)
        return self.micro_batch_size * self.seq_len // self.cp

    @property
    def dp_cp(self) -> int:
        """Ranks holding the same parameters: gradients are reduced, and ZeRO partitions, over them."""
        return self.dp * self.cp

    @property
    def edp(self) -> int:
        """Ranks holding the same experts: expert gradients are reduced over them (dp×cp / ep)."""
        return self.dp_cp // self.ep

    @property
    def prec(self) -> Precision:
        return PRECISIONS[self.precision]

    @property
    def world(self) -> int:
        return self.dp * self.tp * self.pp * self.cp

    @property
    def global_batch(self) -> int:
        return self.dp * self.micro_batches * self.micro_batch_size

    def stages(self, pp_rank: int) -> list[Stage]:
        return rank_stages(self.cfg, self.pp, self.schedule, self.virtual_stages, pp_rank, self.seq_len)


def describe(cand: Candidate) -> str:
    """The one-line name of a candidate in the planner's tables, e.g. `dp8 tp1 pp2 1f1b m64x1 ZeRO-1`."""
    s = f"dp{cand.dp} tp{cand.tp} pp{cand.pp}" + (f" cp{cand.cp}" if cand.cp > 1 else "") + \
        (f" ep{cand.ep}" if cand.ep > 1 else "")
    if cand.pp > 1:
        s += f" {cand.schedule}" + (f" v{cand.virtual_stages}" if cand.virtual_stages > 1 else "")
    s += f" m{cand.micro_batches}x{cand.micro_batch_size} ZeRO-{cand.zero_stage}"
    if cand.offload_optimizer:
        s += "+offload" + ("(opt,param)" if cand.offload_params else "(opt)")
    if cand.recompute:
        s += " +recompute"
    if cand.sequence_parallel:
        s += " +sp"
    if cand.fp8:
        s += f" +fp8 {cand.fp8}"
    return s


# ---- parameters per rank (parallel/param_counts.py reads them off the family's ParallelPlan) -------------------------
def block_params(cfg, tp: int, layer: int | None = None, ep: int = 1) -> int:
    """One block's parameters on one TP rank (`layer` None: the largest block): column-parallel layers split whole,
    row-parallel weights split and their biases replicated, norms replicated, experts whole and divided by ep."""
    lp = local_params(cfg, tp)
    if layer is None:
        return max(b.total(ep) for b in lp.blocks)
    return lp.block(layer).total(ep)


def stage_params(cfg, tp: int, st: Stage, ep: int = 1) -> int:
    lp = local_params(cfg, tp)
    n = sum(b.total(ep) * k for b, k in lp.kinds(st.blocks))
    if st.first:
        n += lp.embedding + sum(lp.first_extra)  # vocab-parallel embedding, replicated positions (GPT-2)
    if st.last:
        n += sum(lp.last_extra) + (0 if cfg.tie_embeddings and st.first else lp.head)  # final norm (and MTP
        # modules); the head (a copy of a tied embedding when it lives elsewhere)
        n += lp.embedding if not st.first and not cfg.tie_embeddings and embedding_on_last(cfg) else 0  # MTP's copy
    return n


def rank_params(cfg, tp: int, stages: list[Stage], ep: int = 1) -> int:
    return sum(stage_params(cfg, tp, s, ep) for s in stages)


def matmul_params(cfg, tp: int, stages: list[Stage], ep: int = 1) -> int:
    """A rank's parameters in its blocks and an untied head: what a frozen LoRA base under DDP and autocast holds in
    the compute dtype (parallel/lora.hold_base_in; the blocks' norms and routers, a few per mille, counted with them);
    the embedding, its tied copy and the stages' extras stay fp32."""
    lp = local_params(cfg, tp)
    blocks = sum(b.total(ep) * k for s in stages for b, k in lp.kinds(s.blocks))
    return blocks + sum(lp.head for s in stages if s.last and not cfg.tie_embeddings)


def trainable_params(cand, stages: list[Stage]) -> float:
    """The parameters of a rank's stages that take gradients and AdamW state: every one, or under LoRA the adapters
    alone (parallel/lora.py's Target.local_params)."""
    if cand.lora is None:
        return rank_params(cand.cfg, cand.tp, stages, cand.ep)
    blocks = {b for s in stages for b in s.blocks}
    total = 0
    for prefix, t in targets_by_linear(cand.cfg, cand.lora).items():
        if int(prefix.split(".")[1]) in blocks:
            total += t.local_params(cand.lora.rank, cand.tp)
    return total + lora_expert_params(cand, stages)


def lora_expert_params(cand, stages: list[Stage]) -> int:
    """A rank's adapters of a mixture's experts (--lora-targets experts): a pair per expert on both of its stacked
    weights, split over ep as the experts are (ZeRO partitions them over edp)."""
    if cand.lora is None:
        return 0
    blocks = {b for s in stages for b in s.blocks}
    return sum(E // cand.ep * cand.lora.rank * (2 * H + 3 * I)  # gate_up: r·H + 2I·r; down: r·I + H·r
               for prefix, (E, H, I) in expert_targets(cand.cfg, cand.lora).items()
               if int(prefix.split(".")[1]) in blocks)


def expert_params(cfg, tp: int, stages: list[Stage], ep: int = 1) -> int:
    """The rank's share of the experts (each MoE layer's n_experts/ep, whole)."""
    lp = local_params(cfg, tp)
    return sum(b.experts(ep) * k for s in stages for b, k in lp.kinds(s.blocks))


def partition_params(cand, stages: list[Stage]) -> float:
    """A rank's ZeRO partition of its stages' parameters: 1/dp×cp of them, the experts under ep 1/edp of theirs (their
    own engine partitions over edp: zero/experts.py)."""
    n = rank_params(cand.cfg, cand.tp, stages, cand.ep)
    experts = expert_params(cand.cfg, cand.tp, stages, cand.ep) if cand.ep > 1 else 0
    return (n - experts) / cand.dp_cp + experts / cand.edp


def _stage_pieces(cfg, stages: list[Stage], ep: int, keep, extras: bool) -> list[tuple[int, bool]]:
    """(elements on a rank, is an expert tensor) of the block tensors of a rank's stages that `keep` selects, and
    with `extras` the first and last stages' replicated extras (positions, the final norm)."""
    lp, out = local_params(cfg, 1), []
    for s in stages:
        if extras and s.first:
            out += [(n, False) for n in lp.first_extra]
        for b, k in lp.kinds(s.blocks):
            out += [(p.on_rank(ep), p.expert) for p in b.pieces if keep(p)] * k
        if extras and s.last:
            out += [(n, False) for n in lp.last_extra]
    return out


def replicated_params(cfg, stages: list[Stage], ep: int = 1) -> list[int]:
    """Sizes of the tp-replicated parameters of a rank's stages (norms, row-parallel biases, positions, an MoE's
    router and experts): every tp rank holds them whole."""
    return [n for n, _ in _stage_pieces(cfg, stages, ep, lambda p: p.replicated, extras=True)]


def tp_summed_params(cand: Candidate, stages: list[Stage]) -> list[int]:
    """Sizes of the parameters whose gradient each tp rank holds only a share of, summed over tp once per step
    (engine.sum_tp_partial_grads): under sequence parallelism every replicated one, else an MoE's and Qwen3's
    q/k norms."""
    return [n for n, _ in tp_summed_pieces(cand, stages)]


def tp_summed_pieces(cand: Candidate, stages: list[Stage]) -> list[tuple[int, bool]]:
    """(elements, is an expert tensor) of each of tp_summed_params: ZeRO-3 partitions an expert's over edp, the rest
    over dp×cp."""
    if cand.tp == 1:
        return []
    if cand.sequence_parallel:  # every replicated tensor, the stages' extras included
        return _stage_pieces(cand.cfg, stages, cand.ep, lambda p: p.replicated, extras=True)
    return _stage_pieces(cand.cfg, stages, cand.ep, lambda p: p.partial, extras=False)


def max_param_tensor(cfg, tp: int, stages: list[Stage], ep: int = 1) -> int:
    """Elements of the largest parameter on the rank (the vocab shard of the embedding or head, else a block's
    largest weight)."""
    lp = local_params(cfg, tp)
    biggest = max((p.on_rank(ep) for s in stages for b, _ in lp.kinds(s.blocks) for p in b.pieces), default=0)
    if any(s.first or s.last for s in stages):
        biggest = max(biggest, lp.embedding)
    return biggest


def persistent_params(cand: Candidate, stages: list[Stage]) -> int:
    """Parameters ZeRO-3 leaves unpartitioned (each tensor below the persistence threshold)."""
    threshold = cand.zero3_persistence
    if threshold is None:
        threshold = auto_buckets(cand.cfg.n_embd)["stage3_param_persistence_threshold"]
    if threshold <= 0 or cand.zero_stage < 3:
        return 0
    lp = local_params(cand.cfg, cand.tp)
    small = 0
    for s in stages:
        small += sum(k * sum(n for n in (p.on_rank(cand.ep) for p in b.pieces) if n < threshold)
                     for b, k in lp.kinds(s.blocks))
        if s.last:
            small += sum(n for n in lp.last_extra if n < threshold)
        if s.first:
            small += sum(n for n in lp.first_extra if n < threshold)
    return small


def gib(x: float) -> float:
    return x / 2**30
