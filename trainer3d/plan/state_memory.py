"""What one rank needs for the model's state outside a training step: at start-up, during a checkpoint save, and the
bytes it writes and reads (issue 22), by the same arithmetic as plan/memory.py, for what the code does today:

- a save (checkpoint/save.py) keeps this rank's pieces in host memory, a 1/dp slice of its tp shard of every fp32
  value and Adam moment (12 bytes a parameter; a tensor replicated over tp is sliced over dp×tp, this ep rank's
  experts over edp×tp; a last stage's copy of the tied embedding is saved by the first stage), plus one tensor at a
  time assembled over dp;
- start-up (parallel/parallelize.py) materializes every parameter of the rank's stages (its tp shard, fp32), each
  cut from a full tensor (the initialisation is layout-free): whole under DDP and ZeRO-1/2, which keep it so;
  under ZeRO-3 each parameter is partitioned over dp as soon as it exists (zero/engine.ZeroEngineFactory), so the
  rank holds its partitions plus one parameter;
- a resume reads each parameter's tp shard to build the stage (ZeRO-3: only dp rank 0, which broadcasts it), then
  the Adam state: DDP the moments of its whole tp shard, ZeRO-1/2/3 only its partition of the master and moments.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer3d.parallel.param_counts import embedding_on_last, local_params
from trainer3d.plan.candidate import (
    Candidate, expert_params, max_param_tensor, rank_params, replicated_params, trainable_params,
)


@dataclass(frozen=True)
class StateMemory:
    """Bytes per rank."""

    startup_device: float  # what the stage's parameters take on the device while they are built
    startup_host: float  # the largest full (tp-unsharded) fp32 tensor a shard is cut from, on the rank computing it
    save_host: float  # host memory a save adds: the rank's pieces plus one tensor
    save_written: float  # what the rank writes
    resume_read: float  # what the rank reads when resuming


def state_memory(cand: Candidate, pp_rank: int) -> StateMemory:
    stages, ep = cand.stages(pp_rank), cand.ep
    n = rank_params(cand.cfg, cand.tp, stages, ep)
    largest = max_param_tensor(cand.cfg, cand.tp, stages, ep)
    tied_copy = any(s.last and not s.first for s in stages) and embedding_on_last(cand.cfg)  # saved by the first
    replicated = sum(replicated_params(cand.cfg, stages, ep))  # held by every tp rank, written 1/tp by each
    saved = n - (local_params(cand.cfg, cand.tp).head if tied_copy else 0) - replicated * (1 - 1 / cand.tp)
    experts = expert_params(cand.cfg, cand.tp, stages, ep) if ep > 1 else 0  # (replicated over tp: 1/tp of them left)
    share = (saved - experts / cand.tp) * 12 / cand.dp_cp + experts / cand.tp * 12 / cand.edp
    if cand.lora is not None:  # a checkpoint holds the adapters and their moments; the base is read from its source
        saved = trainable_params(cand, stages)
        share = saved * 12 / cand.dp_cp
    if cand.zero_stage >= 3:  # partitions, plus one parameter's tp shard before it is partitioned
        built = n * cand.prec.param / cand.dp_cp + largest * 4
    else:
        built = n * 4
    # a resume reads the values that build the stage (ZeRO-3: dp rank 0, which broadcasts them), then DDP the Adam
    # moments of its tp shard, ZeRO its partition of master and moments
    masters_and_moments = share if cand.zero_stage else saved * 8
    return StateMemory(
        startup_device=built,
        startup_host=largest * cand.tp * 4,
        save_host=share + largest * 4,
        save_written=share,
        resume_read=n * 4 + masters_and_moments,
    )


def worst_state_memory(cand: Candidate, ranks: list[int]) -> StateMemory:
    """Each figure's maximum over the given pipeline ranks."""
    per_rank = [state_memory(cand, r) for r in ranks]
    return StateMemory(*(max(getattr(s, f) for s in per_rank) for f in StateMemory.__dataclass_fields__))
