"""The GPU round's parts (bench/gpu_round.sh runs this): what one lent GPU session measures, unattended.

A GPU comes to this project by chance, for about 15 minutes, so the whole measurement is prepared here and runs as
one command. Parts run in the order of their worth, each under its own time limit and all under --budget-s, and
every part rewrites $OUT/summary.md when it ends, so a round cut short still says what it found:

  part     what it runs                                                   measured (H200 2026-11-27/28, H100 11-28)
  env      nvidia-smi; torch, CUDA, NCCL, driver, DeepSpeed, torchao versions      6 s
  smoke    the default run (launch/train_gpt2.py) on CUDA, 20 steps                22 s
  paths    tiny runs, 4 at a time: fp32 GPU vs CPU losses, bf16, --compile,         90-129 s H200, 143 s H100
           --recompute selective, save -> resume, export -> --init-from-hf,
           ZeRO-1, ZeRO-3, --document-mask (flex attention), Qwen3-MoE tiny
           (grouped GEMM), DeepSeek-V3 tiny (MLA, MTP), --fp8 rowwise and tensorwise,
           --objective dpo (and --dpo-padding-free), trainer3d.engine
           (examples/grpo, 3 steps)
  fp8      llama3.1-8b's first 8 layers (d = 4096) on the bundled corpus,          169 s H100
           --compile, 60 steps of 32k tokens: bf16 against --fp8 tensorwise,
           the loss after the same steps and tokens/s
  mfu      bench/gpu_mfu.py: gpt2-medium, gpt2, llama3.2-1b in bf16, trainer3d       387 s for 12 of 13 rows (H200);
           eager and compiled against the bare compiled loop, then the trainer's     6 compiled rows 215 s (H100)
           --fp8 eager and compiled; the top kernels of each trainer row; then        4 compiled gpt2 rows 133 s
           bench/step_phases.py: a gpt2 step's host time by phase and its syncs      (H200); phases ~35 s
  big      llama3.2-3b with full recomputation on one GPU, then under ZeRO-3 with    51 s; offload 123 s at
           CPU offload (the planner's JSON): tokens/s and peak memory against the   3 steps (H200, 5th round)
           planner's estimate
  engine   bench/engine_gpu.py: trainer3d.engine's offload()/onload() (what it        not yet run (~60 s est.)
           frees, their cost, the same log-probs after) and named_weights' rate,
           llama3.2-1b bf16 under DDP, ZeRO-1, ZeRO-3
  lora     bench/lora_experts.py in bf16: one MoE layer's experts with LoRA       not yet run (~20 s est.)
           pairs through torch._grouped_mm against the per-expert loop, full
           training's grouped experts beside them

The rounds' figures are in bench/gpu_round.md; --parts skips what a round need not repeat and --mfu-rows picks the
mfu part's rows (the fourth round: env,fp8,mfu with the six compiled bf16 rows, then env,paths,fp8).
--dry runs every part on CPU at tiny sizes (tests/test_gpu_round.py runs it, so that the round cannot rot), each Python
command forked from one process that imported the trainer (bench/preloaded.py: 242 -> 161 CPU-seconds), its compiled
rows under --compile-backend aot_eager (DRY_COMPILE: no C++ kernels, which no GPU runs).
"""

from __future__ import annotations

import argparse
import concurrent.futures as cf
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)

from bench.preloaded import Preloaded  # noqa: E402
from trainer3d.fsio import write_text_atomic  # noqa: E402


