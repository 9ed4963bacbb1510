"""DeepSpeed ZeRO (stages 0-3, CPU and NVMe offload) as the data-parallel axis, composed with our TP and PP.

Why this works at all: DeepSpeed's own PipelineEngine refuses ZeRO-2/3. We do not use it. Each pipeline stage
module (already TP-sharded and materialized by parallelize.py) gets its own `deepspeed.initialize`, over the dp
group only, and torch.distributed.pipelining drives the stages. What DeepSpeed normally does around
`engine.backward(loss)` is done here around every micro-batch backward that torch's schedule runs.

The glue, all in this file (DeepSpeed internals: pinned by `check_deepspeed_version`, tested by
tests/test_zero.py::test_glue_contract so that an upgrade that moves them fails loudly):

 1. mpu: `TopologyMPU` hands DeepSpeed our sub-groups: data parallel = dp, model parallel = tp (what DeepSpeed
    calls the model-parallel group is only used for its own grad norm and overflow checks, which we replace).
 2. ZeRO-3's `PartitionedParameterCoordinator.reset_step` checks its module trace with
    `assert_ints_same_as_other_ranks`, a broadcast on the *world* group. Stages own different modules, so
    stage 0 sits in that broadcast while stage 1 waits for activations: a deadlock. `_patch_zero3_trace_check`
    replaces the name in partitioned_param_coordinator with the same check over the dp group.
 3. Backward bracketing (`ZeroPipelineStage`): torch's schedule calls torch.autograd.backward itself, so ZeRO's
    per-parameter hooks fire but nothing marks the start and end of a backward. Every micro-batch backward is
    bracketed exactly as `DeepSpeedEngine.backward` brackets its `loss.backward()`: set the accumulation
    boundary (True on the schedule's last micro-batch only), clear the optimizer's backward-seen flag, mark the
    engine as running its own backward (which silences the "torch-style backward" post hook so the epilogue
    runs exactly once), `engine._backward_prologue()`, the backward, `engine._backward_epilogue()` (flush of
    the last bucket, reduce(-scatter) over dp at the boundary, accumulate-vs-overwrite bookkeeping).
    The stage's forward calls the engine's *module*, not `engine(...)`: in 0.19.8 `engine.forward` registers
    output hooks that run the prologue a second time and divide each stage's output gradient by
    gradient_accumulation_steps, which compounds across stages (stage k's gradient would be scaled 1/gas^(pp-k)).
    Each piece is needed (measured at dp2×pp2, 4 steps, against DDP): forward through `engine(...)` with this
    bracket: losses off by 1.6e-4; DeepSpeed's own torch-style hooks alone (boundary set, no bracket), or no
    bracket at all: KeyError in ZeRO-2's reduction; without clear_backward_seen_flag: ZeRO-3 off by 1e-3;
    without the running-backward mark: the epilogue runs twice and a rank crashes. With all of it: 0 to 8e-8.
    Every rank builds the same number of engines in the same order (one per stage it owns): ZeRO-3's engine
    init has world-group barriers (stage3.py `_create_fp16_partitions_with_defragmentation`), which pair up
    across pipeline stages only that way.
 4. The loss is scaled, not the gradients: the trainer divides each micro-batch loss by the number of
    micro-batches and schedules with scale_grads=False; then one `engine.step()` per schedule step.
    ZeRO-1/2 also need static stage shapes (pipeline.stage_shapes): the schedule's dynamic shape inference runs a
    forward/backward that fires DeepSpeed's hooks outside any bracket.

Use (see ds_configs/ for starting points; "auto" values come from the flags and the layout):

    python -m trainer3d.zero --build-ops     # once: DeepSpeed's JIT ops into $TORCH_EXTENSIONS_DIR (default
                                             # <checkout>/.cache/torch_extensions); .ci/run does this
    deepspeed --num_gpus 4 launch/train_gpt2.py --tp 2 --deepspeed_config ds_configs/zero3_offload.json
    torchrun --nproc_per_node 8 launch/train_gpt2.py --tp 2 --pp 2 --deepspeed_config ds_configs/zero1.json
    python -m trainer3d.zero --check-config ds_configs/zero3.json --world-size 8 --tp 2 --pp 2   # resolved JSON

On a host without GPUs `deepspeed --num_gpus N` still starts N local processes (DeepSpeed's runner has no
--num_procs; it sets CUDA_VISIBLE_DEVICES=0..N-1, which nothing reads on CPU) and passes --local_rank=i, which
the entry script accepts; DeepSpeed then picks its cpu accelerator and gloo.

The cross-stage gradient steps (`ZeroDataParallel.train_step`), after the schedule, before `engine.step()`:
 - tied embedding: the first stage's wte and the last stage's lm_head copy get the sum of both gradients.
   ZeRO-3 partitions each parameter on its own, so the copies' local partitions are aligned and are summed
   directly (`safe_get_local_grad`/`safe_set_local_grad`); ZeRO-0/1/2 partition a flat group, so the full
   gradient is assembled (`safe_get_full_grad`), summed and written back (`safe_set_full_grad`).
 - global grad norm and clipping. DeepSpeed's own clipping is turned off (gradient_clipping 0 in the config it
   gets): its norm sums over its "model-parallel" group and counts a parameter by `is_model_parallel_parameter`
   or model-parallel rank 0, ZeRO-1/2 skip `ds_pipe_replicated` parameters and ZeRO-3 does not, and with
   several engines per rank (virtual stages) each engine would clip with its own norm. Instead every rank sums
   the squares of the gradient elements it owns after the dp reduction (its ZeRO partition, or at ZeRO-0 the
   whole gradient on dp rank 0 only), each parameter counted once (tp-replicated ones on tp rank 0, the tied
   copy on the first stage only), and all-reduces over the world group. Exact for every ZeRO stage, offload
   and schedule, because it only relies on "every gradient element lives on exactly one dp rank (or is
   replicated at ZeRO-0)". The clip, min(1, clip / (norm + 1e-6)) as in torch.nn.utils.clip_grad_norm_ and the
   DDP path, is applied by the ZeRO optimizer itself inside engine.step(): its loss scale is set to 1/coef for
   that one step, and ZeRO divides its fp32 gradient partitions by the loss scale wherever they live (device,
   CPU or NVMe swap), so nothing is copied back or swapped in for it.
 - a non-finite norm stops the run on every rank with a FloatingPointError (bf16/fp32 have no loss scale to
   back off, and ZeRO keeps accumulating into partitions that a skipped step would not reset).

Checkpoints: zero_state.py reads ZeRO's partitioned values and optimizer state as whole tensors and writes them
back, so checkpoint.py's layout-free files serve every engine.
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import inspect
import json
import math
import os
import sys
import warnings
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from trainer3d.zero import state as zero_state
from trainer3d.zero.config import (
    DeepSpeedSpec, build_ops, check_deepspeed_version, default_extensions_dir, resolve_deepspeed, use_prebuilt_ops,
)


def check_glue() -> None:
    """Fail loudly, naming the piece, if this DeepSpeed moved an internal the glue uses."""
    from deepspeed.runtime.base_optimizer import ZeROOptimizer
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3 as Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Stage12

    tensor_fragment = importlib.import_module("deepspeed.utils.tensor_fragment")

    needs = [
        (ppc, "assert_ints_same_as_other_ranks", "glue 2 (ZeRO-3 trace check over dp)"),
        (DeepSpeedEngine, "_backward_prologue", "glue 3 (backward bracketing)"),
        (DeepSpeedEngine, "_backward_epilogue", "glue 3 (backward bracketing)"),
        (DeepSpeedEngine, "set_gradient_accumulation_boundary", "glue 3 (backward bracketing)"),
        (ZeROOptimizer, "clear_backward_seen_flag", "glue 3 (backward bracketing)"),
        (tensor_fragment.tensor_fragment, "get_lp_grad_fragment", "ZeRO-1/2 gradient fragments (norm, clip)"),
        (tensor_fragment, "safe_get_local_grad", "ZeRO-3 local gradients (tied embedding, norm, clip)"),
        (tensor_fragment, "safe_set_local_grad", "ZeRO-3 local gradients (tied embedding, norm, clip)"),
        (tensor_fragment, "safe_get_full_grad", "ZeRO-0/1/2 tied embedding"),
        (tensor_fragment, "safe_set_full_grad", "ZeRO-0/1/2 tied embedding"),
        (Stage3, "_get_fp32_grad_state_partition", "ZeRO-3 tied embedding with NVMe-swapped parameters"),
        (Stage3, "_swappable_optimizer_subgroup", "ZeRO-3 tied embedding with NVMe-swapped parameters"),
        (Stage3, "_writeback_swap_state", "ZeRO-3 tied embedding with NVMe-swapped parameters"),
        (Stage3, "_constant_buffered_norm2", "ZeRO-3 offload gradient norms"),
        (Stage3, "_optimizer_states_and_gradient_swap_in", "checkpoint loading under NVMe optimizer offload"),
        (Stage3, "_optimizer_states_and_gradient_swap_out", "checkpoint loading under NVMe optimizer offload"),
        (Stage3, "_get_param_partition_rank", "checkpoint loading under NVMe optimizer offload"),
        (Stage12, "loss_scale", "clipping through the loss scale (ZeRO-1/2)"),
        (Stage3, "loss_scale", "clipping through the loss scale (ZeRO-3)"),
    ]
    missing = [f"{getattr(obj, '__name__', obj)}.{name} ({what})" for obj, name, what in needs if not hasattr(obj, name)]
    src = inspect.getsource(DeepSpeedEngine)  # DeepSpeedEngine.backward itself is an nvtx wrapper
    src = src[src.find("    def backward(") :]
    src = src[: src.find("\n    def ", 1)]
    for marker in ("_running_engine_backward_lock", "_running_engine_backward_count", "_backward_epilogue()"):
        if marker not in src:
            missing.append(f"DeepSpeedEngine.backward no longer uses {marker} (glue 3)")
    if missing:
        raise RuntimeError("trainer3d/zero.py glue does not fit this DeepSpeed: missing " + "; ".join(missing))


# ---- 1. mpu ----------------------------------------------------------------------------------------------------
class TopologyMPU:
    """DeepSpeed's `mpu` interface over our Topology. Data parallel = dp; DeepSpeed's "model parallel" = tp
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


