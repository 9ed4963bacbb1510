"""Every private name of torch and DeepSpeed that trainer3d relies on, in one table, and the check that fails with one
sentence when an installed version no longer has one. Each user calls `require(<its module>)` before it relies on
them (zero/glue.check_glue, parallel/compile.check_compiler); tests/test_private_api.py checks the whole table
against the installed versions and that the package uses no private name the table does not list, so a new torch or
DeepSpeed fails loudly there and nowhere else.
"""

from __future__ import annotations

import dataclasses
import importlib
import inspect
import re
from dataclasses import dataclass

# What the table was written and checked against (torch: CI's pin and the GPU image's; DeepSpeed: the pin).
WRITTEN_FOR = "torch 2.11-2.13 and DeepSpeed 0.19"


@dataclass(frozen=True)
class Private:
    """`path`: a module, then attributes (`kind` "attr"), optionally with the parameter names trainer3d calls it with
    or overrides it with, in order (`params`); a dataclass and one of its fields ("field"); or a module whose source
    must still assign an attribute of that name on the objects it creates ("set": `x.name = ...`, `"name"` handed
    to setattr, or `def name(`: attributes DeepSpeed and torch put on parameters, optimizers and modules at run time).
    Internal names without a leading underscore are listed too: what a library does not document may change as
    freely. `user`: the trainer3d module relying on it; `torch_before`: a version below which alone it does (a mend
    for older torch), so a newer torch that drops the name is not refused."""

    path: str
    user: str
    why: str
    kind: str = "attr"
    torch_before: str | None = None  # used only on torch older than this (a mend for those versions)
    params: tuple[str, ...] | None = None  # "attr" of a function or aten op: its leading parameter names

    @property
    def name(self) -> str:
        return self.path.rpartition(".")[2]


_Z = "deepspeed.runtime.zero"
_S3 = f"{_Z}.stage3.DeepSpeedZeroOptimizer_Stage3"
_S12 = f"{_Z}.stage_1_and_2.DeepSpeedZeroOptimizer"
_ENGINE = "deepspeed.runtime.engine.DeepSpeedEngine"
_FRAGMENT = "deepspeed.utils.tensor_fragment.tensor_fragment"

