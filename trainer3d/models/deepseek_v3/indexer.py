"""DeepSeek Sparse Attention (DSA; the DeepSeek-V3.2 report, transformers' DeepseekV32Indexer): a lightning indexer
beside each MLA layer picks, for every query, the `index_topk` earlier tokens its attention reads.

    q_h = wq_b(q latent) per indexer head, k = LayerNorm(wk(x)), one key shared by the heads; both rotate their first
          qk_rope_head_dim dims with the layer's YaRN tables (half-split pairs; GLM-5: interleaved pairs)
    I[t, s] = Σ_h w_h(t) · ReLU(q_h(t) · k(s) / √index_head_dim),   w = weights_proj(x) / √index_n_heads   (fp32)

Selection is the top-k of I among the keys a query may see (causal, and its own document under --document-mask);
fewer visible keys than k: all of them. The indexer learns from its own loss only (top-k passes no gradient): the KL
from the main attention's distribution, p[t] = the heads' probabilities summed and L1-normalised, to softmax(I[t])
over the same keys: every visible key in the dense warm-up, the selected ones in sparse training. Its input is
detached (the report's sparse stage), so the loss trains the indexer and nothing else.

Written here: transformers' indexer runs under no_grad (inference only) and no library trains one on CPU."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.models.llama.model import rotate

INDEXER_NORM_EPS = 1e-6  # transformers' nn.LayerNorm(index_head_dim, eps=1e-6)


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, interleaved: bool) -> torch.Tensor:
    """RoPE on x's last dim: half-split pairs (x_i, x_{i+d/2}), or DeepSeek's interleaved pairs (x_2i, x_2i+1),
    rotated as transformers rotates them (evens then odds out)."""
    if interleaved:
        x = torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)
    return rotate(x, cos, sin)


class Indexer(nn.Module):
    def __init__(self, cfg):
        super().__init__()
        n, hd, d = cfg.index_n_heads, cfg.index_head_dim, cfg.n_embd
        self.wq_b = nn.Linear(cfg.q_lora_rank, n * hd, bias=False)
        self.wk = nn.Linear(d, hd, bias=False)
        self.k_norm = nn.LayerNorm(hd, eps=INDEXER_NORM_EPS)
        self.weights_proj = nn.Linear(d, n, bias=False)
        self.weights_proj.keeps_fp32 = True  # computed in fp32 (forward): a bf16 hold (parallel/lora.py) passes it by
        self.heads, self.head_dim, self.rope = n, hd, cfg.qk_rope_head_dim
        self.interleaved = cfg.index_rope_interleave

    def _rope(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return torch.cat((rotate_pairs(x[..., :self.rope], cos, sin, self.interleaved), x[..., self.rope:]), dim=-1)

    def forward(self, x: torch.Tensor, q_latent: torch.Tensor, cos: torch.Tensor,
                sin: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """x [B, T, d] and the q latent [B, T, q_lora_rank], both detached by the caller -> (q [B, n, T, hd],
        k [B, 1, T, hd], w [B, T, n]) in fp32; cos, sin the layer's rope tables for these T positions."""
        B, T, _ = x.shape
        q = self.wq_b(q_latent).view(B, T, self.heads, self.head_dim).transpose(1, 2)
        k = self.k_norm(self.wk(x)).view(B, 1, T, self.head_dim)
        # transformers keeps weights_proj in fp32; the module itself is called (ZeRO-3 gathers it in its hook)
        with torch.autocast(x.device.type, enabled=False):
            w = self.weights_proj(x.to(self.weights_proj.weight.dtype)).float() * self.heads ** -0.5
        return self._rope(q, cos, sin).float(), self._rope(k, cos, sin).float(), w


