"""MFU of GPT-2 124M and 350M in bf16 on one GPU with trainer3d's Trainer at (1,1,1).

    python bench/gpu_mfu.py                                   # both models, seq 1024, 30 steps (5 warm-up)
    python bench/gpu_mfu.py --models gpt2 --micro-batch-size 16 --steps 50
    python bench/gpu_mfu.py --peak-tflops 989                 # a GPU metrics.PEAK_TFLOPS does not know

tokens/s is timed over the steps after --warmup (torch.cuda.synchronize before starting and stopping the clock;
the trainer also synchronizes every step when it reads the loss). MFU = tokens/s × FLOPs per token
(the family config's flops_per_token: 6 per matmul parameter, LM head included, + attention's 12·L·d·T) /
the device's dense bf16 peak (trainer3d.metrics.PEAK_TFLOPS, or --peak-tflops). Synthetic random tokens: the
data pipeline is not what is measured. Prints one table row per (model, micro-batch size); with several
--micro-batch-size values it tries each and skips sizes that run out of memory.

--profile adds, per row, where the GPU time of 3 more steps goes (torch.profiler kernels grouped: matmuls,
attention, optimizer, elementwise, ...) and how busy the GPU was. --reference eager compile adds rows for the same
model (trainer3d.models.gpt2.GPT, vocab padded to 50304) in a bare nanoGPT-style loop (autocast bf16 over fp32 params,
F.cross_entropy, clip, fused AdamW), eager and under torch.compile: what the trainer's own code costs, and what
compilation would buy, on the same GPU.

Runs on CPU too (--device cpu, for a smoke test; MFU then needs --peak-tflops).
"""

from __future__ import annotations

import argparse
import gc
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from bench.harness import stamp, table  # noqa: E402
from trainer3d.config import COMPILE_BACKENDS  # noqa: E402


def config_of(model: str, **kw):
    """The TrainConfig of a row's MODEL: a preset, or PRESET/N for its first N layers (a wide model's per-layer
    speed, FP8's at d = 4096 say, on one GPU that cannot hold all its layers with AdamW)."""
    from trainer3d.config import TrainConfig

    name, _, layers = model.partition("/")
    return TrainConfig(model=name, n_layer=int(layers) if layers else None, **kw)


def one_process_trainer(model: str, mbs: int, grad_accum: int, seq_len: int, device: torch.device,
                        precision: str = "auto", compile: bool = False, fp8: str | None = None,
                        compile_backend: str = "inductor"):
    """(trainer3d's Trainer at (1,1,1) on `device`, its model config, 4 synthetic global batches on the device, seed
    0): what a trainer row times here and bench/step_phases.py takes apart."""
    import torch.distributed as dist

    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    if not dist.is_initialized():
        dist.init_process_group("nccl" if device.type == "cuda" else "gloo", store=dist.HashStore(), rank=0,
                                world_size=1, device_id=device if device.type == "cuda" else None)
    cfg = config_of(model, seq_len=seq_len, global_batch=mbs * grad_accum, micro_batches=grad_accum,
                    precision=precision, max_steps=10**6, warmup_steps=10, lr=6e-4, compile=compile, fp8=fp8,
                    compile_backend=compile_backend)
    mcfg = cfg.model_config(50257)
    setup = validate(cfg, 1, mcfg.vocab_size)
    free_memory(device)  # the previous row's Trainer (reference cycles) would count in this row's peak memory
    trainer = Trainer(setup, setup.topology(), device, mcfg)
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, mcfg.vocab_size, (setup.plan.global_batch, seq_len + 1), generator=g).to(device)
               for _ in range(4)]
    return trainer, mcfg, batches


