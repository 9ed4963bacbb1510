"""The data-parallel axis as one interface, `DataParallelEngine`, implemented by DDP (parallel/ddp.py) and by
DeepSpeed ZeRO 0-3 (zero/engine.py). The trainer calls only this interface; the gradient rules both engines share
(which copies of the tied embedding exist, which gradient elements a rank counts in the global norm) live here.

An engine owns everything between "the schedule has run every micro-batch's backward" and "the weights moved":
the dp reduction, the tied-embedding sum across the first and last stage, the tp sum of sequence-parallel
gradients, the global norm, clipping and the optimizer step; and, for checkpoints, each parameter's fp32 value and
optimizer state, whole over dp.

A training step reads the device once (`read_scalars`, in `DataParallelEngine.step`): the global norm must be on the
host before the update (a non-finite one skips it: fp16's loss scale backs off), so the step's loss rides along in
the same transfer and the trainer reads nothing else.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Iterable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage

from trainer3d.distributed.collectives import all_reduce, group_size
from trainer3d.optim import clip_coefficient
from trainer3d.parallel.shards import materialize


@dataclass
class Partition:
    """This rank's part of a parameter's fp32 value and AdamW moments, as an engine holds it: the flat range
    [start, start + numel) of the tp shard (of `shape`), as 1-D views (`tensors`: "param", and "exp_avg",
    "exp_avg_sq" after the first step). Over dp × cp the partitions of a parameter are disjoint and cover it."""

    start: int
    shape: tuple[int, ...]
    tensors: dict[str, torch.Tensor]

    @property
    def numel(self) -> int:
        return self.tensors["param"].numel()


@dataclass
class StepResult:
    grad_norm: float  # global L2 norm of the (dp-averaged, unscaled) gradient, each element counted once
    stepped: bool  # False: a non-finite loss or norm skipped the update
    loss: float  # the `loss` handed to step(), read in the same transfer as the norm
    stop: bool  # the `stop` handed to step() was positive: some rank asked the run to stop after this step
    extra: list[float] = field(default_factory=list)  # the `extra` vector handed to step(), in the same transfer


class DataParallelEngine:
    """One optimizer step's worth of data parallelism over this rank's pipeline stage modules."""

    name: str  # for logs and meta.json, e.g. "DDP" or "ZeRO-3"
    stage_cls: type = PipelineStage  # what the pipeline schedule wraps each of `stage_modules` in
    casts_module = False  # True: the engine holds the stage in the compute dtype (no autocast; activations in it)

    @property
    def stage_modules(self) -> list[nn.Module]:
        """What the schedule runs, one per stage on this rank (wrapped as the engine needs)."""
        raise NotImplementedError

    def train(self, mode: bool = True) -> None:
        for m in self.stage_modules:
            m.train(mode)

    def zero_grad(self) -> None:
        raise NotImplementedError

    def step(self, lr: float, max_norm: float, grad_scale: float = 1.0, *, loss: torch.Tensor,
             stop: torch.Tensor, extra: torch.Tensor | None = None) -> StepResult:
        """After the schedule's backward: reduce over dp, sum the tied embedding, multiply gradients by
        `grad_scale` (fp16's 1/loss-scale), take the global norm, clip to `max_norm` (0: off), step at `lr`.
        `loss` (and `stop`, the world's count of stop requests; `extra`, a vector such as every rank's step time):
        device tensors not yet read; they come back in StepResult from the step's only device-to-host transfer, which
        also brings the norm that decides whether to step and the clip."""
        norm_t = self.reduce_grads(grad_scale)
        norm, loss_value, stop_requests, *rest = read_scalars(norm_t, loss, stop, *(() if extra is None else (extra,)))
        stop_agreed = stop_requests > 0
        if not (math.isfinite(norm) and math.isfinite(loss_value)):  # alike on every rank: both reduced over the world
            self.skip_step(norm)
            return StepResult(norm, stepped=False, loss=loss_value, stop=stop_agreed, extra=rest)
        self.update(lr, clip_coefficient(norm, max_norm))
        return StepResult(norm, stepped=True, loss=loss_value, stop=stop_agreed, extra=rest)

    def hold_boundary(self, hold: bool) -> None:
        """Several passes before one step (trainer3d.engine): an engine whose reduction at a pass's end would not add
        up over passes defers it to release_boundary. DDP reduces in reduce_grads: nothing to hold."""

    def release_boundary(self) -> None:
        """Before the step of held passes: the reduction their last backward deferred."""

    def offload(self) -> dict:
        """Between steps, parameters, gradients and optimizer state to host memory, so that a colocated rollout
        engine has the device; onload() brings them back. Returns the bytes moved by kind. Where the device is the
        host (CPU) there is nothing to free: nothing moves."""
        raise NotImplementedError

    def onload(self) -> None:
        raise NotImplementedError

    def reduce_grads(self, grad_scale: float) -> torch.Tensor:
        """step()'s first half, without reading the device: reduce over dp, sum the tied embedding and the
        sequence-parallel gradients, multiply by `grad_scale`; return the global gradient norm as a device scalar."""
        raise NotImplementedError

    def skip_step(self, norm: float) -> None:
        """A non-finite loss or norm: leave the weights as they are (the next zero_grad drops the gradients)."""

    def update(self, lr: float, coef: float) -> None:
        """step()'s second half: multiply the gradients by the clip coefficient `coef` (<= 1; on the device, the
        host float as a kernel argument) and step the optimizer at `lr`."""
        raise NotImplementedError

    # -- checkpoints: collective over dp (every dp rank asks for the same parameters in the same order) --------------
    def param_value(self, param: nn.Parameter) -> torch.Tensor:
        """This rank's tp shard of `param`, whole over dp, in fp32 (under ZeRO: the fp32 master copy)."""
        raise NotImplementedError

    def optimizer_state_of(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """This rank's tp shard of `param`'s AdamW state (exp_avg, exp_avg_sq, step), whole over dp; {} before the
        first step."""
        raise NotImplementedError

    def partition_of(self, param: nn.Parameter, moments: bool) -> Partition | None:
        """The part of `param`'s state this rank holds as it lies (no collective), where the engine partitions it
        over dp (ZeRO); None where every dp rank holds it whole (checkpoints then slice it: checkpoint/save.py).
        `moments`: Adam has stepped, so its moments exist (adam_step() is not None)."""
        return None

    def adam_step(self) -> int | None:
        """AdamW's step count (every parameter steps together), None before the first step; one host read."""
        raise NotImplementedError

    def load_param_states(self, items: Iterable[tuple[nn.Parameter, Callable, Callable]]) -> None:
        """(parameter, read_state, read_value) per parameter: the readers read lazily, so an engine reads only what
        it must (DDP built its parameters from these values already and never reads them twice); each takes
        `flat=(start, numel)` to read only that range of the flattened tp shard (a ZeRO-3 partition)."""
        raise NotImplementedError

    def memory(self) -> dict:
        """Bytes this rank holds of parameters, gradients and optimizer states, and how much of each is offloaded
        (keys param_bytes, grad_bytes, optim_bytes and their *_offloaded_bytes)."""
        raise NotImplementedError

    def describe(self) -> dict:
        """What owned the dp axis, for meta.json (informational: any engine loads any checkpoint)."""
        raise NotImplementedError


class EngineFactory:
    """Builds the data-parallel engine over a rank's stage modules (`build`), and materializes the stages'
    parameters the way that engine keeps them (`materialize`): whole, by default; ZeRO-3 partitions each parameter
    as soon as it exists, so that no rank ever holds more than its partition plus one parameter. `input_grads`: the
    engine's backward hooks need a first block whose input takes a gradient even where no parameter before it does
    (ZeRO-3's, under a frozen embedding: parallel/lora.freeze_base)."""

    input_grads = False

    def __init__(self, build: Callable[[list[nn.Module]], DataParallelEngine]):
        self.build = build

    def materialize(self, module: nn.Module, device: torch.device, shard_value, coords: dict) -> None:
        materialize(module, device, shard_value, coords)


def read_scalars(*scalars: torch.Tensor) -> list[float]:
    """THE device-to-host read of a training step: every scalar (or vector, flattened in order) the host needs,
    concatenated on the device and copied in one transfer. float64 holds float32 and float64 values exactly, so each
    equals its own `.item()`."""
    device = scalars[0].device
    return torch.cat([s.detach().reshape(-1).to(device, torch.float64) for s in scalars]).tolist()


# ---- gradient rules shared by every engine ---------------------------------------------------------------------------
def unique_parameters(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """Every parameter object once (the tied embedding is one Parameter when one stage holds both ends)."""
    seen: set[int] = set()
    out = []
    for m in modules:
        for p in m.parameters():
            if id(p) not in seen:
                seen.add(id(p))
                out.append(p)
    return out


def tied_copies(stage_modules: list[nn.Module]) -> list[nn.Parameter]:
    """This rank's copies of an embedding the last stage uses too (CausalLM.shares_embedding): the first stage's
    embedding, the last stage's tied head weight and its own copy for multi-token prediction (the same Parameter
    where one module holds both ends); none when the last stage uses no embedding, or it is frozen (a LoRA base:
    no gradient to share, on every stage alike). `stage_modules`: plain (unwrapped) stage modules (models.CausalLM)."""
    out: list[nn.Parameter] = []
    for m in stage_modules:
        if not m.shares_embedding() or not any(p.requires_grad for p in _embedding_ends(m)):
            continue
        for w in _embedding_ends(m):
            if not any(w is p for p in out):
                out.append(w)
    return out


def is_tied_duplicate(module: nn.Module, param: nn.Parameter) -> bool:
    """The last stage's copy of the embedding when the embedding lives on another stage (a tied head's weight, or
    multi-token prediction's own copy): the same values, so it is counted once in the gradient norm and saved once
    in checkpoints."""
    if module.embedding_copy is not None and param is module.embedding_copy.weight:
        return True
    return (module.cfg.tie_embeddings and module.head is not None and module.embedding is None
            and param is module.head.weight)


def _embedding_ends(m: nn.Module) -> list[nn.Parameter]:
    return [part.weight for part in (m.embedding, m.head if m.cfg.tie_embeddings else None, m.embedding_copy)
            if part is not None]


def counts_in_norm(module: nn.Module, param: nn.Parameter, tp_rank: int) -> bool:
    """Whether this rank counts `param`'s gradient in the global norm, so that every element is counted once over
    tp and pp: parameters replicated over tp (experts split over ep are) on tp rank 0 only, the tied head copy never
    (engines add their dp and ep rules)."""
    if is_tied_duplicate(module, param):
        return False
    spec = getattr(param, "tp_spec", None)
    return (spec is not None and spec.axis == "tp") or tp_rank == 0


def sum_tied_grads(copies: list[nn.Parameter], embedding_group, read: Callable, write: Callable) -> None:
    """Give every copy of the tied embedding (here and across the first/last stage's embedding group) the sum of
    all copies' gradients, so that the optimizer keeps them bitwise identical. `read(p)`/`write(p, total)` access
    a gradient as the engine holds it."""
    in_group = group_size(embedding_group) > 1
    if not copies or (len(copies) == 1 and not in_group):
        return  # a middle stage, or pp=1 where one shared Parameter already received both gradients
    total = None
    for p in copies:
        g = read(p)
        if g is not None:
            total = g.clone() if total is None else total + g
    if total is None:
        total = torch.zeros_like(copies[0], dtype=torch.float32)
    if in_group:
        total = all_reduce(total.contiguous(), embedding_group)
    for p in copies:
        write(p, total)


NORM_CHUNK = 4096  # elements per partial norm: float32 sums of 4096 squares keep ~1e-9 of their value (below)


def sum_of_squares(tensors: Iterable[torch.Tensor], device: torch.device,
                   foreach: bool | None = None) -> torch.Tensor:
    """The sum of the squares of every element of `tensors`, a float64 device scalar: THE norm rule of every engine.
    Each tensor's norm is taken in float32 (bf16 ones too) and their squares are summed in float64. On CPU torch's
    norm of a whole tensor drifts with its element count (get_total_norm: 7e-5 relative on 3.2M elements, 2.3e-3 on
    GPT-2's 38.6M-element embedding), and differently for each way tp cuts a tensor, so there each tensor is read as
    rows of NORM_CHUNK elements (a view, no copy) whose norms are squared and summed in float64: within a few 1e-9
    (tests/test_precision.py), at the cost of one plain norm (docs/testing.md, the parity rules). On CUDA (`foreach`
    None) one multi-tensor kernel takes every tensor's norm (torch._foreach_norm: per-thread sums of ~128 elements,
    then trees, no drift with the count; the GPU round's fp32 GPU-vs-CPU path compares the norms), where the rows
    cost a launch or two a tensor: ~300 launches and 4 ms of host time in a GPT-2 step whose host was its bottleneck
    (bench/gpu_round.md, the fifth round)."""
    rows_of: dict[torch.device, list[torch.Tensor]] = {}  # row norms, by the device the gradients are on (offload)
    whole: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = {}  # tensors for one foreach norm each
    for t in tensors:
        flat = t.detach().reshape(-1)
        if (flat.is_cuda if foreach is None else foreach) and flat.numel():
            whole.setdefault((flat.device, flat.dtype), []).append(flat)
            continue
        dtype = torch.promote_types(flat.dtype, torch.float32)  # bf16 rows are summed in float32
        rows, tail = divmod(flat.numel(), NORM_CHUNK)
        if rows:
            rows_of.setdefault(flat.device, []).append(
                torch.linalg.vector_norm(flat[: rows * NORM_CHUNK].view(rows, NORM_CHUNK), dim=1, dtype=dtype))
        if tail:
            rows_of.setdefault(flat.device, []).append(torch.linalg.vector_norm(flat[rows * NORM_CHUNK:], dtype=dtype)
                                                       .reshape(1))
    for (dev, dtype), flats in whole.items():
        norms = torch._foreach_norm(flats, 2, dtype=torch.promote_types(dtype, torch.float32))
        rows_of.setdefault(dev, []).append(torch.stack(norms))
    total = torch.zeros((), dtype=torch.float64, device=device)
    for parts in rows_of.values():
        total += torch.cat(parts).double().square().sum().to(device)
    return total


def tp_partial_params(modules: Iterable[nn.Module]) -> list[nn.Parameter]:
    """The tp-replicated parameters whose gradient each tp rank holds only a share of: the ones that saw only this
    rank's sequence shard (sequence parallelism: parallel/sequence_parallel.py), its tokens (a mixture of experts'
    router and experts: parallel/expert_parallel.py) or its heads (Qwen3's q/k norms: tensor_parallel.py)."""
    return [p for p in unique_parameters(modules) if getattr(p, "tp_partial", False)]


def sum_tp_partial_grads(params: list[nn.Parameter], tp_group, read: Callable, write: Callable) -> None:
    """The gradient of a tp-replicated parameter each tp rank holds a share of is the sum of the shares, and every tp
    rank takes that sum so the copies stay identical (Megatron's all-reduce of the LayerNorm gradients). One
    all-reduce for all of them. `read(p)`/`write(p, total)` access a gradient as the engine holds it; tp peers hold
    the same parameters in the same order and, under ZeRO, the same partitions of them."""
    if not params or group_size(tp_group) == 1:
        return
    grads = [read(p) for p in params]
    flat = all_reduce(torch.cat([g.reshape(-1).float() for g in grads]), tp_group)
    for p, g, total in zip(params, grads, flat.split([g.numel() for g in grads])):
        write(p, total.view_as(g).to(g.dtype))


def offload_to_host(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer) -> dict:
    """Parameters, their gradients and the optimizer's state tensors into pinned host memory, replaced in place
    (`.data`), so the optimizer, the modules and DDP keep their references; the device's freed blocks go back to the
    driver, where another process (a rollout engine) can allocate them. The bytes moved by kind."""
    moved = {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}
    for p in params:
        moved["param_bytes"] += _to_host(p)
        if p.grad is not None:
            moved["grad_bytes"] += _to_host(p.grad)
    for state in optimizer.state.values():
        for v in state.values():
            if torch.is_tensor(v) and v.device.type != "cpu":
                moved["optim_bytes"] += _to_host(v)
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return moved


def onload_from_host(params: Iterable[nn.Parameter], optimizer: torch.optim.Optimizer, device: torch.device) -> None:
    """offload_to_host undone: what it moved (pinned tensors) back on `device`."""
    tensors = [t for p in params for t in (p, p.grad) if t is not None]
    tensors += [v for state in optimizer.state.values() for v in state.values() if torch.is_tensor(v)]
    for t in tensors:
        if t.is_pinned():
            t.data = t.data.to(device, non_blocking=True)
    torch.cuda.synchronize(device)


def _to_host(t: torch.Tensor) -> int:
    host = torch.empty(t.shape, dtype=t.dtype, device="cpu", pin_memory=True)
    host.copy_(t.data)
    t.data = host
    return t.numel() * t.element_size()
