"""LoRA against full fine-tuning, and against TRL + PEFT (issue 73): memory per rank read from outside the processes,
the planner's figure beside each, and speed, as ratios within one run, on CPU in fp32.

The same model and data for every side: a random Llama (tests/test_llama.hf_llama at the size below) with the tests'
chat tokenizer and ChatML template (tests/helpers/chat_data, tests/test_sft_trl.CHATML), N conversations, the whole set in
each step's batch, unpacked (one conversation a row), constant lr, AdamW, clip 1.0. LoRA: rank 16, α 32, all-linear.
Sides, each a process (or a torchrun world) of its own, one after the other:
  - trainer3d full SFT and trainer3d LoRA SFT, at 1 process and at dp 2 under ZeRO-3 (ds_configs/zero3.json);
  - TRL's SFTTrainer with peft_config (LoRA, the same rank, α and targets), and without, at 1 process.
Memory: every process of a side is read every 20 ms from here (/proc/<pid>/status VmHWM, the kernel's high-water mark,
so no peak between two reads is missed); a torchrun world's ranks are its children (a rank's own forks, which share its
pages, are not counted).
The planner's figure (plan/memory.estimate_memory, fp32, the side's layout) is its model states (parameters, gradients,
AdamW state) and its peak, which adds activations; the bench compares the drop from full to LoRA, measured and
planned, since a process's own footprint (torch, the interpreter: ~0.4 GiB) is in neither of the planner's figures.
Speed: median step time of the steps after the first `--skip`; tokens/s counts the set's real tokens.
Then the planner alone for Llama 3.1 8B and 70B on 8 and 16 H100s: GiB per GPU, full against LoRA.

    python bench/lora.py                  # the bench/lora.md tables (~5 min)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT, os.path.join(ROOT, "tests")]

from bench.harness import stamp, table  # noqa: E402

RANK, ALPHA, LR, N = 16, 32.0, 1e-3, 8
SIZE = dict(hidden_size=512, intermediate_size=1536, num_hidden_layers=8, num_attention_heads=8, num_key_value_heads=4)


def run_measured(cmd: list[str], log: Path) -> dict:
    """Run `cmd`; its wall time and the VmHWM of each rank (the process itself, or torchrun's children; not a rank's
    own forks, which share its pages), read from here every 20 ms."""
    import psutil

    env = {k: v for k, v in os.environ.items() if not k.startswith(("WANDB_", "TRAINER3D_"))}
    env.update(OMP_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    t0, peaks = time.perf_counter(), {}
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                ranks = root.children() if "torch.distributed.run" in cmd else [root]
                for p in ranks:
                        with open(f"/proc/{p.pid}/status") as f:
                            hwm = next((int(x.split()[1]) * 1024 for x in f if x.startswith("VmHWM")), 0)
                        peaks[p.pid] = max(peaks.get(p.pid, 0), hwm)
            except (OSError, psutil.Error):
                pass
            time.sleep(0.02)
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed:\n{log.read_text()[-3000:]}")
    return {"wall_s": time.perf_counter() - t0, "peaks": sorted(peaks.values(), reverse=True)}


def trainer3d_side(work: Path, name: str, seq: int, steps: int, lora: bool, zero: bool) -> dict:
    from test_sft_trl import t3d_argv

    out = work / name
    flags = ["--lr", str(LR), "--min-lr", str(LR), "--no-final-save", "--max-steps", str(steps)]
    flags += ["--lora-rank", str(RANK), "--lora-alpha", str(ALPHA)] if lora else []
    flags += ["--deepspeed_config", "ds_configs/zero3.json"] if zero else []
    argv = t3d_argv(work / "hf", work / "chat.jsonl", work / "chatml.jinja", seq, N, False, flags, out)
    launch = [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "launch/train.py"] if zero \
        else [sys.executable, "launch/train.py"]
    measured = run_measured(launch + argv, work / f"{name}.log")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "step_time_s" in r]
    return {**measured, "step_s": [r["step_time_s"] for r in rows], "loss": [r["loss"] for r in rows]}


def trl_side(work: Path, seq: int, steps: int, lora: bool) -> dict:
    out = work / f"trl-{int(lora)}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", str(work), str(seq), str(steps), str(int(lora))]
    measured = run_measured(cmd, work / f"trl-{int(lora)}.log")
    return {**measured, **json.loads(out.read_text())}


def trl_child(work: Path, seq: int, steps: int, lora: bool) -> None:
    """TRL's SFTTrainer (with `lora`, and peft_config: the bench's rank, α and targets), test_sft_trl's settings."""
    import datasets
    import peft
    import torch
    import transformers
    import trl
    from helpers.chat_data import conversations

    torch.set_num_threads(1)
    tok = transformers.AutoTokenizer.from_pretrained(work / "hf")
    args = trl.SFTConfig(
        output_dir=str(work / "trl"), assistant_only_loss=True, packing=False,
        chat_template_path=str(work / "chatml.jinja"), max_length=seq + 1, per_device_train_batch_size=N,
        max_steps=steps, learning_rate=LR, lr_scheduler_type="constant", warmup_steps=0, weight_decay=0.0,
        max_grad_norm=1.0, adam_beta2=0.999, logging_steps=1, report_to="none", save_strategy="no", use_cpu=True,
        disable_tqdm=True)
    data = datasets.Dataset.from_list([{"messages": m} for m in conversations(N, seed=6)])
    ends = []

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            ends.append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            ends.append(time.perf_counter())

    trainer = trl.SFTTrainer(model=transformers.AutoModelForCausalLM.from_pretrained(work / "hf"), args=args,
                             train_dataset=data, processing_class=tok, callbacks=[Timer()],
                             peft_config=peft.LoraConfig(r=RANK, lora_alpha=ALPHA, target_modules="all-linear")
                             if lora else None)
    trainer.train()
    loss = [h["loss"] for h in trainer.state.log_history if "loss" in h]
    (work / f"trl-{int(lora)}.json").write_text(json.dumps({"step_s": [b - a for a, b in zip(ends, ends[1:])], "loss": loss}))


