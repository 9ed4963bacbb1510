"""Llama 3 in plain PyTorch: RMSNorm, rotary positions (Llama 3.1's frequency rescaling), grouped-query attention,
SwiGLU, no biases, the head tied or not as the config says.

Parameter names are Hugging Face's LlamaForCausalLM without the `model.` prefix, except two fused weights: q|k|v as
`self_attn.qkv_proj` and gate|up as `mlp.gate_up_proj` (as Megatron-LM's linear_qkv and linear_fc1), so each enters
its tensor-parallel region with one matmul and, under sequence parallelism, one all-gather; hf.py splits them for
Hugging Face. Rotary positions follow HF's convention (rotate_half), so HF weights need no permutation.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.models.attention import AttentionCore, KVCache, contiguous_positions
from trainer3d.models.interface import CausalLM, ColumnParallel, ParallelPlan, RowParallel
from trainer3d.models.llama.config import LlamaConfig
from trainer3d.models.moe import MoE, moe_init_std
from trainer3d.models.seeding import name_seeded_normal


class RMSNorm(nn.Module):
    """x · rsqrt(mean(x²) + eps) · w, computed in fp32 (HF's LlamaRMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def rope_frequencies(cfg: LlamaConfig) -> torch.Tensor:
    """inv_freq [rotary_dim / 2] (fp32, CPU): 1 / theta^(2i/d), each rescaled once by Llama 3.1's rule when
    `rope_factor` is set: kept where the wavelength is under original_context/high_freq_factor, divided by the factor
    where it is over original_context/low_freq_factor, interpolated smoothly between."""
    d = cfg.rotary_dim
    inv_freq = 1.0 / (cfg.rope_theta ** (torch.arange(0, d, 2, dtype=torch.int64, device="cpu").float() / d))
    if cfg.rope_factor is None:
        return inv_freq
    factor, low, high = cfg.rope_factor, cfg.rope_low_freq_factor, cfg.rope_high_freq_factor
    ctx = cfg.rope_original_context
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > ctx / low, inv_freq / factor, inv_freq)
    smooth = (ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = ~(wavelen < ctx / high) * ~(wavelen > ctx / low)
    return torch.where(medium, smoothed, scaled)


class Rotary(nn.Module):
    """cos and sin of the rotary angles of T tokens continuing a sequence at `start` (fp32 math, then the activations'
    dtype): [T, hd], or [B, 1, T, hd] where positions differ per row (positions restarting at each document)."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.inv_freq: torch.Tensor | None = None  # fp32, filled by init_tables (CausalLM.init_tables)
        self.position_ids = contiguous_positions  # the tokens' positions (context parallelism installs its own)

    def init_tables(self, device: torch.device) -> None:
        self.inv_freq = rope_frequencies(self.cfg).to(device)

    def forward(self, start: int, T: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.position_ids(start, T, like.device).float()
        freqs = positions[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:  # [B, T, hd]: per row, broadcast over the heads
            emb = emb[:, None]
        return emb.cos().to(like.dtype), emb.sin().to(like.dtype)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, hd] rotated by the angles (cos, sin [T, hd]); HF's rotate_half convention."""
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat((-x2, x1), dim=-1) * sin


class Attention(AttentionCore):
    def __init__(self, cfg: LlamaConfig, layer: int = 0):
        super().__init__(cfg.dropout)
        self.qkv_proj = nn.Linear(cfg.n_embd, cfg.q_width + 2 * cfg.kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.q_width, cfg.n_embd, bias=False)
        self.rotary = Rotary(cfg)
        self.head_dim = cfg.head_dim
        self.heads_per_group = (cfg.n_head + 2 * cfg.n_kv_heads, cfg.n_head)  # (q + k + v heads, q heads)
        # Qwen3: each head's q and k normalized over head_dim (one weight for all heads) before the rotation
        self.q_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None
        self.k_norm = RMSNorm(cfg.head_dim, cfg.norm_eps) if cfg.qk_norm else None

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        # Local heads follow from the (possibly tp-sharded) width: every rank holds the same share of q, k and v heads;
        # the length from the projection's output (under sequence parallelism it gathers the sequence).
        B, T, width = qkv.shape
        all_heads, q_heads = self.heads_per_group
        n_q = width // self.head_dim * q_heads // all_heads
        n_kv = (width // self.head_dim - n_q) // 2
        q, k, v = (t.reshape(B, T, -1, self.head_dim)
                   for t in qkv.split([n_q * self.head_dim, n_kv * self.head_dim, n_kv * self.head_dim], dim=-1))
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        cos, sin = self.rotary(0 if kv_cache is None else kv_cache.length, T, q)
        return self.o_proj(self.attend(rotate(q, cos, sin), rotate(k, cos, sin), v, kv_cache, layer))


class SwiGLU(nn.Module):
    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.gate_up_proj = nn.Linear(cfg.n_embd, 2 * cfg.ffn_hidden, bias=False)  # gate | up
        self.down_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)  # under tp: this rank's columns of each
        return self.down_proj(F.silu(gate) * up)


class Block(nn.Module):
    """Pre-norm attention and MLP (an MoE block where the config says); `attention(cfg, layer)`: the family's
    (DeepSeek-V3's latent attention in place of grouped-query attention)."""

    def __init__(self, cfg: LlamaConfig, layer: int, attention: type[nn.Module] = Attention):
        super().__init__()
        self.input_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.self_attn = attention(cfg, layer)
        self.post_attention_layernorm = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MoE(cfg.n_embd, cfg.moe, layer) if cfg.is_moe_layer(layer) else SwiGLU(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Llama(CausalLM):
    BLOCKS, EMBEDDING, HEAD = "layers", "embed_tokens", "lm_head"
    FIRST_STAGE = ("embed_tokens",)
    LAST_STAGE = ("norm", "lm_head")
    ATTENTION: type[nn.Module] = Attention  # a block's attention (a family built on this skeleton names its own)

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i, self.ATTENTION) for i in range(cfg.n_layer)})
        self.norm: nn.Module | None = RMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def parallel_plan(self) -> ParallelPlan:
        c = self.cfg
        return ParallelPlan(
            linears={"self_attn.qkv_proj": ColumnParallel(fused=(c.q_width, c.kv_width, c.kv_width)),
                     "self_attn.o_proj": RowParallel(),
                     "mlp.gate_up_proj": ColumnParallel(fused=(c.ffn_hidden, c.ffn_hidden)),
                     "mlp.down_proj": RowParallel()},
            attention="self_attn",
            head_shared=("self_attn.q_norm.weight", "self_attn.k_norm.weight") if c.qk_norm else (),
        )

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        if self.embed_tokens is not None:  # first stage: x holds token ids
            x = self.embed_tokens(x)
        x = self.run_blocks(x, kv_cache)
        if self.lm_head is not None:  # last stage: x becomes logits (a vocab shard under TP)
            x = self.lm_head(self.norm(x))
        return x


def init_value(cfg: LlamaConfig, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """N(0, 0.02) for every matrix (HF's initializer_range), the residual projections (o_proj, down_proj, the experts'
    down_proj) scaled by 1/sqrt(2 * n_layer) as Megatron-LM does; unit norm gains."""
    if name.endswith("norm.weight"):
        return torch.ones(shape)
    std = moe_init_std(name, cfg.n_layer)
    if std is None:
        std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith(("o_proj.weight", "down_proj.weight")) else 0.02
    return name_seeded_normal(name, shape, seed, std)