class _IndexScores(torch.autograd.Function):
    """Σ_h w_h·ReLU(q_h·kᵀ·scale) a head at a time, −inf where not visible, and the backward recomputes each head's
    scores: what autograd would keep is the [B, heads, T, S] of them (2 GiB for 8 heads at 4096 tokens, bench/dsa.md)
    and a mask of its own; this keeps q, k, w and the caller's `visible`."""

    @staticmethod
    def forward(ctx, q, k, w, visible, scale):
        ctx.save_for_backward(q, k, w, visible)
        ctx.scale = scale
        keys = k[:, 0].transpose(-1, -2)
        out = torch.zeros(q.shape[0], q.shape[2], k.shape[2], dtype=q.dtype, device=q.device)
        for h in range(q.shape[1]):
            out.addcmul_(w[:, :, h, None], F.relu(q[:, h] @ keys * scale))
        return out.masked_fill_(~visible, float("-inf"))

    @staticmethod
    def backward(ctx, grad):
        q, k, w, visible = ctx.saved_tensors
        grad = grad.masked_fill(~visible, 0.0)
        keys = k[:, 0]
        dq, dk, dw = torch.empty_like(q), torch.zeros_like(keys), torch.empty_like(w)
        for h in range(q.shape[1]):
            scores = q[:, h] @ keys.transpose(-1, -2) * ctx.scale
            dw[:, :, h] = (grad * F.relu(scores)).sum(-1)
            through = grad * w[:, :, h, None] * (scores > 0) * ctx.scale
            dq[:, h] = through @ keys
            dk += through.transpose(-1, -2) @ q[:, h]
        return dq, dk.unsqueeze(1), dw, None, None


def index_scores(q: torch.Tensor, k: torch.Tensor, w: torch.Tensor, visible: torch.Tensor) -> torch.Tensor:
    """I [B, T, S] (fp32) of queries q [B, n, T, hd] over keys k [B, 1, S, hd], −inf where `visible` [B|1, T, S] is
    False; w [B, T, n] the heads' weights."""
    return _IndexScores.apply(q, k, w, visible, q.shape[-1] ** -0.5)


def select(scores: torch.Tensor, topk: int, visible: torch.Tensor) -> torch.Tensor:
    """[B, T, S] bool: each query's top-k keys by `scores` among the visible ones (all of them where fewer). Exact
    ties go as torch.topk orders them, as in transformers (whose choice the tests reproduce); they need a key that no
    head scores above 0, rare with the published 32-64 heads but common with a test's 4, and topk may order them
    otherwise for a row of another length (one decoded token's)."""
    chosen = scores.topk(min(topk, scores.shape[-1]), dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, chosen, True) & visible


@torch.no_grad()
def head_probabilities(q: torch.Tensor, k: torch.Tensor, allowed: torch.Tensor, scale: float,
                       heads_at_once: int = 2) -> torch.Tensor:
    """Σ_h softmax(q_h k_hᵀ · scale) over the allowed keys, [B, T, S] fp32: the main attention's probabilities
    summed over this rank's heads (q [B, H, T, d], k [B, H, S, d]), a few heads at a time (no [B, H, T, S] at
    once)."""
    total = torch.zeros(q.shape[0], q.shape[2], k.shape[2], dtype=torch.float32, device=q.device)
    blocked = ~allowed.unsqueeze(1)
    for h in range(0, q.shape[1], heads_at_once):
        logits = (q[:, h:h + heads_at_once].float() @ k[:, h:h + heads_at_once].float().transpose(-1, -2)) * scale
        total += logits.masked_fill(blocked, float("-inf")).softmax(-1).sum(1)
    return total


def kl_per_query(p: torch.Tensor, scores: torch.Tensor, allowed: torch.Tensor) -> torch.Tensor:
    """KL(p[t] ‖ softmax(I[t])) over the allowed keys, [B, T]: p [B, T, S] the target (rows sum to 1, 0 where not
    allowed), scores I [B, T, S] with their gradient."""
    return _IndexerKL.apply(p, scores, allowed)


class _IndexerKL(torch.autograd.Function):
    """kl_per_query, keeping for the backward one [B, T, S] fp32, its gradient's direction dKL_t/dI = q·Σp − p (q =
    softmax(I) over the allowed keys; 0 elsewhere): autograd kept log q, p and two masks (10 bytes a query-key pair
    where this keeps 4; bench/dsa.md)."""

    @staticmethod
    def forward(ctx, p, scores, allowed):
        log_q = scores.masked_fill(~allowed, float("-inf")).log_softmax(-1).masked_fill_(~allowed, 0.0)
        log_p = torch.where(p > 0, p, 1.0).log()
        ctx.save_for_backward(log_q.exp().masked_fill_(~allowed, 0.0) * p.sum(-1, keepdim=True) - p)
        return (p * (log_p - log_q)).sum(-1)

    @staticmethod
    def backward(ctx, grad):
        (direction,) = ctx.saved_tensors
        return None, grad.unsqueeze(-1) * direction, None
