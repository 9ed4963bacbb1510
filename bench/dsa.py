"""DeepSeek Sparse Attention on CPU, fp32, one thread: one MLA layer of trainer3d's DeepSeek family with its lightning
indexer, in --dsa-stage sparse (each query attends to its top-k keys through the masked SDPA every device runs here,
the indexer's KL in the backward) against the same layer dense (flash attention over every earlier key, no indexer),
forward and backward, at two lengths: what selection costs while no kernel skips the unselected keys. Time: both
sides in one process, rotated each round, the median of per-round ratios to dense MLA's. Memory: each side and length
in its own process, the malloc peak of three passes (bench/memhook.c) and the resident-set high-water mark read from
outside (/proc/<pid>/status VmHWM).

    python bench/dsa.py --rounds 3
"""

from __future__ import annotations

import dataclasses
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)
os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402

from bench.harness import length_rows, lengths_cli, stamp, table  # noqa: E402

LENGTHS = (1024, 4096)
TOPK = 256


def _config(sparse: bool):
    """DeepSeek-V3.2's MLA scaled to a CPU: width 1024, 8 heads of 64 + 32 qk (64 v) dims, q and kv latents of 256
    and 128; its indexer 8 heads of 64 choosing 256 keys (V3.2: 64 of 128 choosing 2048)."""
    from trainer3d.models import MODEL_PRESETS

    return dataclasses.replace(
        MODEL_PRESETS["deepseek-v3.2-tiny"], n_embd=1024, n_head=8, q_lora_rank=256, kv_lora_rank=128,
        qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64, index_n_heads=8 if sparse else 0,
        index_head_dim=64, index_topk=TOPK)


class _KL:
    """parallel/dsa.py's IndexerLoss at one process and coefficient 1, without a trainer."""

    @staticmethod
    def over_heads(probs):
        return probs

    @staticmethod
    def attach(out, kl):
        from trainer3d.parallel.moe_balance import AuxLossScaler

        return AuxLossScaler.apply(out, kl.mean())


def _pass_of(sparse: bool, tokens: int):
    from trainer3d.models.deepseek_v3.model import MLAttention

    cfg = _config(sparse)
    torch.manual_seed(0)
    layer = MLAttention(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, std=0.02) if p.dim() > 1 else torch.nn.init.ones_(p)
    layer.rotary.init_tables(torch.device("cpu"))
    layer.observer = _KL() if sparse else None
    x = torch.randn(1, tokens, cfg.n_embd, requires_grad=True)
    target = torch.randn(1, tokens, cfg.n_embd)

    def run():
        (layer(x) * target).sum().backward()
        layer.zero_grad(set_to_none=True)
        x.grad = None

    return run


SIDES = {"dense MLA": False, f"DSA, top {TOPK} (masked)": True}


def _side_pass(side: str, tokens: int):
    return _pass_of(SIDES[side], tokens)


def main() -> None:
    args = lengths_cli(__doc__, 3, _side_pass)
    if args is None:
        return
    print("One MLA layer, forward + backward (DSA: the indexer's KL included):\n")
    rows = length_rows(__file__, _side_pass, SIDES, LENGTHS, args.rounds, "dense MLA")
    print(table(rows, ["tokens", "side", "ms", "time / dense", "malloc peak", "RSS high-water (outside)"]))
    print("\n" + stamp("python bench/dsa.py " + " ".join(sys.argv[1:])))


if __name__ == "__main__":
    main()