PRIVATE: tuple[Private, ...] = (
    # torch
    Private("torch.optim.optimizer._default_to_fused_or_foreach", "optim.py", "AdamW fused where torch has it"),
    Private("torch._foreach_mul_", "parallel/ddp.py", "scale every gradient in one kernel"),
    Private("torch._foreach_norm", "parallel/engine.py (the norm of parallel/ddp.py and zero/engine.py)",
            "the gradient norm on CUDA in one kernel per dtype, called (tensors, 2, dtype=)"),
    Private("torch.nn.parallel.DistributedDataParallel._set_params_and_buffers_to_ignore_for_model", "parallel/ddp.py",
            "experts split over ep left out of DDP (reduced over their edp group)"),
    Private("torch._grouped_mm", "models/moe.py", "the experts' grouped matmul (a loop over experts where absent)"),
    Private("torch._dynamo.eval_frame.check_if_dynamo_supported", "parallel/compile.py", "--compile's check"),
    Private("torch.utils._triton.has_triton", "parallel/compile.py", "--compile's check on CUDA"),
    Private("torch._inductor.config.cpp", "parallel/compile.py", "--compile's C++ compiler check on CPU"),
    Private("torch._inductor.cpp_builder.get_cpp_compiler", "parallel/compile.py", "--compile's check on CPU"),
    Private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu", "parallel/context_parallel.py",
            "cp's later chunks on CPU: flash attention with its log-sum-exp (no materialized mask)",
            params=("query", "key", "value", "dropout_p", "is_causal")),
    Private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "parallel/context_parallel.py",
            "the backward of the same, called positionally",
            params=("grad_out", "query", "key", "value", "out", "logsumexp", "dropout_p", "is_causal")),
    Private("torch._ops._schema", "private_api.py", "an aten op's parameter names, checked here", "set"),
    Private("torch.nn.modules.module._parameters", "parallel/tensor_parallel.py, models/__init__.py",
            "a module's parameter slots written directly: materializing shards in place of meta parameters", "set"),
    Private("torch.distributed.pipelining.stage._PipelineStageBase.forward_maybe_with_nosync", "zero/glue.py",
            "a ZeRO stage runs its engine's module", params=("self",)),
    Private("torch.distributed.pipelining.stage._PipelineStageBase.backward_maybe_with_nosync", "zero/glue.py",
            "a ZeRO stage brackets each micro-batch's backward",
            params=("self", "backward_type", "bwd_kwargs", "last_backward")),
    Private("torch.distributed.distributed_c10d._get_default_store", "distributed/collectives.py",
            "the rendezvous store: the heartbeat, and ranks waiting for their node's data cache without a timeout"),
    Private("torch.distributed.pipelining.stage.fwd_cache", "parallel/pipeline.py",
            "the last stage frees its logits' storage after their backward", "set"),
    Private("torch.distributed.pipelining.stage.args_recv_info", "parallel/pipeline.py",
            "torch < 2.13: receive buffers made by a first eval() pass get gradients", "set", torch_before="2.13"),
    Private("torch.distributed.pipelining.stage.buffer", "parallel/pipeline.py",
            "torch < 2.13: receive buffers made by a first eval() pass get gradients", "set", torch_before="2.13"),
    Private("torch.distributed.pipelining.stage._PipelineStageBase._get_init_p2p_neighbors_ops", "parallel/pipeline.py",
            "torch < 2.13: no link opened from a stage to a stage of its own rank", torch_before="2.13"),
    # DeepSpeed: the glue under torch's pipeline schedules (docs/zero.md)
    Private(f"{_Z}.partitioned_param_coordinator.assert_ints_same_as_other_ranks", "zero/glue.py",
            "ZeRO-3's trace check over dp only"),
    Private(f"{_ENGINE}._backward_prologue", "zero/glue.py", "backward bracketing"),
    Private(f"{_ENGINE}._backward_epilogue", "zero/glue.py", "backward bracketing"),
    Private("deepspeed.runtime.engine._running_engine_backward", "zero/glue.py", "backward bracketing", "set"),
    Private("deepspeed.runtime.engine._running_engine_backward_lock", "zero/glue.py", "backward bracketing", "set"),
    Private("deepspeed.runtime.engine._running_engine_backward_count", "zero/glue.py", "backward bracketing", "set"),
    Private(f"{_S12}.loss_scale", "zero/engine.py", "clipping through the loss scale (ZeRO-1/2)"),
    # DeepSpeed: one accumulation boundary for several passes (trainer3d.engine's calls; ZeroEngine.release_boundary)
    Private(f"{_S12}.setup_buckets", "zero/engine.py", "a boundary's reduction buckets without a gradient hook"),
    Private(f"{_S12}.get_gradient_for_reduction", "zero/engine.py", "ZeRO-1's held gradients, reduced at the boundary"),
    Private(f"{_S12}.reduce_ready_partitions_and_remove_grads", "zero/engine.py",
            "ZeRO-1's held gradients, reduced at the boundary", params=("self", "param", "i")),
    Private(f"{_Z}.stage_1_and_2.partition_gradients", "zero/engine.py", "ZeRO-2 reduced in its hooks", "set"),
    Private(f"{_Z}.stage_1_and_2.bit16_groups", "zero/engine.py", "ZeRO-1's parameters, by group", "set"),
    Private(f"{_Z}.stage_1_and_2.all_grad_tensors", "zero/glue.py", "a discarded pass's sums (drop_gradients)", "set"),
    Private(f"{_Z}.stage_1_and_2.micro_step_id", "zero/glue.py", "a discarded pass's count (drop_gradients)", "set"),
    Private(f"{_Z}.stage_1_and_2.INITIAL_MICRO_STEP_ID", "zero/glue.py", "the count step() restarts from"),
    Private(f"{_S3}.loss_scale", "zero/engine.py", "clipping through the loss scale (ZeRO-3)"),
    # DeepSpeed: gradients, norms and the tied embedding
    Private(f"{_FRAGMENT}.get_lp_grad_fragment", "zero/grads.py", "ZeRO-1/2 gradient fragments"),
    Private(f"{_FRAGMENT}.lp_fragment_address", "zero/grads.py, zero/state.py", "a ZeRO-1/2 fragment's place",
            "field"),
    Private(f"{_Z}.stage_1_and_2._hp_mapping", "zero/grads.py, zero/state.py", "ZeRO-1/2 parameter fragments", "set"),
    Private("deepspeed.runtime.bf16_optimizer._index_in_param_group", "zero/grads.py", "ZeRO-1/2 gradient fragments",
            "set"),
    Private(f"{_Z}.stage3._z3_optimizer", "zero/grads.py", "ZeRO-3 local gradients", "set"),
    Private(f"{_S3}._get_fp32_grad_state_partition", "zero/grads.py", "tied embedding with NVMe-swapped parameters"),
    Private(f"{_S3}._swappable_optimizer_subgroup", "zero/grads.py, zero/state.py", "NVMe-swapped sub-groups"),
    Private(f"{_S3}._writeback_swap_state", "zero/grads.py", "tied embedding with NVMe-swapped parameters"),
    Private(f"{_S3}._constant_buffered_norm2", "zero/grads.py", "ZeRO-3 offload gradient norms"),
    Private(f"{_S3}.norm_for_param_grads", "zero/engine.py, zero/grads.py",
            "ZeRO-3 offload's partition norms: the global norm without copying gradients back", "set"),
    Private(f"{_S3}.get_param_id", "zero/engine.py, zero/grads.py, zero/state.py", "ZeRO-3's per-parameter keys"),
    Private(f"{_Z}.stage3.fp32_partitioned_groups_flat", "zero/grads.py, zero/memory.py, zero/state.py",
            "ZeRO-3's fp32 master partitions", "set"),
    Private(f"{_Z}.stage3.swap_optimizer", "zero/state.py", "ZeRO-Infinity: the optimizer lives on NVMe", "set"),
    Private(f"{_Z}.stage3.grad_position", "zero/state.py", "a parameter's place in its ZeRO-3 sub-group", "set"),
    Private(f"{_Z}.stage_1_and_2.single_partition_of_fp32_groups", "zero/grads.py", "ZeRO-1/2's fp32 masters", "set"),
    Private("deepspeed.runtime.bf16_optimizer.fp32_groups_flat_partition", "zero/grads.py",
            "stage 0's bf16 optimizer's fp32 masters", "set"),
    Private("deepspeed.runtime.bf16_optimizer.BF16_Optimizer", "zero/grads.py", "how a ZeRO optimizer holds state"),
    Private(f"{_Z}.partition_parameters.ds_tensor", "zero/grads.py, zero/memory.py, zero/state.py",
            "a ZeRO-3 parameter's partition", "set"),
    Private(f"{_Z}.partition_parameters.ds_numel", "zero/state.py", "a ZeRO-3 parameter's full size", "set"),
    Private(f"{_Z}.partition_parameters.ds_shape", "zero/engine.py, zero/state.py", "a ZeRO-3 parameter's shape",
            "set"),
    Private(f"{_Z}.partition_parameters.param_swapper", "zero/engine.py", "one NVMe swapper per stage", "set"),
    Private(f"{_Z}.utils.is_zero_param", "zero/grads.py", "DeepSpeed's own test for a ZeRO-3 parameter"),
    Private(f"{_FRAGMENT}.optim_fragment", "zero/state.py", "whether ZeRO-1/2 linked a parameter's Adam views",
            "field"),
    Private(f"{_FRAGMENT}.hp_fragment", "zero/state.py", "a ZeRO-1/2 parameter's fp32 master fragment (saved as it lies)",
            "field"),
    Private(f"{_FRAGMENT}.get_optim_state_fragment", "zero/state.py",
            "a ZeRO-1/2 parameter's Adam moment fragments (saved as they lie)"),
    Private("deepspeed.runtime.zero.stage3.clear_backward_seen_flag", "zero/glue.py", "backward bracketing", "set"),
    Private("deepspeed.ops.adam.cpu_adam.fp32_optimizer_states", "zero/state.py",
            "DeepSpeedCPUAdam's moment dtype", "set"),
    Private("deepspeed.ops.op_builder.builder.OpBuilder.jit_load", "zero/ops.py",
            "ops built without -g, async_io with a precompiled torch/extension.h", params=("self", "verbose")),
    Private("deepspeed.ops.op_builder.builder.OpBuilder.cxx_args", "zero/ops.py",
            "ops built without -g, async_io with a precompiled torch/extension.h"),
    Private("torch.utils.cpp_extension._run_ninja_build", "zero/ops.py",
            "the header precompiled with the flags of the build.ninja torch just wrote, before ninja compiles",
            params=("build_directory", "verbose", "error_prefix")),
    Private("deepspeed.comm.torch.build_shm_op", "zero/ops.py", "no shared-memory inference op on a CPU host"),
    # DeepSpeed: checkpoint state
    Private(f"{_S3}._optimizer_states_and_gradient_swap_in", "zero/state.py", "loading under NVMe optimizer offload"),
    Private(f"{_S3}._optimizer_states_and_gradient_swap_out", "zero/state.py", "loading under NVMe optimizer offload"),
    Private(f"{_S3}._get_param_partition_rank", "zero/state.py", "a ZeRO-3 rank reads only its partition"),
    Private(f"{_S12}._lazy_init_hp_params_optimizer_state", "zero/state.py", "re-linking ZeRO-1/2's Adam views"),
    Private(f"{_Z}.stage_1_and_2._hp_optimizer_states_linked", "zero/state.py", "re-linking ZeRO-1/2's Adam views",
            "set"),
)


