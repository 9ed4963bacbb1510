"""trainer3d.engine on one GPU, as an RL framework colocating its rollout uses it: what offload() frees on the device
(torch's allocated bytes, and the driver's free memory, which a rollout engine in another process can take), what
onload() costs, that the log-probs after the round trip are the same, and the weight stream's rate (named_weights in
bf16, on the device and to the host), under DDP, ZeRO-1 and ZeRO-3 (docs/post_training.md; the GPU round's `engine`
part).

    python bench/engine_gpu.py [--model llama3.2-1b] [--engines ddp,zero1,zero3]
    python bench/engine_gpu.py --dry                   # a tiny model on the CPU: the commands, nothing to free
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.harness import fmt_bytes, stamp, table  # noqa: E402

ENGINES = {"ddp": {}, "zero1": {"deepspeed_config": "ds_configs/zero1.json"},
           "zero3": {"deepspeed_config": "ds_configs/zero3.json"}}


def device_memory() -> tuple[int, int]:
    """(torch's allocated bytes, the driver's free bytes) on the current GPU; (0, 0) on a CPU."""
    if not torch.cuda.is_available():
        return 0, 0
    torch.cuda.synchronize()
    return torch.cuda.memory_allocated(), torch.cuda.mem_get_info()[0]


def stream_seconds(engine, device) -> tuple[float, int]:
    t0, total = time.perf_counter(), 0
    for _, tensor in engine.named_weights(torch.bfloat16, device=device):
        total += tensor.numel() * tensor.element_size()
        del tensor
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return time.perf_counter() - t0, total


def measure(name: str, model: str, seq: int, batch: int, dry: bool, out: str) -> list:
    from trainer3d.config import TrainConfig
    from trainer3d.engine import Engine

    cfg = TrainConfig(model=model, seq_len=seq, global_batch=batch, micro_batches=batch, lr=1e-5,
                      precision="fp32" if dry else "bf16", out_dir=out, **ENGINES[name])
    engine = Engine(cfg)
    tokens = torch.randint(0, engine.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    engine.forward_backward(tokens, lambda lp, f: -lp)  # a step, so that AdamW's state exists
    engine.step()
    before = engine.logprobs(tokens)
    allocated, free = device_memory()
    t0 = time.perf_counter()
    engine.offload()
    t_off = time.perf_counter() - t0
    allocated_off, free_off = device_memory()
    t0 = time.perf_counter()
    engine.onload()
    t_on = time.perf_counter() - t0
    same = torch.equal(engine.logprobs(tokens), before)
    on_device, nbytes = stream_seconds(engine, engine.device)
    to_host, _ = stream_seconds(engine, "cpu")
    engine.close()
    return [name, fmt_bytes(allocated), fmt_bytes(allocated - allocated_off), fmt_bytes(free_off - free),
            f"{t_off:.2f} / {t_on:.2f}", "yes" if same else "NO", fmt_bytes(nbytes),
            f"{nbytes / on_device / 1e9:.1f}", f"{nbytes / to_host / 1e9:.1f}"]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="llama3.2-1b")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--global-batch", type=int, default=4)
    ap.add_argument("--engines", default="ddp,zero1,zero3")
    ap.add_argument("--dry", action="store_true", help="a tiny model on the CPU")
    args = ap.parse_args(argv)
    model, seq = ("llama-tiny", 32) if args.dry else (args.model, args.seq_len)
    os.environ.setdefault("RANK", "0"), os.environ.setdefault("WORLD_SIZE", "1")
    os.environ.setdefault("LOCAL_RANK", "0"), os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29531")
    rows = []
    with tempfile.TemporaryDirectory() as out:
        for name in args.engines.split(","):
            rows.append(measure(name, model, seq, args.global_batch, args.dry, os.path.join(out, name)))
    print(table(rows, ["engine", "allocated", "offload frees (torch)", "driver's free rises", "offload / onload s",
                       "same log-probs", "weights (bf16)", "stream GB/s on device", "GB/s to host"]))
    print(stamp("python bench/engine_gpu.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
