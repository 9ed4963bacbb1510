"""Pipeline parallelism with torch.distributed.pipelining: split the model into contiguous stages, give each
rank its stage(s), and drive them with one of torch's schedules.

Stages are balanced by forward FLOPs (the family's formulas): a GPT-2 block costs ~24·d² per token, the LM head
2·d·V, which for GPT-2 124M is worth ~5 blocks, so the last stage gets fewer blocks. With v virtual stages per rank the
model is cut into pp·v stages; "looped" schedules give rank r stages r, r+pp, r+2pp, ... and the V-shaped
ones (ZBV, DualPipeV) give it stages r and 2pp-1-r, which puts the first and last stage on rank 0.
"""

from __future__ import annotations

import contextlib
import functools

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn as nn
from torch.distributed.pipelining import PipelineStage, schedules

from trainer3d.config import SCHEDULE_NAMES
from trainer3d.errors import LayoutError
from trainer3d.models.interface import CausalLM
from trainer3d.models.moe import split_backward_pass
from trainer3d.private_api import require

# torch's pipelining before 2.13 (the GPU image has 2.11) needs two mends, found by running the suite on 2.11
# (docs/launching.md):
# - it makes a stage's receive buffers once, on the schedule's first pass, and marks them as needing gradients only
#   if that pass trains: after a first eval() (the step-0 validation) a later stage never sends its input gradient
#   back ("chunk 0 has gradients None"); 2.13 remakes them on a train/eval switch;
# - its first pass opens each stage's links with a send and a receive to both neighbours, even where the neighbour
#   is a stage of the same rank (the V-shaped schedules), which gloo cannot do ("Pair is not connected");
# and one it cannot be mended from outside, so check_pipeline refuses it: the weight pass of a split backward fails
# on the custom autograd functions of sequence parallelism ("Attribute '_input_metadata' is invalid").
PIPELINING_BEFORE_2_13 = torch.__version__ < "2.13"


@dataclass(frozen=True)
class ScheduleInfo:
    cls: type
    multi_stage: bool  # takes a list of stages (virtual stages per rank)
    v_shape: bool = False  # exactly two stages per rank, placed in a V
    # Zero-bubble schedules split backward into input- and weight-gradient passes; the weight pass runs outside
    # DDP's autograd hooks, so their dp gradient reduction is done after the schedule (parallel/ddp.py).
    split_backward: bool = False


SCHEDULES: dict[str, ScheduleInfo] = {
    "gpipe": ScheduleInfo(schedules.ScheduleGPipe, multi_stage=False),
    "1f1b": ScheduleInfo(schedules.Schedule1F1B, multi_stage=False),
    "interleaved-1f1b": ScheduleInfo(schedules.ScheduleInterleaved1F1B, multi_stage=True),
    "looped-bfs": ScheduleInfo(schedules.ScheduleLoopedBFS, multi_stage=True),
    "interleaved-zb": ScheduleInfo(schedules.ScheduleInterleavedZeroBubble, multi_stage=True, split_backward=True),
    "zbv": ScheduleInfo(schedules.ScheduleZBVZeroBubble, multi_stage=True, v_shape=True, split_backward=True),
    "dualpipev": ScheduleInfo(schedules.ScheduleDualPipeV, multi_stage=True, v_shape=True, split_backward=True),
}
# The flag's choices (config.SCHEDULE_NAMES, a leaf module) name exactly these, in this order.
assert tuple(SCHEDULES) == SCHEDULE_NAMES, "config.SCHEDULE_NAMES and pipeline.SCHEDULES disagree"


def stages_per_rank(schedule: str, virtual_stages: int) -> int:
    info = SCHEDULES[schedule]
    if info.v_shape:
        return 2
    return virtual_stages if info.multi_stage else 1


def check_pipeline(cfg, pp: int, schedule: str, virtual_stages: int, micro_batches: int,
                   sequence_parallel: bool = False) -> None:
    """Refuse, before any process group exists, a pipeline the model, the schedule or this torch cannot run."""
    problem = pipeline_problem(cfg, pp, schedule, virtual_stages, micro_batches, sequence_parallel)
    if problem is not None:
        raise LayoutError(problem[1])


