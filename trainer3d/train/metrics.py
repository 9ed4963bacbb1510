"""Throughput, model FLOPs utilisation, memory, and the metrics.jsonl that tools and tests read."""

from __future__ import annotations

import json
import os
import resource
import time

import torch
import torch.distributed as dist

from trainer3d.distributed.collectives import all_reduce
from trainer3d.rundir import METRICS

# Dense peak TFLOP/s per device (vendor datasheets; no sparsity). Matched against torch.cuda.get_device_name() in
# this order, first substring wins, so the PCIe/NVL variants come before their SXM names ("NVIDIA H100 80GB HBM3"
# is the SXM part; "NVIDIA H100 PCIe" and "NVIDIA H100 NVL" are slower). "tf32" is the tensor-core fp32 peak,
# "fp32" the plain (IEEE) one: torch multiplies fp32 matrices in full fp32 unless TF32 is switched on
# (torch.backends.cuda.matmul.allow_tf32 or torch.set_float32_matmul_precision("high")), and the trainer leaves
# it off, so an fp32 run is measured against the peak that matches what it ran.
PEAK_TFLOPS = {
    "H200 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H200": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM; GH200 too
    "H100 PCIe": {"bf16": 756.0, "fp16": 756.0, "tf32": 378.0, "fp32": 51.0},
    "H100 NVL": {"bf16": 835.0, "fp16": 835.0, "tf32": 418.0, "fp32": 60.0},
    "H100": {"bf16": 989.0, "fp16": 989.0, "tf32": 494.0, "fp32": 67.0},  # SXM ("NVIDIA H100 80GB HBM3")
    "A100": {"bf16": 312.0, "fp16": 312.0, "tf32": 156.0, "fp32": 19.5},
    "L40S": {"bf16": 362.0, "fp16": 362.0, "tf32": 183.0, "fp32": 91.6},
    "A10G": {"bf16": 70.0, "fp16": 70.0, "tf32": 35.0, "fp32": 31.2},
    "V100": {"fp16": 125.0, "fp32": 15.7},  # no bf16 or TF32 tensor cores
}


def device_peak_tflops(device: torch.device, precision: str, override: float | None) -> float | None:
    if override:
        return override
    if device.type != "cuda":
        return None  # CPUs vary too much; pass --peak-tflops to get MFU
    name = torch.cuda.get_device_name(device)
    for key, table in PEAK_TFLOPS.items():
        if key in name:
            if precision == "fp32" and torch.backends.cuda.matmul.allow_tf32 and "tf32" in table:
                return table["tf32"]
            return table.get(precision)
    return None


class PeakMemory:
    """metrics' `peak_mem_bytes`: the most memory any rank held since the previous report. Each rank tracks its own
    peak and resets it after every report; a report takes the maximum over the world (one all-reduce, on logged steps
    only), since the peak is often not on the logging rank (the first stage's under 1F1B). CUDA: the caching
    allocator's max_memory_allocated; CPU: the process's peak resident set (VmHWM), reset by writing 5 to
    /proc/self/clear_refs (Linux; where that cannot be written, the peak since the start, ru_maxrss)."""

    def __init__(self, device: torch.device, group):
        self.device, self.group = device, group
        self.reset()

    def local(self) -> int:
        if self.device.type == "cuda":
            return torch.cuda.max_memory_allocated(self.device)
        try:
            with open("/proc/self/status") as f:
                return next(int(line.split()[1]) for line in f if line.startswith("VmHWM:")) * 1024
        except (OSError, StopIteration, ValueError):
            return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux reports KiB

    def reset(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
            return
        try:
            with open("/proc/self/clear_refs", "w") as f:
                f.write("5")
        except OSError:
            pass

    def report(self) -> int:
        """Collective over `group`: the highest peak of any rank since the last report; then every rank resets."""
        peak = torch.tensor([self.local()], dtype=torch.int64, device=self.device)
        peak = int(all_reduce(peak, self.group, op=dist.ReduceOp.MAX).item())
        self.reset()
        return peak


class MetricsFile:
    """Append-only JSON lines, one object per optimizer step (and per evaluation); written by one rank."""

    def __init__(self, out_dir: str, enabled: bool, append: bool = False):
        self.enabled = enabled
        self.path = os.path.join(out_dir, METRICS)
        self._f = None
        if enabled:
            os.makedirs(out_dir, exist_ok=True)
            self._f = open(self.path, "a" if append else "w")

    def write(self, record: dict) -> None:
        if self._f is not None:
            self._f.write(json.dumps(record) + "\n")
            self._f.flush()

    def close(self) -> None:
        if self._f is not None:
            self._f.close()
            self._f = None


class RunSummary:
    """What a run ends with on the console: steps and time, the losses, where its files are, and the commands that
    read them next (sample, export, resume)."""

    def __init__(self, start_step: int):
        self.start_step, self.t0 = start_step, time.perf_counter()
        self.last: dict = {}
        self.best_val: tuple[float, int] | None = None  # (val_loss, step)

    def observe(self, record: dict) -> None:
        if "loss" in record:
            self.last = record
        if "val_loss" in record and (self.best_val is None or record["val_loss"] < self.best_val[0]):
            self.best_val = (record["val_loss"], record["step"])

    def lines(self, out_dir: str, checkpoint, chat: bool = False) -> list[str]:
        if not self.last:
            return []
        step, elapsed = self.last["step"], time.perf_counter() - self.t0
        took = f"{elapsed:.0f} s" if elapsed < 120 else f"{elapsed / 60:.1f} min"
        text = (f"[trainer3d] trained steps {self.start_step + 1}-{step} in {took} "
                f"({self.last['tokens']:,} tokens seen); final loss {self.last['loss']:.4f}")
        if "val_loss" in self.last:
            text += f", val_loss {self.last['val_loss']:.4f}"
        if self.best_val is not None:
            text += f" (best {self.best_val[0]:.4f} at step {self.best_val[1]})"
        out = [text, f"[trainer3d] metrics: {os.path.join(out_dir, 'metrics.jsonl')}"]
        if checkpoint is None:
            return out + ["[trainer3d] no checkpoint was saved (--no-final-save and no --save-every)"]
        return out + [f"[trainer3d] checkpoint: {checkpoint}",
                      f"[trainer3d] next: python -m trainer3d.sample {out_dir}{' --chat' if chat else ''} "
                      f"--prompt \"...\"   |   "
                      f"python -m trainer3d.export {checkpoint} {os.path.join(out_dir, 'hf')}   |   the same command "
                      f"with --resume and a larger --max-steps"]
