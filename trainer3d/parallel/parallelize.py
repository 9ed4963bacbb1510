"""The one place where parallelism is applied to the plain model, always in this order:

  1. build the family's plain model on the meta device (no memory, any size),
  2. pipeline: keep only this rank's stage(s),
  3. tensor parallel: swap each stage's layers for their sharded forms (with LoRA's pairs beside them; sequence
     parallelism: the activations between them on sequence shards), mixtures of experts (tokens split over tp,
     experts over ep), context parallelism and document masking (the attention and the positions of this rank's
     tokens), then activation recomputation around them,
     then compile: torch.compile on each block, in place (--compile),
  4. materialize this rank's shards with layout-independent values (init, checkpoint or HF weights); what does not
     train stops taking gradients (DeepSeek Sparse Attention's warm-up, a LoRA base),
  5. data parallel: hand the stages to the data-parallel engine (DDP, or DeepSpeed ZeRO: zero/engine.py),
  6. pipeline schedule: torch's schedule over what the engine wraps, with static stage shapes (in the compute dtype).
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field
from typing import Callable

import torch
import torch.nn as nn

from trainer3d.config import TrainConfig
from trainer3d.distributed.topology import Topology
from trainer3d.models import CausalLM, build_model, canonical_name, init_value
from trainer3d.parallel import pipeline
from trainer3d.parallel.batch import BatchPlan
from trainer3d.parallel.compile import apply_compile
from trainer3d.parallel.context_parallel import SequenceLayout, apply_context_parallel
from trainer3d.parallel.dsa import freeze_for_warmup
from trainer3d.parallel.engine import DataParallelEngine, EngineFactory, is_tied_duplicate
from trainer3d.parallel.expert_parallel import apply_expert_parallel
from trainer3d.parallel.fp8 import apply_fp8
from trainer3d.parallel.lora import LoRASpec, apply_lora, freeze_base, hold_base_in, initial_value, is_adapter
from trainer3d.parallel.recompute import apply_recompute
from trainer3d.parallel.sequence_parallel import apply_sequence_parallel
from trainer3d.parallel.shards import from_full, gather_full
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG, apply_tensor_parallel, padded_vocab_size


@dataclass
class ParallelModel:
    stages: list[CausalLM]  # this rank's plain stage modules (tp-sharded), in stage order
    stage_ids: list[int]
    n_stages: int
    layer_ranges: list[range]  # blocks of every stage, indexed by stage id
    vocab_start: int  # first vocab id of this rank's shard of the logits
    padded_vocab: int
    engine: DataParallelEngine
    schedule: object  # a torch.distributed.pipelining schedule
    sequence: SequenceLayout | None = None  # --cp > 1, --document-mask or --reset-position-ids: this rank's tokens
    # told the running micro-batch by the schedule's stages: the SequenceLayout, and what the trainer adds (its MoE
    # balance)
    listeners: list = field(default_factory=list)
    fp8_layers: list[str] = field(default_factory=list)  # this rank's linears that run in FP8 (--fp8)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids


def parallelize(
    mcfg,
    topo: Topology,
    device: torch.device,
    cfg: TrainConfig,
    plan: BatchPlan,
    engine_factory: EngineFactory,
    loss_fn: Callable,
    compute_dtype: torch.dtype,
    shard_value: Callable | None = None,
    boundary: int | None = None,
) -> ParallelModel:
    """`mcfg`: the model's config (its family's); `cfg`: the run's TrainConfig (schedule, virtual stages, seed,
    seq_len, cp, document masking); `compute_dtype`: what matmuls run in; `shard_value`: the materialize hook (default:
    the initialisation); `boundary`: the token that opens a document (--document-mask, --reset-position-ids)."""
    L = topo.layout
    # 1. the plain model, shapes only
    with torch.device("meta"):
        model = build_model(mcfg)

    # 2. pipeline: this rank's stages
    n_stages = L.pp * pipeline.stages_per_rank(cfg.schedule, cfg.virtual_stages)
    ranges = pipeline.balance_layers(mcfg, n_stages, cfg.seq_len)
    ids = pipeline.stage_ids(topo.pp_rank, L.pp, cfg.schedule, cfg.virtual_stages)
    stages = [model] if n_stages == 1 else [model.stage(ranges[i], first=i == 0, last=i == n_stages - 1) for i in ids]

    # 3. tensor parallel. Dropout on head-sharded attention uses a per-tp-rank stream; everything else uses
    # the default generator, seeded alike on tp peers (seed_rngs).
    sharded_rng = ShardedDropoutRNG(rng_seeds(cfg.seed, topo)[1], device)
    stages = [apply_tensor_parallel(s, topo.tp_group, topo.tp_rank, L.tp, sharded_rng) for s in stages]
    lora = LoRASpec.of(cfg)  # ... with LoRA's pairs beside the targeted linears, split as they are
    stages = [apply_lora(s, lora, topo.tp_group, L.tp, sharded_rng) for s in stages]
    if cfg.sequence_parallel:  # ... with the activations between the tp regions on sequence shards
        stages = [apply_sequence_parallel(s, topo.tp_rank, L.tp, sharded_rng) for s in stages]
    # ... mixtures of experts: tokens split over tp, experts over ep (parallel/expert_parallel.py)
    stages = [apply_expert_parallel(s, tp_group=topo.tp_group, tp_rank=topo.tp_rank, tp=L.tp,
                                    sequence_parallel=cfg.sequence_parallel, ep_group=topo.ep_group,
                                    ep_rank=topo.ep_rank, ep=L.ep) for s in stages]
    sequence = None
    if L.cp > 1 or cfg.uses_documents:  # ... and this rank's tokens of each sequence
        sequence = SequenceLayout(cfg.seq_len, topo.cp_group, topo.cp_rank, L.cp, device, boundary=boundary,
                                  document_mask=cfg.document_mask, reset_position_ids=cfg.reset_position_ids)
        stages = [apply_context_parallel(s, sequence) for s in stages]
    listeners = [sequence] if sequence is not None else []  # told the running micro-batch (pipeline.py)

    # ... FP8 matmuls in the eligible tensor-parallel linears (--fp8)
    fp8_layers = [name for s in stages for name in apply_fp8(s, cfg.fp8, mcfg.n_layer)]

    # 3b. activation recomputation, around the tensor-parallel layers (their collectives run again in the backward)
    stages = [apply_recompute(s, cfg.recompute) for s in stages]

    # 3c. compile each block in place, TP and recomputation included (parameter names do not change)
    stages = [apply_compile(s, cfg.compiled_backend) for s in stages]

    # 4. materialize: values are a function of the parameter's name, never of the layout
    if shard_value is None:  # (a LoRA pair starts as PEFT's)
        shard_value = from_full(lambda name, shape: initial_value(name, shape, cfg.seed) if is_adapter(name)
                                else init_value(mcfg, name, shape, cfg.seed))
    for s in stages:
        engine_factory.materialize(s, device, shard_value, topo.coords_by_axis)
        s.init_tables(device)
    seed_rngs(cfg.seed, topo)  # the default generator's dropout stream, before anything draws from it
    if getattr(mcfg, "sparse", False) and cfg.dsa_stage == "warmup":  # DSA's warm-up trains the indexers only
        freeze_for_warmup(stages)
    if lora is not None:  # LoRA trains the adapters only
        freeze_base(stages, engine_factory.input_grads)

    # 5. data parallel
    engine = engine_factory.build(stages)
    if lora is not None and compute_dtype != torch.float32 and not engine.casts_module:
        hold_base_in(stages, compute_dtype)  # (DDP under autocast: the frozen matmul weights without an fp32 copy)

    # 6. the schedule over the engine's stage modules; stage boundaries in the compute dtype (under autocast the
    # residual stream is fp32 inside a stage and is cast for the wire)
    if compute_dtype != torch.float32 and not engine.casts_module:
        for s in stages:
            pipeline.send_in_compute_dtype(s, compute_dtype)
    padded = padded_vocab_size(mcfg.vocab_size, L.tp)
    local_seq_len = cfg.seq_len // L.cp  # this rank's tokens of a sequence
    schedule = pipeline.build_schedule(
        engine.stage_modules, ids, n_stages, cfg.schedule, plan.micro_batches, loss_fn, topo.pp_group, device,
        shapes=lambda i: pipeline.stage_shapes(
            i, n_stages, plan.micro_batch_size, local_seq_len, mcfg.n_embd, padded // L.tp, compute_dtype,
            hidden_seq_len=local_seq_len // L.tp if cfg.sequence_parallel else local_seq_len,
        ),
        stage_cls=engine.stage_cls,
        listeners=listeners if listeners or mcfg.moe is not None else None,
    )
    return ParallelModel(
        stages=stages,
        stage_ids=ids,
        n_stages=n_stages,
        layer_ranges=ranges,
        vocab_start=topo.tp_rank * (padded // L.tp),
        padded_vocab=padded,
        engine=engine,
        schedule=schedule,
        sequence=sequence,
        listeners=listeners,
        fp8_layers=fp8_layers,
    )


def rng_seeds(seed: int, topo, step: int = 0) -> tuple[int, int]:
    """The seeds of this rank's two dropout streams at `step` (0 when a run starts; a resume at another layout
    re-derives both at its step): the default generator's, identical on tp peers (their replicated activations need
    identical masks) and different over dp, cp and pp; and the sharded stream's (head-sharded attention), different on
    every rank. A pure function of (seed, step, coordinates)."""
    pp, dp, tp = topo.pp_rank, topo.dp_cp_rank, topo.tp_rank  # context shards hold different tokens, as replicas do
    return _mix(seed, step, pp, dp), _mix(seed + 2718, step, pp, dp, tp)


def seed_rngs(seed: int, topo, step: int = 0) -> None:
    """Seed the default generator (the replicated activations' dropout stream)."""
    torch.manual_seed(rng_seeds(seed, topo, step)[0])


def _mix(*xs: int) -> int:
    h = hashlib.sha256(repr(xs).encode()).digest()
    return int.from_bytes(h[:8], "little") & ((1 << 63) - 1)


def named_full_params(pm: ParallelModel) -> dict[str, tuple[nn.Parameter, object]]:
    """canonical name -> (local parameter, tp spec) for every parameter this rank owns, the tied head copy
    of a last stage excluded (its values are the embedding's)."""
    out = {}
    for m in pm.stages:
        for name, p in m.named_parameters():
            if not is_tied_duplicate(m, p):
                out[canonical_name(m.cfg, name)] = (p, getattr(p, "tp_spec", None))
    return out


def gather_stage_params(pm: ParallelModel, topo) -> dict[str, torch.Tensor]:
    """Full (unsharded, unpadded) values of this rank's stage parameters, by canonical name. Collective over
    the tp group; every tp rank gets the result."""
    return {name: gather_full(p.data, spec, topo.shard_group(spec)) for name, (p, spec) in named_full_params(pm).items()}