def pipeline_problem(cfg, pp: int, schedule: str, virtual_stages: int, micro_batches: int,
                     sequence_parallel: bool = False) -> tuple[str, str] | None:
    """Why a pipeline cannot run, as (a short reason, the sentence naming the fix), or None: THE rules, which
    check_pipeline raises and the planner counts its refusals by."""
    if schedule not in SCHEDULES:
        return "unknown schedule", f"Unknown --schedule {schedule!r}; choose one of {', '.join(SCHEDULES)}."
    info = SCHEDULES[schedule]
    if pp > 1 and info.split_backward and sequence_parallel and PIPELINING_BEFORE_2_13:
        return "a split backward with sequence parallelism (torch < 2.13)", (
            f"--schedule {schedule} with --sequence-parallel fails inside torch {torch.__version__}'s weight pass "
            "(fixed in torch 2.13); install torch 2.13, or choose a schedule without a split backward.")
    if virtual_stages > 1 and not info.multi_stage:
        return "virtual stages need a multi-stage schedule", (
            f"--virtual-stages {virtual_stages} needs a multi-stage schedule; use --schedule interleaved-1f1b.")
    if info.v_shape and virtual_stages not in (1, 2):
        return "a V-shaped schedule places 2 stages per rank", (
            f"--schedule {schedule} places exactly 2 stages per rank; drop --virtual-stages.")
    n_stages = pp * stages_per_rank(schedule, virtual_stages)
    if n_stages > cfg.n_layer:
        return "more stages than layers", (
            f"{n_stages} pipeline stages (pp={pp} × {stages_per_rank(schedule, virtual_stages)} per rank) exceed the "
            f"model's {cfg.n_layer} layers; lower --pp or --virtual-stages.")
    if schedule == "1f1b" and micro_batches < pp:
        return "1F1B needs at least pp micro-batches", (
            f"1F1B needs at least pp={pp} micro-batches (got {micro_batches}); raise --micro-batches.")
    if info.multi_stage and not info.v_shape and micro_batches % pp:
        return "micro-batches not a multiple of pp", (
            f"--schedule {schedule} needs --micro-batches to be a multiple of pp={pp} (got {micro_batches}).")
    if info.v_shape and micro_batches < n_stages:
        return "a V-shaped schedule needs a micro-batch per stage", (
            f"--schedule {schedule} needs at least {n_stages} micro-batches (2 per stage... got {micro_batches}); "
            "raise --micro-batches.")
    return None


def block_costs(cfg, seq_len: int) -> list[float] | None:
    """Each block's forward FLOPs per token where a family's blocks differ in kind (a hybrid stack's linear and full
    attention: its `block_flops(layer, seq_len)`); None where every block costs `layer_flops`."""
    per_block = getattr(cfg, "block_flops", None)
    return None if per_block is None else [per_block(i, seq_len) for i in range(cfg.n_layer)]


def stage_cost(cfg, layers: range, last: bool, seq_len: int, costs: list[float] | None = None) -> float:
    """Forward FLOPs per token of a stage holding blocks `layers` at `seq_len`, plus the LM head (and its loss) on the
    last stage; the embedding lookup costs no FLOPs. The one cost model of a stage: balance_layers minimises it and
    the planner (trainer3d.plan.step_time) paces a pipeline by it. `cfg`: a model config (its family's formulas);
    `costs`: block_costs(cfg, seq_len), if already at hand."""
    costs = block_costs(cfg, seq_len) if costs is None else costs
    blocks = len(layers) * cfg.layer_flops(seq_len) if costs is None else sum(costs[i] for i in layers)
    return blocks + (cfg.head_flops() if last else 0)


def balance_layers(cfg, n_stages: int, seq_len: int) -> list[range]:
    """Contiguous block ranges per stage minimising the most expensive stage (`stage_cost`: each block at its own
    cost), at least one block per stage."""
    L = cfg.n_layer
    costs = block_costs(cfg, seq_len)

    @functools.cache  # S·L² calls over at most L² ranges
    def cost_of(start: int, end: int, last: bool) -> float:
        return stage_cost(cfg, range(start, end), last, seq_len, costs)

    def cost(start: int, end: int, stage: int) -> float:
        return cost_of(start, end, stage == n_stages - 1)

    # best[s][i]: the smallest max-cost of splitting blocks [0, i) into stages 0..s-1.
    inf = float("inf")
    best = [[inf] * (L + 1) for _ in range(n_stages + 1)]
    cut = [[0] * (L + 1) for _ in range(n_stages + 1)]
    best[0][0] = 0
    for s in range(1, n_stages + 1):
        for i in range(s, L - (n_stages - s) + 1):
            for j in range(s - 1, i):
                c = max(best[s - 1][j], cost(j, i, s - 1))
                if c < best[s][i]:
                    best[s][i], cut[s][i] = c, j
    bounds, i = [], L
    for s in range(n_stages, 0, -1):
        bounds.append(range(cut[s][i], i))
        i = cut[s][i]
    return bounds[::-1]


def stage_ids(pp_rank: int, pp: int, schedule: str, virtual_stages: int) -> list[int]:
    """The global stage indices owned by one pipeline rank."""
    if SCHEDULES[schedule].v_shape:
        return [pp_rank, 2 * pp - 1 - pp_rank]
    return [pp_rank + v * pp for v in range(stages_per_rank(schedule, virtual_stages))]


