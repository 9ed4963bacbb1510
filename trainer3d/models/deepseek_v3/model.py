"""DeepSeek-V3 in plain PyTorch: multi-head latent attention (MLA), YaRN rotary positions on the decoupled rope dims,
dense SwiGLU blocks, then mixtures of experts (models/moe.py) with shared experts and DeepSeek's routing; the parts it
shares with Llama (RMSNorm, SwiGLU, the rotation, the model's skeleton) are Llama's.

Parameter names are transformers' DeepseekV3ForCausalLM's without the `model.` prefix, except the dense MLP's fused
gate|up (`mlp.gate_up_proj`, as Llama's), the experts stacked per layer (`mlp.experts.gate_up_proj` [E, 2I, H],
`mlp.experts.down_proj` [E, H, I]) and the shared experts as one SwiGLU (`mlp.shared_expert`); hf.py maps them. The
router's `e_score_correction_bias` is its `expert_bias` table (moe.Router).

MLA: q = q_b(norm(q_a(x))) (or one q_proj); [latent, k_rope] = kv_a_proj_with_mqa(x); k_nope | v = kv_b(norm(latent));
the rope key is one head shared by every head. Only the rope dims rotate (in DeepSeek's interleaved pairs where
`rope_interleave`, rotated as transformers does: evens then odds). The softmax scale is qk_head_dim**-0.5 times YaRN's
mscale² (applied to q here, so the shared attention kernels keep their default scale). Values are padded with zeros
to qk_head_dim before attention, and the padding of the output dropped: the CPU flash kernels and context
parallelism's gather take one head size. Decoding caches the normed latent and the rotated rope key, kv_lora_rank +
qk_rope_head_dim numbers a token and layer (DeepSeek-V3: 576, against 2·128·192 = 49,152 for k and v), and a new
token attends to them in the latent space, kv_b_proj's halves absorbed into its query and output (`_absorbed`), never
expanding the cache.
"""

from __future__ import annotations

import contextlib
import copy
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from trainer3d.models.attention import AttentionCore, KVCache, WholeKeys, causal_mask
from trainer3d.models.deepseek_v3.config import LATENT_NORM_EPS, DeepseekV3Config
from trainer3d.models.deepseek_v3.indexer import (
    Indexer, head_probabilities, index_scores, kl_per_query, rotate_pairs, select,
)
from trainer3d.models.deepseek_v3.mtp import MTPModule, mtp_logits
from trainer3d.models.interface import CausalLM, ColumnParallel, ParallelPlan, RowParallel
from trainer3d.models.llama.model import Llama, RMSNorm, Rotary


