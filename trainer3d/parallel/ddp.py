"""torch DDP as the data-parallel engine: every dp rank holds its whole stage, gradients are averaged by DDP's
buckets during the last micro-batch's backward (torch's pipeline stages run the others under `no_sync`).

Zero-bubble schedules (interleaved-zb, zbv, dualpipev) split backward into input- and weight-gradient passes, and
the weight pass runs outside DDP's autograd hooks: for them the stages stay unwrapped and the dp average is a
flat-bucket all-reduce after the schedule, with the same arithmetic as DDP (sum, then divide by the dp size).
"""

from __future__ import annotations


import torch
import torch.distributed as dist
import torch.nn as nn
from torch.nn.parallel import DistributedDataParallel

from trainer3d.distributed.collectives import all_reduce, group_size
from trainer3d.optim import adam, adam_step_state, param_groups, set_lr
from trainer3d.parallel.engine import (
    DataParallelEngine, counts_in_norm, offload_to_host, onload_from_host, sum_of_squares, sum_tp_partial_grads,
    tp_partial_params, sum_tied_grads, tied_copies, unique_parameters,
)
from trainer3d.parallel.pipeline import SCHEDULES
from trainer3d.private_api import require


def wrap_ddp(module: nn.Module, dp_group, device: torch.device) -> nn.Module:
    if group_size(dp_group) == 1:
        return module
    # Experts split over ep are not replicated over the dp group: DDP leaves them to DDPEngine (the edp group).
    experts = [name for name, p in module.named_parameters() if getattr(p, "expert", False)]
    if experts:
        DistributedDataParallel._set_params_and_buffers_to_ignore_for_model(module, experts)
    # Every parameter is used in every forward, so no find_unused_parameters (its graph walk each step). torch's
    # PipelineStage runs forwards under no_sync and arms the reducer before the last backward; DDP's forward still
    # rebuilds its buckets in the next step's first forward (_pre_forward calls _rebuild_buckets whatever no_sync
    # says), from the gradient order the first step's armed backward recorded.
    return DistributedDataParallel(module, process_group=dp_group,
                                   device_ids=[device.index] if device.type == "cuda" else None)


def all_reduce_grads(params: list[nn.Parameter], dp_group, bucket_elems: int = 25_000_000) -> None:
    """Average gradients over dp in flat buckets (the split-backward schedules, which DDP cannot follow; experts
    split over ep, over their edp group). A parameter without a gradient (an expert no token reached on this rank)
    takes part as zeros, so every rank reduces the same buckets."""
    n = group_size(dp_group)
    if n == 1:
        return
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    grads = [p.grad for p in params]
    bucket: list[torch.Tensor] = []
    for i, g in enumerate(grads):
        bucket.append(g)
        if sum(b.numel() for b in bucket) >= bucket_elems or i == len(grads) - 1:
            flat = torch.cat([b.reshape(-1) for b in bucket])
            dist.all_reduce(flat, group=dp_group)
            flat.div_(n)
            for b, reduced in zip(bucket, flat.split([b.numel() for b in bucket])):
                b.copy_(reduced.view_as(b))
            bucket = []


def _grad_or_zeros(p: nn.Parameter) -> torch.Tensor:
    return p.grad if p.grad is not None else torch.zeros_like(p)


def _set_grad(p: nn.Parameter, value: torch.Tensor) -> None:
    if p.grad is None:
        p.grad = value.clone()
    else:
        p.grad.copy_(value)


