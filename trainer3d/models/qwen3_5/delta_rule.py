"""The gated delta rule (Yang et al. 2025, "Gated Delta Networks") and the short causal convolution before it, in
torch, with packed documents: what Qwen3.5's linear-attention layers compute.

Per value head, with a state S [dk, dv], a log-decay g_t ≤ 0 and a write strength β_t:
    S_t = e^{g_t} S_{t−1} + k_t β_t (v_t − (e^{g_t} S_{t−1})ᵀ k_t)ᵀ,     o_t = S_tᵀ q_t.
The chunked form (chunks of C tokens: a triangular solve inside each chunk, the state carried across chunks) costs
O(T·C·d + T·d²), linear in the length. Written here because flash-linear-attention's kernels are Triton (CUDA only)
and transformers' torch path has no packed documents; on CUDA the family calls fla's kernel where it is installed
(`fla_available`), with the same documents as cu_seqlens.

Documents: a packed row must equal each of its documents run alone, so at a document's first token the state restarts
(the carried state is multiplied by 0 there, not by e^{g}) and the convolution reads nothing from before it. In the
chunked form that is three masks on the decays: within a chunk a token reads only earlier tokens of its document,
reads the carried-in state only if the chunk's incoming document is still its own, and writes into the outgoing
state only if it belongs to the chunk's last document.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

CHUNK = 64  # fla's and transformers' chunk size


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    """x / sqrt(Σx² + eps) over the last dim (fla's and transformers' rule, eps inside the root)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def causal_conv(x: torch.Tensor, weight: torch.Tensor, documents: torch.Tensor | None = None,
                window: torch.Tensor | None = None) -> torch.Tensor:
    """Depthwise causal convolution then SiLU: x [B, T, C], weight [C, K] -> [B, T, C]; out_t = Σ_j w[:, K−1−j]·x_{t−j}
    over the j < K earlier tokens of t's document (`documents` [B, T]; None: one document per row). `window`
    [B, K−1, C]: the inputs before x (decoding: the cache's last K−1), read as part of the first document."""
    K = weight.shape[1]
    T = x.shape[1]
    if window is not None:
        x = torch.cat([window.to(x.dtype), x], dim=1)
        if documents is not None:
            documents = torch.cat([documents[:, :1].expand(-1, K - 1), documents], dim=1)
    past = x.shape[1] - T
    out = x[:, past:] * weight[:, K - 1]
    for j in range(1, K):  # K shifted products: the mask per shift is what a packed row needs (F.conv1d has none)
        shifted = F.pad(x, (0, 0, j, 0))[:, past:past + T]
        if documents is not None:
            docs = F.pad(documents, (j, 0), value=-1)[:, past:past + T]
            shifted = shifted * (docs == documents[:, past:]).unsqueeze(-1).to(x.dtype)
        out = out + shifted * weight[:, K - 1 - j]
    return F.silu(out)


