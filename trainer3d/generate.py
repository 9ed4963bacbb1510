"""Text generation from a plain model (any family): the next-token rule (temperature, top-k), shared by `python -m trainer3d.sample`
and the samples written during training, and `generate`, the decoding loop over a KV cache.

With the cache a new token runs the model on one position (attending to the cached keys and values) instead of
the whole prefix, which is what makes GPT-2 124M interactive on a CPU (bench/sample.py measures it).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from trainer3d.models import CausalLM
from trainer3d.models.attention import KVCache


def pick_next_token(
    logits: torch.Tensor, temperature: float = 1.0, top_k: int | None = None, generator: torch.Generator | None = None
) -> torch.Tensor:
    """logits [B, V] -> next token ids [B] (int64). temperature 0 picks the argmax; top_k keeps the k likeliest
    tokens before sampling. The draw uses `generator` on the generator's own device (a CPU generator serves a
    model on a GPU), so a seed gives the same text on every run."""
    logits = logits.float()
    if temperature == 0:
        return logits.argmax(dim=-1)
    logits = logits / temperature
    if top_k is not None and top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k, dim=-1).values[:, -1:]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if generator is not None and generator.device != probs.device:
        return torch.multinomial(probs.to(generator.device), 1, generator=generator).squeeze(-1).to(logits.device)
    return torch.multinomial(probs, 1, generator=generator).squeeze(-1)


def new_token_budget(prompt_len: int, max_new_tokens: int, n_positions: int) -> int:
    """How many tokens `generate` adds: max_new_tokens, but the sequence (prompt included) never grows past the
    model's n_positions (its context: learned positions end there, rotary ones were trained up to it) and a KV cache
    cannot slide a window."""
    return max(0, min(max_new_tokens, n_positions - prompt_len))


@torch.no_grad()
def generate(
    model: CausalLM,
    prompt_ids: torch.Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int | None = None,
    generator: torch.Generator | None = None,
    eos_id: int | Sequence[int] | None = None,
) -> torch.Tensor:
    """prompt_ids [B, T] -> [B, T + n]: the prompt and n = new_token_budget(...) new tokens, or fewer if every row
    has produced `eos_id` (or any of several: a chat reply ends at its end of turn or at the eos; a finished row is
    padded with the first). One prefill of the prompt, then one position per token through a KVCache; the model
    should be in eval mode (no dropout)."""
    stops = None if eos_id is None else torch.as_tensor(eos_id, device=prompt_ids.device).reshape(-1)
    B, T = prompt_ids.shape
    n = new_token_budget(T, max_new_tokens, model.cfg.n_positions)
    if n == 0:
        return prompt_ids
    # The last new token is never fed back, so the cache needs T + n - 1 positions.
    cache = KVCache(max_len=T + n - 1)
    out = [prompt_ids]
    done = torch.zeros(B, dtype=torch.bool, device=prompt_ids.device)
    logits = model(prompt_ids, kv_cache=cache)[:, -1]
    for i in range(n):
        token = pick_next_token(logits, temperature, top_k, generator)
        if stops is not None:
            token = token.masked_fill(done, stops[0])
            done |= torch.isin(token, stops)
        out.append(token[:, None])
        if i == n - 1 or (stops is not None and bool(done.all())):
            break
        logits = model(token[:, None], kv_cache=cache)[:, -1]
    return torch.cat(out, dim=1)
