"""The four pieces of glue that let DeepSpeed's ZeRO engines run under torch's pipeline schedules, one engine per
stage over the dp group (docs/zero.md explains each and the measurements behind it):

 1. `TopologyMPU` hands DeepSpeed our dp and tp groups;
 2. ZeRO-3's module-trace check runs over dp, not the world (stages trace different modules: a deadlock);
 3. `ZeroPipelineStage` brackets every micro-batch backward as `DeepSpeedEngine.backward` would;
 4. the loss is scaled, not the gradients (the trainer's loss; `scale_grads=False` in the schedule).

`check_glue` fails loudly, naming the piece, when a DeepSpeed upgrade moves an internal used here.
"""

from __future__ import annotations

import contextlib
import functools
import inspect

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage

from trainer3d.private_api import WRITTEN_FOR, require


@functools.cache
def check_glue() -> None:
    """Fail loudly, naming the piece, if this DeepSpeed moved an internal the glue uses (the table:
    trainer3d/private_api.py; and DeepSpeedEngine.backward's own steps, which glue 3 reproduces). Once a process
    (a pass is remembered: the installed DeepSpeed cannot change under it), since reading DeepSpeedEngine's source
    costs ~0.7 s of CPU and every engine build (one per stage) asks."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    require("zero/")
    src = inspect.getsource(DeepSpeedEngine)  # DeepSpeedEngine.backward itself is an nvtx wrapper
    src = src[src.find("    def backward(") :]
    src = src[: src.find("\n    def ", 1)]
    missing = [m for m in ("_running_engine_backward_lock", "_running_engine_backward_count", "_backward_epilogue()")
               if m not in src]
    if missing:
        raise RuntimeError(f"trainer3d/zero/glue.py does not fit this DeepSpeed: DeepSpeedEngine.backward no longer "
                           f"uses {', '.join(missing)} (glue 3); it was written for {WRITTEN_FOR}.")


# ---- 1. mpu ----------------------------------------------------------------------------------------------------
class TopologyMPU:
    """DeepSpeed's `mpu` interface over our Topology. Data parallel = dp (dp × cp for gradients and ZeRO's partitions);
    DeepSpeed's "model parallel" = tp
    (used for its own grad-norm/overflow reductions, and for which tensor-parallel rank broadcasts)."""

    def __init__(self, topo):
        self.topo = topo

    def _ranks(self, group):
        return dist.get_process_group_ranks(group) if group is not None else [dist.get_rank()]

    def get_data_parallel_group(self):
        return self.topo.dp_group

    def get_data_parallel_rank(self):
        return self.topo.dp_rank

    def get_data_parallel_world_size(self):
        return self.topo.layout.dp

    def get_data_parallel_group_ranks(self):
        return self._ranks(self.topo.dp_group)

    # The ranks holding the same parameters, dp × cp: DeepSpeed reduces gradients and partitions ZeRO state over its
    # "sequence data parallel" group (its hook for Ulysses; no sequence-parallel size is declared, so nothing else of
    # Ulysses turns on) and sizes the batch by the data-parallel group alone. At cp 1 both are dp.
    def get_sequence_data_parallel_group(self):
        return self.topo.dp_cp_group

    def get_sequence_data_parallel_rank(self):
        return self.topo.dp_cp_rank

    def get_sequence_data_parallel_world_size(self):
        return self.topo.layout.dp_cp

    def get_model_parallel_group(self):
        return self.topo.tp_group

    def get_model_parallel_rank(self):
        return self.topo.tp_rank

    def get_model_parallel_world_size(self):
        return self.topo.layout.tp

    get_tensor_model_parallel_group = get_model_parallel_group
    get_tensor_model_parallel_rank = get_model_parallel_rank
    get_tensor_model_parallel_world_size = get_model_parallel_world_size

    def get_tensor_model_parallel_src_rank(self):
        return self._ranks(self.topo.tp_group)[0]

    def get_pipeline_model_parallel_group(self):
        return self.topo.pp_group

    def get_pipeline_model_parallel_rank(self):
        return self.topo.pp_rank

    def get_pipeline_model_parallel_world_size(self):
        return self.topo.layout.pp

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size


# ---- 2. ZeRO-3's trace check over dp instead of the world --------------------------------------------------------
_TRACE_CHECK_GROUP = None  # the dp group of the engines being trained (one Topology at a time per process)


def _assert_ints_same_over_dp(ints: list[int]) -> None:
    """deepspeed.runtime.zero.utils.assert_ints_same_as_other_ranks, limited to the dp group: only dp peers run
    the same stage module, so only they can (and must) agree on its module/parameter trace."""
    group = _TRACE_CHECK_GROUP
    if group is None or dist.get_world_size(group) == 1:
        return
    # Parameter ds_ids come from a process-wide counter (partition_parameters.Init.param_id): a process that
    # built other ZeRO-3 models before (tests run many layouts per process) has them shifted. Compare the
    # trace relative to its smallest id.
    base = min(ints) if ints else 0
    # NCCL groups move device tensors only (gloo, CPU ones); DeepSpeed's own check uses the accelerator too
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else None
    mine = torch.tensor([len(ints)] + [i - base for i in ints], dtype=torch.long, device=device)
    n = torch.tensor([mine.numel()], dtype=torch.long, device=device)
    sizes = [torch.zeros_like(n) for _ in range(dist.get_world_size(group))]
    dist.all_gather(sizes, n, group=group)
    if any(int(s) != int(n) for s in sizes):
        raise RuntimeError(f"ZeRO-3 trace length differs across dp ranks: {[int(s) for s in sizes]}")
    gathered = [torch.zeros_like(mine) for _ in sizes]
    dist.all_gather(gathered, mine, group=group)
    if any(not torch.equal(g, mine) for g in gathered):
        raise RuntimeError(
            f"ZeRO-3 module/parameter trace differs across dp ranks (rank {dist.get_rank()}): "
            f"{[g.tolist() for g in gathered]}"
        )


def patch_zero3_trace_check(dp_group) -> None:
    """Make ZeRO-3's trace check compare the engines of `dp_group` only (glue 2)."""
    global _TRACE_CHECK_GROUP
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    _TRACE_CHECK_GROUP = dp_group
    # (that ppc has the name is checked with every other private name of glue.py: check_glue, private_api.py)
    ppc.assert_ints_same_as_other_ranks = _assert_ints_same_over_dp