def run_one(model: str, mbs: int, grad_accum: int, seq_len: int, steps: int, warmup: int, device: torch.device,
            peak_override: float | None, precision: str, profile: bool = False, compile: bool = False,
            fp8: str | None = None, compile_backend: str = "inductor") -> dict:
    from trainer3d.train.metrics import device_peak_tflops

    trainer, mcfg, batches = one_process_trainer(model, mbs, grad_accum, seq_len, device, precision, compile, fp8,
                                                  compile_backend)
    plan = trainer.plan

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    for i in range(warmup):  # compilation happens here
        trainer.train_step(batches[i % 4])
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        rec = trainer.train_step(batches[i % 4])
    sync()
    dt = time.perf_counter() - t0
    mem = torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None
    breakdown = None
    if profile:
        try:
            breakdown = gpu_time_breakdown(trainer.train_step, batches, device)
        except Exception as e:  # noqa: BLE001 - a profiler problem must not cost the row
            print(f"profile failed: {type(e).__name__}: {e}", flush=True)
    tokens = steps * plan.global_batch * seq_len
    tps = tokens / dt
    fpt = mcfg.flops_per_token(seq_len)
    peak = device_peak_tflops(device, trainer.precision, peak_override)
    out = dict(model=model, params=mcfg.num_params(), mbs=mbs, accum=grad_accum, seq=seq_len, steps=steps,
               step_ms=1000 * dt / steps, tps=tps, tflops=tps * fpt / 1e12, peak=peak,
               mfu=tps * fpt / (peak * 1e12) if peak else None, loss=rec["loss"], precision=trainer.precision,
               mem=mem, breakdown=breakdown, warm_s=warm_s)
    return out  # the caller frees this Trainer (free_memory) before the next row


def free_memory(device: torch.device) -> None:
    gc.collect()
    if device.type == "cuda":
        torch.cuda.synchronize(device)
        torch.cuda.empty_cache()
        torch.cuda.reset_peak_memory_stats(device)


_KINDS = [  # (kind, substrings of the lower-cased kernel name), first match wins
    ("matmul", ("gemm", "nvjet", "cutlass", "xmma", "wgmma", "cublas", "sm90_", "sm80_")),
    ("attention", ("flash", "fmha", "attention", "efficient")),
    ("optimizer", ("adam", "multi_tensor", "foreach")),
    ("nccl", ("nccl",)),
    ("layernorm", ("layer_norm", "layernorm")),
    ("copy/cast", ("copy", "cast", "memcpy", "memset", "fill")),
    ("softmax/reduce", ("reduce", "softmax", "max", "sum", "log")),
]