def chunk_gated_delta_rule(q, k, v, g, beta, documents: torch.Tensor | None = None, chunk_size: int = CHUNK,
                           initial_state: torch.Tensor | None = None, final_state: bool = False):
    """q, k [B, T, Hk, dk] (already L2-normalised), v [B, T, Hv, dv], g and beta [B, T, Hv]; each key head serves
    Hv/Hk consecutive value heads. q is scaled by dk^-1/2 here. `documents` [B, T] or None. Returns o [B, T, Hv, dv]
    (q's dtype; the math in fp32) and, if `final_state`, S [B, Hv, dk, dv] after the last token (transformers'
    layout), starting from `initial_state` (decoding)."""
    dtype = q.dtype
    B, T, Hk, dk = k.shape
    Hv, dv = v.shape[-2:]
    if Hv != Hk:
        q, k = (t.repeat_interleave(Hv // Hk, dim=2) for t in (q, k))
    q, k, v, g, beta = (t.transpose(1, 2).float() for t in (q, k, v, g, beta))  # heads first: [B, H, T, ...]
    q = q * dk ** -0.5
    if T == 1 and initial_state is not None:  # a decoded token: the recurrence's one step, no chunk to build
        S = initial_state.float() * g[..., 0, None, None].exp()
        delta = (v[:, :, 0] - (S * k[:, :, 0, :, None]).sum(-2)) * beta[:, :, 0, None]
        S = S + k[:, :, 0, :, None] * delta[..., None, :]
        o = (S * q[:, :, 0, :, None]).sum(-2)[:, :, None]
        return o.transpose(1, 2).to(dtype), (S if final_state else None)
    C = min(chunk_size, T)
    pad = -T % C
    docs = torch.zeros(B, T, dtype=torch.long, device=q.device) if documents is None else documents.to(q.device)
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = F.pad(g, (0, pad)), F.pad(beta, (0, pad))
        docs = torch.cat([docs, docs[:, -1:].expand(-1, pad)], dim=1)
    N = (T + pad) // C
    q, k, v = (t.reshape(B, Hv, N, C, -1) for t in (q, k, v))
    g, beta = g.reshape(B, Hv, N, C), beta.reshape(B, Hv, N, C)
    docs = docs.reshape(B, 1, N, C)
    # the document each chunk's carried-in state belongs to: that of the token before the chunk
    incoming = torch.cat([docs[:, :, :1, :1], docs[:, :, :-1, -1:]], dim=2)
    reads_state = docs == incoming  # [B, 1, N, C]
    writes_state = docs == docs[..., -1:]
    cum = g.cumsum(-1)
    # counted from its document's start (the chunk's start for the incoming one): a decay summed over an earlier
    # document would cost the later one precision (fp32 cumsums of hundreds), not change its value
    index = torch.arange(C, device=q.device)
    opens = torch.zeros_like(reads_state)
    opens[..., 1:] = docs[..., 1:] != docs[..., :-1]
    start = torch.where(opens, index, 0).cummax(-1).values.expand_as(cum)
    cum = cum - F.pad(cum, (1, 0)).gather(-1, start)
    same = (docs.unsqueeze(-1) == docs.unsqueeze(-2)) & torch.ones(C, C, dtype=torch.bool, device=q.device).tril()
    decay = (cum.unsqueeze(-1) - cum.unsqueeze(-2)).masked_fill(~same, float("-inf")).exp()  # [.., i, j]: j -> i
    # the carried-in state's decay to each token (0 past a document start), each token's decay to the chunk's end
    # (0 if a document follows): masked before the exp, whose argument is positive across documents
    from_start = cum.masked_fill(~reads_state, float("-inf")).exp()
    to_end = (cum[..., -1:] - cum).masked_fill(~writes_state, float("-inf")).exp()
    k_beta, v_beta = k * beta.unsqueeze(-1), v * beta.unsqueeze(-1)
    system = (k_beta @ k.transpose(-1, -2)) * decay  # its strict lower triangle: the UT transform's system
    eye = torch.eye(C, dtype=q.dtype, device=q.device)
    unit = system.tril(-1) + eye
    u = torch.linalg.solve_triangular(unit, v_beta, upper=False, unitriangular=True)
    w = torch.linalg.solve_triangular(unit, k_beta * from_start.unsqueeze(-1), upper=False, unitriangular=True)
    attn = (q @ k.transpose(-1, -2)) * decay
    q_state = q * from_start.unsqueeze(-1)
    k_state = k * to_end.unsqueeze(-1)
    carry = from_start[..., -1:].unsqueeze(-1)  # the carried state's decay over the whole chunk [B, H, N, 1, 1]
    S = (q.new_zeros(B, Hv, dk, dv) if initial_state is None else initial_state.float())
    outs = []
    # each chunk's slices taken once (unbind: one stack in the backward; an index per chunk would make the backward
    # zero-fill the whole tensor once per chunk, quadratic in the length)
    for u_n, w_n, q_n, attn_n, k_n, carry_n in zip(*(t.unbind(2) for t in (u, w, q_state, attn, k_state, carry))):
        v_new = u_n - w_n @ S
        outs.append(q_n @ S + attn_n @ v_new)
        S = S * carry_n + k_n.transpose(-1, -2) @ v_new
    o = torch.stack(outs, dim=2).reshape(B, Hv, N * C, dv)[:, :, :T]
    return o.transpose(1, 2).to(dtype), (S if final_state else None)
