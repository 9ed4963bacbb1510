"""Causal self-attention's core and the KV cache, shared by every family: what differs between families is how q, k and
v are made (projections, rotary positions), not how they are attended.

Grouped-query attention (fewer kv heads than query heads) goes to SDPA as it is (`enable_gqa`): the cache and, under
tensor parallelism, each rank's k/v hold only the kv heads.
"""

from __future__ import annotations

import contextlib

import torch
import torch.nn as nn
import torch.nn.functional as F


class KVCache:
    """Keys and values of every layer for incremental decoding, and `length`, the positions already filled (or what a
    family caches in their place: MLA its compressed latent and its shared rope key).

    Each layer's buffers ([B, kv heads, max_len, head_dim], the dtype and device of its keys) are allocated whole at its
    first `append`, so decoding never reallocates; the head count comes from the keys, so grouped-query attention
    stores only its kv heads and a tensor-parallel attention its local ones. The model advances `length` once all
    layers have appended.
    """

    def __init__(self, max_len: int):
        self.max_len = max_len
        self.length = 0
        self.k: dict[int, torch.Tensor] = {}
        self.v: dict[int, torch.Tensor] = {}
        self.states: dict[int, tuple] = {}  # a recurrent layer's state in place of keys and values (Qwen3.5's)

    def append(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Store k, v [B, h, T, hd] at positions [length, length + T); return this layer's keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.max_len:
            raise ValueError(f"KV cache of {self.max_len} positions is full ({start} used, {k.shape[2]} more)")
        if layer not in self.k:  # k and v may differ in width (MLA caches its latent and its rope key)
            self.k[layer] = k.new_empty(*k.shape[:2], self.max_len, k.shape[3])
            self.v[layer] = v.new_empty(*v.shape[:2], self.max_len, v.shape[3])
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


def causal_mask(T: int, S: int, device: torch.device) -> torch.Tensor:
    """[1, T, S] bool: T queries, the newest of S positions (query i at S - T + i), each seeing the keys up to its
    own."""
    return torch.ones(T, S, dtype=torch.bool, device=device).tril(S - T).unsqueeze(0)


def causal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, dropout_p: float) -> torch.Tensor:
    """The attention kernel of a whole sequence: q [B, Hq, T, hd], k and v [B, Hkv, T, hd], causal."""
    return F.scaled_dot_product_attention(q, k, v, dropout_p=dropout_p, is_causal=True, **gqa(q, k))


def contiguous_positions(start: int, T: int, device: torch.device) -> torch.Tensor:
    """The positions of T tokens that continue a sequence at `start`."""
    return torch.arange(start, start + T, device=device)


class AttentionCore(nn.Module):
    """The part of an attention module between its projections: softmax(q k^T / sqrt(d)) v, causal, with dropout on the
    probabilities. A family's attention module subclasses it and calls `attend`.

    `core` is what selective recomputation recomputes (its activations grow with the sequence squared, its FLOPs are
    few). Attention probabilities are sharded by head under tensor parallelism and need a per-rank dropout stream;
    tensor parallelism installs it as `sharded_rng` (one process: the default generator). `kernel(q, k, v, dropout_p)`
    is the attention itself: context parallelism and document masking install theirs
    (parallel/context_parallel.py).
    """

    def __init__(self, dropout: float):
        super().__init__()
        self.attn_dropout_p = dropout
        self.sharded_rng = contextlib.nullcontext
        self.kernel = causal_attention

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_cache: KVCache | None,
               layer: int) -> torch.Tensor:
        """q [B, Hq, T, hd], k and v [B, Hkv, T, hd] -> [B, T, Hq·hd]."""
        if kv_cache is None:
            y = self.core(q, k, v)
        else:
            y = self.cached_core(q, *kv_cache.append(layer, k, v))
        B, _, T, _ = q.shape
        return y.transpose(1, 2).reshape(B, T, -1)

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        dropout_p = self.attn_dropout_p if self.training else 0.0
        if dropout_p == 0.0:  # no mask to draw, no stream to switch to (and no graph break under --compile)
            return self.kernel(q, k, v, 0.0)
        with self.sharded_rng():  # under --compile: a graph break, and the kernel eager, so that its dropout draws
            return torch.compiler.disable(self.kernel)(q, k, v, dropout_p)  # from this stream, not inductor's RNG

    @staticmethod
    def cached_core(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Attention of the T newest positions (q) over all S cached ones (k, v), no dropout (inference). SDPA's
        is_causal aligns the mask top-left, right only for a prefill (T == S); one new token sees every key."""
        T, S, flags = q.shape[2], k.shape[2], gqa(q, k)
        if T == S:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, **flags)
        if T == 1:
            return F.scaled_dot_product_attention(q, k, v, **flags)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=causal_mask(T, S, q.device), **flags)


def gqa(q: torch.Tensor, k: torch.Tensor) -> dict:
    """SDPA's grouped-query flag where the kv heads are fewer (nothing otherwise: multi-head attention's call as it was)."""
    return {"enable_gqa": True} if k.shape[1] != q.shape[1] else {}


class WholeKeys:
    """A rank's view of the keys, for attention that builds its own mask (DeepSeek Sparse Attention's selection) or
    gathers something smaller than its keys (MLA's latent), installed as its `keys`: here the rank holds whole rows.
    `gather(t)`: t [B, h, T_local, d] -> the sequence's [B, h, S, d] (with the gradient back to each token's owner);
    `visible(T, device)` [B|1, T_local, S] bool: the keys each query may see, causal. Context parallelism and
    --document-mask install theirs (parallel/context_parallel.py); `size`: the ranks a sequence is split over."""

    size = 1

    @staticmethod
    def gather(t: torch.Tensor) -> torch.Tensor:
        return t

    @staticmethod
    def visible(T: int, device: torch.device) -> torch.Tensor:
        return causal_mask(T, T, device)


class WholeSequences:
    """A rank's view of its sequences as a recurrent mixer (a linear attention: Qwen3.5's) needs it, installed as its
    `sequence`: here, whole rows, one document each. Context parallelism and --document-mask install theirs
    (parallel/recurrent_sequences.py): `size` ranks share each sequence, `to_heads` turns this rank's tokens of every head group [B, T_local, size·c] into the whole sequence of its own
    group [B, T, c] and `to_sequence` back; `documents()` [B, T]: the document of each token, or None."""

    size, rank = 1, 0

    @staticmethod
    def documents() -> torch.Tensor | None:
        return None

    @staticmethod
    def to_heads(x: torch.Tensor) -> torch.Tensor:
        return x

    @staticmethod
    def to_sequence(y: torch.Tensor) -> torch.Tensor:
        return y