def gpu_time_breakdown(step, batches: list, device: torch.device, n: int = 3) -> dict | None:
    """GPU time per step by kernel kind over n profiled steps, plus the step's wall time (CUDA only)."""
    if device.type != "cuda":
        return None
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize(device)
    t0 = time.perf_counter()
    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for i in range(n):
            step(batches[i % len(batches)])
        torch.cuda.synchronize(device)
    wall_ms = 1000 * (time.perf_counter() - t0) / n
    kinds: dict[str, float] = {}
    kernels: list[tuple[float, int, str, str]] = []  # (ms per step, calls per step, kind, name)
    for e in prof.key_averages():
        t = getattr(e, "self_device_time_total", 0) or 0
        if getattr(e, "device_type", None) != torch.autograd.DeviceType.CUDA or t <= 0:
            continue
        name = e.key.lower()
        kind = next((k for k, subs in _KINDS if any(x in name for x in subs)), "other elementwise")
        kinds[kind] = kinds.get(kind, 0.0) + t / 1000 / n  # us -> ms per step
        kernels.append((t / 1000 / n, e.count // n, kind, e.key))
    return {"wall_ms": wall_ms, "gpu_ms": sum(kinds.values()), "kinds": kinds, "top": sorted(kernels)[::-1][:15]}


def run_reference(model: str, mbs: int, seq_len: int, steps: int, warmup: int, device: torch.device,
                  peak_override: float | None, mode: str, fp8: str | None = None,
                  compile_backend: str = "inductor") -> dict:
    """The same model in a bare loop (no pipeline schedule, no tp layers, no vocab-parallel loss), eager or
    compiled: a ceiling for this GPU and this torch, to read the trainer's MFU against. fp8 ("tensorwise",
    "rowwise"): torchao's float8 training recipe on every block linear (not the tied LM head), what FP8 can buy."""
    import torch.nn.functional as F

    from trainer3d.config import TrainConfig
    from trainer3d.train.metrics import device_peak_tflops
    from trainer3d.models import build_model, init_value

    free_memory(device)
    mcfg = config_of(model, seq_len=seq_len).model_config(50304)  # the trainer pads 50257 to 50304 too
    net = build_model(mcfg)  # at tp 1 the family's parallel linears are plain linears
    with torch.no_grad():
        for name, p in net.named_parameters():  # a tied lm_head is listed once, as the embedding
            p.copy_(init_value(mcfg, name, p.shape, TrainConfig().seed))
            if p.shape[0] == 50304:
                p[50257:].zero_()  # the embedding's (and an untied head's) padding rows, zeros as the trainer's
    net = net.to(device)
    net.init_tables(device)  # rotary frequencies, routers' biases
    if fp8:
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        convert_to_float8_training(net, config=Float8LinearConfig.from_recipe_name(fp8), module_filter_fn=lambda m, fqn:
                                   m.out_features != 50304 and m.in_features % 16 == 0 and m.out_features % 16 == 0)
    params = list(net.parameters())
    groups = [{"params": [p for p in params if p.dim() >= 2], "weight_decay": 0.1},  # as trainer3d.train
              {"params": [p for p in params if p.dim() < 2], "weight_decay": 0.0}]
    opt = torch.optim.AdamW(groups, lr=6e-4, betas=(0.9, 0.95), eps=1e-8, fused=device.type == "cuda")
    fwd = torch.compile(net, backend=compile_backend) if mode == "compile" else net
    g = torch.Generator().manual_seed(0)
    batches = [torch.randint(0, 50257, (mbs, seq_len + 1), generator=g).to(device) for _ in range(4)]
    cuda = device.type == "cuda"
    amp = torch.autocast("cuda", dtype=torch.bfloat16) if cuda else torch.autocast("cpu", enabled=False)  # fp32

    done = [0]

    def step(i):  # batches in the order run_one feeds them, lr as the trainer's warm-up (warmup_steps=10)
        x = batches[i % 4]
        for group in opt.param_groups:
            group["lr"] = 6e-4 * min(1.0, (done[0] + 1) / 10)
        done[0] += 1
        opt.zero_grad(set_to_none=True)
        with amp:
            logits = fwd(x[:, :-1])
        loss = F.cross_entropy(logits.float().flatten(0, 1), x[:, 1:].flatten())
        loss.backward()
        torch.nn.utils.clip_grad_norm_(net.parameters(), 1.0)
        opt.step()
        return loss

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)

    t0 = time.perf_counter()
    for i in range(warmup):  # compile happens here
        step(i)
    sync()
    warm_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for i in range(steps):
        loss = step(i)
    sync()
    dt = time.perf_counter() - t0
    tps = steps * mbs * seq_len / dt
    fpt = config_of(model, seq_len=seq_len).model_config(50257).flops_per_token(seq_len)
    peak = device_peak_tflops(device, "bf16" if device.type == "cuda" else "fp32", peak_override)
    out = dict(model=model, params=mcfg.num_params(), mbs=mbs, accum=1, seq=seq_len, steps=steps,
               step_ms=1000 * dt / steps, tps=tps, tflops=tps * fpt / 1e12, peak=peak,
               mfu=tps * fpt / (peak * 1e12) if peak else None, loss=loss.item(), warm_s=warm_s,
               mem=torch.cuda.max_memory_allocated(device) if device.type == "cuda" else None)
    return out  # the caller frees the model (free_memory) before the next row


def device_description(device: torch.device) -> str:
    if device.type != "cuda":
        return "cpu"
    props = torch.cuda.get_device_properties(device)
    try:
        driver = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader", "-i",
                                 str(device.index or 0)], capture_output=True, text=True, timeout=30,
                                check=False).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        driver = "?"
    try:
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    except Exception:  # noqa: BLE001
        nccl = "?"
    return (f"{props.name}, {props.total_memory / 2**30:.0f} GiB, {props.multi_processor_count} SMs, "
            f"driver {driver or '?'}, CUDA {torch.version.cuda}, NCCL {nccl}, "
            f"TF32 matmul {torch.backends.cuda.matmul.allow_tf32}")


