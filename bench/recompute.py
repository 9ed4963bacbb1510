"""Activation recomputation on CPU: what the forward keeps for the backward, and what recomputing costs.

For one GPT-2-shaped model (12 heads of 64, seq 512: the attention core's s² terms matter) at (1,1,1), fp32, with
dropout 0.1 (so the attention core keeps its masks): the bytes autograd saves for backward during one micro-batch's
forward (torch.autograd.graph.saved_tensors_hooks, each storage counted once: exactly what the backward holds), and
the median train_step time of `--rounds` rounds, none / selective / full stepped in turn in the same process (order
rotated each round), as ratios to none. Full recomputation runs each block's forward twice: expect ≈ 4/3 of the step.

    python bench/recompute.py            # ~3 min on 2 cores
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

import torch  # noqa: E402

from bench.harness import stamp, table  # noqa: E402

MODES = ("none", "selective", "full")
MODEL = dict(model="gpt2", n_layer=4, seq_len=512, global_batch=2, micro_batches=1, dropout=0.1, vocab_size=8192)


def build(mode: str):
    import torch.distributed as dist

    from trainer3d.config import TrainConfig
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    cfg = TrainConfig(**MODEL, recompute=mode, precision="fp32", lr=1e-4, warmup_steps=1, max_steps=10**6)
    setup = validate(cfg, 1, MODEL["vocab_size"])
    return Trainer(setup, setup.topology(), torch.device("cpu"), setup.model_config(MODEL["vocab_size"]))


def saved_bytes(trainer, batch) -> int:
    """Bytes of the distinct storages autograd keeps for backward during one forward of the stage."""
    seen: dict[int, int] = {}

    def pack(t):
        if t.device.type != "meta":
            s = t.untyped_storage()
            seen[s.data_ptr()] = s.nbytes()
        return t

    model = trainer.parallel_model.stages[0]
    model.train()
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        logits = model(batch[:, :-1])
    del logits
    return sum(seen.values())


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--rounds", type=int, default=8)
    args = ap.parse_args(argv)
    trainers = {m: build(m) for m in MODES}
    g = torch.Generator().manual_seed(0)
    batch = torch.randint(0, MODEL["vocab_size"], (MODEL["global_batch"], MODEL["seq_len"] + 1), generator=g)
    saved = {m: saved_bytes(t, batch) for m, t in trainers.items()}
    times: dict[str, list[float]] = {m: [] for m in MODES}
    for r in range(args.rounds + 1):
        order = MODES[r % 3:] + MODES[: r % 3]
        for m in order:
            t0 = time.perf_counter()
            trainers[m].train_step(batch)
            if r:  # round 0 warms up
                times[m].append(time.perf_counter() - t0)
    base_t, base_b = statistics.median(times["none"]), saved["none"]
    rows = [[m, f"{saved[m] / 2**20:.1f}", f"{saved[m] / base_b:.2f}", f"{statistics.median(times[m]):.2f}",
             f"{statistics.median(times[m]) / base_t:.2f}"] for m in MODES]
    s, b, h, a, L = MODEL["seq_len"], MODEL["global_batch"], 768, 12, MODEL["n_layer"]
    print(f"\n{stamp('python bench/recompute.py')}; gpt2 widths, {L} layers, seq {s}, micro-batch {b}, dropout 0.1, fp32")
    print(f"(reference: a layer's input is s·b·h·4 = {s * b * h * 4 / 2**20:.1f} MiB; the attention scores "
          f"a·s²·b·4 = {a * s * s * b * 4 / 2**20:.1f} MiB per layer)\n")
    print(table(rows, ["recompute", "saved for backward MiB", "vs none", "step s", "step vs none"]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
