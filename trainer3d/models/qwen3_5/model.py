"""Qwen3.5 in plain PyTorch: a stack of Gated DeltaNet blocks (`linear_attn`) with a gated full-attention block
(`self_attn`) every `full_attention_interval`-th; zero-centred RMSNorms (x̂ · (1 + w), w starting at 0); a dense
SwiGLU or a mixture of experts with a gated shared expert.

Parameter names are transformers' Qwen3_5ForCausalLM's without `model.`, but for two fused weights: q|gate, k and v
as `self_attn.qkv_proj`, and `linear_attn.in_proj` = in_proj_qkv | in_proj_z | in_proj_b | in_proj_a, so each enters
its tensor-parallel region with one matmul (hf.py splits them). Under tensor parallelism a rank holds whole key
heads and the value heads they serve: the projections' blocks, the convolution's q|k|v channels, A_log and dt_bias
are split alike, the gated norm's weight (one per head dim) is shared.
"""

from __future__ import annotations

import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.models.attention import AttentionCore, KVCache, WholeSequences
from trainer3d.models.interface import CausalLM, ColumnParallel, ParallelPlan, RowParallel
from trainer3d.models.llama.model import Rotary, SwiGLU, init_value as llama_init_value, rotate
from trainer3d.models.moe import MoE
from trainer3d.models.qwen3_5.config import Qwen35Config
from trainer3d.models.qwen3_5.delta_rule import causal_conv, chunk_gated_delta_rule, l2_normalize
from trainer3d.models.seeding import name_seeded_normal, name_seeded_uniform


class ZeroCentredRMSNorm(nn.Module):
    """x̂ · (1 + w) in fp32, then the input's dtype (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return (h * (1.0 + self.weight.float())).type_as(x)


class GatedRMSNorm(nn.Module):
    """norm(o) · w · silu(z) per head (transformers' Qwen3_5RMSNormGated: w starts at 1, not zero-centred)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, o: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        h = o.float()
        h = self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).to(o.dtype)
        return (h * F.silu(z.float())).to(o.dtype)