KINDS = tuple(f"{runner}{compiled}{fp8}" for runner in ("trainer", "bare") for compiled in ("", "-compile")
              for fp8 in ("", "-fp8-rowwise", "-fp8-tensorwise"))


def parse_row(spec: str) -> tuple[str, int, str]:
    """"MODEL:MICRO_BATCH:KIND", KIND one of KINDS: trainer3d's Trainer (eager or --compile) or the bare loop, either
    with FP8 (the trainer's --fp8; torchao's conversion in the bare loop)."""
    model, mbs, kind = spec.split(":")
    if kind not in KINDS:
        raise argparse.ArgumentTypeError(f"row {spec!r}: the kind must be one of {', '.join(KINDS)}")
    return model, int(mbs), kind


def fp8_of(kind: str) -> str | None:
    return kind.split("fp8-")[1] if "fp8-" in kind else None


def json_row(label: str, kind: str, r: dict, device: torch.device) -> dict:
    """One row of bench/results/gpu_mfu.json (the GPU round's record)."""
    return dict(model=r["model"], runner="bare" if kind.startswith("bare") else "trainer3d", micro_batch=r["mbs"],
                grad_accum=r["accum"], seq=r["seq"], compiled="compile" in kind, fp8=fp8_of(kind),
                tokens_per_s=round(r["tps"], 1), step_ms=round(r["step_ms"], 2), tflops=round(r["tflops"], 2),
                mfu=round(r["mfu"], 4) if r["mfu"] else None, peak_mem_bytes=r["mem"], loss=r["loss"],
                warmup_s=round(r.get("warm_s", 0.0), 1), device=device_description(device), torch=torch.__version__,
                label=label)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--models", nargs="+", default=["gpt2", "gpt2-medium"])
    ap.add_argument("--micro-batch-size", type=int, nargs="+", default=[8, 16], help="sequences per micro-batch")
    ap.add_argument("--rows", nargs="+", type=parse_row, default=None, metavar="MODEL:MBS:KIND",
                    help="instead of --models x --micro-batch-size: these rows in this order; KIND: "
                    + ", ".join(KINDS))
    ap.add_argument("--grad-accum", type=int, default=1, help="micro-batches per step")
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=30, help="timed steps")
    ap.add_argument("--warmup", type=int, default=5, help="untimed steps first")
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--precision", default="auto", help="auto: bf16 on CUDA (the trainer's default), fp32 on CPU")
    ap.add_argument("--peak-tflops", type=float, default=None, help="override the device's dense peak")
    ap.add_argument("--profile", action="store_true", help="per trainer row: GPU time by kernel kind, 3 more steps")
    ap.add_argument("--reference", nargs="*", default=[], choices=["eager", "compile"],
                    help="also time the same model in a bare loop, eager and/or torch.compile'd")
    ap.add_argument("--compile-backend", default="inductor", choices=COMPILE_BACKENDS,
                    help="torch.compile's backend in the compiled rows (the dry GPU round's: aot_eager, no C++ "
                    "kernels)")
    ap.add_argument("--json", default=None, help="write every finished row here (rewritten after each row)")
    ap.add_argument("--kernels", default=None, help="write the profiled rows' top kernels here")
    ap.add_argument("--deadline-s", type=float, default=None, help="start no row after this many seconds")
    args = ap.parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda":
        device = torch.device("cuda", device.index or 0)  # set_device wants an index (torch 2.11)
        torch.cuda.set_device(device)  # TF32 and the rest left as the trainer leaves them
    reference = [{"eager": "bare", "compile": "bare-compile"}[r] for r in args.reference]
    specs = args.rows or [(m, b, k) for m in args.models for b in args.micro_batch_size
                          for k in ["trainer", *reference]]
    rows, profiles, records = [], [], []
    began = time.perf_counter()

    def measure(model, mbs, kind):
        fp8 = fp8_of(kind)
        if kind.startswith("bare"):
            return run_reference(model, mbs, args.seq_len, args.steps, args.warmup, device, args.peak_tflops,
                                 "compile" if "compile" in kind else "eager", fp8, args.compile_backend)
        return run_one(model, mbs, args.grad_accum, args.seq_len, args.steps, args.warmup, device, args.peak_tflops,
                       args.precision, args.profile, compile="compile" in kind, fp8=fp8,
                       compile_backend=args.compile_backend)

    for model, mbs, kind in specs:
        label = f"{model} {kind}"
        if args.deadline_s is not None and time.perf_counter() - began > args.deadline_s:
            print(f"{label} mbs {mbs}: skipped (past --deadline-s {args.deadline_s:.0f})", flush=True)
            continue
        failed = None
        try:
            r = measure(model, mbs, kind)
        except torch.OutOfMemoryError:
            failed = "OOM"
        except Exception as e:  # noqa: BLE001 - e.g. torch.compile without a compiler: report it, keep the table
            print(f"{label} mbs {mbs} failed: {type(e).__name__}: {e}", flush=True)
            failed = "failed"
        free_memory(device)  # outside the handler: a failure's traceback (and the trainer in it) is gone by now
        if failed:
            rows.append([label, "-", mbs, args.grad_accum, args.seq_len, failed, "-", "-", "-", "-", "-", "-"])
            continue
        rows.append([label, f"{r['params'] / 1e6:.0f}M", mbs, r["accum"], r["seq"], f"{r['step_ms']:.0f}",
                     f"{r['tps']:,.0f}", f"{r['tflops']:.1f}", f"{100 * r['mfu']:.1f}%" if r["mfu"] else "-",
                     f"{r['mem'] / 2**30:.1f} GiB" if r["mem"] else "-", f"{r['loss']:.3f}", f"{r['warm_s']:.0f}"])
        print(rows[-1], flush=True)
        records.append(json_row(label, kind, r, device))
        if args.json:
            write_json(args.json, records)
        if r.get("breakdown"):
            profiles.append(describe_breakdown(f"{label} mbs {mbs}", r["breakdown"]))
            print(profiles[-1], flush=True)
            if args.kernels:
                with open(args.kernels, "w") as f:
                    f.write("\n\n".join(profiles) + "\n")
    print(table(rows, ["row", "params", "micro-batch", "accum", "seq", "step ms", "tokens/s", "TFLOP/s",
                       "MFU", "peak mem", "loss", "warm-up s"]))
    for line in profiles:
        print(line)
    print(f"device: {device_description(device)}; precision {args.precision}; MFU against the dense bf16 peak")
    print(stamp("python bench/gpu_mfu.py " + " ".join(argv if argv is not None else sys.argv[1:])))
    return 0


def describe_breakdown(label: str, b: dict) -> str:
    kinds = ", ".join(f"{k} {v:.1f} ({100 * v / b['wall_ms']:.0f}%)" for k, v in sorted(b["kinds"].items(),
                                                                                     key=lambda kv: -kv[1]))
    top = "\n".join(f"  {ms:8.2f} ms {calls:5d}x  {kind:18s} {name[:110]}" for ms, calls, kind, name in b["top"])
    return (f"{label}: step {b['wall_ms']:.1f} ms wall, GPU busy {b['gpu_ms']:.1f} ms "
            f"({100 * b['gpu_ms'] / b['wall_ms']:.0f}%); ms per step by kernel kind: {kinds}\ntop kernels "
            f"(ms per step, calls per step):\n{top}")


def write_json(path: str, records: list[dict]) -> None:
    import json

    from trainer3d.fsio import write_text_atomic

    write_text_atomic(path, json.dumps(records, indent=1))


if __name__ == "__main__":
    sys.exit(main())