def yarn_mscale(scale: float, mscale: float = 1.0) -> float:
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def rope_tables(cfg: DeepseekV3Config) -> tuple[torch.Tensor, float]:
    """(inv_freq [rope_dim / 2] in fp32 on the CPU, the factor cos and sin are multiplied by): plain RoPE, or YaRN
    (Peng et al. 2023) as transformers' `_compute_yarn_parameters` computes it: each frequency interpolated by the
    factor below the beta_slow rotations, kept above beta_fast, ramped linearly between."""
    d, base = cfg.qk_rope_head_dim, cfg.rope_theta
    pos_freqs = base ** (torch.arange(0, d, 2, dtype=torch.int64).float() / d)
    if cfg.rope_factor is None:
        return 1.0 / pos_freqs, 1.0
    factor, ctx = cfg.rope_factor, cfg.rope_original_context

    def correction_dim(rotations: float) -> float:
        return (d * math.log(ctx / (rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(cfg.rope_beta_fast), correction_dim(cfg.rope_beta_slow)
    if cfg.rope_truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, d - 1)
    if low == high:
        high += 0.001
    ramp = torch.clamp((torch.arange(d // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation = 1 - ramp
    inv_freq = 1.0 / (factor * pos_freqs) * (1 - extrapolation) + 1.0 / pos_freqs * extrapolation
    attention_factor = cfg.rope_attention_factor
    if attention_factor is None:
        both = cfg.rope_mscale and cfg.rope_mscale_all_dim
        attention_factor = (yarn_mscale(factor, cfg.rope_mscale) / yarn_mscale(factor, cfg.rope_mscale_all_dim)
                            if both else yarn_mscale(factor))
    return inv_freq, float(attention_factor)


def softmax_mscale(cfg: DeepseekV3Config) -> float:
    """What YaRN multiplies the softmax scale by (transformers' yarn_apply_mscale): mscale(factor, mscale_all_dim)²."""
    if cfg.rope_factor is None or not cfg.rope_mscale_all_dim:
        return 1.0
    return yarn_mscale(cfg.rope_factor, cfg.rope_mscale_all_dim) ** 2


class YarnRotary(Rotary):
    """Llama's rotary angles over the rope dims, with YaRN's frequencies and cos/sin scaled by its attention factor."""

    def init_tables(self, device: torch.device) -> None:
        inv_freq, self.attention_factor = rope_tables(self.cfg)
        self.inv_freq = inv_freq.to(device)

    def forward(self, start: int, T: int, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        positions = self.position_ids(start, T, like.device).float()
        freqs = positions[..., None] * self.inv_freq
        emb = torch.cat((freqs, freqs), dim=-1)
        if emb.dim() == 3:  # [B, T, rope]: per row, broadcast over the heads
            emb = emb[:, None]
        f = self.attention_factor
        return (emb.cos() * f).to(like.dtype), (emb.sin() * f).to(like.dtype)


class Selections(dict):
    """GLM-5's shared layers: the keys each layer with an indexer selected in this forward, for the layers after it
    that reuse them. A block's recomputation (--recompute full, in the backward) reads the selections its forward
    read, not the live ones a later micro-batch's forward has replaced since (`recompute_state`: snapshot and swap,
    parallel/recompute.py); a snapshot holds references, no copy."""

    def snapshot(self) -> dict:
        return dict(self)

    def swap(self, state: dict) -> dict:
        live = dict(self)
        self.clear()
        self.update(state)
        return live


class MLAttention(AttentionCore):
    def __init__(self, cfg: DeepseekV3Config, layer: int = 0):
        super().__init__(cfg.dropout)
        d, H, qk = cfg.n_embd, cfg.n_head, cfg.qk_head_dim
        if cfg.q_lora_rank is None:
            self.q_proj = nn.Linear(d, H * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(d, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = nn.Linear(cfg.q_lora_rank, H * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(d, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = nn.Linear(cfg.kv_lora_rank, H * (cfg.qk_nope_head_dim + cfg.v_head_dim), bias=False)
        # where the rope key, shared by every head, enters the head-sharded region (ParallelPlan.tp_entries)
        self.rope_key = nn.Identity()
        self.o_proj = nn.Linear(H * cfg.v_head_dim, d, bias=False)
        self.rotary = YarnRotary(cfg)
        self.dims = (cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim)
        self.interleaved = cfg.rope_interleave
        self.q_scale = softmax_mscale(cfg)
        # DeepSeek Sparse Attention (indexer.py): this layer's indexer, or none where it reuses an earlier layer's
        # selection (GLM-5's shared layers: `selections`, filled by the model); `dense_warmup` and `observer` (the
        # indexer's loss) are the trainer's (parallel/dsa.py)
        self.sparse, self.layer, self.heads = cfg.sparse, layer, cfg.n_head
        self.indexer = Indexer(cfg) if cfg.has_indexer(layer) else None
        # where the indexer's detached inputs enter: the whole sequence under sequence parallelism
        # (ParallelPlan.whole_sequence)
        self.index_inputs = nn.Identity() if self.indexer is not None else None
        self.topk, self.selections, self.recompute_state = cfg.index_topk, None, None
        self.dense_warmup, self.observer = False, None
        self.keys = WholeKeys()

    def _rotate(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        return rotate_pairs(x, cos, sin, self.interleaved)

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None, layer: int = 0) -> torch.Tensor:
        latent_dim, nope, rope, v_dim = self.dims
        if hasattr(self, "q_proj"):
            q_latent, q = None, self.q_proj(x)
        else:
            q_latent = self.q_a_layernorm(self.q_a_proj(x))
            q = self.q_b_proj(q_latent)
        latent, k_rope = self.kv_a_proj_with_mqa(x).split([latent_dim, rope], dim=-1)
        latent = self.kv_a_layernorm(latent)
        k_rope = self.rope_key(k_rope)
        # this rank's heads follow from the (possibly tp-sharded) widths; the length from q (under sequence
        # parallelism the projections gather the sequence)
        B, T, _ = q.shape
        q = q.view(B, T, -1, nope + rope).transpose(1, 2)
        cos, sin = self.rotary(0 if kv_cache is None else kv_cache.length, T, q)
        q = torch.cat((q[..., :nope], self._rotate(q[..., nope:], cos, sin)), dim=-1)
        k_rope = self._rotate(k_rope.view(B, 1, T, rope), cos, sin)
        if kv_cache is not None:  # decoding caches the latent and the rope key (kv_lora_rank + rope a token)
            cached, k_rope = kv_cache.append(layer, latent.unsqueeze(1), k_rope)
            latent = cached.squeeze(1)
        if self.q_scale != 1.0:
            q = q * self.q_scale
        if kv_cache is not None and T < latent.shape[1]:  # decoding: attention in the latent space, never expanded
            S = latent.shape[1]
            visible = causal_mask(T, S, q.device)
            allowed = self._select(x, q_latent, (cos, sin), visible, kv_cache, layer)[0] if self.sparse else visible
            return self.o_proj(self._absorbed(q, latent, k_rope, allowed).transpose(1, 2).reshape(B, T, -1))
        if kv_cache is None and self.keys.size > 1 and not getattr(self.rope_key, "sequence_parallel", False):
            # context parallelism: the latent and the rope key travel (kv_lora_rank + rope numbers a token), not the
            # keys and values they expand to; the attention then finds them gathered (under sequence parallelism,
            # where kv_b gathers its input over tp first, the expanded ones still travel)
            both = self.keys.gather(torch.cat((latent.unsqueeze(1), k_rope), dim=-1))
            latent, k_rope = both.squeeze(1)[..., :latent_dim], both[..., latent_dim:]
        kv = self.kv_b_proj(latent)  # (sequence parallelism: gathered here, as the rope key in rope_key)
        S = kv.shape[1]
        k_nope, v = kv.view(B, S, -1, nope + v_dim).transpose(1, 2).split([nope, v_dim], dim=-1)
        k = torch.cat((k_nope, k_rope.expand(-1, k_nope.shape[1], -1, -1)), dim=-1)
        if self.sparse:
            y = self._sparse(x, q_latent, q, k, v, (cos, sin), kv_cache, layer)
            return self.o_proj(y.transpose(1, 2).reshape(B, T, -1))
        if v_dim != nope + rope:
            v = F.pad(v, (0, nope + rope - v_dim))
        y = self.core(q, k, v) if kv_cache is None else self.cached_core(q, k, v)
        y = y.transpose(1, 2)
        if v_dim != nope + rope:
            y = y[..., :v_dim]
        return self.o_proj(y.reshape(B, T, -1))


    def _sparse(self, x, q_latent, q, k, v, rope: tuple, kv_cache: KVCache | None, layer: int) -> torch.Tensor:
        """MLA over each query's selected keys (a masked dense SDPA, what every device runs; v padded to the keys'
        width only on CPU). k and v come whole (context parallelism's gathered latent; under sequence parallelism as
        well, gathered here as the expanded keys and values); the indexer's keys are gathered as the latent is."""
        T = q.shape[2]
        visible = self.keys.visible(T, q.device) if kv_cache is None else causal_mask(T, T, q.device)  # (a prefill)
        allowed, scores = self._select(x, q_latent, rope, visible, kv_cache, layer)
        if k.shape[2] != visible.shape[-1]:  # context parallelism under sequence parallelism: the expanded ones travel
            k, v = self.keys.gather(k), self.keys.gather(v)
        dropout_p = self.attn_dropout_p if self.training else 0.0
        width = v.shape[-1]
        if q.device.type == "cpu" and width != q.shape[-1]:  # CPU's flash kernel takes a mask but one head size
            v = F.pad(v, (0, q.shape[-1] - width))  # (its math fallback is 1.5x the time and keeps the probabilities)
        with self.sharded_rng() if dropout_p else contextlib.nullcontext():
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=allowed.unsqueeze(1), dropout_p=dropout_p)
        y = y[..., :width]
        if self.observer is not None and self.indexer is not None and self.training:  # the indexer's loss
            probs = self.observer.over_heads(head_probabilities(q, k, allowed, q.shape[-1] ** -0.5)) / self.heads
            y = self.observer.attach(y, kl_per_query(probs, scores, allowed))
        return y

    def _select(self, x, q_latent, rope: tuple, visible: torch.Tensor, kv_cache: KVCache | None,
                layer: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """(the keys each query attends to [B|1, T, S], the indexer's scores or None): this layer's indexer on
        detached inputs, or the selection of the layer it shares (GLM-5)."""
        if self.indexer is None:
            return self.selections[self.source], None
        both = self.index_inputs(torch.cat((x, q_latent), dim=-1).detach())
        iq, ik, w = self.indexer(*both.split([x.shape[-1], q_latent.shape[-1]], dim=-1), *rope)
        ik = self.keys.gather(ik) if kv_cache is None else self._cached_index_keys(ik, kv_cache, layer)
        scores = index_scores(iq, ik, w, visible)
        allowed = visible if self.dense_warmup else select(scores.detach(), self.topk, visible)
        if self.selections is not None:
            self.selections[self.layer] = allowed
        return allowed, scores

    def _absorbed(self, q: torch.Tensor, latent: torch.Tensor, k_rope: torch.Tensor,
                  allowed: torch.Tensor) -> torch.Tensor:
        """Decoding's attention over the cached latent [B, S, L] and rope key [B, 1, S, rope] without expanding them
        (DeepSeek-V2 §2.1.2's absorption): kv_b's key half W_UK is absorbed into each head's query, q_nope·W_UK·c =
        (W_UKᵀ q_nope)·c, so the scores are those of a query [q_nope·W_UK | q_rope] against the one shared key
        [c | k_rope], and its value half W_UV is applied after the weighted sum of the latents. Per new token O(S·H·L)
        where expanding the cache costs O(S·L·H·(nope + v)). -> [B, H, T, v]."""
        latent_dim, nope, rope, v_dim = self.dims
        w = self.kv_b_proj.weight.view(-1, nope + v_dim, latent_dim)  # [H (this rank's), nope + v, L]
        query = torch.cat((torch.einsum("bhtn,hnl->bhtl", q[..., :nope], w[:, :nope].to(q.dtype)), q[..., nope:]), -1)
        B, H, T, _ = query.shape
        key = torch.cat((latent, k_rope.squeeze(1)), dim=-1)  # [B, S, L + rope], one for every head
        scores = query.reshape(B, H * T, -1) @ key.transpose(1, 2) * (nope + rope) ** -0.5  # heads as rows: one bmm
        scores = scores.view(B, H, T, -1).masked_fill(~allowed.unsqueeze(1), float("-inf")).softmax(-1)
        out = (scores.view(B, H * T, -1) @ latent).view(B, H, T, latent_dim)
        return torch.einsum("bhtl,hvl->bhtv", out, w[:, nope:].to(q.dtype))

    @staticmethod
    def _cached_index_keys(ik: torch.Tensor, kv_cache: KVCache, layer: int) -> torch.Tensor:
        """Decoding: the indexer's keys of every position so far (one [B, 1, max_len, hd] buffer a layer)."""
        key = ("indexer", layer)
        if key not in kv_cache.states:
            kv_cache.states[key] = ik.new_empty(ik.shape[0], 1, kv_cache.max_len, ik.shape[-1])
        end = kv_cache.length + ik.shape[2]
        kv_cache.states[key][:, :, kv_cache.length:end] = ik
        return kv_cache.states[key][:, :, :end]


class DeepseekV3(Llama):
    """Llama's skeleton (embedding, blocks, final norm, head) with latent attention in its blocks, and the MTP modules
    (mtp.py) on the last stage, `mtp` keyed by their layer index in DeepSeek's files (n_layer + k - 1). They predict
    only while `next_tokens` (set by the trainer: the running micro-batch's t_{i+k} of each depth k, [D, B, T]) gives
    tokens: the logits [B, T, V] are then followed by each module's, [B, (1 + D)·T, V]; evaluation, sampling and
    export see the plain model. A last stage without the embedding embeds with its own copy (EMBEDDING_COPY)."""

    ATTENTION = MLAttention
    LAST_STAGE = ("norm", "lm_head", "mtp")
    EMBEDDING_COPY = "mtp_embed_tokens"

    def __init__(self, cfg: DeepseekV3Config):
        super().__init__(cfg)
        n = cfg.n_layer
        self.mtp: nn.ModuleDict | None = nn.ModuleDict(
            {str(n + k): MTPModule(cfg, n + k, self.ATTENTION) for k in range(cfg.mtp_layers)})
        self.mtp_embed_tokens: nn.Module | None = None
        self.next_tokens = None  # a callable: the running micro-batch's next tokens, or None (parallel/mtp.py)
        if cfg.sparse and cfg.n_indexers < n + cfg.mtp_layers:  # GLM-5's shared layers read an earlier selection
            selections = Selections()
            source = None
            for i in range(n):
                attention = self.layers[str(i)].self_attn
                attention.selections = attention.recompute_state = selections
                source = i if attention.indexer is not None else source
                attention.source = source

    def stage(self, layers: range, first: bool, last: bool) -> CausalLM:
        out = super().stage(layers, first, last)
        if last and not first and self.cfg.mtp_layers:
            out.mtp_embed_tokens = copy.deepcopy(self.embed_tokens)
        return out

    def shares_embedding(self) -> bool:
        return super().shares_embedding() or self.cfg.mtp_layers > 0

    def extra_blocks(self) -> list[nn.Module]:
        return list(self.mtp.values()) if self.mtp is not None else []

    def forward(self, x: torch.Tensor, kv_cache: KVCache | None = None) -> torch.Tensor:
        if self.embed_tokens is not None:  # first stage: x holds token ids
            x = self.embed_tokens(x)
        x = self.run_blocks(x, kv_cache)
        if self.lm_head is None:
            return x
        logits = self.lm_head(self.norm(x))
        next_tokens = self.next_tokens() if self.next_tokens is not None and self.mtp else None
        if next_tokens is None:
            return logits
        embedding = self.embed_tokens if self.embed_tokens is not None else self.mtp_embed_tokens
        return torch.cat([logits, *mtp_logits(self.mtp, embedding, self.lm_head, x, next_tokens)], dim=1)

    def parallel_plan(self) -> ParallelPlan:
        """Heads split over tp: q_b (or q_proj) and kv_b column-parallel, o_proj row-parallel. The latent projections
        and their norms are replicated and see whole gradients (the column-parallel q_b and kv_b sum their inputs'
        gradients over tp); the rope key, used by every rank's heads without such a linear, enters the region through
        `rope_key`. A dense block's SwiGLU as Llama's; an MoE block is left to expert parallelism. DSA's indexer,
        replicated, reads the whole sequence through `index_inputs` on every rank."""
        c = self.cfg
        q = "self_attn.q_proj" if c.q_lora_rank is None else "self_attn.q_b_proj"
        return ParallelPlan(
            linears={q: ColumnParallel(), "self_attn.kv_b_proj": ColumnParallel(), "self_attn.o_proj": RowParallel(),
                     "mlp.gate_up_proj": ColumnParallel(fused=(c.ffn_hidden, c.ffn_hidden)),
                     "mlp.down_proj": RowParallel()},
            attention="self_attn",
            tp_entries=("self_attn.rope_key",),
            whole_sequence={"self_attn.index_inputs": "self_attn.indexer"} if c.sparse else {},
        )
