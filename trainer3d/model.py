"""GPT-2 in plain PyTorch: learned positions, pre-LayerNorm, GELU, tied input/output embedding.

No distributed code lives here. Tensor parallelism swaps the Linear/Embedding modules for sharded ones
(tensor_parallel.py) and pipeline parallelism deletes the parts a stage does not own (pipeline.py), so
`forward` tolerates a missing embedding (input is hidden states) and a missing head (output is hidden
states). Parameter names follow Hugging Face's GPT2Model without the `transformer.` prefix; blocks live in
a ModuleDict keyed by their global index, so a name means the same parameter under every layout.

Generation passes a KVCache to `forward`: each attention layer appends its new keys and values and attends to all
of them, so a new token costs one position's work instead of the whole prefix's. Without a cache (training) the
code path is the one above, untouched.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass

import torch
import torch.nn as nn
import torch.nn.functional as F


@dataclass(frozen=True)
class GPTConfig:
    vocab_size: int = 50257
    n_positions: int = 1024
    n_embd: int = 768
    n_layer: int = 12
    n_head: int = 12
    dropout: float = 0.0
    layer_norm_eps: float = 1e-5

    @property
    def head_dim(self) -> int:
        return self.n_embd // self.n_head

    def num_params(self, include_embedding: bool = True) -> int:
        d, L, V, P = self.n_embd, self.n_layer, self.vocab_size, self.n_positions
        per_block = 12 * d * d + 13 * d  # qkv, proj, fc, proj weights and biases + 2 LayerNorms
        n = L * per_block + 2 * d  # + final LayerNorm
        if include_embedding:
            n += V * d + P * d
        return n

    def flops_per_token(self, seq_len: int) -> float:
        """Training FLOPs per token: 6 per parameter touched by a token (all matmuls, the LM head included, the
        embedding lookups excluded) plus attention's QK^T and AV, 12·L·d·T (PaLM appendix B / Megatron)."""
        matmul_params = self.num_params(include_embedding=False) + self.vocab_size * self.n_embd
        return 6.0 * matmul_params + 12.0 * self.n_layer * self.n_embd * seq_len


# The published GPT-2 family (Radford et al. 2019), a tiny one for CPU runs and tests, and the GPT-3 family. The one
# model table: the trainer's --model and the planner's both read it.
MODEL_PRESETS: dict[str, GPTConfig] = {
    "tiny": GPTConfig(n_positions=256, n_embd=128, n_layer=4, n_head=4),
    "gpt2": GPTConfig(n_embd=768, n_layer=12, n_head=12),
    "gpt2-medium": GPTConfig(n_embd=1024, n_layer=24, n_head=16),
    "gpt2-large": GPTConfig(n_embd=1280, n_layer=36, n_head=20),
    "gpt2-xl": GPTConfig(n_embd=1600, n_layer=48, n_head=25),
    # GPT-3 (Brown et al. 2020, Table 2.1), context 2048. Where the paper's heads do not divide d_model we keep its
    # d_head of 128 and choose the heads: 1.3B has 16 (paper: 24 heads of 128 on d_model 2048), 13B d_model 5120
    # (paper: 5140, not a multiple of its 40 heads).
    "gpt3-125m": GPTConfig(n_positions=2048, n_embd=768, n_layer=12, n_head=12),
    "gpt3-350m": GPTConfig(n_positions=2048, n_embd=1024, n_layer=24, n_head=16),
    "gpt3-760m": GPTConfig(n_positions=2048, n_embd=1536, n_layer=24, n_head=16),
    "gpt3-1.3b": GPTConfig(n_positions=2048, n_embd=2048, n_layer=24, n_head=16),
    "gpt3-2.7b": GPTConfig(n_positions=2048, n_embd=2560, n_layer=32, n_head=32),
    "gpt3-6.7b": GPTConfig(n_positions=2048, n_embd=4096, n_layer=32, n_head=32),
    "gpt3-13b": GPTConfig(n_positions=2048, n_embd=5120, n_layer=40, n_head=40),
    "gpt3-175b": GPTConfig(n_positions=2048, n_embd=12288, n_layer=96, n_head=96),
    # Megatron-LM's 1T model (Narayanan et al. 2021, Table 1)
    "megatron-1t": GPTConfig(n_positions=2048, n_embd=25600, n_layer=128, n_head=160),
}