def last_stage_pp_rank(schedule: str, pp: int) -> int:
    """The pipeline rank holding the last stage (the loss and the LM head's copy of the embedding)."""
    return 0 if SCHEDULES[schedule].v_shape else pp - 1


def send_in_compute_dtype(stage: CausalLM, dtype: torch.dtype) -> None:
    """Under autocast the residual stream is fp32 inside a stage. Cast it to `dtype` (bf16) where it leaves a stage
    and back to fp32 where it enters one, so pipeline sends and their gradients cross the wire in bf16 (half the
    bytes); the residual is rounded to bf16 only at stage boundaries (Megatron keeps it in bf16 throughout)."""
    if stage.head is None:
        stage.register_forward_hook(lambda module, args, out: out.to(dtype))
    if stage.embedding is None:
        stage.register_forward_pre_hook(lambda module, args: (args[0].float(),) + tuple(args[1:]))


def stage_shapes(
    stage_index: int, n_stages: int, micro_batch_size: int, seq_len: int, d: int, vocab_shard: int,
    dtype: torch.dtype, hidden_seq_len: int | None = None,
) -> dict:
    """Static input/output examples (on the meta device) for one stage. With them torch never runs its shape
    inference, a forward (and backward) of every stage outside the schedule at the first step and at every
    train/eval switch, which would draw dropout masks, fire DDP's and DeepSpeed's gradient hooks and cost a step's
    worth of compute. Activations cross stages, and the last stage emits its logits shard, in `dtype`, the compute
    dtype (bf16 under autocast too: send_in_compute_dtype).
    Activations are marked requires_grad: torch derives the gradient buffers from these flags, and without them a
    later stage never sends its input gradient back (earlier stages silently get zero gradients).
    `hidden_seq_len`: the sequence length of the hidden states between stages (seq_len / tp under sequence
    parallelism; default seq_len); the token ids in and the logits out always span the whole sequence."""
    meta = torch.device("meta")
    hidden_seq_len = hidden_seq_len or seq_len
    if stage_index == 0:
        inp = torch.empty(micro_batch_size, seq_len, dtype=torch.long, device=meta)
    else:
        inp = torch.empty(micro_batch_size, hidden_seq_len, d, dtype=dtype, device=meta, requires_grad=True)
    last = stage_index == n_stages - 1
    out = torch.empty(micro_batch_size, seq_len if last else hidden_seq_len, vocab_shard if last else d,
                      dtype=dtype, device=meta, requires_grad=True)
    return {"input_args": (inp,), "output_args": (out,)}


def build_schedule(
    stage_modules: list[nn.Module],
    ids: list[int],
    n_stages: int,
    schedule: str,
    micro_batches: int,
    loss_fn: Callable,
    pp_group,
    device: torch.device,
    shapes: Callable[[int], dict],
    stage_cls: type = PipelineStage,
    listeners: list | None = None,
):
    """`shapes(stage_index)`: stage_shapes of each stage; `stage_cls`: zero/glue.py's ZeroPipelineStage (DeepSpeed
    engines as submodules) or torch's PipelineStage; `listeners`: what is told which micro-batch each forward and
    backward runs (`micro_batch`): the rank's SequenceLayout (parallel/context_parallel.py), the MoE balance's padding
    (parallel/moe_balance.py); the list may grow after the schedule is built."""
    info = SCHEDULES[schedule]
    require("parallel/pipeline.py")
    stage_cls = _derived(_FreeLogitsAfterBackward, stage_cls)
    if info.split_backward:
        stage_cls = _derived(_NamingSplitPasses, stage_cls)
    if PIPELINING_BEFORE_2_13:
        stage_cls = _derived(_MendedBefore2_13, stage_cls)
    if info.v_shape:
        stage_cls = _derived(_NoGradientHandoffWithoutBackward, stage_cls)
    if listeners is not None:
        stage_cls = _telling_micro_batch(stage_cls, listeners)
    stages = [stage_cls(m, i, n_stages, device, group=pp_group, **shapes(i)) for m, i in zip(stage_modules, ids)]
    # scale_grads=False: the loss is already divided by the number of micro-batches (see train/trainer.py), so the
    # gradient means the same thing at every layout.
    if info.multi_stage:
        return info.cls(stages, micro_batches, loss_fn=loss_fn, scale_grads=False)
    return info.cls(stages[0], micro_batches, loss_fn=loss_fn, scale_grads=False)