def _patch_zero3_trace_check() -> None:
    from deepspeed.runtime.zero import partitioned_param_coordinator as ppc

    if not hasattr(ppc, "assert_ints_same_as_other_ranks"):
        raise RuntimeError(
            "deepspeed.runtime.zero.partitioned_param_coordinator no longer imports assert_ints_same_as_other_ranks: "
            "re-check trainer3d/zero.py glue 2 against this DeepSpeed version."
        )
    ppc.assert_ints_same_as_other_ranks = _assert_ints_same_over_dp


# ---- 3. the pipeline stage that brackets every micro-batch backward ------------------------------------------------
class ZeroPipelineStage(PipelineStage):
    """A PipelineStage whose submodule is a DeepSpeedEngine (see the module docstring, glue 3)."""

    def forward_maybe_with_nosync(self, *args, **kwargs):
        # engine.module, not engine(...): see the module docstring (engine.forward's output hooks).
        return self.submod.module(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs: dict, last_backward: bool = False):
        engine = self.submod
        if backward_type != "full":
            raise RuntimeError("ZeRO stages run full backwards only (split-backward schedules are refused in config)")
        engine.set_gradient_accumulation_boundary(last_backward)
        zero_opt = _is_zero_optimizer(engine.optimizer)
        if zero_opt:
            engine.optimizer.clear_backward_seen_flag()
        # What DeepSpeedEngine.backward does around loss.backward(), minus the loss scaling (ours is in the loss).
        with engine._running_engine_backward_lock:
            engine._running_engine_backward_count += 1
            engine._running_engine_backward = True
        try:
            engine._backward_prologue()
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
            engine._backward_epilogue()
        finally:
            with engine._running_engine_backward_lock:
                engine._running_engine_backward_count -= 1
                engine._running_engine_backward = engine._running_engine_backward_count > 0
        return result