class Round:
    """Runs commands under the round's deadline, logs them to $OUT/round.log, and keeps $OUT/summary.md current."""

    def __init__(self, out: str, work: str, budget_s: float, dry: bool):
        self.out, self.work, self.dry = out, work, dry
        self.deadline = time.monotonic() + budget_s
        self.rows: list[tuple[str, str, float, str]] = []  # (part, status, seconds, finding)
        self.parts = ["env", "smoke", "paths", "fp8", "mfu", "big", "engine", "lora"]
        self.mfu_rows = MFU_ROWS
        self.log_path = os.path.join(out, "round.log")
        # dry: each Python command forked from one process that imported the trainer (bench/preloaded.py)
        self.preloaded = Preloaded() if dry else None

    def left(self) -> float:
        return self.deadline - time.monotonic()

    def log(self, text: str) -> None:
        with open(self.log_path, "a") as f:
            f.write(text if text.endswith("\n") else text + "\n")

    def run(self, name: str, cmd: list[str], limit_s: float, env: dict | None = None) -> tuple[int, str]:
        """Run cmd (from the repo root) for at most min(limit_s, what the round has left); rc 124 on timeout."""
        limit = min(limit_s, self.left())
        if limit < 5:
            self.log(f"## {name}: not started, the round's time is spent")
            return 124, ""
        t0, env = time.monotonic(), {**os.environ, **(env or {})}
        if self.preloaded is not None and cmd[0] == sys.executable:
            log = os.path.join(self.work, f"{name}.{threading.get_ident()}.log")
            rc = self.preloaded.run(cmd, env, limit, log)
            with open(log, errors="replace") as f:
                text = f.read()
        else:
            try:
                p = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=limit)
                rc, text = p.returncode, p.stdout + p.stderr
            except subprocess.TimeoutExpired as e:
                rc, text = 124, (e.stdout or b"").decode(errors="replace") + (e.stderr or b"").decode(errors="replace")
        self.log(f"## {name} (rc {rc}, {time.monotonic() - t0:.0f} s): {' '.join(cmd)}\n{text[-20000:]}")
        return rc, text

    def record(self, part: str, status: str, seconds: float, finding: str) -> None:
        self.rows.append((part, status, seconds, finding))
        lines = ["| part | status | seconds | finding |", "|---|---|---|---|"]
        lines += [f"| {p} | {s} | {t:.0f} | {f} |" for p, s, t, f in self.rows]
        write_text_atomic(os.path.join(self.out, "summary.md"), "\n".join(lines) + "\n")

    # ---- training runs ------------------------------------------------------------------------------------------
    def train(self, name: str, args: list[str], limit_s: float = 240, cpu: bool = False) -> dict:
        """One launch/train_gpt2.py run in its own out dir; its metrics (step -> record) and rc."""
        out_dir = os.path.join(self.work, name)
        if not any(a == "--resume" for a in args):
            shutil.rmtree(out_dir, ignore_errors=True)
        env = {"CUDA_VISIBLE_DEVICES": ""} if cpu or self.dry else {}
        if self.dry:
            env["TRAINER3D_FP8_EMULATE"] = "1"  # --fp8 on CPU: torchao's emulation (parallel/fp8.py)
        rc, text = self.run(name, [sys.executable, "launch/train_gpt2.py", "--out-dir", out_dir, "--log-every", "1",
                                   "--eval-every", "0", *args], limit_s, env)
        steps = {}
        path = os.path.join(out_dir, "metrics.jsonl")
        if os.path.exists(path):
            with open(path) as f:
                for line in f:
                    rec = json.loads(line)
                    if "loss" in rec:
                        steps[rec["step"]] = rec
        return {"rc": rc, "steps": steps, "dir": out_dir, "text": text}


def max_diff(a: dict, b: dict, key: str = "loss", first: int = 1) -> float:
    shared = [s for s in a["steps"] if s in b["steps"] and s >= first]
    if not shared:
        return float("nan")
    return max(abs(a["steps"][s][key] - b["steps"][s][key]) for s in shared)


def ok(*runs: dict) -> bool:
    return all(r["rc"] == 0 and r["steps"] for r in runs)


def last(run: dict, key: str = "loss"):
    return run["steps"][max(run["steps"])][key] if run["steps"] else float("nan")


def failed(run: dict) -> str:
    tail = [ln for ln in run["text"].strip().splitlines() if ln.strip()][-1:] or ["no output"]
    return f"rc {run['rc']}: {tail[0][:160]}"