def planned(cfg, dp: int, zero: int, lora: bool) -> tuple[float, float]:
    """The planner's (model states, peak) in bytes for a side's layout, fp32."""
    from trainer3d.parallel.lora import LoRASpec
    from trainer3d.plan.candidate import Candidate
    from trainer3d.plan.memory import estimate_memory

    cand = Candidate(cfg, dp=dp, zero_stage=zero, precision="fp32", micro_batches=1, micro_batch_size=N // dp,
                     seq_len=SEQ[0], lora=LoRASpec(RANK, ALPHA) if lora else None)
    e = estimate_memory(cand, 0)
    return e.model_states, e.peak


SEQ = [0]  # the run's --seq-len, once known


def planner_rows() -> list[list]:
    from trainer3d.models import MODEL_PRESETS
    from trainer3d.parallel.lora import LoRASpec
    from trainer3d.plan.candidate import Candidate, trainable_params
    from trainer3d.plan.memory import estimate_memory

    rows = []
    for model, layouts in (("llama3.1-8b", ((8, 1, 3), (1, 8, 0))), ("llama3.1-70b", ((16, 1, 3), (2, 8, 3)))):
        cfg = MODEL_PRESETS[model]
        for dp, tp, zero in layouts:
            kw = dict(dp=dp, tp=tp, zero_stage=zero, precision="bf16-mixed" if zero else "bf16-autocast",
                      seq_len=4096, micro_batches=8, micro_batch_size=1, recompute=True, sequence_parallel=tp > 1)
            full, lora = (estimate_memory(Candidate(cfg, lora=spec, **kw), 0) for spec in (None, LoRASpec(RANK, ALPHA)))
            cand = Candidate(cfg, lora=LoRASpec(RANK, ALPHA), **kw)
            rows.append([model, f"dp{dp} tp{tp} {'ZeRO-3' if zero else 'DDP'}",
                         f"{trainable_params(cand, cand.stages(0)) / 1e6:.1f}M", f"{full.model_states / 2**30:.1f}",
                         f"{lora.model_states / 2**30:.1f}", f"{full.peak / 2**30:.1f}", f"{lora.peak / 2**30:.1f}",
                         f"{lora.peak / full.peak:.2f}"])
    return rows


