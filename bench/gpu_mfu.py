"""MFU of GPT-2 124M and 350M in bf16 on one GPU with trainer3d's Trainer at (1,1,1).

    python bench/gpu_mfu.py                                   # both models, seq 1024, 30 steps (5 warm-up)
    python bench/gpu_mfu.py --models gpt2 --micro-batch-size 16 --steps 50
    python bench/gpu_mfu.py --peak-tflops 989                 # a GPU metrics.PEAK_TFLOPS does not know

tokens/s is timed over the steps after --warmup (torch.cuda.synchronize before starting and stopping the clock;
the trainer also synchronizes every step when it reads the loss). MFU = tokens/s × FLOPs per token
(trainer3d.metrics.flops_per_token: 6 per matmul parameter, LM head included, + attention's 12·L·d·T) /
the device's dense bf16 peak (trainer3d.metrics.PEAK_TFLOPS, or --peak-tflops). Synthetic random tokens: the
data pipeline is not what is measured. Prints one table row per (model, micro-batch size); with several
--micro-batch-size values it tries each and skips sizes that run out of memory.

Runs on CPU too (--device cpu, for a smoke test; MFU then needs --peak-tflops).
"""

from __future__ import annotations

import argparse
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.harness import stamp, table  # noqa: E402


def run_one(model: str, mbs: int, grad_accum: int, seq_len: int, steps: int, warmup: int, device: torch.device,
            peak_override: float | None, precision: str) -> dict:
    import torch.distributed as dist

    from trainer3d.config import TrainConfig, validate
    from trainer3d.metrics import device_peak_tflops, flops_per_token
    from trainer3d.topology import Topology
    from trainer3d.train import Trainer

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    cfg = TrainConfig(model=model, seq_len=seq_len, global_batch=mbs * grad_accum, micro_batches=grad_accum,
                      precision=precision, max_steps=10**6, warmup_steps=10, lr=6e-4)
    mcfg = cfg.gpt_config(50257)
    layout, plan = validate(cfg, 1, mcfg.vocab_size)
    if device.type == "cuda":
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)
    trainer = Trainer(cfg, Topology(layout), device, mcfg, plan)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, mcfg.vocab_size, (plan.global_batch, seq_len + 1), generator=g).to(device)
               for _ in range(4)]

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    for i in range(warmup):
        trainer.train_step(batches[i % 4])
    sync()
    t0 = time.perf_counter()
    for i in range(steps):
        rec = trainer.train_step(batches[i % 4])
    sync()
    dt = time.perf_counter() - t0
    tokens = steps * plan.global_batch * seq_len
    tps = tokens / dt
    fpt = flops_per_token(mcfg, seq_len)
    peak = device_peak_tflops(device, trainer.precision, peak_override)
    out = dict(model=model, params=mcfg.num_params(), mbs=mbs, accum=grad_accum, seq=seq_len, steps=steps,
               step_ms=1000 * dt / steps, tps=tps, tflops=tps * fpt / 1e12, peak=peak,
               mfu=tps * fpt / (peak * 1e12) if peak else None, loss=rec["loss"], precision=trainer.precision,
               mem=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    del trainer, batches
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"])
    ap.add_argument("--micro-batch-size", type=int, nargs="+", default=[8, 16], help="sequences per micro-batch")
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="auto", help="auto: bf16 on CUDA (the trainer's default), fp32 on CPU")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        torch.cuda.set_device(device)  # TF32 and the rest left as the trainer leaves them
    rows = []
    for model in args.models:
        for mbs in args.micro_batch_size:
            try:
                r = run_one(model, mbs, args.grad_accum, args.seq_len, args.steps, args.warmup, device,
                            args.peak_tflops, args.precision)
            except torch.OutOfMemoryError:
                rows.append([model, "-", mbs, args.grad_accum, args.seq_len, "OOM", "-", "-", "-", "-", "-"])
                torch.cuda.empty_cache()
                continue
            rows.append([
                r["model"], f"{r['params'] / 1e6:.0f}M", r["mbs"], r["accum"], r["seq"], f"{r['step_ms']:.0f}",
                f"{r['tps']:,.0f}", f"{r['tflops']:.1f}", f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-",
                f"{r['mem'] / 2**30:.1f} GiB" if r["mem"] else "-", f"{r['loss']:.3f}",
            ])
            print(rows[-1], flush=True)
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(table(rows, ["model", "params", "micro-batch", "accum", "seq", "step ms", "tokens/s", "TFLOP/s",
                       "MFU", "peak mem", "loss"]))
    print(f"device: {name}; precision {args.precision}")
    print(stamp("python bench/gpu_mfu.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


if __name__ == "__main__":
    sys.exit(main())
