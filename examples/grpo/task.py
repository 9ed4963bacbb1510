"""The example's verifiable task: "7 x 3 =" asks for the digit 7 three times, " 7 7 7", then the end of the turn.

The SFT data (sft.py) teaches the format with counts that are off by one a third of the time each way, so the SFT
model ends its replies at eos with lengths that vary and are right about a third of the time; RL (grpo.py) then has
something to learn: the exact count.
"""

from __future__ import annotations

import json
import random

MAX_COUNT = 5


def prompt(digit: int, count: int) -> str:
    return f"{digit} x {count} ="


def reply(digit: int, count: int) -> str:
    return "".join(f" {digit}" for _ in range(count))


def sft_rows(n: int, seed: int) -> list[dict]:
    """Chat rows whose replies repeat the digit count - 1, count or count + 1 times (at least once)."""
    rng = random.Random(seed)
    rows = []
    for _ in range(n):
        digit, count = rng.randint(0, 9), rng.randint(1, MAX_COUNT)
        shown = max(1, count + rng.choice((-1, 0, 1)))
        rows.append({"messages": [{"role": "user", "content": prompt(digit, count)},
                                  {"role": "assistant", "content": reply(digit, shown)}]})
    return rows


def write_sft(path: str, n: int, seed: int) -> None:
    with open(path, "w") as f:
        for row in sft_rows(n, seed):
            f.write(json.dumps(row) + "\n")


def reward(text: str, ended: bool, digit: int, count: int) -> float:
    """1 for exactly `count` copies of the digit then eos; else the share of the positions max(count, length) that
    hold the digit among the first `count`; 0 for a reply that never ended (no eos within the limit)."""
    if not ended:
        return 0.0
    words = text.split()
    right = sum(1 for w in words[:count] if w == str(digit))
    return right / max(count, len(words), 1)