class _NoGradientHandoffWithoutBackward:
    """torch 2.13's runtime for the V-shaped schedules hands the input gradient from a rank's later stage to its
    earlier, adjacent one even in `schedule.eval()`, where no backward ran, and the stage asserts; forward-only
    passes (validation, HellaSwag, samples) then crash. Without a backward there is nothing to hand over."""

    def get_local_bwd_output(self, mb_index):
        return super().get_local_bwd_output(mb_index) if self.has_backward else ()

    def set_local_bwd_input(self, next_stage_bwd_outputs, mb_index):
        if self.has_backward:
            super().set_local_bwd_input(next_stage_bwd_outputs, mb_index)


class _FreeLogitsAfterBackward:
    """The loss works in the logits' storage (parallel/cross_entropy.py), so once the last stage's backward is done
    it holds a used gradient. torch's schedules keep the last forward's output in a local variable until the next
    forward, so that storage would live on through the next micro-batch's head, two logits-sized tensors at the last
    stage's peak (bench/last_stage_memory.md). Free it when the micro-batch's backward is done, as Megatron-LM frees a
    pipeline output (deallocate_output_tensor); with a split backward, after the weight pass, which still reads it."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.logits_until_weight_pass: dict[int, tuple] = {}

    def backward_one_chunk(self, bwd_chunk_id, *args, full_backward: bool = True, **kwargs):
        logits = self.fwd_cache[bwd_chunk_id][0] if self.is_last and self.has_backward else ()
        super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)
        if full_backward:
            _free(logits)
        else:
            self.logits_until_weight_pass[bwd_chunk_id] = logits

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)
        _free(self.logits_until_weight_pass.pop(bwd_chunk_id, ()))


class _NamingSplitPasses:
    """Names the passes of a split backward to the experts (models/moe.split_backward_pass), so that each computes
    only its own gradients instead of the whole backward twice."""

    def backward_one_chunk(self, bwd_chunk_id, *args, full_backward: bool = True, **kwargs):
        with contextlib.nullcontext() if full_backward else split_backward_pass("input"):
            super().backward_one_chunk(bwd_chunk_id, *args, full_backward=full_backward, **kwargs)

    def backward_weight_one_chunk(self, bwd_chunk_id, *args, **kwargs):
        # torch runs stage 0's weight pass as a whole backward (its inputs, token ids, need no gradient)
        with split_backward_pass("weight") if self.stage_index != 0 else contextlib.nullcontext():
            super().backward_weight_one_chunk(bwd_chunk_id, *args, **kwargs)


def _free(tensors) -> None:
    """Release the memory of tensors that own their whole storage (never a view into something larger)."""
    for t in tensors:
        storage = t.untyped_storage()
        if storage.nbytes() == t.numel() * t.element_size():
            storage.resize_(0)


class _MendedBefore2_13:
    """torch < 2.13 (PIPELINING_BEFORE_2_13): before a training forward, mark the micro-batch's receive buffers as
    needing gradients, as torch does itself when a schedule's first pass trains; open links only to other ranks."""

    def forward_one_chunk(self, fwd_chunk_id, *args, **kwargs):
        if self.has_backward:
            for info in self.args_recv_info[fwd_chunk_id]:
                buffer = getattr(info, "buffer", None)  # None: the first stage's inputs
                if buffer is not None and buffer.is_floating_point() and not buffer.requires_grad:
                    buffer.requires_grad_(True)
        return super().forward_one_chunk(fwd_chunk_id, *args, **kwargs)

    def _get_init_p2p_neighbors_ops(self):
        return [op for op in super()._get_init_p2p_neighbors_ops() if op.group_peer != self.group_rank]

    def _validate_fwd_outputs(self, outputs):
        """The last stage's output goes to the loss, never on the wire, and with multi-token prediction its length
        differs between training (the D extra predictions) and evaluation: checked only where it is sent, as torch
        2.13 (which dropped this check) has it. Seen on torch 2.11 on a GPU (bench/gpu_round.md)."""
        if not self.is_last:
            super()._validate_fwd_outputs(outputs)


def _derived(mixin: type, stage_cls: type) -> type:
    return type(stage_cls.__name__, (mixin, stage_cls), {})


def _telling_micro_batch(stage_cls: type, listeners: list) -> type:
    """A stage class that sets `micro_batch` on each of `listeners` before each forward and backward of a micro-batch:
    document masks, positions and padding depend on the micro-batch's rows, and a recomputation in the backward must
    see the same ones as its forward did (the schedule interleaves micro-batches)."""

    def run_as(method):
        def run(self, chunk_id, *args, **kwargs):
            for listener in listeners:
                listener.micro_batch = chunk_id
            return getattr(stage_cls, method)(self, chunk_id, *args, **kwargs)
        return run

    methods = ("forward_one_chunk", "backward_one_chunk", "backward_weight_one_chunk")
    return type(stage_cls.__name__, (stage_cls,), {m: run_as(m) for m in methods})
