"""Where a trainer step's host time goes: each phase of Trainer.train_step timed on the host, the step's CUDA launches
and synchronizations counted, and (CUDA) every synchronizing call of one step printed with where it comes from.

A step whose GPU idles while the bare loop's does not (the fifth GPU round: GPU busy 37 ms of gpt2's 48 ms step) is
either host-bound (the phases add up to the step and the read waits for nothing) or stalled by a synchronization
(torch.cuda.set_sync_debug_mode names it). This found the two host numbers written into a CUDA tensor in every step
(bench/gpu_round.md, the fifth round). One process, (1,1,1): bench/gpu_mfu.py's trainer row.

    python bench/step_phases.py --model gpt2 --micro-batch-size 16 --compile      # on the GPU (the round's mfu part)
    python bench/step_phases.py --model tiny --micro-batch-size 2 --seq-len 64     # CPU: the phases only
"""

from __future__ import annotations

import argparse
import collections
import os
import sys
import time
import traceback
import warnings

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402

from bench.gpu_mfu import one_process_trainer  # noqa: E402
from bench.harness import stamp, table  # noqa: E402

WAIT = "read_scalars (the step's one device read)"


def time_calls(owner, name: str, acc: dict, key: str) -> None:
    """Replace owner.name by a wrapper that adds its host seconds to acc[key]."""
    fn = getattr(owner, name)

    def timed(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            acc[key] += time.perf_counter() - t0

    setattr(owner, name, timed)


def print_syncs(step) -> None:
    """Run step() under torch.cuda.set_sync_debug_mode and print each synchronizing call's stack (trainer3d frames)."""
    def show(message, category, filename, lineno, file=None, line=None):
        if "prototype" in str(message):
            return
        frames = [f for f in traceback.extract_stack()[:-2] if "trainer3d" in f.filename]
        print(f"synchronizing: {message}\n  " + "\n  ".join(f"{f.filename}:{f.lineno} {f.line}" for f in frames[-4:]))

    with warnings.catch_warnings():  # restores showwarning and the filters on the way out
        warnings.showwarning = show
        warnings.simplefilter("always")
        torch.cuda.synchronize()
        torch.cuda.set_sync_debug_mode(1)
        try:
            step()
        finally:
            torch.cuda.set_sync_debug_mode(0)


def launches_per_step(step, device: torch.device, steps: int = 2) -> dict:
    """CUDA runtime and driver calls that launch or synchronize, per step (torch.profiler's CPU events)."""
    from torch.profiler import ProfilerActivity, profile

    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        for _ in range(steps):
            step()
    calls = collections.Counter(e.name for e in prof.events() if "Launch" in e.name or "Synchronize" in e.name)
    return {name: n / steps for name, n in calls.most_common()}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="gpt2")
    ap.add_argument("--micro-batch-size", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=10, help="timed steps, after 5 untimed")
    ap.add_argument("--compile", action="store_true")
    args = ap.parse_args(argv)
    from trainer3d.parallel import engine as engine_module

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    cuda = device.type == "cuda"
    trainer, _, batches = one_process_trainer(args.model, args.micro_batch_size, 1, args.seq_len, device,
                                              compile=args.compile)  # bf16 on CUDA, fp32 on CPU
    for i in range(5):
        trainer.train_step(batches[i % 4])
    if cuda:
        print_syncs(lambda: trainer.train_step(batches[0]))

    acc: dict = collections.defaultdict(float)
    time_calls(trainer.engine, "zero_grad", acc, "zero_grad")
    time_calls(trainer, "run_pass", acc, "forward and backward (launch)")
    time_calls(trainer.engine, "reduce_grads", acc, "reduce_grads: dp, norm (launch)")
    time_calls(engine_module, "read_scalars", acc, WAIT)
    time_calls(trainer.engine, "update", acc, "update: clip, AdamW (launch)")
    if cuda:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for i in range(args.steps):
        trainer.train_step(batches[i % 4])
    if cuda:
        torch.cuda.synchronize()
    step_s = (time.perf_counter() - t0) / args.steps
    rows = [[k, f"{1e3 * v / args.steps:.2f}"] for k, v in acc.items()]
    rows.append(["the rest of train_step", f"{1e3 * (step_s - sum(acc.values()) / args.steps):.2f}"])
    rows.append(["the step", f"{1e3 * step_s:.2f}"])
    print(f"{args.model}, micro-batch {args.micro_batch_size}, seq {args.seq_len}, compile {args.compile}, "
          f"{device.type}; host ms per step:")
    print(table(rows, ["phase", "ms"]))
    print("per step:", launches_per_step(lambda: trainer.train_step(batches[1]), device))
    print(stamp(" ".join(["python bench/step_phases.py", *(argv if argv is not None else sys.argv[1:])])))
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
