"""GPT-2 in plain PyTorch: learned positions, pre-LayerNorm, GELU, tied input/output embedding.

Parameter names follow Hugging Face's GPT2Model without the `transformer.` prefix (with nn.Linear where it has
Conv1D: hf.py transposes). No distributed code: its ParallelPlan says what tensor and sequence parallelism do to it.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.models.attention import AttentionCore, KVCache, contiguous_positions
from trainer3d.models.gpt2.config import GPTConfig
from trainer3d.models.interface import CausalLM, ColumnParallel, ParallelPlan, RowParallel
from trainer3d.models.seeding import name_seeded_normal


class CausalSelfAttention(AttentionCore):
    def __init__(self, cfg: GPTConfig):
        super().__init__(cfg.dropout)
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v stacked along the output dim
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.head_dim = cfg.head_dim

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.c_attn(x)
        # The local head count follows from the (possibly sharded) width, the length from the projection's output
        # (under sequence parallelism x is a shard of the sequence and the projection gathers it).
        B, T, _ = qkv.shape
        q, k, v = (t.reshape(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        return self.resid_dropout(self.c_proj(self.attend(q, k, v, kv_cache, layer)))


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, cfg.ffn_hidden)
        self.c_proj = nn.Linear(cfg.ffn_hidden, cfg.n_embd)
        self.dropout = nn.Dropout(cfg.dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.dropout(self.c_proj(F.gelu(self.c_fc(x), approximate="tanh")))


class Block(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.ln_1 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.attn = CausalSelfAttention(cfg)
        self.ln_2 = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.mlp = MLP(cfg)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.attn(self.ln_1(x), kv_cache, layer)
        return x + self.mlp(self.ln_2(x))


class GPT(CausalLM):
    BLOCKS, EMBEDDING, HEAD = "h", "wte", "lm_head"
    FIRST_STAGE = ("wte", "wpe", "drop")
    LAST_STAGE = ("ln_f", "lm_head")

    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe: nn.Module | None = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop: nn.Module | None = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied; pipeline stages that split them keep a synced copy
        self.position_ids = contiguous_positions  # the tokens' positions (context parallelism installs its own)

    def parallel_plan(self) -> ParallelPlan:
        d = self.cfg.n_embd
        return ParallelPlan(
            linears={"attn.c_attn": ColumnParallel(fused=(d, d, d)), "attn.c_proj": RowParallel(),
                     "mlp.c_fc": ColumnParallel(), "mlp.c_proj": RowParallel()},
            attention="attn",
            positions="wpe",
        )

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """With `kv_cache`, x continues the cached sequence: its positions start at the cache's length."""
        start = 0 if kv_cache is None else kv_cache.length
        if self.wte is not None:  # first stage: x holds token ids
            x = self.drop(self.wte(x) + self.wpe(self.position_ids(start, x.shape[1], x.device)))
        x = self.run_blocks(x, kv_cache)
        if self.lm_head is not None:  # last stage: x becomes logits (a vocab shard under TP)
            x = self.lm_head(self.ln_f(x))
        return x


def init_value(cfg: GPTConfig, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """GPT-2's scheme for the full (unsharded) parameter `name` (canonical): N(0, 0.02), residual projections scaled by
    1/sqrt(2 * n_layer), zero biases, unit LayerNorm gains."""
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_f"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    return name_seeded_normal(name, shape, seed, std)
