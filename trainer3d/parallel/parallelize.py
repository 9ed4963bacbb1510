"""The one place where parallelism is applied to the plain model, always in this order:

  1. build the plain GPT on the meta device (no memory, any size),
  2. pipeline: keep only this rank's stage(s),
  3. tensor parallel: swap each stage's layers for their sharded forms,
  4. materialize this rank's shards with layout-independent values (init, checkpoint or HF weights),
  5. data parallel: wrap each stage in DDP over the dp group (or hand it to DeepSpeed, see zero.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn

from trainer3d.parallel import pipeline
from trainer3d.parallel.ddp import unwrap, wrap_ddp
from trainer3d.model import GPT, GPTConfig, canonical_name, init_value
from trainer3d.parallel.tensor_parallel import ShardedDropoutRNG, apply_tensor_parallel, materialize, padded_vocab_size
from trainer3d.dist.topology import Topology


@dataclass
class ParallelModel:
    modules: list[nn.Module]  # this rank's stage modules (DDP-wrapped when dp > 1), in stage order
    stage_ids: list[int]
    n_stages: int
    layer_ranges: list[range]  # blocks of every stage, indexed by stage id
    last_stage_pp_rank: int  # where the loss lives (pp-1, or 0 for V-shaped schedules)
    vocab_start: int  # first vocab id of this rank's shard of the logits
    padded_vocab: int
    ddp: bool  # gradients averaged over dp by DDP during backward (else by the trainer after it)

    @property
    def has_first(self) -> bool:
        return 0 in self.stage_ids

    @property
    def has_last(self) -> bool:
        return self.n_stages - 1 in self.stage_ids

    def plain_modules(self) -> list[GPT]:
        return [unwrap(m) for m in self.modules]

    def parameters(self):
        seen: set[int] = set()
        for m in self.modules:
            for p in m.parameters():
                if id(p) not in seen:
                    seen.add(id(p))
                    yield p


def build_parallel_model(
    mcfg: GPTConfig,
    topo: Topology,
    device: torch.device,
    schedule: str,
    virtual_stages: int,
    seed: int,
    full_value: Callable[[str, tuple], torch.Tensor] | None = None,
    wrap_data_parallel: bool = True,
) -> ParallelModel:
    L = topo.layout
    # 1. the plain model, shapes only
    with torch.device("meta"):
        model = GPT(mcfg)

    # 2. pipeline: this rank's stages
    n_stages = L.pp * pipeline.stages_per_rank(schedule, virtual_stages)
    ranges = pipeline.balance_layers(mcfg, n_stages)
    ids = pipeline.stage_ids(topo.pp_rank, L.pp, schedule, virtual_stages)
    stages = [pipeline.split_stage(model, ranges[i], first=i == 0, last=i == n_stages - 1) for i in ids]

    # 3. tensor parallel. Dropout on head-sharded attention uses a per-tp-rank stream; everything else uses
    # the default generator, seeded alike on tp peers (below, in seed_rngs).
    sharded_rng = ShardedDropoutRNG(seed + 2718 + 100 * topo.pp_rank + 7919 * topo.dp_rank + topo.tp_rank, device)
    stages = [apply_tensor_parallel(s, topo.tp_group, topo.tp_rank, L.tp, sharded_rng) for s in stages]

    # 4. materialize: values are a function of the parameter's name, never of the layout
    if full_value is None:
        full_value = lambda name, shape: init_value(name, shape, mcfg, seed)  # noqa: E731
    for s in stages:
        materialize(s, device, full_value, topo.tp_rank, L.tp)

    # 5. data parallel (DDP, except under zero-bubble schedules: see pipeline.ScheduleInfo.split_backward)
    ddp = wrap_data_parallel and not pipeline.SCHEDULES[schedule].split_backward
    if ddp:
        stages = [wrap_ddp(s, topo.dp_group, device) for s in stages]

    padded = padded_vocab_size(mcfg.vocab_size, L.tp)
    return ParallelModel(
        modules=stages,
        stage_ids=ids,
        n_stages=n_stages,
        layer_ranges=ranges,
        last_stage_pp_rank=pipeline.last_stage_pp_rank(schedule, L.pp),
        vocab_start=topo.tp_rank * (padded // L.tp),
        padded_vocab=padded,
        ddp=ddp,
    )


def seed_rngs(seed: int, topo: Topology) -> None:
    """Default generator: identical on tp peers (their replicated activations need identical dropout masks),
    different across dp replicas and pipeline stages."""
    torch.manual_seed(seed + 100 * topo.pp_rank + 7919 * topo.dp_rank)


def named_full_params(pm: ParallelModel) -> dict[str, tuple[nn.Parameter, object]]:
    """canonical name -> (local parameter, tp spec) for every parameter this rank owns, the tied head copy
    of a last stage excluded (its values are the embedding's)."""
    out = {}
    for m in pm.plain_modules():
        for name, p in m.named_parameters():
            if name == "lm_head.weight" and m.wte is None:
                continue
            out[canonical_name(name)] = (p, getattr(p, "tp_spec", None))
    return out


def gather_stage_params(pm: ParallelModel, topo: Topology) -> dict[str, torch.Tensor]:
    """Full (unsharded, unpadded) values of this rank's stage parameters, by canonical name. Collective over
    the tp group; every tp rank gets the result."""
    from trainer3d.parallel.tensor_parallel import gather_full

    return {name: gather_full(p.data, spec, topo.tp_group) for name, (p, spec) in named_full_params(pm).items()}