class DDPEngine(DataParallelEngine):
    """AdamW is torch's fused kernel (torch has one on CUDA and on CPU; foreach elsewhere): one pass per step where
    the CPU default's per-tensor loop makes ~8 (optim.adam). The clip multiplies gradients on the device by a float."""

    name = "DDP"

    def __init__(self, stages: list[nn.Module], topo, device: torch.device, cfg):
        require("parallel/ddp.py")
        self.stages, self.topo, self.device = stages, topo, device
        self.hooks_reduce = not SCHEDULES[cfg.schedule].split_backward  # DDP's hooks see every gradient
        self.wrapped = [wrap_ddp(s, topo.dp_cp_group, device) for s in stages] if self.hooks_reduce else list(stages)
        self.params = [p for p in unique_parameters(stages) if p.requires_grad]  # (frozen ones: no state, no grad)
        self.experts = [p for p in self.params if getattr(p, "expert", False)]  # split over ep (reduced over edp)
        self.tp_partial = [p for p in tp_partial_params(stages) if p.requires_grad]
        # which gradients this rank counts in the norm, decided once (a walk of every module each step cost ~1 ms)
        self.norm_params = [(p, getattr(p, "expert", False)) for m in stages for p in m.parameters()
                            if p.requires_grad and counts_in_norm(m, p, topo.tp_rank)]
        groups = param_groups(self.params, cfg.weight_decay)
        self.optimizer = adam(groups, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.adam_eps)
        self._offloaded = False  # (offload)

    @property
    def stage_modules(self) -> list[nn.Module]:
        return self.wrapped

    def zero_grad(self) -> None:
        self.optimizer.zero_grad(set_to_none=True)

    def reduce_grads(self, grad_scale: float) -> torch.Tensor:
        if not self.hooks_reduce:
            all_reduce_grads([p for p in self.params if not getattr(p, "expert", False)], self.topo.dp_cp_group)
        all_reduce_grads(self.experts, self.topo.edp_group)  # (their 1/ep is in their backward: expert_parallel.py)
        sum_tied_grads(tied_copies(self.stages), self.topo.embedding_group, lambda p: p.grad, _set_grad)
        sum_tp_partial_grads(self.tp_partial, self.topo.tp_group, _grad_or_zeros, _set_grad)
        if grad_scale != 1.0:
            torch._foreach_mul_(self._grads(), grad_scale)
        return self.global_grad_norm()

    def update(self, lr: float, coef: float) -> None:
        grads = self._grads()
        if coef < 1.0 and grads:
            torch._foreach_mul_(grads, coef)
        set_lr(self.optimizer, lr)
        self.optimizer.step()

    def _grads(self) -> list[torch.Tensor]:
        return [p.grad for p in self.params if p.grad is not None]

    def global_grad_norm(self) -> torch.Tensor:
        """Squares of tp shards and pp stages summed over the model-parallel group, each element counted once
        (experts split over ep summed over the ep group first); DDP has already averaged over dp, so dp needs no
        reduction. A device scalar (float64), not read here."""
        counted = [(p, expert) for p, expert in self.norm_params if p.grad is not None]
        squares = sum_of_squares([p.grad for p, expert in counted if not expert], self.device)
        if self.experts:  # this replica holds its ep rank's experts: the ep group holds them all
            squares += all_reduce(sum_of_squares([p.grad for p, expert in counted if expert], self.device),
                                  self.topo.ep_group)
        return all_reduce(squares, self.topo.mp_group).sqrt()

    def param_value(self, param: nn.Parameter) -> torch.Tensor:
        return param.data

    def optimizer_state_of(self, param: nn.Parameter) -> dict[str, torch.Tensor]:
        """(A frozen parameter, which the optimizer does not hold: the zero moments AdamW starts from, once it has
        stepped, so that every checkpoint holds every parameter's state.)"""
        if not param.requires_grad and self.params:  # (whether AdamW has stepped, without adam_step()'s host read)
            state = self.optimizer.state.get(self.params[0], {})
            return {k: torch.zeros_like(param) for k in ("exp_avg", "exp_avg_sq") if k in state}
        return {k: v for k, v in self.optimizer.state.get(param, {}).items() if torch.is_tensor(v)}

    def adam_step(self) -> int | None:
        state = next((self.optimizer.state[p] for p in self.params if p in self.optimizer.state), None)
        return None if state is None else int(state["step"])

    def load_param_states(self, items) -> None:
        for param, read_state, _ in items:
            state = read_state() if param.requires_grad else None  # (a frozen one has no optimizer state)
            if state:
                self.optimizer.state[param] = {
                    k: adam_step_state(v, param, self.optimizer) if k == "step" else v.to(param.device, param.dtype)
                    for k, v in state.items()
                }

    def memory(self) -> dict:
        params = sum(p.numel() * p.element_size() for p in self.params)
        grads = sum(p.grad.numel() * p.grad.element_size() for p in self.params if p.grad is not None)
        optim = sum(
            v.numel() * v.element_size() for s in self.optimizer.state.values() for v in s.values() if torch.is_tensor(v)
        )
        return {
            "param_bytes": params, "grad_bytes": grads, "optim_bytes": optim,
            "param_offloaded_bytes": 0, "grad_offloaded_bytes": 0, "optim_offloaded_bytes": 0,
        }

    def describe(self) -> dict:
        return {"engine": "ddp"}

    def offload(self) -> dict:
        """Every parameter (frozen ones too), gradient and AdamW state tensor to pinned host memory (offload_to_host).
        DDP's own gradient buckets stay on the device (torch has no call that frees them)."""
        if self.device.type == "cpu" or self._offloaded:
            return {"param_bytes": 0, "grad_bytes": 0, "optim_bytes": 0}
        self._offloaded = True
        return offload_to_host(unique_parameters(self.stages), self.optimizer)

    def onload(self) -> None:
        if self._offloaded:
            onload_from_host(unique_parameters(self.stages), self.optimizer, self.device)
            self._offloaded = False
