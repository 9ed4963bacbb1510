"""The reference side of the tests against Hugging Face: a model trained the way a reader of torch's and transformers'
documentation would, sharing no code with trainer3d (its optimizer, schedule and clip are torch's or written here from
their documented rules), so that a bug in trainer3d's own cannot hide on both sides."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F


def lr_schedule(step: int, lr: float, warmup: int, max_steps: int, min_lr: float | None = None) -> float:
    """GPT-2's (nanoGPT's, llm.c's) schedule as the README states it: linear warmup over `warmup` steps to lr (step s,
    counted from 0, takes lr·(s+1)/warmup), then a cosine from lr down to min_lr (lr/10 unless given) at max_steps."""
    min_lr = lr / 10 if min_lr is None else min_lr
    if step < warmup:
        return lr * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, max_steps - warmup))
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (lr - min_lr)


def adamw(model: torch.nn.Module, lr: float, weight_decay: float, betas=(0.9, 0.95)) -> torch.optim.AdamW:
    """torch's AdamW (its default implementation), decay on matrices and embeddings only (the GPT-2/nanoGPT rule: no
    decay on biases and norm gains)."""
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": weight_decay},
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas, eps=1e-8)


def plain_loop(model: torch.nn.Module, data: torch.Tensor, lr: float, warmup_steps: int, max_steps: int,
               grad_clip: float, weight_decay: float, aux_loss=None) -> tuple[list[float], list[float]]:
    """Train a transformers causal LM on `data` [steps, batch, seq + 1]: the mean token cross-entropy of the batch
    (plus `aux_loss(outputs)` when given, e.g. a router's), `clip_grad_norm_`, AdamW at the schedule's lr. Returns
    the per-step losses (cross-entropy plus aux) and gradient norms (before clipping)."""
    model.train()
    opt = adamw(model, lr, weight_decay)
    losses, norms = [], []
    for step, batch in enumerate(data):
        out = model(batch[:, :-1])
        logits = out.logits
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), batch[:, 1:].reshape(-1))
        if aux_loss is not None:
            loss = loss + aux_loss(out)
        loss.backward()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), grad_clip).item())
        for group in opt.param_groups:
            group["lr"] = lr_schedule(step, lr, warmup_steps, max_steps)
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses, norms