def median_tok_s(run: dict) -> float | None:
    """The median tokens/s of a run's steps after the second (the first ones compile and warm up)."""
    rates = sorted(rec["tokens_per_s"] for s, rec in run["steps"].items() if s > 2 and rec.get("tokens_per_s"))
    return rates[len(rates) // 2] if rates else None


def tok_s(run: dict) -> str:
    rate = median_tok_s(run)
    return f"{rate:,.0f} tok/s" if rate is not None else "- tok/s"


def tail_loss(run: dict, steps: int = 5) -> float:
    """The mean loss of a run's last `steps` logged steps."""
    last_steps = sorted(run["steps"])[-steps:]
    return sum(run["steps"][s]["loss"] for s in last_steps) / len(last_steps)


def peak_gib(run: dict) -> float:
    return max((rec.get("peak_mem_bytes") or 0) for rec in run["steps"].values()) / 2**30 if run["steps"] else 0.0


# ---- the parts ------------------------------------------------------------------------------------------------
def part_env(r: Round) -> tuple[str, str]:
    code = ("import torch, importlib.metadata as m\n"
            "print('torch', torch.__version__, 'CUDA', torch.version.cuda, 'available', torch.cuda.is_available())\n"
            "if torch.cuda.is_available():\n"
            "    p = torch.cuda.get_device_properties(0); print('device', p.name, p.total_memory // 2**20, 'MiB',"
            " p.multi_processor_count, 'SMs, capability', torch.cuda.get_device_capability(0))\n"
            "    print('NCCL', torch.cuda.nccl.version())\n"
            "for d in ('deepspeed', 'torchao', 'transformers', 'datasets', 'triton'):\n"
            "    try: print(d, m.version(d))\n"
            "    except m.PackageNotFoundError: print(d, 'absent')\n")
    rc, text = r.run("env", [sys.executable, "-c", code], 120)
    smi = r.run("nvidia-smi", ["nvidia-smi"], 30)[1] if shutil.which("nvidia-smi") else "no nvidia-smi\n"
    with open(os.path.join(r.out, "env.txt"), "w") as f:
        f.write(text + "\n" + smi)
    first = [ln for ln in text.splitlines() if ln.startswith(("torch", "device"))]
    return ("ok" if rc == 0 else f"rc {rc}"), "; ".join(first)


def part_smoke(r: Round) -> tuple[str, str]:
    return solo(r.train("smoke", ["--max-steps", "3" if r.dry else "20"], 180))


def path_runs(r: Round, n: int) -> dict:
    """Each path: a function of the shared bf16 run's future returning (status, finding)."""
    half_precision = "fp32" if r.dry else "bf16"  # CPU autocast in bf16 is ~40x slower than fp32 (2 cores)

    def flags(steps: int = n) -> list[str]:  # a constant lr after 2 warm-up steps: a run of fewer steps is a prefix
        return ["--max-steps", str(steps), "--lr", "6e-4", "--min-lr", "6e-4", "--warmup-steps", "2", "--seed", "7",
                *(["--seq-len", "64", "--global-batch", "2"] if r.dry else [])]

    common = flags()

    def vs(base, run, what):
        if not ok(run):
            return "failed", failed(run)
        b = base.result()
        return "ok", (f"{what}: max Δloss vs bf16 eager {max_diff(b, run):.2e}, Δgrad_norm "
                      f"{max_diff(b, run, 'grad_norm'):.2e} over {n} steps; {tok_s(run)}, peak {peak_gib(run):.2f} GiB")

    def fp32(base):  # (dry: the bf16 eager run is this fp32 run already, its --save-every changing nothing)
        a = base.result() if r.dry else r.train("fp32_gpu", [*common, "--precision", "fp32"])
        c = r.train("fp32_cpu", [*common, "--precision", "fp32"], cpu=True)
        if not ok(a, c):
            return "failed", failed(a if not ok(a) else c)
        return "ok", (f"fp32 GPU vs CPU: first loss {a['steps'][1]['loss']:.6f} vs {c['steps'][1]['loss']:.6f}, "
                      f"max Δloss {max_diff(a, c):.2e}, Δgrad_norm {max_diff(a, c, 'grad_norm'):.2e} over {n}")

    def resume(base):  # with FP8: 0-n straight against 0-n/2, then --resume to n
        fp8 = ["--precision", half_precision, "--fp8", "rowwise"]
        straight = rowwise()
        a = r.train("resume", [*flags(n // 2), *fp8, "--save-every", str(n // 2)])
        b = r.train("resume", [*common, *fp8, "--resume"]) if ok(a) else a
        if not ok(b, straight):
            return "failed", failed(b if not ok(b) else straight)
        later = {"steps": {s: v for s, v in b["steps"].items() if s > n // 2}}
        return "ok", (f"steps {n // 2 + 1}-{n} after resume with --fp8 rowwise: max Δloss vs the straight run "
                      f"{max_diff(straight, later):.2e}")

    def fp8_row(recipe):
        def run(base):
            run_ = rowwise() if recipe == "rowwise" else r.train(f"fp8_{recipe}", [*bf16, "--fp8", recipe])
            status, finding = vs(base, run_, f"--fp8 {recipe}")
            said = [ln.split("fp8=")[1].split(" (")[0] for ln in run_["text"].splitlines() if "fp8=" in ln]
            return status, f"{said[0] if said else 'no fp8 banner'}; {finding}"
        return run

    def init_from_hf(base):
        b = base.result()
        ckpts = sorted(os.listdir(os.path.join(b["dir"], "checkpoints"))) if ok(b) else []
        if not ckpts:
            return "failed", "the bf16 run left no checkpoint"
        hf = os.path.join(r.work, "hf")
        rc, text = r.run("export", [sys.executable, "-m", "trainer3d.export",
                                    os.path.join(b["dir"], "checkpoints", ckpts[-1]), hf], 120)
        if rc:
            return "failed", f"export rc {rc}"
        run = r.train("init_from_hf", [*flags(2), "--precision", half_precision, "--init-from-hf", hf])
        if not ok(run):
            return "failed", failed(run)
        return "ok", f"first loss {run['steps'][1]['loss']:.4f} after the bf16 run's last {last(b):.4f}"

    def dpo(base):  # --objective dpo on text pairs (the bundled GPT-2 tokenizer): its first loss is ln 2
        data = os.path.join(r.work, "pairs.jsonl")
        words = "the cat sat on a mat while dog ran fast and slow birds sing songs of old kings".split()
        with open(data, "w") as f:
            for i in range(64):
                pick = lambda k, j: " ".join(words[(i * 7 + j * 3 + m) % len(words)] for m in range(k))  # noqa: E731
                row = {"prompt": pick(6, 0), "chosen": " " + pick(4, 1), "rejected": " " + pick(5, 2)}
                f.write(json.dumps(row) + "\n")
        dpo_flags = [*flags(n), "--precision", half_precision, "--objective", "dpo", "--data-format", "preference",
                     "--data", data]
        run = r.train("dpo", [*dpo_flags, "--seq-len", "64", "--global-batch", "8"])
        if not ok(run):
            return "failed", failed(run)
        # padding-free: ~8 pairs a row of 257 tokens, each side a document (flex attention's block mask on CUDA)
        free = r.train("dpo_padding_free", [*dpo_flags, "--seq-len", "256", "--global-batch", "2", "--dpo-padding-free"])
        if not ok(free):
            return "failed", f"--dpo-padding-free: {failed(free)}"
        return "ok", (f"--objective dpo: loss {run['steps'][1]['loss']:.6f} (ln 2 = 0.693147) -> {last(run):.4f}, "
                      f"rewards/margins {last(run, 'rewards/margins'):.4f}; {tok_s(run)}; --dpo-padding-free: loss "
                      f"{free['steps'][1]['loss']:.6f} -> {last(free):.4f}, {last(free, 'pairs'):.0f} pairs a step; "
                      f"{tok_s(free)}")

    def engine(base):  # the GRPO example: the engine on this device, its rollouts in a CPU process of transformers
        out, env = os.path.join(r.work, "grpo"), {"CUDA_VISIBLE_DEVICES": ""} if r.dry else None
        sft = [sys.executable, "examples/grpo/sft.py", "--steps", "10", "--rows", "500", "--out-dir", f"{out}_sft"]
        rc, text = r.run("grpo_sft", sft, 120, env)  # (its start model, briefly: this path checks the engine only)
        cmd = [sys.executable, "examples/grpo/grpo.py", "--model", f"{out}_sft/hf", "--steps", "3", "--prompts", "4",
               "--group", "4", "--minibatches", "2", "--out-dir", out]
        if not rc:
            rc, text = r.run("grpo", cmd, 180, env)
        path = os.path.join(out, "grpo.jsonl")
        if rc or not os.path.exists(path):
            return "failed", f"rc {rc}: {(text.strip().splitlines() or ['no output'])[-1][:160]}"
        recs = [json.loads(line) for line in open(path)]
        return "ok", (f"trainer3d.engine (examples/grpo): step 1's KL between the engine's log-probs and transformers' "
                      f"of the streamed weights {recs[0]['kl']:.2e}; rewards {[round(x['reward'], 3) for x in recs]}")

    bf16 = [*common, "--precision", half_precision]
    compiled = ["--compile", *DRY_COMPILE] if r.dry else ["--compile"]
    rowwise = once(lambda: r.train("fp8_rowwise", [*bf16, "--fp8", "rowwise"]))  # the resume path's straight run too
    paths = {
        "fp32 GPU vs CPU": fp32,
        "compile": lambda base: vs(base, r.train("compile", [*bf16, *compiled]), "--compile"),
        "recompute": lambda base: vs(base, r.train("recompute", [*bf16, "--recompute", "selective"]),
                                     "--recompute selective"),
        "save -> resume": resume,
        "export -> init-from-hf": init_from_hf,
        "ZeRO-1": lambda base: vs(base, r.train("zero1", [*bf16, "--deepspeed_config", "ds_configs/zero1.json"]),
                                  "ZeRO-1 (bf16 weights, DeepSpeed's mixed precision)"),
        "ZeRO-3": lambda base: vs(base, r.train("zero3", [*bf16, "--deepspeed_config", "ds_configs/zero3.json"]),
                                  "ZeRO-3 (bf16 weights)"),
        "document mask (flex)": lambda base: solo(r.train("docmask", [*bf16, "--model", "llama-tiny",
                                                                     "--document-mask"])),
        "Qwen3-MoE tiny": lambda base: solo(r.train("moe", [*bf16, "--model", "qwen3-moe-tiny"])),
        "DeepSeek-V3 tiny": lambda base: solo(r.train("deepseek", [*bf16, "--model", "deepseek-v3-tiny"])),
        "fp8 rowwise": fp8_row("rowwise"),
        "fp8 tensorwise": fp8_row("tensorwise"),
        "DPO": dpo,
        "engine (GRPO)": engine,
    }
    return {"bf16": bf16, "paths": paths}


def once(fn):
    """fn's result, computed by the first caller; a concurrent caller waits for it (two paths share a run)."""
    lock, box = threading.Lock(), []

    def get():
        with lock:
            if not box:
                box.append(fn())
        return box[0]
    return get


def solo(run: dict) -> tuple[str, str]:
    if not ok(run):
        return "failed", failed(run)
    return "ok", f"loss {run['steps'][1]['loss']:.3f} -> {last(run):.3f}, {tok_s(run)}, peak {peak_gib(run):.2f} GiB"


def part_paths(r: Round) -> None:
    n = 4 if r.dry else 10
    spec = path_runs(r, n)
    t0 = time.monotonic()
    with cf.ThreadPoolExecutor(max_workers=2 if r.dry else 4) as pool:
        base = pool.submit(r.train, "bf16", [*spec["bf16"], "--save-every", str(n)])
        futures = {pool.submit(fn, base): name for name, fn in spec["paths"].items()}
        b = base.result()
        r.record("paths: bf16 eager", "ok" if ok(b) else "failed", time.monotonic() - t0,
                 solo(b)[1] if ok(b) else failed(b))
        for fut in cf.as_completed(futures):
            try:
                status, finding = fut.result()
            except Exception as e:  # noqa: BLE001 - one path's bug must not cost the others
                status, finding = "error", f"{type(e).__name__}: {e}"
            r.record(f"paths: {futures[fut]}", status, time.monotonic() - t0, finding)


def part_fp8(r: Round) -> tuple[str, str]:
    """FP8 tensorwise against bf16 on the bundled corpus at d = 4096 (llama3.1-8b's first 8 layers, --compile): the
    loss after the same steps (issue 45's 1%) and tokens/s (its 1.2x), where the MFU rows use random tokens."""
    n = 4 if r.dry else 60
    model = ["--model", "llama-tiny", "--seq-len", "64", "--global-batch", "4", "--micro-batches", "2",
             "--precision", "fp32"] if r.dry else \
        ["--model", "llama3.1-8b", "--n-layer", "8", "--seq-len", "1024", "--global-batch", "32", "--micro-batches",
         "4", "--precision", "bf16", "--compile"]  # compiling on 2 CPU cores costs more than the dry test may spend
    # lr 3e-4 after 5 warm-up steps spiked both runs' loss to 25-40 on an H100 (2026-11-28): chaos, not FP8, decided
    common = [*model, "--max-steps", str(n), "--lr", "1e-4", "--min-lr", "1e-4", "--warmup-steps", "20", "--seed", "7",
              "--no-final-save"]
    base = r.train("fp8_base", common, 240)
    fp8 = r.train("fp8_tensorwise", [*common, "--fp8", "tensorwise"], 240) if ok(base) else base
    if not ok(base, fp8):
        return "failed", failed(fp8 if ok(base) else base)
    change = 100 * (tail_loss(fp8) / tail_loss(base) - 1)
    rate_base, rate_fp8 = median_tok_s(base), median_tok_s(fp8)
    speed = f"{rate_fp8 / rate_base:.2f}x" if rate_base and rate_fp8 else "-"
    return "ok", (f"{' '.join(model[1:2] if r.dry else model[1:4])}, {n} steps: mean loss of the last steps "
                  f"{tail_loss(base):.4f} -> {tail_loss(fp8):.4f} with --fp8 tensorwise ({change:+.3f}%); "
                  f"{tok_s(base)} -> {tok_s(fp8)} ({speed}); peak {peak_gib(base):.1f} -> {peak_gib(fp8):.1f} GiB")


MFU_ROWS = ["gpt2-medium:16:trainer", "gpt2-medium:16:bare-compile", "gpt2-medium:16:trainer-fp8-rowwise",
            "gpt2-medium:16:trainer-compile", "llama3.2-1b:8:trainer", "llama3.2-1b:8:trainer-fp8-rowwise",
            "gpt2:16:trainer", "gpt2:16:bare-compile", "llama3.2-1b:8:trainer-compile-fp8-rowwise",
            "gpt2-medium:16:trainer-compile-fp8-rowwise", "llama3.2-1b:8:bare-compile", "gpt2:16:trainer-compile",
            "gpt2-medium:16:bare-compile-fp8-rowwise"]  # worth first; FP8's compile took ~2 minutes
# dry: --compile's graphs run by AOT autograd's eager kernels; a GPU's kernels are Triton's, so the C++ kernels inductor
# would build on the CPU (~1 CPU-second each, ~70 CPU-seconds for the dry round's 31) test nothing the GPU runs.
# tests/test_compile.py holds inductor's CPU kernels to the eager run.
DRY_COMPILE = ["--compile-backend", "aot_eager"]
MFU_DRY = ["tiny:2:trainer", "tiny:2:trainer-compile", "tiny:2:bare-compile", "tiny:2:bare-fp8-rowwise",
           "tiny:2:trainer-fp8-rowwise"]


def part_mfu(r: Round) -> tuple[str, str]:
    limit = max(30.0, r.left() - ((20 if r.dry else 120) if "big" in r.parts else 0))  # leave the big part its start
    sizes = ["--seq-len", "64", "--steps", "2", "--warmup", "1", "--device", "cpu", "--peak-tflops", "1",
             *DRY_COMPILE] if r.dry \
        else ["--steps", "20", "--warmup", "3"]
    rows = MFU_DRY if r.dry else r.mfu_rows
    cmd = [sys.executable, "bench/gpu_mfu.py", "--rows", *rows, *sizes, "--profile",
           "--json", os.path.join(r.out, "gpu_mfu.json"), "--kernels", os.path.join(r.out, "kernels.txt"),
           "--deadline-s", str(max(0.0, limit - (10 if r.dry else 60)))]
    rc, text = r.run("mfu", cmd, limit, {"CUDA_VISIBLE_DEVICES": "", "TRAINER3D_FP8_EMULATE": "1"} if r.dry else None)
    with open(os.path.join(r.out, "mfu.txt"), "w") as f:
        f.write(text)
    path = os.path.join(r.out, "gpu_mfu.json")
    done = json.load(open(path)) if os.path.exists(path) else []
    found = ", ".join(f"{x['label']} {100 * x['mfu']:.1f}%" if x["mfu"] else x["label"] for x in done)
    # where the trainer's host time goes, and what synchronizes its step (bench/step_phases.py)
    phases = ["--model", "tiny", "--micro-batch-size", "2", "--seq-len", "64", "--steps", "2"] if r.dry \
        else ["--model", "gpt2", "--micro-batch-size", "16", "--compile"]
    prc, text = r.run("mfu: step phases", [sys.executable, "bench/step_phases.py", *phases], 90,
                      {"CUDA_VISIBLE_DEVICES": ""} if r.dry else None)
    with open(os.path.join(r.out, "phases.txt"), "w") as f:
        f.write(text)
    step = next((ln.split("|")[2].strip() for ln in text.splitlines() if ln.startswith("| the step ")), None)
    found += f"; step phases: {f'a {step} ms step' if prc == 0 and step else f'rc {prc}'} (phases.txt)"
    return ("ok" if rc == 0 else f"rc {rc}"), f"{len(done)}/{len(rows)} rows: {found}"


def planner_gib(r: Round, model: str, seq: int, batch: int, layout: str) -> str:
    """The planner's GiB per GPU for this layout on this device (python -m trainer3d.plan --evaluate)."""
    import torch

    gib = "139" if r.dry else f"{torch.cuda.get_device_properties(0).total_memory / 2**30:.0f}" \
        if torch.cuda.is_available() else "80"
    rc, text = r.run("plan", [sys.executable, "-m", "trainer3d.plan", "--model", model, "--nodes", "1",
                              "--gpus-per-node", "1", "--gpu-memory-gib", gib, "--peak-tflops", "989",
                              "--seq-len", str(seq), "--global-batch", str(batch), "--vocab", "50257",
                              "--precision", "bf16", "--top", "1", "--evaluate", layout], 60,
                     {"CUDA_VISIBLE_DEVICES": ""})
    rows = text.split("\nevaluated:")[1].splitlines() if "\nevaluated:" in text else []
    row = next((ln for ln in rows if ln.startswith("1 ")), "")
    return next((t for t in row.split() if t.replace(".", "", 1).isdigit() and "." in t), "?")  # GiB/GPU


def part_big(r: Round) -> None:
    model, seq, batch = ("llama-tiny", 128, 8) if r.dry else ("llama3.2-3b", 2048, 8)
    args = ["--model", model, "--seq-len", str(seq), "--global-batch", str(batch), "--micro-batches", str(batch),
            "--recompute", "full", "--precision", "fp32" if r.dry else "bf16", "--no-final-save"]
    # offload: ~8 s a step on the H200, its first (DeepSpeedCPUAdam's build) ~12 s more: 3 steps. It runs the
    # DeepSpeed JSON the planner writes for that layout (what --layout auto runs: ZeRO-3's live parameters bounded to
    # two blocks), so that the peak is measured against the estimate of the same configuration; the first and fifth
    # rounds ran ds_configs/zero3_offload.json (DeepSpeed's 1e9 live parameters) and found 3x the estimate
    from trainer3d.config import TrainConfig
    from trainer3d.plan.report import deepspeed_config

    planned = os.path.join(r.work, "zero3_offload_planned.json")
    with open(planned, "w") as f:
        json.dump(deepspeed_config(3, True, True, 1, batch, 1, TrainConfig(model=model).model_config(50257),
                                   "fp32" if r.dry else "bf16-mixed"), f)
    for name, run_name, extra, steps, layout in [
        ("big: recompute full", "recompute_full", [], 5, "tp=1,pp=1,mbs=1,zero=0,recompute=1"),
        # LoRA rank 16 on all-linear, the same run otherwise: its speed and peak beside full training's (issue 73)
        ("big: LoRA r16, recompute full", "lora", ["--lora-rank", "16", "--lora-alpha", "32"], 5,
         "tp=1,pp=1,mbs=1,zero=0,recompute=1,lora=16"),
        ("big: ZeRO-3 + CPU offload (the planner's JSON)", "zero3_offload", ["--deepspeed_config", planned], 3,
         "tp=1,pp=1,mbs=1,zero=3,offload=all,recompute=1"),
    ]:
        t0 = time.monotonic()
        if r.left() < 45:
            r.record(name, "skipped", 0, "the round's time is spent")
            continue
        run = r.train(run_name, [*args, "--max-steps", str(3 if r.dry else steps), *extra], r.left())
        if not ok(run):
            r.record(name, "failed", time.monotonic() - t0, failed(run))
            continue
        r.record(name, "ok", time.monotonic() - t0,
                 f"{model} seq {seq} batch {batch}: {tok_s(run)}, peak {peak_gib(run):.1f} GiB measured vs "
                 f"{planner_gib(r, model, seq, batch, layout)} GiB planned; loss {last(run):.3f}")


def part_engine(r: Round) -> tuple[str, str]:
    """trainer3d.engine as a colocated RL trainer (bench/engine_gpu.py): what offload() frees, onload's cost, the
    weight stream's rate, at DDP, ZeRO-1 and ZeRO-3 (llama3.2-1b in bf16)."""
    rc, output = r.run("engine", [sys.executable, "bench/engine_gpu.py", *(["--dry"] if r.dry else [])], 180)
    rows = [line for line in output.splitlines() if line.startswith(("| ddp", "| zero"))]
    if rc != 0 or not rows:
        return "failed", output.strip().splitlines()[-1] if output.strip() else f"exit {rc}"
    cells = [[c.strip() for c in row.strip("|").split("|")] for row in rows]
    return "ok", "; ".join(f"{c[0]}: offload frees {c[2]} (driver {c[3]}) in {c[4]} s, same log-probs {c[5]}, "
                           f"stream {c[7]} GB/s on device, {c[8]} to host" for c in cells)


def part_lora(r: Round) -> tuple[str, str]:
    """The experts' LoRA pairs on the GPU (bench/lora_experts.py): grouped against the loop, in bf16 (sm90/sm100:
    torch._grouped_mm's fast path); the dry run at a tiny size in fp32."""
    sizes = ["--experts", "4", "--hidden", "64", "--expert-hidden", "32", "--rows", "256", "--rounds", "1"]
    rc, output = r.run("lora", [sys.executable, "bench/lora_experts.py", *(sizes if r.dry else ["--dtype", "bf16"])],
                       90)
    rows = [[c.strip() for c in line.strip("|").split("|")] for line in output.splitlines()
            if line.startswith(("| full", "| LoRA"))]
    if rc != 0 or len(rows) != 3:
        return "failed", output.strip().splitlines()[-1] if output.strip() else f"exit {rc}"
    return "ok", "; ".join(f"{c[0]}: {c[1]} ms, {c[2]}x the loop's" for c in rows)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", default=os.environ.get("OUT") or os.path.join(ROOT, "bench", "results", "gpu_round"))
    ap.add_argument("--budget-s", type=float, default=450, help="the whole round's wall time")
    ap.add_argument("--parts", default="env,smoke,paths,fp8,mfu,big,engine,lora",
                    help="which parts, comma-separated (a later round may skip what an earlier one measured)")
    ap.add_argument("--dry", action="store_true", default=os.environ.get("GPU_ROUND_DRY") == "1",
                    help="every part on CPU at tiny sizes (GPU_ROUND_DRY=1)")
    ap.add_argument("--mfu-rows", nargs="+", default=MFU_ROWS, metavar="MODEL:MBS:KIND",
                    help="the mfu part's rows (bench/gpu_mfu.py --rows), in the order they run")
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    work = tempfile.mkdtemp(prefix="gpu_round_")
    r = Round(args.out, work, args.budget_s, args.dry)
    r.parts, r.mfu_rows = args.parts.split(","), args.mfu_rows
    r.log(f"# GPU round {'(dry, CPU)' if args.dry else ''} {time.strftime('%Y-%m-%d %H:%M:%S UTC', time.gmtime())}")
    for name, fn in [("env", part_env), ("smoke", part_smoke), ("paths", part_paths), ("fp8", part_fp8),
                     ("mfu", part_mfu), ("big", part_big), ("engine", part_engine), ("lora", part_lora)]:
        if name not in r.parts:
            continue
        t0 = time.monotonic()
        try:
            res = fn(r)
        except Exception as e:  # noqa: BLE001 - a part's bug is a finding, the round goes on
            res = ("error", f"{type(e).__name__}: {e}")
        if res is not None:
            r.record(name, res[0], time.monotonic() - t0, res[1])
        print(f"[gpu_round] {name} done after {args.budget_s - r.left():.0f} s", flush=True)
    shutil.rmtree(work, ignore_errors=True)
    print(open(os.path.join(args.out, "summary.md")).read())
    return 0


if __name__ == "__main__":
    sys.exit(main())