def _is_zero_optimizer(opt) -> bool:
    from deepspeed.runtime.base_optimizer import ZeROOptimizer

    return isinstance(opt, ZeROOptimizer)


# ---- gradients as ZeRO holds them after the dp reduction ------------------------------------------------------------
@dataclass
class GradShare:
    """A piece of one parameter's gradient held by this rank after the dp reduction."""

    tensor: torch.Tensor  # ZeRO-0/1/2: a view (writable in place); ZeRO-3: read-only (may be a copy)
    dp_replicated: bool  # True: every dp rank holds the same values (ZeRO-0); False: dp-disjoint partition


def grad_shares(param: nn.Parameter) -> list[GradShare]:
    """This rank's share of `param`'s (dp-reduced) gradient, whatever ZeRO stage owns it. Valid between the last
    backward epilogue of a step and engine.step()."""
    from deepspeed.utils import safe_get_local_grad

    if hasattr(param, "ds_id"):  # ZeRO-3: each parameter partitioned on its own over dp (write: _z3_set_local_grad)
        g = safe_get_local_grad(param)
        return [] if g is None else [GradShare(g, False)]
    if hasattr(param, "_hp_mapping"):  # ZeRO-1/2: a fragment of the flat partition (None: owned by another rank)
        if param._hp_mapping is None:
            return []
        try:
            frag = param._hp_mapping.get_lp_grad_fragment(param._index_in_param_group)
        except ValueError:  # "only available immediately after backward": none held right now
            return []
        address = param._hp_mapping.lp_fragment_address
        if frag.numel() == param.numel() and address.numel < param.numel():  # a full buffer: keep the owned part
            frag = frag.reshape(-1).narrow(0, address.start, address.numel)
        return [GradShare(frag, False)]
    if param.grad is not None:  # ZeRO-0: DeepSpeed all-reduced the full gradient
        return [GradShare(param.grad, True)]
    return []