# ---- 3. the pipeline stage that brackets every micro-batch backward ------------------------------------------------
class ZeroPipelineStage(PipelineStage):
    """A PipelineStage whose submodule is a DeepSpeedEngine (glue 3, docs/zero.md), with the stage's other engines
    (`trainer3d_companions`: its experts' under expert parallelism, zero/experts.py) bracketed alike."""

    def forward_maybe_with_nosync(self, *args, **kwargs):
        for other in self.submod.trainer3d_companions:
            other.module()  # its ZeRO-3 start-of-forward hook (its modules run inside the stage's forward)
        # engine.module, not engine(...): docs/zero.md (engine.forward's output hooks).
        return self.submod.module(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        if backward_type != "full":
            raise RuntimeError("ZeRO stages run full backwards only (split-backward schedules are refused in config)")
        boundary = last_backward and not self.submod.trainer3d_hold_boundary  # (ZeroEngine.hold_boundary)
        with engines_backward([self.submod, *self.submod.trainer3d_companions], boundary):
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)


@contextlib.contextmanager
def engines_backward(engines: list, boundary: bool):
    """DeepSpeed's brackets around a backward through `engines` (a stage's, with its companions): each one's prologue,
    the backward, each one's epilogue (its reduction, at the accumulation `boundary` the last). With nothing inside,
    the boundary's reduction of gradients earlier backwards left (ZeroEngine.release_boundary)."""
    with contextlib.ExitStack() as stack:
        for engine in engines:
            stack.enter_context(_engine_backward(engine, boundary))
        yield
        for engine in reversed(engines):
            engine._backward_epilogue()


@contextlib.contextmanager
def _engine_backward(engine, last_backward: bool):
    """What DeepSpeedEngine.backward does around loss.backward(), minus the loss scaling (ours is in the loss) and
    the epilogue (run by the caller once the backward is done, before this exits)."""
    engine.set_gradient_accumulation_boundary(last_backward)
    if is_zero_optimizer(engine.optimizer):
        engine.optimizer.clear_backward_seen_flag()
    with engine._running_engine_backward_lock:
        engine._running_engine_backward_count += 1
        engine._running_engine_backward = True
    try:
        engine._backward_prologue()
        yield
    finally:
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count -= 1
            engine._running_engine_backward = engine._running_engine_backward_count > 0


def drop_gradients(engine) -> None:
    """Drop what the backwards since the last step left in `engine` (Engine.discard, a loss_fn refused mid-pass):
    its optimizer's zero_grad; for ZeRO-1/2 also the sums it keeps across backwards short of the accumulation
    boundary (all_grad_tensors) and its count of micro-steps, reset as its step() resets them, so the next backward
    writes its buffers afresh instead of adding to them (an offloaded one's host copies too). ZeRO-3's zero_grad
    restarts its own count, after which its next reduction overwrites the partitions."""
    from deepspeed.runtime.zero import stage_1_and_2

    opt = engine.optimizer
    opt.zero_grad(set_to_none=True)
    if isinstance(opt, stage_1_and_2.DeepSpeedZeroOptimizer):
        opt.all_grad_tensors = {}
        opt.micro_step_id = stage_1_and_2.INITIAL_MICRO_STEP_ID


def is_zero_optimizer(opt) -> bool:
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    return isinstance(opt, ZeROOptimizer)