def main(argv=None) -> int:
    if argv is None and len(sys.argv) > 1 and sys.argv[1] == "--child":
        trl_child(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), bool(int(sys.argv[5])))
        return 0
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--skip", type=int, default=2)
    ap.add_argument("--out", default=os.path.join(ROOT, "bench", "results", "lora.json"))
    args = ap.parse_args(argv)

    import transformers
    from helpers.chat_data import chat_tokenizer, conversations
    from test_llama import hf_llama
    from test_sft_trl import CHATML, rendered, shapes
    from trainer3d.checkpoint.hf_init import hf_model_config

    work = Path(tempfile.mkdtemp(prefix="lora-bench-"))
    hf_llama(seed=5, **SIZE).save_pretrained(work / "hf")
    chat_tokenizer(work / "hf")
    (work / "chat.jsonl").write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(N, seed=6)))
    (work / "chatml.jinja").write_text(CHATML)
    convs = rendered(transformers.AutoTokenizer.from_pretrained(work / "hf"), CHATML)
    seq, _ = shapes([n for n, _ in convs], False)
    seq += seq % 2
    SEQ[0] = seq
    tokens = sum(n for n, _ in convs)
    cfg = hf_model_config(work / "hf")

    sides = {"trainer3d full, 1 process": lambda: trainer3d_side(work, "full", seq, args.steps, False, False),
             "trainer3d LoRA, 1 process": lambda: trainer3d_side(work, "lora", seq, args.steps, True, False),
             "TRL + PEFT LoRA, 1 process": lambda: trl_side(work, seq, args.steps, True),
             "TRL full, 1 process": lambda: trl_side(work, seq, args.steps, False),
             "trainer3d full, dp2 ZeRO-3": lambda: trainer3d_side(work, "full-z3", seq, args.steps, False, True),
             "trainer3d LoRA, dp2 ZeRO-3": lambda: trainer3d_side(work, "lora-z3", seq, args.steps, True, True)}
    results = {name: run() for name, run in sides.items()}
    layout = {"trainer3d full, 1 process": (1, 0, False), "trainer3d LoRA, 1 process": (1, 0, True),
              "TRL + PEFT LoRA, 1 process": (1, 0, True), "TRL full, 1 process": (1, 0, False),
              "trainer3d full, dp2 ZeRO-3": (2, 3, False),
              "trainer3d LoRA, dp2 ZeRO-3": (2, 3, True)}
    gib = 2**30
    rows = []
    for name, r in results.items():
        step = statistics.median(r["step_s"][args.skip:])
        states, peak = planned(cfg, *layout[name])
        rows.append([name, " / ".join(f"{p / gib:.2f}" for p in r["peaks"]), f"{states / gib:.3f}",
                     f"{peak / gib:.3f}", f"{step * 1e3:.0f}", f"{tokens / step:,.0f}",
                     f"{r['loss'][0]:.4f} / {r['loss'][-1]:.4f}"])
    print(table(rows, ["side", "peak RSS per rank, GiB (outside)", "planner: model states GiB", "planner: peak GiB",
                       "step ms (median)", "tokens/s", "loss first / last"]))
    med = {n: statistics.median(r["step_s"][args.skip:]) for n, r in results.items()}
    drops = []
    for where, full, lora in (("1 process", "trainer3d full, 1 process", "trainer3d LoRA, 1 process"),
                              ("dp2 ZeRO-3", "trainer3d full, dp2 ZeRO-3", "trainer3d LoRA, dp2 ZeRO-3")):
        measured = max(results[full]["peaks"]) - max(results[lora]["peaks"])
        plan = planned(cfg, *layout[full])[1] - planned(cfg, *layout[lora])[1]
        drops.append([where, f"{measured / gib:.3f}", f"{plan / gib:.3f}", f"{measured / plan:.2f}",
                      f"{med[full] / med[lora]:.2f}"])
    print(table(drops, ["full -> LoRA", "peak drop measured GiB", "planner's peak drop GiB", "measured / planned",
                        "LoRA speed-up (full step / LoRA step)"]))
    peak = {n: max(r["peaks"]) for n, r in results.items()}
    print(table([[kind, f"{med[f'trainer3d {kind}, 1 process'] / med[f'{trl} {kind}, 1 process']:.2f}",
                  f"{peak[f'trainer3d {kind}, 1 process'] / peak[f'{trl} {kind}, 1 process']:.2f}",
                  f"{(peak[f'trainer3d {kind}, 1 process'] - peak[f'{trl} {kind}, 1 process']) / gib:.2f}"]
                 for kind, trl in (("full", "TRL"), ("LoRA", "TRL + PEFT"))],
                ["1 process", "trainer3d / TRL step time", "trainer3d / TRL peak RSS", "peak RSS difference GiB"]))
    print(table(planner_rows(), ["model", "layout (seq 4096, mbs 1, recompute)", "adapters a GPU",
                                 "full: model states GiB/GPU", "LoRA: model states", "full: peak GiB/GPU",
                                 "LoRA: peak", "LoRA / full peak"]))
    print(stamp("python bench/lora.py"))
    Path(args.out).write_text(json.dumps({"seq_len": seq, "tokens": tokens, "results": results}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