def _z3_set_local_grad(param: nn.Parameter, value: torch.Tensor) -> None:
    """deepspeed.utils.safe_set_local_grad, which in 0.19.8 asserts on the size of `param.ds_tensor`, a 1-element
    placeholder while the parameter itself is swapped out to NVMe; the write it guards goes to the optimizer's
    fp32 gradient partition, which exists either way. Same steps, without that assertion."""
    from deepspeed.utils import safe_set_local_grad

    if param.ds_tensor.numel() == value.numel():
        safe_set_local_grad(param, value)
        return
    opt = param._z3_optimizer
    if opt.offload_optimizer:
        opt.norm_for_param_grads[opt.get_param_id(param)] = opt._constant_buffered_norm2(value)
    grad, group = opt._get_fp32_grad_state_partition(param=param, release_swap_buffers=False)
    grad.data.copy_(value.flatten().data)
    if opt._swappable_optimizer_subgroup(group):
        opt._writeback_swap_state(group, write_opt_state=False, write_gradients=True)


# ---- the runtime: engines, the step, memory -----------------------------------------------------------------------
class ZeroDataParallel:
    """One DeepSpeed engine per pipeline stage module on this rank, over the dp group."""

    stage_cls = ZeroPipelineStage  # what the trainer builds its pipeline stages with

    def __init__(self, spec: DeepSpeedSpec, pm, topo, device: torch.device, verbose: bool = False):
        global _TRACE_CHECK_GROUP
        check_deepspeed_version()
        if "TORCH_EXTENSIONS_DIR" not in os.environ and os.path.isdir(default_extensions_dir()):
            use_prebuilt_ops()  # what `python -m trainer3d.zero --build-ops` built for this checkout
        import logging

        import deepspeed
        from deepspeed.utils import logger as ds_logger

        self.spec, self.pm, self.topo, self.device = spec, pm, topo, device
        check_glue()
        if not verbose:
            ds_logger.setLevel(logging.WARNING)
        # DeepSpeed 0.19 calls torch.distributed functions that torch 2.13 marks deprecated, on every step.
        warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)
        os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
        deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
        _patch_zero3_trace_check()
        _TRACE_CHECK_GROUP = topo.dp_group
        self.mpu = TopologyMPU(topo)
        self.engines = []
        for module in pm.modules:
            optimizer = self._client_optimizer(module)
            engine, *_ = deepspeed.initialize(
                model=module, optimizer=optimizer, config=copy.deepcopy(spec.ds_config), mpu=self.mpu,
                dist_init_required=False,
            )
            self.engines.append(engine)
        self._engine_of = {id(p): e for e in self.engines for p in e.module.parameters()}

    def _client_optimizer(self, module: nn.Module):
        """AdamW with the DDP path's parameter groups (decay on matrices only); DeepSpeedCPUAdam under offload."""
        cfg = self.spec.cfg
        params = list(module.parameters())
        groups = [
            {"params": [p for p in params if p.dim() >= 2], "weight_decay": cfg.weight_decay},
            {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
        ]
        groups = [g for g in groups if g["params"]]
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=self.spec.eps)
        if self.spec.offload_optimizer != "none":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=self.spec.adamw, **kw)
        return (torch.optim.AdamW if self.spec.adamw else torch.optim.Adam)(groups, **kw)

    # -- one optimizer step -------------------------------------------------------------------------------------
    def train_step(self, trainer, batch: torch.Tensor) -> dict:
        from trainer3d.train.trainer import lr_at

        cfg = self.spec.cfg
        for e in self.engines:
            e.train()
        loss = trainer._run_schedule(batch, train=True)
        self.sync_tied_embedding_grads()
        norm = self.global_grad_norm()
        if not math.isfinite(norm):  # the same on every rank (a world all-reduce): all stop at this step
            raise FloatingPointError(
                f"non-finite gradient norm at step {trainer.step + 1} under DeepSpeed ({cfg.precision}: no loss "
                "scale to back off); lower --lr or check the data."
            )
        coef = min(1.0, cfg.grad_clip / (norm + 1e-6)) if cfg.grad_clip > 0 else 1.0
        lr = lr_at(trainer.step, cfg)
        grad_mem = self.grad_bytes()
        for e in self.engines:
            for group in e.optimizer.param_groups:
                group["lr"] = lr
            self._step(e, coef)
        trainer.step += 1
        record = {"step": trainer.step, "loss": loss, "lr": lr, "grad_norm": norm}
        record.update(self.memory(grad_mem))
        return record

    @staticmethod
    def _zero_optimizer_with_scale(opt) -> bool:
        from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
        from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

        return isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))

    def _step(self, engine, coef: float) -> None:
        """engine.step() with the gradients multiplied by `coef` (global clipping). ZeRO-1/2/3 divide their fp32
        gradient partitions by the optimizer's loss scale inside step(), wherever those partitions live (device,
        CPU, NVMe swap): a loss scale of 1/coef for this one step applies the clip without touching (or swapping
        in) a gradient here. ZeRO-0's plain optimizer: the gradients are multiplied in place."""
        opt = engine.optimizer
        if coef == 1.0:
            engine.step()
        elif self._zero_optimizer_with_scale(opt):
            opt.loss_scale = 1.0 / coef  # the static scaler's cur_scale (fp32/bf16: 1.0 otherwise)
            try:
                engine.step()
            finally:
                opt.loss_scale = 1.0
        else:
            for p in engine.module.parameters():
                for share in grad_shares(p):
                    share.tensor.mul_(coef)
            engine.step()

    def _plain(self, engine) -> nn.Module:
        return engine.module

    # -- checkpoints: zero_state.py turns ZeRO's partitions into whole tensors and back (collective over dp) -------
    full_param = staticmethod(zero_state.full_param)

    def optimizer_state_of(self, p: nn.Parameter) -> dict[str, torch.Tensor]:
        return zero_state.optimizer_state_of(self._engine_of[id(p)], p)

    def load_param_states(self, items) -> None:
        zero_state.load_param_states(self._engine_of, items)

    def sync_tied_embedding_grads(self) -> None:
        """Sum the tied embedding's gradient over its copies (first stage's wte, last stage's lm_head copy) and
        give every copy the sum (see the module docstring)."""
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        from trainer3d.parallel.ddp import tied_copies
        from trainer3d.parallel.tensor_parallel import all_reduce, group_size

        copies = tied_copies([self._plain(e) for e in self.engines])
        group = self.topo.embedding_group
        in_group = group_size(group) > 1
        if not copies or (len(copies) == 1 and not in_group):
            return
        local = self.spec.stage == 3  # aligned per-parameter partitions: sum them without assembling
        if local:  # (clone: under NVMe offload the value read lives in a swap buffer that is reused)
            total = sum(grad_shares(p)[0].tensor.float().clone() for p in copies)
        else:
            total = sum(safe_get_full_grad(p).float() for p in copies)
        if in_group:
            total = all_reduce(total.contiguous(), group)
        for p in copies:
            if local:
                _z3_set_local_grad(p, total)
            else:
                safe_set_full_grad(p, total.to(p.grad.dtype if p.grad is not None else torch.float32))

    def _counted(self, module: nn.Module, p: nn.Parameter, dp_replicated: bool) -> bool:
        from trainer3d.parallel.ddp import is_tied_duplicate

        if is_tied_duplicate(module, p):
            return False
        if getattr(p, "tp_spec", None) is None and self.topo.tp_rank != 0:
            return False
        return not (dp_replicated and self.topo.dp_rank != 0)

    def global_grad_norm(self) -> float:
        """L2 norm of the whole model's gradient: every element counted once over dp shards, tp shards and
        pipeline stages (world all-reduce of the squares this rank owns). ZeRO-3 with an offloaded optimizer
        keeps each partition's norm from the accumulation boundary (what its own clipping reads), so nothing is
        copied back from CPU or swapped in from NVMe for it."""
        from trainer3d.parallel.tensor_parallel import all_reduce

        total = torch.zeros((), dtype=torch.float64, device=self.device)
        for e in self.engines:
            module, opt = self._plain(e), e.optimizer
            norms = getattr(opt, "norm_for_param_grads", None) if (
                self.spec.stage == 3 and self.spec.offload_optimizer != "none") else None
            for p in module.parameters():
                if norms is not None:
                    if self._counted(module, p, False) and opt.get_param_id(p) in norms:
                        total += float(norms[opt.get_param_id(p)]) ** 2
                    continue
                for share in grad_shares(p):
                    if self._counted(module, p, share.dp_replicated):
                        total += share.tensor.detach().double().pow(2).sum().to(total.device)
        return math.sqrt(all_reduce(total, self.topo.world_group).item())

    # -- memory ---------------------------------------------------------------------------------------------------
    def _offloaded(self, t: torch.Tensor, category_offloaded: bool) -> bool:
        if self.device.type != "cpu":
            return t.device.type == "cpu"
        return category_offloaded  # a CPU host: what the config sends to the "host" side

    def grad_bytes(self) -> tuple[int, int]:
        total = off = 0
        seen = set()
        if self.spec.stage == 3 and self.spec.offload_optimizer != "none":
            # the fp32 gradient partitions the CPU optimizer steps on (in RAM, or swapped to NVMe between uses)
            for e in self.engines:
                for flat in e.optimizer.fp32_partitioned_groups_flat:
                    n = flat.numel() * 4
                    total, off = total + n, off + n
            return total, off
        for e in self.engines:
            for p in self._plain(e).parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                tensors = [s.tensor for s in grad_shares(p)]
                if p.grad is not None and not any(t is p.grad for t in tensors):
                    tensors.append(p.grad)
                for t in tensors:
                    n = t.numel() * t.element_size()
                    total += n
                    off += n if self._offloaded(t, self.spec.offload_optimizer != "none") else 0
        return total, off

    def memory(self, grad_mem: tuple[int, int] | None = None) -> dict:
        """Bytes this rank holds: parameters (its ZeRO-3 partition, else the whole stage), gradients (as held when
        the optimizer steps), optimizer states (fp32 master partitions + Adam moments), and how much of each is
        offloaded."""
        params = params_off = optim = optim_off = 0
        seen = set()
        off_p, off_o = self.spec.offload_param != "none", self.spec.offload_optimizer != "none"
        model_storages = set()  # a master "copy" that is the parameters' own storage (ZeRO-3 fp32) is no copy
        for e in self.engines:
            for p in self._plain(e).parameters():
                if id(p) in seen:
                    continue
                seen.add(id(p))
                held = [p.data] + ([p.ds_tensor] if hasattr(p, "ds_tensor") else [])
                for t in held:
                    if t.numel():
                        model_storages.add(t.untyped_storage().data_ptr())
                    n = t.numel() * t.element_size()
                    params += n
                    params_off += n if self._offloaded(t, off_p and t is not p.data) else 0
        for e in self.engines:
            basic = getattr(e.optimizer, "optimizer", e.optimizer)
            # ZeRO keys the wrapped optimizer's state by its fp32 master partitions (its param_groups are
            # emptied between steps at stage 3), so walk the state, then any grouped tensor without state yet.
            masters = {id(q): q for q in basic.state} | {id(q): q for g in basic.param_groups for q in g["params"]}
            for q in masters.values():
                tensors = [q] if q.numel() and q.untyped_storage().data_ptr() not in model_storages else []
                tensors += [v for v in basic.state.get(q, {}).values() if torch.is_tensor(v)]
                for t in tensors:
                    n = t.numel() * t.element_size()
                    optim += n
                    optim_off += n if self._offloaded(t, off_o) else 0
        grads, grads_off = grad_mem if grad_mem is not None else self.grad_bytes()
        out = {
            "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim,
            "param_offloaded_bytes": params_off, "grad_offloaded_bytes": grads_off, "optim_offloaded_bytes": optim_off,
        }
        if "nvme" in (self.spec.offload_param, self.spec.offload_optimizer):
            out["nvme_bytes"] = self.nvme_bytes()
        return out

    def nvme_bytes(self) -> int:
        """Bytes in this rank's ZeRO-Infinity swap files (DeepSpeed writes <nvme_path>/zero_stage_3/<kind>/rank<r>/):
        what is offloaded to NVMe rather than held in memory."""
        zero_cfg = self.spec.ds_config["zero_optimization"]
        paths = {(zero_cfg.get(k) or {}).get("nvme_path") for k in ("offload_param", "offload_optimizer")} - {None}
        me, total = f"rank{dist.get_rank()}", 0
        for path in paths:
            for root, _, files in os.walk(path):
                if me in root.split(os.sep):
                    total += sum(os.path.getsize(os.path.join(root, f)) for f in files)
        return total


