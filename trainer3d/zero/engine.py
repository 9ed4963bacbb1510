"""DeepSpeed ZeRO (stages 0-3, CPU and NVMe offload) as the data-parallel engine, under torch's pipeline schedules.

One `deepspeed.initialize` per pipeline stage module on this rank, over the dp group only; torch's schedule drives
the stages through glue.py's ZeroPipelineStage. The step replaces DeepSpeed's own clipping with the global norm over
dp × tp × pp (DeepSpeed's counts tp/pp replicas differently per stage, and each engine would clip with its own
norm) and applies the clip through the optimizer's loss scale, so nothing offloaded is copied back for it.
docs/zero.md explains every piece and the ablations behind it.
"""

from __future__ import annotations

import copy
import logging
import os
import warnings

import torch
import torch.distributed as dist
import torch.nn as nn

from trainer3d.distributed.collectives import all_reduce
from trainer3d.errors import ConfigError
from trainer3d.optim import adam, param_groups, set_lr
from trainer3d.parallel.engine import (
    DataParallelEngine, EngineFactory, counts_in_norm, offload_to_host, onload_from_host, sum_of_squares,
    tp_partial_params, sum_tp_partial_grads, sum_tied_grads, tied_copies,
)
from trainer3d.parallel.shards import materialize
from trainer3d.zero import memory, state
from trainer3d.zero.config import DeepSpeedSpec
from trainer3d.zero.experts import ExpertMPU, ExpertShard, detached, expert_config, moe_blocks, over_edp
from trainer3d.zero.glue import (
    TopologyMPU, ZeroPipelineStage, check_glue, drop_gradients, engines_backward, is_zero_optimizer,
    patch_zero3_trace_check,
)
from trainer3d.zero.grads import grad_shares, is_zero_param, z3_set_local_grad
from trainer3d.zero.ops import (
    check_deepspeed_version,
    default_extensions_dir,
    op_build_flags,
    skip_inference_shm_op,
    use_prebuilt_ops,
)


