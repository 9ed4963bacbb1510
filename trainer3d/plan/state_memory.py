"""What one rank needs for the model's state outside a training step: at start-up, during a checkpoint save, and the
bytes it writes and reads (issue 22), by the same arithmetic as plan/memory.py, for what the code does today:

- a save (checkpoint/save.py) keeps this rank's pieces in host memory, a 1/dp slice of its tp shard of every fp32
  value and Adam moment (12 bytes a parameter), plus one tensor at a time assembled over dp;
- start-up (parallel/parallelize.py) materializes every parameter of the rank's stages (its tp shard, fp32), each
  cut from a full tensor (the initialisation is layout-free): whole under DDP and ZeRO-1/2, which keep it so;
  under ZeRO-3 each parameter is partitioned over dp as soon as it exists (zero/engine.ZeroEngineFactory), so the
  rank holds its partitions plus one parameter;
- a resume reads each parameter's tp shard to build the stage (ZeRO-3: only dp rank 0, which broadcasts it), then
  the fp32 master and moments: ZeRO-3 only its partition, DDP and ZeRO-1/2 the whole tp shard.
"""

from __future__ import annotations

from dataclasses import dataclass

from trainer3d.plan.candidate import Candidate, max_param_tensor, rank_params


@dataclass(frozen=True)
class StateMemory:
    """Bytes per rank."""

    startup_device: float  # what the stage's parameters take when built, plus the largest full tensor cut from
    save_host: float  # host memory a save adds: the rank's pieces plus one tensor
    save_written: float  # what the rank writes
    resume_read: float  # what the rank reads when resuming


def state_memory(cand: Candidate, pp_rank: int) -> StateMemory:
    stages = cand.stages(pp_rank)
    n = rank_params(cand.cfg, cand.tp, stages)
    largest = max_param_tensor(cand.cfg, cand.tp, stages)
    share = n * 12 / cand.dp
    cut_from = largest * cand.tp * 4  # the full tensor a tp shard is cut from (and, ZeRO-3, the shard itself)
    if cand.zero_stage >= 3:
        masters_and_moments = share
        built = n * cand.prec.param / cand.dp + largest * 4
    else:
        masters_and_moments = n * (12 if cand.zero_stage else 8)  # DDP: the moments (the values built the stage)
        built = n * 4
    return StateMemory(
        startup_device=built + cut_from,
        save_host=share + largest * 4,
        save_written=share,
        resume_read=n * 4 + masters_and_moments,
    )


def worst_state_memory(cand: Candidate, ranks: list[int]) -> StateMemory:
    """Each figure's maximum over the given pipeline ranks."""
    per_rank = [state_memory(cand, r) for r in ranks]
    return StateMemory(*(max(getattr(s, f) for s in per_rank) for f in StateMemory.__dataclass_fields__))