def ddp_memory(modules, optimizer, device: torch.device) -> dict:
    """The same accounting for the DDP path: every dp rank holds its whole stage."""
    seen, params, grads = set(), 0, 0
    for m in modules:
        for p in m.parameters():
            if id(p) in seen:
                continue
            seen.add(id(p))
            params += p.numel() * p.element_size()
            if p.grad is not None:
                grads += p.grad.numel() * p.grad.element_size()
    optim = sum(
        v.numel() * v.element_size() for s in optimizer.state.values() for v in s.values() if torch.is_tensor(v)
    )
    return {
        "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim,
        "param_offloaded_bytes": 0, "grad_offloaded_bytes": 0, "optim_offloaded_bytes": 0,
    }


def main(argv: list[str] | None = None) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="python -m trainer3d.zero", description=__doc__.split("\n")[0])
    p.add_argument("--build-ops", action="store_true", help="build DeepSpeed's JIT ops into $TORCH_EXTENSIONS_DIR")
    p.add_argument("--check-config", metavar="JSON", help="resolve a DeepSpeed JSON against flags (with --world-size)")
    p.add_argument("--world-size", type=int, default=1)
    args, rest = p.parse_known_args(argv)
    if args.build_ops:
        check_deepspeed_version()
        for name, state in build_ops().items():
            print(f"{name}: {state}")
        return 0
    if args.check_config:
        from trainer3d.config import ConfigError, parse_args, validate
        from trainer3d.dist.topology import LayoutError

        cfg = parse_args(rest + ["--deepspeed_config", args.check_config])
        try:
            layout, plan = validate(cfg, args.world_size)
            spec = resolve_deepspeed(cfg, layout)
        except (ConfigError, LayoutError) as e:
            print(f"trainer3d: error: {e}", file=sys.stderr)
            return 2
        print(json.dumps({"layout": str(layout), "plan": dataclasses.asdict(plan), "deepspeed": spec.ds_config}, indent=2))
        return 0
    p.print_help()
    return 1


if __name__ == "__main__":
    sys.exit(main())
