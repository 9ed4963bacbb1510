"""How trainer3d.engine lays out rollouts of any shape (engine/batch.pack): the rows and passes a batch of rollouts
takes, the share of those rows' tokens that are padding, and how evenly the dp ranks' tokens come out, packed several
a row (document_mask + reset_position_ids) against one a row, for GRPO-like length distributions. Pure bookkeeping:
no model runs, so the figures hold on any machine.

    python bench/rollout_packing.py
"""

from __future__ import annotations

import datetime
import platform
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from trainer3d.engine.batch import pack  # noqa: E402

SEQ_LEN, ROWS, DP = 4096, 64, 8  # seq_len, global_batch rows a pass, dp ranks


def lengths(kind: str, n: int, g: torch.Generator) -> list[int]:
    """Prompt + reply lengths: a 256-token prompt and replies of a long-tailed (log-normal, reasoning-like) or
    uniform length, each capped at seq_len + 1."""
    if kind == "long-tailed":
        reply = torch.exp(torch.randn(n, generator=g) * 0.9 + 6.5)  # median ~665 tokens, a tail to the cap
    else:
        reply = torch.rand(n, generator=g) * 2048
    return [int(min(SEQ_LEN + 1, 256 + max(1, r))) for r in reply.tolist()]


def row(kind: str, n: int, several: bool) -> str:
    g = torch.Generator().manual_seed(0)
    ls = lengths(kind, n, g)
    p = pack(ls, ROWS, SEQ_LEN + 1, DP, several_a_row=several)
    used = {(pp, r) for pp, r, _ in p.place}
    slot_tokens = [0] * (p.passes * DP)
    for (pp, r, _), n_tok in zip(p.place, ls):
        slot_tokens[pp * DP + r // (ROWS // DP)] += n_tok
    capacity = p.passes * ROWS * (SEQ_LEN + 1)
    imbalance = max(slot_tokens) / (sum(slot_tokens) / len(slot_tokens))
    return (f"| {kind} | {n} | {'several' if several else 'one'} | {len(used)} | {p.passes} | "
            f"{1 - sum(ls) / capacity:.1%} | {imbalance:.3f} |")


def main() -> None:
    print(f"seq_len {SEQ_LEN}, {ROWS} rows a pass, dp {DP}\n")
    print("| lengths | rollouts | a row | rows used | passes | padding | max / mean tokens of a (pass, dp rank) |")
    print("|---|---|---|---|---|---|---|")
    for kind in ("long-tailed", "uniform"):
        for n in (256, 1000):
            for several in (True, False):
                print(row(kind, n, several))
    print(f"\ndate: {datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; machine: {platform.machine()}; "
          f"torch {torch.__version__}")


if __name__ == "__main__":
    main()
