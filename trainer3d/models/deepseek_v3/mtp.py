"""Multi-token prediction (DeepSeek-V3 §2.2, as Megatron-core's MultiTokenPredictionLayer): D modules after the last
block, module k predicting the token k + 1 places ahead of each position from the depth before's hidden state:

    h'_i = eh_proj([enorm(Emb(t_{i+k})); hnorm(h^{k-1}_i)])      (the embedding first, as DeepSeek's code and Megatron)
    h^k  = Block_k(h')                                             (a block of the last block's kind: MoE)
    P^k  = Head(shared_head.norm(h^k))                             (the model's embedding and head, shared)

h^0 is the last block's output before the final norm. Each sequence keeps its full length at every depth (Megatron's
rolling): the embedded tokens are shifted left by k and padded at the end, and causal attention keeps the padding
away from every position whose target exists. The loss over the targets is the trainer's (parallel/mtp.py)."""

from __future__ import annotations

import torch
import torch.nn as nn

from trainer3d.models.llama.model import Block, RMSNorm


class SharedHead(nn.Module):
    """DeepSeek's `shared_head`: the module's own final norm (its head is the model's, shared)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps)


class MTPModule(Block):
    """One MTP module: a block (its parameters named as a block's, as DeepSeek's files name them) plus enorm, hnorm,
    eh_proj and shared_head.norm."""

    def __init__(self, cfg, layer: int, attention: type[nn.Module]):
        super().__init__(cfg, layer, attention)
        d = cfg.n_embd
        self.enorm = RMSNorm(d, cfg.norm_eps)
        self.hnorm = RMSNorm(d, cfg.norm_eps)
        self.eh_proj = nn.Linear(2 * d, d, bias=False)
        self.shared_head = SharedHead(d, cfg.norm_eps)

    def predict(self, h: torch.Tensor, embedded: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(h^k, its normed form for the head) from h^{k-1} [B, T, d] and the embedded shifted tokens [B, T, d]."""
        h = self(self.eh_proj(torch.cat([self.enorm(embedded), self.hnorm(h)], dim=-1)))
        return h, self.shared_head.norm(h)


def mtp_logits(modules: nn.ModuleDict, embedding: nn.Module, head: nn.Module, h: torch.Tensor,
               next_tokens: torch.Tensor) -> list[torch.Tensor]:
    """Every module's logits [B, T, V] in order of depth. `next_tokens` [D, B, T]: what depth k embeds at position i,
    t_{i+k} (zeros past the row's end: no target there), shifted by the trainer over the whole row before any split
    of the sequence (parallel/mtp.py)."""
    out = []
    for module, ids in zip(modules.values(), next_tokens):
        h, normed = module.predict(h, embedding(ids))
        out.append(head(normed))
    return out