class GatedAttention(AttentionCore):
    """Qwen3's attention (q/k norms, grouped kv heads) whose q projection also yields a gate per head (HF's q_proj
    rows: each head's q then its gate); the output is attn · sigmoid(gate). Rotary on the first rotary_dim dims."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__(cfg.dropout)
        self.qkv_proj = nn.Linear(cfg.n_embd, 2 * cfg.q_width + 2 * cfg.kv_width, bias=False)
        self.o_proj = nn.Linear(cfg.q_width, cfg.n_embd, bias=False)
        self.rotary = Rotary(cfg)
        self.head_dim, self.rotary_dim = cfg.head_dim, cfg.rotary_dim
        self.heads = (cfg.n_head, cfg.n_kv_heads)
        self.q_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.norm_eps)
        self.k_norm = ZeroCentredRMSNorm(cfg.head_dim, cfg.norm_eps)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        qkv = self.qkv_proj(x)
        B, T, width = qkv.shape  # local heads from the (maybe tp-sharded) width: 2·n_q + 2·n_kv head_dims
        hq, hkv = self.heads
        n_q = width // self.head_dim * hq // (2 * hq + 2 * hkv)
        n_kv = (width // self.head_dim - 2 * n_q) // 2
        qg, k, v = qkv.split([2 * n_q * self.head_dim, n_kv * self.head_dim, n_kv * self.head_dim], dim=-1)
        q, gate = qg.reshape(B, T, n_q, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(k.reshape(B, T, n_kv, self.head_dim)).transpose(1, 2)
        v = v.reshape(B, T, n_kv, self.head_dim).transpose(1, 2)
        cos, sin = self.rotary(0 if kv_cache is None else kv_cache.length, T, q)
        q, k = (torch.cat([rotate(t[..., :self.rotary_dim], cos, sin), t[..., self.rotary_dim:]], dim=-1)
                for t in (q, k))
        y = self.attend(q, k, v, kv_cache, layer)
        return self.o_proj(y * torch.sigmoid(gate.reshape(B, T, -1)))


class DepthwiseConv(nn.Module):
    """The causal convolution's weight [channels, 1, kernel] (nn.Conv1d's, as transformers stores it)."""

    def __init__(self, channels: int, kernel: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(channels, 1, kernel))


class GatedDeltaNet(nn.Module):
    """The linear-attention block's mixer: projections, causal conv + SiLU over q|k|v, L2-normalised q and k, the gated
    delta rule (β = sigmoid(b), g = −exp(A_log)·softplus(a + dt_bias)), the gated RMSNorm with z, out_proj.
    `sequence` (WholeSequences, or the run's) says where documents start and, under context parallelism, how the
    heads are exchanged for the sequence: heads are independent, so each cp rank runs the recurrence over the whole
    sequence for 1/cp of the heads. Decoding keeps (conv window, state) per layer in the cache's `states`."""

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        hv = cfg.linear_value_heads
        self.in_proj = nn.Linear(cfg.n_embd, cfg.conv_width + cfg.value_width + 2 * hv, bias=False)
        self.conv1d = DepthwiseConv(cfg.conv_width, cfg.linear_conv_kernel)
        self.A_log = nn.Parameter(torch.empty(hv))
        self.dt_bias = nn.Parameter(torch.empty(hv))
        self.norm = GatedRMSNorm(cfg.linear_value_head_dim, cfg.norm_eps)
        self.out_proj = nn.Linear(cfg.value_width, cfg.n_embd, bias=False)
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        self.ratio = hv // cfg.linear_key_heads  # value heads per key head
        self.sharded_rng = None  # (no dropout here; tensor parallelism sets it on every mixer)
        self.sequence = WholeSequences()

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        p = self.in_proj(x)
        B, T, width = p.shape
        nk = width // (2 * self.dk + self.ratio * (2 * self.dv + 2))  # local key heads (tp-sharded widths)
        nv = nk * self.ratio
        q, k, v, z, b, a = p.split([nk * self.dk, nk * self.dk, nv * self.dv, nv * self.dv, nv, nv], dim=-1)
        state = kv_cache.states.get(layer) if kv_cache is not None else None
        o, new_state = self.core(q, k, v, b, a, state, kv_cache is not None)
        if kv_cache is not None:
            kv_cache.states[layer] = new_state
        o = self.norm(o.reshape(B, T, nv, self.dv), z.reshape(B, T, nv, self.dv))
        return self.out_proj(o.reshape(B, T, -1))

    def core(self, q, k, v, b, a, state=None, keep: bool = False):
        """The conv and the recurrence over this rank's heads: what selective recomputation recomputes (its
        activations grow with the chunk size, its FLOPs are few). `state`: (conv window, S) continuing a decoded
        sequence; `keep`: return the state after the last token (decoding), else None."""
        seq, n = self.sequence, self.sequence.size
        weight = self.conv1d.weight.squeeze(1)
        A_log, dt_bias = self.A_log, self.dt_bias
        if n > 1:  # this rank's head group over the whole sequence (the tables' rows of the same group)
            weight = torch.cat([w.unflatten(0, (n, -1))[seq.rank]
                                for w in weight.split([q.shape[-1], k.shape[-1], v.shape[-1]], dim=0)])
            A_log, dt_bias = (t.unflatten(0, (n, -1))[seq.rank] for t in (A_log, dt_bias))
            groups = [t.unflatten(-1, (n, -1)) for t in (q, k, v, b, a)]
            q, k, v, b, a = seq.to_heads(torch.cat(groups, dim=-1).flatten(-2)).split(
                [g.shape[-1] for g in groups], dim=-1)
        B, T, _ = q.shape
        nk, nv = q.shape[-1] // self.dk, b.shape[-1]
        window, S = state if state is not None else (None, None)
        docs = seq.documents()
        qkv = torch.cat([q, k, v], dim=-1)
        conv = causal_conv(qkv, weight, docs, window)
        cq, ck, cv = conv.split([nk * self.dk, nk * self.dk, nv * self.dv], dim=-1)
        cq = l2_normalize(cq.reshape(B, T, nk, self.dk).float())
        ck = l2_normalize(ck.reshape(B, T, nk, self.dk).float())
        g = -A_log.float().exp() * F.softplus(a.float() + dt_bias)
        o, S = chunk_gated_delta_rule(cq, ck, cv.reshape(B, T, nv, self.dv), g, torch.sigmoid(b), docs,
                                      initial_state=S, final_state=keep)
        o = seq.to_sequence(o.to(q.dtype).flatten(-2))
        if S is None:
            return o, None
        K = weight.shape[1]
        inputs = qkv if window is None else torch.cat([window.to(qkv.dtype), qkv], dim=1)
        return o, (F.pad(inputs, (0, 0, max(0, K - 1 - inputs.shape[1]), 0))[:, -(K - 1):], S)


class Block(nn.Module):
    def __init__(self, cfg: Qwen35Config, layer: int):
        super().__init__()
        self.input_layernorm = ZeroCentredRMSNorm(cfg.n_embd, cfg.norm_eps)
        if cfg.is_linear(layer):
            self.linear_attn = GatedDeltaNet(cfg)
        else:
            self.self_attn = GatedAttention(cfg)
        self.post_attention_layernorm = ZeroCentredRMSNorm(cfg.n_embd, cfg.norm_eps)
        self.mlp = MoE(cfg.n_embd, cfg.moe, layer) if cfg.is_moe_layer(layer) else SwiGLU(cfg)

    @property
    def mixer(self) -> nn.Module:
        return self.linear_attn if hasattr(self, "linear_attn") else self.self_attn

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        x = x + self.mixer(self.input_layernorm(x), kv_cache, layer)
        return x + self.mlp(self.post_attention_layernorm(x))


class Qwen35(CausalLM):
    BLOCKS, EMBEDDING, HEAD = "layers", "embed_tokens", "lm_head"
    FIRST_STAGE = ("embed_tokens",)
    LAST_STAGE = ("norm", "lm_head")

    def __init__(self, cfg: Qwen35Config):
        super().__init__()
        self.cfg = cfg
        self.embed_tokens: nn.Module | None = nn.Embedding(cfg.vocab_size, cfg.n_embd)
        self.layers = nn.ModuleDict({str(i): Block(cfg, i) for i in range(cfg.n_layer)})
        self.norm: nn.Module | None = ZeroCentredRMSNorm(cfg.n_embd, cfg.norm_eps)
        self.lm_head: nn.Module | None = nn.Linear(cfg.n_embd, cfg.vocab_size, bias=False)
        if cfg.tie_embeddings:
            self.lm_head.weight = self.embed_tokens.weight

    def parallel_plan(self) -> ParallelPlan:
        c = self.cfg
        kd, vd, hv = c.key_width, c.value_width, c.linear_value_heads
        return ParallelPlan(
            linears={"self_attn.qkv_proj": ColumnParallel(fused=(2 * c.q_width, c.kv_width, c.kv_width)),
                     "self_attn.o_proj": RowParallel(),
                     "linear_attn.in_proj": ColumnParallel(fused=(kd, kd, vd, vd, hv, hv)),
                     "linear_attn.out_proj": RowParallel(),
                     "mlp.gate_up_proj": ColumnParallel(fused=(c.ffn_hidden, c.ffn_hidden)),
                     "mlp.down_proj": RowParallel()},
            attention=("self_attn", "linear_attn"),
            head_shared=("self_attn.q_norm.weight", "self_attn.k_norm.weight", "linear_attn.norm.weight"),
            sharded={"linear_attn.conv1d.weight": ColumnParallel(fused=(kd, kd, vd)),
                     "linear_attn.A_log": ColumnParallel(), "linear_attn.dt_bias": ColumnParallel()},
        )

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        if self.embed_tokens is not None:
            x = self.embed_tokens(x)
        x = self.run_blocks(x, kv_cache)
        if self.lm_head is not None:
            x = self.lm_head(self.norm(x))
        return x


def init_value(cfg: Qwen35Config, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """Llama's for the matrices (out_proj scaled as o_proj); zero-centred norms at 0 (a gain of 1), the gated norm at
    1; transformers' rules for the decay: A = exp(A_log) uniform in [0.01, 16), dt_bias 1; the convolution as
    nn.Conv1d's default, uniform within ±1/sqrt(kernel)."""
    if name.endswith("linear_attn.norm.weight") or name.endswith("dt_bias"):
        return torch.ones(shape)
    if name.endswith("norm.weight"):
        return torch.zeros(shape)
    if name.endswith("A_log"):
        return name_seeded_uniform(name, shape, seed, 0.01, 16.0).log()
    if name.endswith("conv1d.weight"):
        bound = 1 / math.sqrt(shape[-1])
        return name_seeded_uniform(name, shape, seed, -bound, bound)
    if name.endswith("out_proj.weight"):  # a residual projection, as o_proj
        return name_seeded_normal(name, shape, seed, 0.02 / math.sqrt(2 * cfg.n_layer))
    return llama_init_value(cfg, name, shape, seed)
