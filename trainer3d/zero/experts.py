"""ZeRO under expert parallelism: the experts of a stage get a DeepSpeed engine of their own, over the edp group.

Under --ep N a stage's experts differ between the ep ranks of a dp×cp line, so ZeRO must not partition them over
that line (each partition would mix other ranks' experts): they are partitioned over the ranks that hold the same
experts, the edp group (dp·cp/N ranks), and everything else over dp×cp as without experts. DeepSpeed partitions one
engine's parameters over one group (its mpu's), so each stage has two engines: the stage's own, built while its
Experts modules are detached (`detached`), and one over an `ExpertShard` holding them, whose mpu (`ExpertMPU`) says
edp. The experts stay in the stage's forward where they were; ZeRO-3's hooks on them are the expert engine's, its
reduce-scatter averages their gradients over edp (the 1/ep of expert_parallel.py's backward makes that the mean
over dp×cp) and its optimizer steps their partitions. (DeepSpeed's own MoE support does the same over its expert
groups for ZeRO-1/2 only, and only for its own MoE layer.)
"""

from __future__ import annotations

import contextlib
import copy

import torch.nn as nn

from trainer3d.models.moe import MoE
from trainer3d.zero.glue import TopologyMPU


class ExpertMPU(TopologyMPU):
    """The mpu of an expert engine: its data-parallel group, for partitions, reductions and batch sizes, is edp."""

    def get_data_parallel_group(self):
        return self.topo.edp_group

    def get_data_parallel_rank(self):
        return self.topo.edp_rank

    def get_data_parallel_world_size(self):
        return self.topo.layout.edp

    def get_data_parallel_group_ranks(self):
        return self._ranks(self.topo.edp_group)

    get_sequence_data_parallel_group = get_data_parallel_group
    get_sequence_data_parallel_rank = get_data_parallel_rank
    get_sequence_data_parallel_world_size = get_data_parallel_world_size


class ExpertShard(nn.Module):
    """A stage's Experts modules (owned by their MoE blocks too) under one module, for the expert engine. Its forward
    does nothing: called once before each stage forward, it runs ZeRO-3's start-of-forward hook for the engine, whose
    modules are only ever called from inside the stage."""

    def __init__(self, experts: list[nn.Module]):
        super().__init__()
        self.experts = nn.ModuleList(experts)

    def forward(self) -> None:
        return None


def moe_blocks(stage: nn.Module) -> list[MoE]:
    return [m for m in stage.modules() if isinstance(m, MoE)]


@contextlib.contextmanager
def detached(blocks: list[MoE]):
    """The blocks' Experts modules taken out of the stage (its engine then neither sees nor partitions them), and
    put back."""
    held = [(b, b.experts) for b in blocks]
    for b in blocks:
        del b.experts  # nn.Module.__delattr__: out of the module's children
    try:
        yield [e for _, e in held]
    finally:
        for b, e in held:
            b.experts = e


def expert_config(ds_config: dict, edp: int) -> dict:
    """The stage's DeepSpeed JSON for its expert engine: the same, with the batch sized over edp (DeepSpeed checks
    train_batch_size = micro × accumulation × its data-parallel size)."""
    ds = copy.deepcopy(ds_config)
    ds["train_batch_size"] = ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * edp
    return ds


def over_edp(layout, spec) -> bool:
    """Whether ZeRO partitions a parameter of this split (`spec`: its tp_spec or None) over edp rather than dp×cp:
    an expert's, under expert parallelism."""
    return layout.ep > 1 and spec is not None and spec.axis == "ep"
