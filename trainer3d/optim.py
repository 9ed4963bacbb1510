"""The optimizer's rules, written once for every data-parallel engine: AdamW's parameter groups, the learning-rate
schedule, the global-norm clip coefficient and fp16's dynamic loss scale."""

from __future__ import annotations

import math

import torch


def lr_at(step: int, cfg) -> float:
    """Linear warmup to lr, then cosine decay to min_lr at max_steps (GPT-2 / nanoGPT). `cfg`: a TrainConfig."""
    min_lr = cfg.lr / 10 if cfg.min_lr is None else cfg.min_lr
    if step < cfg.warmup_steps:
        return cfg.lr * (step + 1) / cfg.warmup_steps
    progress = (step - cfg.warmup_steps) / max(1, cfg.max_steps - cfg.warmup_steps)
    return min_lr + 0.5 * (1 + math.cos(math.pi * min(1.0, progress))) * (cfg.lr - min_lr)


def param_groups(params, weight_decay: float) -> list[dict]:
    """Weight decay on matrices (linear weights, embeddings), none on biases and LayerNorm gains; empty groups
    dropped (a ZeRO engine refuses them)."""
    params = list(params)
    groups = [
        {"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
        {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0},
    ]
    return [g for g in groups if g["params"]]


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
