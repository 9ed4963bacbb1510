"""What trainer3d.engine's named_weights() costs each rank: the bytes it receives against the rule (every element of
the model once in the stream's dtype, less the pieces the rank writes itself and the tensors every rank holds whole:
engine/weights.py), and the rise of its
resident memory while it streams the whole model's Hugging Face tensors in buckets, against the bucket, the largest
tensor and the rank's share of the training state; and how long the stream takes (docs/post_training.md).

    python bench/engine_weights.py [--model gpt2] [--layouts tp2pp2,dp4,zero2dp4,zero3dp4,tp2pp2ep2] [--dtype bf16]
        [--bucket-mib 64]

tp2pp2ep2 runs --moe-model (8 processes: dp 2 = ep 2); the others --model at 4 processes.
Memory per rank is measured from outside (the parent samples every rank's resident set every 20 ms,
bench/checkpoint_state.Sampler) and from inside (the kernel's peak-RSS counter VmHWM, reset just before the stream).
"rise" = the peak during the stream minus the resident set just before it. The consumer drops each tensor at once,
as an inference engine's weight loader would after copying it.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from bench.checkpoint_state import Sampler, _hwm, _reset_hwm, _rss  # noqa: E402
from bench.harness import fmt_bytes, stamp, table  # noqa: E402

LAYOUTS = {"tp2pp2": dict(tp=2, pp=2), "dp4": dict(), "zero2dp4": dict(deepspeed_config="ds_configs/zero2.json"),
           "zero3dp4": dict(deepspeed_config="ds_configs/zero3.json"),
           "tp2pp2ep2": dict(tp=2, pp=2, ep=2)}
DTYPES = {"bf16": "bfloat16", "fp32": "float32"}


def _world(rank, world, model, layout, out, dtype_name, bucket_bytes):
    import gc

    import torch
    import torch.distributed as dist

    from trainer3d.config import TrainConfig
    from trainer3d.engine import Engine

    cfg = TrainConfig(model=model, seq_len=64, global_batch=8, micro_batches=2, precision="fp32", out_dir=out,
                      **LAYOUTS[layout])
    engine = Engine(cfg)
    mem = engine.trainer.engine.memory()
    share = mem["param_bytes"] + mem["grad_bytes"] + mem["optim_bytes"]
    gc.collect()
    dist.barrier()
    before, t0 = _rss(), time.time()
    _reset_hwm()
    largest = count = 0
    dtype = getattr(torch, DTYPES[dtype_name])
    total = 0
    for _, tensor in engine.named_weights(dtype, bucket_bytes=bucket_bytes):
        nbytes = tensor.numel() * tensor.element_size()
        largest, count, total = max(largest, nbytes), count + 1, total + nbytes
        del tensor
    t1 = time.time()
    stream = engine._stream
    own = sum(d.numel() for u, *_, d in stream.mine if u not in stream.held_everywhere(dtype)) * dtype.itemsize
    model_bytes = sum(torch.Size(u.shape).numel() for u in stream.units) * dtype.itemsize
    local = sum(torch.Size(stream.units[i].shape).numel() for i in stream.held_everywhere(dtype)) * dtype.itemsize
    out = dict(layout=layout, rank=rank, pid=os.getpid(), share=share, largest=largest, tensors=count, t0=t0, t1=t1,
               inside=_hwm() - before, seconds=t1 - t0, received=stream.received * dtype.itemsize,
               rule=model_bytes - local - own, model=model_bytes)
    engine.close()
    return out


def main() -> int:
    from helpers.distributed import run_world

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--moe-model", default="qwen3-moe-tiny")
    ap.add_argument("--layouts", default="tp2pp2,dp4,zero2dp4,zero3dp4,tp2pp2ep2")
    ap.add_argument("--dtype", default="bf16", choices=sorted(DTYPES))
    ap.add_argument("--bucket-mib", type=float, default=64)
    args = ap.parse_args()
    rows, bucket = [], int(args.bucket_mib * 2**20)
    with tempfile.TemporaryDirectory() as out, Sampler() as sampler:
        for layout in args.layouts.split(","):
            moe = "ep" in LAYOUTS[layout]
            for r in run_world(8 if moe else 4, _world, args.moe_model if moe else args.model, layout, out,
                               args.dtype, bucket, timeout=3000):
                outside = sampler.rise(r["pid"], r["t0"], r["t1"])
                rows.append([layout, r["rank"], fmt_bytes(r["model"]), fmt_bytes(r["received"]), fmt_bytes(r["rule"]),
                             f"{r['received'] / r['rule']:.3f}" if r["rule"] else f"{r['received']} B of 0 B",
                             fmt_bytes(r["share"]), fmt_bytes(r["largest"]),
                             fmt_bytes(outside), fmt_bytes(r["inside"]),
                             f"{max(outside, r['inside']) / max(r['largest'], min(bucket, r['model'])):.2f}",
                             f"{r['seconds']:.1f}"])
    print(f"dtype {args.dtype}, buckets of {args.bucket_mib:g} MiB")
    print(table(rows, ["layout", "rank", "model", "received", "rule", "received / rule", "share (params+grads+Adam)",
                       "largest tensor", "rise (outside)", "rise (VmHWM)", "rise / max(largest, bucket)",
                       "stream s"]))
    print(stamp("python bench/engine_weights.py " + " ".join(sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
