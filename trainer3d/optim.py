"""The optimizer's rules, written once for every data-parallel engine: AdamW's parameter groups and implementation
(fused where torch has it), where Adam keeps its step count, the learning-rate schedule, the global-norm clip
coefficient and fp16's dynamic loss scale."""

from __future__ import annotations

import math

import torch

from trainer3d.private_api import require


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps (GPT-2 / nanoGPT). `cfg`: a TrainConfig."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def param_groups(params, weight_decay: float, shape_of=lambda p: p.shape) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on biases and LayerNorm gains; empty groups
    dropped (a ZeRO engine refuses them). `shape_of(p)`: a parameter's real shape (a ZeRO-3 partition's is kept
    elsewhere)."""
    params = list(params)
    groups = [
        {"params": [p for p in params if len(shape_of(p)) >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if len(shape_of(p)) < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


def adam(params, lr: float, betas: tuple[float, float], eps: float, decoupled: bool = True) -> torch.optim.Optimizer:
    """AdamW (Adam: decoupled=False): torch's fused kernel where torch has one for every parameter's device and dtype
    (CUDA and CPU, floating point), else foreach, else the per-tensor loop. Fused makes one pass over the weights,
    gradients and moments per step; torch's default on CPU is the per-tensor loop, 6-8x slower on GPT-2 124M's
    parameters (bench/optimizer_step.md). Implementations differ in the last bits; the pick depends only on the
    device and dtype, so a resumed run steps as the saved one did (bitwise), and every engine's torch Adam is built
    here."""
    params = list(params)
    tensors = [p for g in params for p in g["params"]] if params and isinstance(params[0], dict) else params
    require("optim.py")
    from torch.optim.optimizer import _default_to_fused_or_foreach

    fused, foreach = _default_to_fused_or_foreach(tensors, differentiable=False, use_fused=True)  # torch's own test
    cls = torch.optim.AdamW if decoupled else torch.optim.Adam
    return cls(params, lr=lr, betas=betas, eps=eps, fused=fused or None, foreach=foreach if not fused else None)


def adam_step_state(step: float | torch.Tensor, param: torch.Tensor, optimizer: torch.optim.Optimizer) -> torch.Tensor:
    """Adam's `step` count as `optimizer` keeps it for `param` (a checkpoint loads it so): float32, on the
    parameter's device for fused (and capturable) implementations, which read it in the kernel; on the CPU
    otherwise, where torch reads it on the host without a device sync."""
    group = next((g for g in optimizer.param_groups if any(q is param for q in g["params"])), optimizer.defaults)
    on_device = group.get("fused") or group.get("capturable")
    return torch.as_tensor(step, dtype=torch.float32).to(param.device if on_device else "cpu").clone()


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for group in optimizer.param_groups:
        group["lr"] = lr


def clip_coefficient(norm: float, max_norm: float) -> float:
    """What every gradient is multiplied by: torch.nn.utils.clip_grad_norm_'s rule with the global norm; 1 when
    clipping is off (max_norm <= 0)."""
    if max_norm <= 0:
        return 1.0
    return min(1.0, max_norm / (norm + 1e-6))


class DynamicLossScale:
    """fp16 loss scaling. The overflow check is the global grad norm, which every rank already shares, so all
    stages and replicas skip the same steps."""

    def __init__(self, init: float = 2.0**16, growth_interval: int = 1000):
        self.scale, self.growth_interval, self.good_steps = init, growth_interval, 0

    def update(self, finite: bool) -> None:
        if not finite:
            self.scale, self.good_steps = max(self.scale / 2, 1.0), 0
        else:
            self.good_steps += 1
            if self.good_steps % self.growth_interval == 0:
                self.scale *= 2
