"""Initial values as a pure function of a parameter's name and the seed: every layout builds its shards from the same
full values, which is what makes a (dp, tp, pp) run start from the exact weights of the one-process run."""

from __future__ import annotations

import torch


def name_seeded_normal(name: str, shape: tuple, seed: int, std: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + stable_hash(name))
    return torch.randn(shape, generator=gen) * std


def name_seeded_uniform(name: str, shape: tuple, seed: int, low: float, high: float) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + stable_hash(name))
    return torch.rand(shape, generator=gen) * (high - low) + low


def stable_hash(text: str) -> int:
    # Python's hash() is salted per process; ranks must agree.
    h = 0
    for ch in text.encode():
        h = (h * 131 + ch) % (2**31 - 1)
    return h