class ZeroEngine(DataParallelEngine):
    """One DeepSpeed engine per pipeline stage module on this rank, over the dp group."""

    stage_cls = ZeroPipelineStage
    casts_module = True  # DeepSpeed holds the stage in bf16 (its "bf16" section); no autocast

    def __init__(self, spec: DeepSpeedSpec, stages: list[nn.Module], topo, device: torch.device, verbose: bool = False):
        prepare_deepspeed(topo, device, verbose)
        import deepspeed

        self.spec, self.stages, self.topo, self.device = spec, stages, topo, device
        self.name = f"ZeRO-{spec.zero_stage}"
        # Every rank builds its engines in stage order: ZeRO-3's init has world-group barriers that pair up so.
        self.engines, self.stage_engines = [], []  # every engine; the one per stage the pipeline drives
        self._params: dict = {}  # id(engine) -> the parameters it owns
        self._stage_of: dict = {}  # id(engine) -> its stage module
        for module in stages:
            blocks = moe_blocks(module) if topo.layout.ep > 1 else []
            if spec.zero_stage == 3 and not blocks:
                gather_by_block(module)
            with detached(blocks) as experts:  # under ep the experts get an engine of their own (zero/experts.py)
                engine = self._initialize(deepspeed, module, TopologyMPU(topo), spec.ds_config, module)
            self.stage_engines.append(engine)
            engine.trainer3d_companions = []  # the stage's other engines, which glue.py brackets alongside
            engine.trainer3d_hold_boundary = False  # (hold_boundary)
            if experts:
                shard = ExpertShard(experts)
                engine.trainer3d_companions.append(self._initialize(
                    deepspeed, shard, ExpertMPU(topo), expert_config(spec.ds_config, topo.layout.edp), module))
        self._engine_of = {id(p): e for e in self.engines for p in self._params[id(e)]}
        # which of each engine's parameters this rank counts in the norm, decided once (as DDPEngine.norm_params)
        self._norm_params = {id(e): [p for p in self._params[id(e)] if p.requires_grad
                                     and counts_in_norm(self._stage_of[id(e)], p, topo.tp_rank)] for e in self.engines}
        self._grad_mem = None  # (bytes, offloaded) of the gradients as the last step held them (memory.report)

    def _initialize(self, deepspeed, module: nn.Module, mpu, ds_config: dict, stage: nn.Module):
        params = list(module.parameters())  # (a frozen one, a LoRA base's, is the engine's but not its optimizer's)
        trained = [p for p in params if p.requires_grad]
        engine, *_ = deepspeed.initialize(model=module, optimizer=self._client_optimizer(trained),
                                          config=copy.deepcopy(ds_config), mpu=mpu, dist_init_required=False)
        self.engines.append(engine)
        self._params[id(engine)], self._stage_of[id(engine)] = params, stage
        return engine

    def params_of(self, engine) -> list[nn.Parameter]:
        """The parameters `engine` owns (a stage engine's module also holds its expert engine's, under ep)."""
        return self._params[id(engine)]

    def _client_optimizer(self, params: list[nn.Parameter]):
        """AdamW with the DDP engine's parameter groups, which ZeRO steps on its fp32 master partitions: torch's
        fused kernel where torch has one for the device (optim.adam; one pass over each flat partition where the
        per-tensor loop makes ~8), or DeepSpeedCPUAdam when the optimizer is offloaded (DeepSpeed's own vectorised
        one-pass C++ step on the host copies: fused/foreach do not apply)."""
        cfg = self.spec.cfg
        kw = dict(lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=self.spec.eps)
        groups = param_groups(params, cfg.weight_decay,
                              shape_of=lambda p: p.ds_shape if is_zero_param(p) else p.shape)
        if self.spec.offload_optimizer != "none":
            from deepspeed.ops.adam import DeepSpeedCPUAdam

            return DeepSpeedCPUAdam(groups, adamw_mode=self.spec.adamw, **kw)
        return adam(groups, decoupled=self.spec.adamw, **kw)

    @property
    def stage_modules(self) -> list[nn.Module]:
        return self.stage_engines

    def zero_grad(self) -> None:
        """Drop the gradient of passes no step used (a step resets it itself): each engine's, experts' too."""
        for e in self.engines:
            drop_gradients(e)

    def hold_boundary(self, hold: bool) -> None:
        """Whether a pass's last backward stays short of DeepSpeed's accumulation boundary, for several passes before
        one step (trainer3d.engine's calls): ZeRO-0/1/2 reduce at each boundary into buffers the next boundary
        overwrites (each pass's gradient replaced the one before), so the boundary is crossed once, by
        release_boundary before the step. ZeRO-3 adds each boundary's gradient into its partitions: no hold."""
        for e in self.stage_engines:
            e.trainer3d_hold_boundary = hold and self.spec.zero_stage < 3

    def release_boundary(self) -> None:
        """The accumulation boundary of held passes (hold_boundary): each engine's reduction as its last backward
        would have run it, over the gradients every pass added."""
        for stage in self.stage_engines:
            if stage.trainer3d_hold_boundary:
                engines = [stage, *stage.trainer3d_companions]
                with engines_backward(engines, boundary=True):
                    for e in engines:
                        _reduce_held(e.optimizer)

    def reduce_grads(self, grad_scale: float) -> torch.Tensor:
        if grad_scale != 1.0:
            raise ValueError("ZeRO engines take no gradient scale (fp16 is refused for DeepSpeed configs)")
        self.sync_tied_embedding_grads()
        self.sum_tp_partial_grads()
        return self.global_grad_norm()

    def skip_step(self, norm: float) -> None:
        """Nothing is stepped, and the trainer stops the run (--on-nonfinite stop: TrainingError, exit 2, the last
        finite step's checkpoints kept). --on-nonfinite skip is refused with a DeepSpeed config (train/setup.py): each
        ZeRO optimizer decides from its own partition whether a step overflowed, so a world-wide skip would need all of
        them told otherwise; with no loss scale (fp16 is refused too) nothing needs one."""

    def update(self, lr: float, coef: float) -> None:
        self._grad_mem = memory.grad_bytes(self)  # as held when the optimizer steps
        for e in self.engines:
            set_lr(e.optimizer, lr)
            self._step(e, coef)

    def _step(self, engine, coef: float) -> None:
        """engine.step() with the gradients multiplied by `coef`. ZeRO-1/2/3 divide their fp32 gradient partitions
        by the optimizer's loss scale inside step(), wherever they live (device, CPU, NVMe swap): a loss scale of
        1/coef for this one step applies the clip without touching a gradient here. ZeRO-0's plain optimizer: the
        gradients are multiplied in place."""
        opt = engine.optimizer
        if coef == 1.0:
            engine.step()
        elif _has_loss_scale(opt):
            opt.loss_scale = 1.0 / coef  # the static scaler's cur_scale (fp32/bf16: 1.0 otherwise)
            try:
                engine.step()
            finally:
                opt.loss_scale = 1.0
        else:
            for p in (p for p in self.params_of(engine) if p.requires_grad):
                for share in grad_shares(p, opt):
                    share.tensor.mul_(coef)
            engine.step()

    def sync_tied_embedding_grads(self) -> None:
        sum_tied_grads(tied_copies([e.module for e in self.stage_engines]), self.topo.embedding_group,
                       *self._grad_access())

    def sum_tp_partial_grads(self) -> None:
        params = [p for p in tp_partial_params(e.module for e in self.stage_engines) if p.requires_grad]
        sum_tp_partial_grads(params, self.topo.tp_group, *self._grad_access())

    def _grad_access(self):
        """(read, write) of a gradient after ZeRO's dp reduction, for sums across stages or tp ranks. ZeRO-3
        partitions each parameter on its own, so copies of a parameter (tied, or on tp peers) have aligned local
        partitions, summed directly; ZeRO-0/1/2 partition a flat group, so the full gradient is assembled and
        written back."""
        from deepspeed.utils import safe_get_full_grad, safe_set_full_grad

        if self.spec.zero_stage == 3:  # (clone: under NVMe offload the value read lives in a swap buffer that is reused)
            return lambda p: grad_shares(p, self._engine_of[id(p)].optimizer)[0].tensor.float().clone(), \
                z3_set_local_grad

        def write(p, total):
            safe_set_full_grad(p, total.to(p.grad.dtype if p.grad is not None else torch.float32))
        return lambda p: safe_get_full_grad(p).float(), write

    def global_grad_norm(self) -> torch.Tensor:
        """Every rank sums the squares of the gradient elements it owns after the dp reduction (its ZeRO partition,
        or at ZeRO-0 the whole gradient on dp rank 0 only), each element once over tp and pp, and the world sums.
        ZeRO-3 with an offloaded optimizer keeps each partition's norm from the accumulation boundary (what its own
        clipping reads), so nothing is copied back from CPU or swapped in from NVMe for it. A device scalar
        (float64), not read here."""
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        dp_rank = self.topo.dp_cp_rank
        kept_norms = self.spec.zero_stage == 3 and self.spec.offload_optimizer != "none"
        for e in self.engines:
            opt, counted = e.optimizer, self._norm_params[id(e)]
            if kept_norms:  # each partition's norm, as DeepSpeed took it
                norms = opt.norm_for_param_grads
                for p in counted:
                    if opt.get_param_id(p) in norms:
                        total += torch.as_tensor(norms[opt.get_param_id(p)]).to(total).square()
                continue
            total += sum_of_squares([share.tensor for p in counted for share in grad_shares(p, opt)
                                     if not (share.dp_replicated and dp_rank != 0)], self.device)
        return all_reduce(total, self.topo.world_group).sqrt()

    # -- checkpoints: state.py turns ZeRO's partitions into whole tensors and back (collective over dp) -------------
    def param_value(self, param: nn.Parameter) -> torch.Tensor:
        return state.full_param(self._engine_of[id(param)], param)

    def optimizer_state_of(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        return state.optimizer_state_of(self._engine_of[id(param)], param)

    def partition_of(self, param: nn.Parameter, moments: bool):
        return state.partition_of(self._engine_of[id(param)], param, moments)

    def adam_step(self) -> int | None:
        return state.optimizer_step_count(self.engines[0]) if self.engines else None

    def load_param_states(self, items) -> None:
        state.load_param_states(self._engine_of, items)

    def memory(self) -> dict:
        return memory.report(self, self._grad_mem)

    def offload(self) -> dict:
        """DeepSpeed's offload_states on every engine for what it moves with a torch optimizer (ZeRO-1/2: everything;
        ZeRO-3: the compute-dtype parameters and the gradient buffers, since its optimizer-state offload needs its CUDA
        FusedAdam), the rest as DDP's (offload_to_host: the fp32 master partitions and AdamW's state in place).
        DeepSpeed runs it on the host too, where it releases the compute-dtype parameters and onload rebuilds them.
        The bytes held before, by kind (the engine's memory report)."""
        from deepspeed.runtime.zero.offload_config import OffloadDeviceEnum, OffloadStateTypeEnum as State

        if self.spec.offload_param != "none" or self.spec.offload_optimizer != "none":
            raise ConfigError("offload() moves states to the host between steps; this DeepSpeed config already keeps "
                              "them there (offload_param / offload_optimizer): drop one of the two.")
        held = {k: v for k, v in self.memory().items() if k in ("param_bytes", "grad_bytes", "optim_bytes")}
        pin = self.device.type == "cuda"
        for e in self.engines:
            if self.spec.zero_stage == 3:
                e.offload_states(include=[State.lp_params, State.lp_grads, State.contiguous_grad_buffer],
                                 device=OffloadDeviceEnum.cpu, pin_memory=pin)
                if pin:
                    offload_to_host(e.optimizer.fp32_partitioned_groups_flat, e.optimizer.optimizer)
            elif self.spec.zero_stage:
                e.offload_states(device=OffloadDeviceEnum.cpu, pin_memory=pin)
            elif pin:
                offload_to_host(e.module.parameters(), e.optimizer)
        return held

    def onload(self) -> None:
        for e in self.engines:
            if self.spec.zero_stage == 3 and self.device.type == "cuda":
                onload_from_host(e.optimizer.fp32_partitioned_groups_flat, e.optimizer.optimizer, self.device)
            if self.spec.zero_stage:
                e.reload_states()
            elif self.device.type == "cuda":
                onload_from_host(e.module.parameters(), e.optimizer, self.device)

    def describe(self) -> dict:
        return {"engine": "deepspeed", "zero_stage": self.spec.zero_stage, "offload_optimizer": self.spec.offload_optimizer,
                "offload_param": self.spec.offload_param}


def gather_by_block(stage: nn.Module) -> None:
    """ZeRO-3 gathers and frees each transformer block's parameters as one (DeepSpeed's leaf modules), as FSDP wraps a
    block: its hooks then run per block, not per linear and norm inside it (~11 a block, each a fetch, a release and
    their bookkeeping in Python). Not under ep, where a block's experts belong to the experts' engine."""
    from deepspeed.utils import set_z3_leaf_modules

    classes = list({type(block) for block in [*stage.blocks.values(), *stage.extra_blocks()]})
    if classes:
        set_z3_leaf_modules(stage, classes)


def _reduce_held(opt) -> None:
    """What the gradient hooks of a boundary backward do, for gradients that earlier backwards left: ZeRO-1/2 set up
    their reduction buckets on a first hook, and ZeRO-1 reduces only at the boundary, each gradient from its hook (so
    its epilogue, with overlap_comm, finds nothing reduced). ZeRO-0's plain optimizer reduces in the epilogue."""
    if not is_zero_optimizer(opt) or not hasattr(opt, "setup_buckets"):
        return
    opt.setup_buckets()
    if opt.partition_gradients:
        return  # ZeRO-2 reduced each backward's gradients in its hooks
    for i, group in enumerate(opt.bit16_groups):
        for p in group:
            if opt.get_gradient_for_reduction(p) is not None:
                opt.reduce_ready_partitions_and_remove_grads(p, i)


def _has_loss_scale(opt) -> bool:
    from deepspeed.runtime.zero.stage3 import DeepSpeedZeroOptimizer_Stage3
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    return isinstance(opt, (DeepSpeedZeroOptimizer, DeepSpeedZeroOptimizer_Stage3))


def prepare_deepspeed(topo, device: torch.device, verbose: bool) -> None:
    """Everything DeepSpeed needs before it touches a parameter (idempotent): the version and glue checks, the
    prebuilt ops, its view of the process groups, quiet logs."""
    check_deepspeed_version()
    if "TORCH_EXTENSIONS_DIR" not in os.environ and os.path.isdir(default_extensions_dir()):
        use_prebuilt_ops()  # what `python -m trainer3d.zero --build-ops` built for this checkout
    op_build_flags()  # as build_ops built them: other flags would rebuild them
    skip_inference_shm_op()
    import deepspeed
    from deepspeed.utils import logger as ds_logger

    check_glue()
    if not verbose:
        ds_logger.setLevel(logging.WARNING)
    # DeepSpeed 0.19 calls torch.distributed functions that torch 2.13 marks deprecated, on every step.
    warnings.filterwarnings("ignore", message=r".*is deprecated\. Please use `torch\.distributed\.", category=FutureWarning)
    os.environ.setdefault("LOCAL_RANK", str(device.index or 0))
    deepspeed.init_distributed(dist_backend=dist.get_backend(), dist_init_required=False)
    patch_zero3_trace_check(topo.dp_cp_group)


class ZeroEngineFactory(EngineFactory):
    """Builds the ZeroEngine; under ZeRO-3 it also partitions every parameter over dp the moment it is materialized
    (DeepSpeed's zero.Init, with the arguments deepspeed.initialize would use), so that start-up never holds more
    than this rank's partitions plus one module's parameters, where materializing the whole stage first needed the
    stage's full fp32 copy on every rank. zero.Init broadcasts each parameter from dp rank 0, so only that rank
    reads (or initializes) values. deepspeed.initialize then finds the parameters partitioned already."""

    def __init__(self, spec: DeepSpeedSpec, topo, device: torch.device, verbose: bool = False):
        super().__init__(lambda stages: ZeroEngine(spec, stages, topo, device, verbose=verbose))
        self.spec, self.topo, self.device, self.verbose = spec, topo, device, verbose
        self.input_grads = spec.zero_stage == 3  # its pre-backward hook fires on the block's input

    def materialize(self, module: nn.Module, device: torch.device, shard_value, coords: dict) -> None:
        if self.spec.zero_stage < 3:
            return super().materialize(module, device, shard_value, coords)
        prepare_deepspeed(self.topo, self.device, self.verbose)
        topo = self.topo

        def value(name, spec, local_shape, rank, size):
            # zero.Init broadcasts each parameter from rank 0 of the group it partitions over (dp×cp, or edp for an
            # expert under ep): the other ranks read or compute nothing
            source = topo.edp_rank if over_edp(topo.layout, spec) else topo.dp_cp_rank
            return shard_value(name, spec, local_shape, rank, size) if source == 0 else torch.empty(local_shape)

        materialize(module, device, value, coords, after_module=self._partitioner())

    def _partitioner(self):
        import deepspeed

        ds = self.spec.ds_config
        offload = ds["zero_optimization"].get("offload_param") or {}
        remote = offload.get("device", "none")
        kw = dict(
            dtype=torch.bfloat16 if (ds.get("bf16") or {}).get("enabled") else torch.float32,
            remote_device=None if remote in (None, "none") else remote, pin_memory=bool(offload.get("pin_memory")),
        )
        dense = dict(data_parallel_group=self.topo.dp_cp_group, mpu=TopologyMPU(self.topo))
        experts = dict(data_parallel_group=self.topo.edp_group, mpu=ExpertMPU(self.topo))

        def partition(module: nn.Module) -> None:
            own = nn.Module()  # just the module's own parameters (its children may not exist yet)
            for name, p in module.named_parameters(recurse=False):
                p.data = p.data.to(kw["dtype"])  # what deepspeed.initialize casts before it partitions
                own.register_parameter(name, p)
            split = any(over_edp(self.topo.layout, getattr(p, "tp_spec", None)) for p in own.parameters())
            config = expert_config(ds, self.topo.layout.edp) if split else copy.deepcopy(ds)
            init = deepspeed.zero.Init(module=own, config_dict_or_path=config, **kw, **(experts if split else dense))
            kw["param_swapper"] = init.param_swapper  # NVMe: one swapper for the stage, as one Init would have

        return partition


def zero_engine_factory(spec: DeepSpeedSpec, topo, device: torch.device, verbose: bool = False) -> ZeroEngineFactory:
    return ZeroEngineFactory(spec, topo, device, verbose)