def _resolve(path: str):
    """The object a dotted path names: the longest importable module prefix, then attributes."""
    parts = path.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ImportError:
            continue
        for attr in parts[i:]:
            obj = getattr(obj, attr)
        return obj
    raise ImportError(path)


def present(entry: Private) -> bool:
    owner, _, name = entry.path.rpartition(".")
    try:
        if entry.kind == "attr":
            obj = _resolve(entry.path)
            return entry.params is None or _leading_params(obj, len(entry.params)) == entry.params
        if entry.kind == "field":
            return name in {f.name for f in dataclasses.fields(_resolve(owner))}
        # "set": the module's source still assigns the attribute (or hands its name to setattr, or defines it)
        pattern = rf"\.{name}\s*(?::[^=\n]+)?=(?!=)|[\"']{name}[\"']|\bdef {name}\("
        return re.search(pattern, inspect.getsource(_resolve(owner))) is not None
    except (ImportError, AttributeError, TypeError, OSError, ValueError):
        return False


def _leading_params(obj, n: int) -> tuple[str, ...]:
    """The first `n` parameter names of a function, or of an aten op's schema."""
    schema = getattr(obj, "default", None)  # an OpOverloadPacket: its default overload's schema
    if schema is not None and hasattr(schema, "_schema"):
        return tuple(a.name for a in schema._schema.arguments)[:n]
    return tuple(inspect.signature(obj).parameters)[:n]


def needed(entry: Private) -> bool:
    """Whether the installed torch is one the entry's user relies on it for."""
    if entry.torch_before is None:
        return True
    import torch

    return torch.__version__ < entry.torch_before


def missing(user: str | None = None) -> list[Private]:
    """The entries (of one trainer3d module, or all) this installation needs and lacks."""
    return [e for e in PRIVATE if (user is None or user in e.user) and needed(e) and not present(e)]


def require(user: str, error: type[Exception] = RuntimeError) -> None:
    """Raise `error`, one sentence, if this torch or DeepSpeed lacks a private name `user` relies on."""
    gone = missing(user)
    if gone:
        names = "; ".join(f"{e.path} ({e.why})" for e in gone)
        raise error(
            f"trainer3d/{user} relies on private names this installation lacks: {names}; it was written for "
            f"{WRITTEN_FOR}: install those, or update trainer3d/private_api.py and its users."
        )