class KVCache:
    """Keys and values of every layer for incremental decoding, and `length`, the positions already filled.

    Each layer's buffers ([B, heads, max_len, head_dim], the dtype and device of its keys) are allocated whole at its
    first `append`, so decoding never reallocates; the head count comes from the keys, so a tensor-parallel
    attention's local heads fit too. GPT.forward advances `length` once all layers have appended.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, h, T, hd] at positions [length, length + T); return this layer's keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full ({start} used, {k.shape[2]} more)")
        if layer not in self.k:
            B, H, _, D = k.shape
            self.k[layer] = k.new_empty(B, H, self.max_len, D)
            self.v[layer] = v.new_empty(B, H, self.max_len, D)
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class CausalSelfAttention(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_attn = nn.Linear(cfg.n_embd, 3 * cfg.n_embd)  # q, k, v stacked along the output dim
        self.c_proj = nn.Linear(cfg.n_embd, cfg.n_embd)
        self.resid_dropout = nn.Dropout(cfg.dropout)
        self.head_dim = cfg.head_dim
        self.attn_dropout_p = cfg.dropout
        # Attention probabilities are sharded by head under tensor parallelism and need a per-rank dropout
        # stream; tensor_parallel.py installs it here. One process: the default generator.
        self.sharded_rng = contextlib.nullcontext

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.c_attn(x)
        # The local head count follows from the (possibly sharded) width, the length from the projection's output
        # (under sequence parallelism x is a shard of the sequence and the projection gathers it).
        B, T, _ = qkv.shape
        q, k, v = (t.reshape(B, T, -1, self.head_dim).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        if kv_cache is None:
            y = self.core(q, k, v)
        else:
            y = self.cached_core(q, *kv_cache.append(layer, k, v))
        y = y.transpose(1, 2).reshape(B, T, -1)
        return self.resid_dropout(self.c_proj(y))

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Softmax, dropout and attention over values: what selective recomputation recomputes (its activations
        grow with the sequence squared, its FLOPs are few)."""
        dropout_p = self.attn_dropout_p if self.training else 0.0
        if dropout_p == 0.0:  # no mask to draw, no stream to switch to (and no graph break under --compile)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        with self.sharded_rng():
            return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True)

    @staticmethod
    def cached_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the T newest positions (q) over all S cached ones (k, v), no dropout (inference). SDPA's
        is_causal aligns the mask top-left, right only for a prefill (T == S); one new token sees every key."""
        T, S = q.shape[2], k.shape[2]
        if T == S:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v)
        mask = torch.ones(T, S, dtype=torch.bool, device=q.device).tril(S - T)  # query i sits at position S-T+i
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask)


class MLP(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.c_fc = nn.Linear(cfg.n_embd, 4 * cfg.n_embd)
        self.c_proj = nn.Linear(4 * cfg.n_embd, cfg.n_embd)
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


class GPT(nn.Module):
    def __init__(self, cfg: GPTConfig):
        super().__init__()
        self.cfg = cfg
        self.wte: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.wpe: nn.Module | None = nn.Embedding(cfg.n_positions, cfg.n_embd)
        self.drop = nn.Dropout(cfg.dropout)
        self.h = nn.ModuleDict({str(i): Block(cfg) for i in range(cfg.n_layer)})
        self.ln_f: nn.Module | None = nn.LayerNorm(cfg.n_embd, eps=cfg.layer_norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        self.lm_head.weight = self.wte.weight  # tied; pipeline stages that split them keep a synced copy

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        """With `kv_cache`, x continues the cached sequence: its positions start at the cache's length."""
        start = 0 if kv_cache is None else kv_cache.length
        if self.wte is not None:  # first stage: x holds token ids
            positions = torch.arange(start, start + x.shape[1], device=x.device)
            x = self.drop(self.wte(x) + self.wpe(positions))
        for name, block in self.h.items():
            x = block(x) if kv_cache is None else block(x, kv_cache, int(name))
        if kv_cache is not None:
            kv_cache.length += x.shape[1]
        if self.lm_head is not None:  # last stage: x becomes logits (a vocab shard under TP)
            x = self.lm_head(self.ln_f(x))
        return x


def canonical_name(name: str) -> str:
    """The layout-free name of a parameter: a stage's untied copy of the head is the embedding."""
    return "wte.weight" if name == "lm_head.weight" else name


def init_value(name: str, shape: torch.Size, cfg: GPTConfig, seed: int) -> torch.Tensor:
    """The initial value of a full (unsharded) parameter, a pure function of its name and the seed.

    Every layout builds its shards from these values, which is what makes a (dp, tp, pp) run start from the
    exact weights of the one-process run. GPT-2's scheme: N(0, 0.02), residual projections scaled by
    1/sqrt(2 * n_layer), zero biases, unit LayerNorm gains.
    """
    name = canonical_name(name)
    if name.endswith(".bias"):
        return torch.zeros(shape)
    if ".ln_" in name or name.startswith("ln_f"):
        return torch.ones(shape)
    std = 0.02 / math.sqrt(2 * cfg.n_layer) if name.endswith("c_proj.weight") else 0.02
    gen = torch.Generator().manual_seed(seed * 1_000_003 + _stable_hash(name))
    return torch.randn(shape, generator=gen) * std


def _stable_hash(text: str) -> int:
    # Python's hash() is salted per process; ranks must agree.
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % (2**31 - 1)
    return h
