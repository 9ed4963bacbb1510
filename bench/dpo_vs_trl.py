"""DPO: trainer3d's `--objective dpo --data-format preference` against TRL 1.16's DPOTrainer, one process each, on CPU,
fp32, one thread: step time, pairs/s and tokens/s, and the peak resident memory of each process, as ratios within
one run.

The same model and data for every side: a random Llama (tests/test_llama.hf_llama at the sizes below) with the tests'
chat tokenizer (tests/helpers/chat_data.chat_tokenizer: byte-level BPE, 392 tokens, a ChatML-like template), saved as a
Hugging Face directory; conversational pairs of words from chat_data.WORDS (tests/helpers/trl_dpo_reference.preference_rows's
shape, longer: a user turn, one assistant turn a side). The same settings: the same pairs a step (trainer3d's
--global-batch counts rows, two a pair), the same steps, a constant lr, AdamW (0.9/0.999, eps 1e-8, no weight decay),
clip 1.0, β 0.1, the sigmoid loss, the reference = the initial weights, no activation checkpointing, no checkpoint at
the end. TRL: per_device_train_batch_size = the pairs a step, gradient_accumulation_steps 1, bf16 False, report_to
none, no truncation: tests/helpers/trl_dpo_reference._config, the settings tests/test_dpo.py checks trainer3d against.

Three sides, each run in a process of its own, one after the other:
- trainer3d: `python launch/train.py --init-from-hf ... --objective dpo --data-format preference` (the reference
  log-probs scored once before step 1, trainer3d/train/dpo.py);
- TRL: this file with `--child trl`: DPOTrainer as TRL runs it by default (ref_model=None: a second copy of the model
  loaded, and its forward on every batch);
- TRL with precompute_ref_log_probs=True: TRL's own way of doing what trainer3d does (the reference scored over the
  set in the trainer's __init__, no reference model kept), to tell the cost of the reference forward from the rest.
`--rounds 2` (default) runs them in the listed order, then in reverse, so that a drift of the machine's load hits all
alike; the table pools the rounds. One thread in every process (OMP_NUM_THREADS=1, and torch.set_num_threads(1) in
TRL's child): the machine has 2 cores shared with other users.

Steps: the first `--skip` are left out (start-up: allocator, first-touch pages); the median of the rest. trainer3d:
`step_time_s` of metrics.jsonl (the loader's batch and `train_step`); TRL: from one step's end to the next's (a
TrainerCallback's on_step_end: the dataloader's batch and collation, training_step, clip, optimizer step, zero_grad,
the step's log), on_step_begin -> on_step_end beside it in the json. Set-up (imports, tokenization, loading, scoring
the reference) is in the process's wall time only.

Memory, read from outside every 20 ms (/proc/<pid>/status): the peak resident set is the kernel's high-water mark
VmHWM (exact: no peak between two reads is missed); "before step 1" is VmRSS when the process's log first shows the
line it prints just before step 1 (trainer3d's banner "rank 0 memory", TRL's callback's on_step_begin), so up to one
read late; the json has TRL's value read inside too. No side starts a long-lived child process (listed in the json).

The sides pad differently: trainer3d's rows are --seq-len + 1 tokens (the bench sets --seq-len to the longest pair - 1,
so no pair is cut), TRL pads each batch to its longest row ("row width as run"). tokens/s counts real tokens only (a
pair's two rows, prompt + completion each): pairs/s × the set's mean tokens a pair, the same numerator for all. The
trainers shuffle the pairs differently (trainer3d's loader and TRL's sampler), so the losses after step 1 differ; at
step 1 policy = reference and every loss is ln 2, which the bench checks.

    python bench/dpo_vs_trl.py                        # the bench/dpo_vs_trl.md table (~4 min)
    python bench/dpo_vs_trl.py --rounds 1 --sides trainer3d trl
    python bench/dpo_vs_trl.py --prompt-words 4 64 --completion-words 2 44    # lengths spread out: more padding
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import os
import random
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
for _p in (ROOT, os.path.join(ROOT, "tests")):
    if _p not in sys.path:
        sys.path.insert(0, _p)
os.environ.setdefault("OMP_NUM_THREADS", "1")

RESULTS = os.path.join(ROOT, "bench", "results", "dpo_vs_trl.json")
LR, BETA = 1e-3, 0.1
TRL_MARKER = "[bench] step 1 begins"


# ---- the model and the pairs ------------------------------------------------------------------------------------
def make_model(directory: Path, hidden: int, layers: int, heads: int, kv_heads: int, ffn: int) -> dict:
    """The tests' chat tokenizer and a random Llama of these sizes (fp32) in `directory`."""
    from helpers.chat_data import chat_tokenizer
    from test_llama import hf_llama

    vocab = chat_tokenizer(directory)
    model = hf_llama(seed=5, vocab_size=vocab, hidden_size=hidden, num_hidden_layers=layers,
                     num_attention_heads=heads, num_key_value_heads=kv_heads, intermediate_size=ffn)
    model.save_pretrained(directory)
    return {"vocab": vocab, "params": sum(p.numel() for p in model.parameters()), "hidden": hidden, "layers": layers,
            "heads": heads, "kv_heads": kv_heads, "ffn": ffn}


def make_pairs(n: int, seed: int = 0, prompt=(48, 64), completion=(28, 44)) -> list[dict]:
    """n conversational pairs (tests/helpers/trl_dpo_reference.preference_rows's shape, longer): a user turn of `prompt` words
    (a system turn first in ~30%), one assistant turn of `completion` words a side, chosen != rejected."""
    from helpers.chat_data import WORDS

    rng, rows = random.Random(seed), []

    def words(lo, hi):
        return " ".join(rng.choices(WORDS, k=rng.randint(lo, hi)))

    while len(rows) < n:
        system = [{"role": "system", "content": "Be brief."}] if rng.random() < 0.3 else []
        chosen, rejected = words(*completion), words(*completion)
        if chosen != rejected:
            rows.append({"prompt": system + [{"role": "user", "content": words(*prompt)}],
                         "chosen": [{"role": "assistant", "content": chosen}],
                         "rejected": [{"role": "assistant", "content": rejected}]})
    return rows


def pair_lengths(model_dir: Path, rows: list[dict]) -> list[tuple[int, int, int]]:
    """(prompt, chosen, rejected) tokens of each pair, as both sides tokenize them (tests/test_dpo.py checks that
    trainer3d's encode_pair gives TRL's tokens)."""
    from trainer3d.data.preference import encode_pair
    from trainer3d.data.tokenizer import load_tokenizer

    tok = load_tokenizer(str(model_dir))
    return [tuple(len(x) for x in encode_pair(tok, row)) for row in rows]


# ---- measuring a process from outside ---------------------------------------------------------------------------
def run_measured(cmd: list[str], env: dict, log_path: Path, marker: str) -> dict:
    """Run `cmd` (stdout and stderr to `log_path`); its wall time and, read from here every 20 ms, its resident set's
    high-water mark (/proc/<pid>/status VmHWM: the kernel's, so no peak between two reads is missed), its VmRSS when
    `marker` first shows in its log (the line it prints just before step 1), and the child processes it started."""
    import psutil

    t0 = time.perf_counter()
    hwm, at_marker, children = 0, None, {}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
        root = psutil.Process(proc.pid)
        while proc.poll() is None:
            try:
                with open(f"/proc/{proc.pid}/status") as f:
                    status = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f if line.startswith("Vm")}
                hwm = max(hwm, status.get("VmHWM", 0))
                if at_marker is None and marker in log_path.read_text():
                    at_marker = status.get("VmRSS")
                for c in root.children(recursive=True):
                    children.setdefault(c.pid, " ".join(c.cmdline()[:4]))
            except (OSError, psutil.Error):
                pass
            time.sleep(0.02)
    wall = time.perf_counter() - t0
    if proc.returncode:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{log_path.read_text()[-3000:]}")
    return {"wall_s": wall, "vmhwm": hwm, "rss_before_step1": at_marker, "children": sorted(children.values())}


def child_env() -> dict:
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("WANDB_", "TRAINER3D_")) and k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK",
                                                                        "MASTER_ADDR", "MASTER_PORT")}
    env.update(OMP_NUM_THREADS="1", MKL_NUM_THREADS="1", PYTHONPATH=ROOT, HF_HUB_DISABLE_TELEMETRY="1",
               HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    return env


# ---- the three sides --------------------------------------------------------------------------------------------
def trainer3d_cmd(model_dir, data, seq_len, rows, steps, out_dir, padding_free: bool = False) -> list[str]:
    return [sys.executable, "launch/train.py", "--init-from-hf", str(model_dir), "--objective", "dpo",
            "--data-format", "preference", "--data", str(data), "--seq-len", str(seq_len),
            *(["--dpo-padding-free"] if padding_free else []),
            "--global-batch", str(rows), "--micro-batches", "1", "--precision", "fp32",
            "--max-steps", str(steps), "--lr", str(LR), "--min-lr", str(LR), "--warmup-steps", "0",
            "--weight-decay", "0", "--beta1", "0.9", "--beta2", "0.999", "--adam-eps", "1e-8", "--grad-clip", "1.0",
            "--dpo-beta", str(BETA), "--dpo-loss", "sigmoid", "--recompute", "none", "--val-fraction", "0",
            "--eval-every", "0", "--log-every", "1", "--no-final-save", "--out-dir", str(out_dir)]


def trainer3d_side(model_dir, data, seq_len, rows, steps, work: Path, tag: str, padding_free: bool = False) -> dict:
    """`rows` a step (unpacked: two a pair; padding-free: rows of several pairs, whose count each step logs)."""
    out_dir = work / f"trainer3d{'-padding-free' if padding_free else ''}{tag}"
    cmd = trainer3d_cmd(model_dir, data, seq_len, rows, steps, out_dir, padding_free)
    measured = run_measured(cmd, child_env(), work / f"{out_dir.name}.log", marker="] rank 0 memory at start")
    with open(out_dir / "metrics.jsonl") as f:
        records = [r for r in map(json.loads, f) if "step_time_s" in r]
    assert len(records) == steps, records
    return {**measured, "step_s": [r["step_time_s"] for r in records], "loss": [r["loss"] for r in records],
            "margins": [r.get("rewards/margins") for r in records], "widths": [seq_len] * steps,
            "pairs": [r.get("pairs", rows // 2) for r in records]}


def trl_side(model_dir, data, pairs_per_step, steps, work: Path, tag: str, precompute: bool) -> dict:
    name = f"trl{'-precomputed' if precompute else ''}{tag}"
    out = work / f"{name}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--child", "trl", str(model_dir), str(data), str(pairs_per_step),
           str(steps), str(int(precompute)), str(work / f"{name}_out"), str(out)]
    measured = run_measured(cmd, child_env(), work / f"{name}.log", marker=TRL_MARKER)
    return {**measured, **json.loads(out.read_text())}


def trl_child(model_dir: str, data: str, pairs_per_step: int, steps: int, precompute: bool, out_dir: str,
              out: str) -> None:
    """TRL's DPOTrainer with tests/helpers/trl_dpo_reference's settings (`precompute`: precompute_ref_log_probs=True, the
    reference scored in the trainer's __init__ and no reference model kept); per step the callback's times, the
    padded width of the batch its collator made, the loss; the RSS at step 1's start."""
    import torch
    import transformers
    from helpers.trl_dpo_reference import _config, _trainer

    torch.set_num_threads(1)
    with open(data) as f:
        rows = [json.loads(line) for line in f]
    args = _config(out_dir, pairs_per_step, steps, LR, BETA, "sigmoid", 0.0, None, 1.0, 0,
                   precompute_ref_log_probs=precompute)
    trainer = _trainer(model_dir, rows, args)
    assert (trainer.ref_model is None) == precompute  # precomputed: TRL keeps no reference model
    widths, times = [], {"begin": [], "end": []}
    rss = {}
    collate = trainer.data_collator

    def collator(features):
        batch = collate(features)
        widths.append(int(batch["input_ids"].shape[1]))
        return batch

    trainer.data_collator = collator

    class Timer(transformers.TrainerCallback):
        def on_train_begin(self, args, state, control, **kw):
            times["train_begin"] = time.perf_counter()

        def on_step_begin(self, args, state, control, **kw):
            if not times["begin"]:
                rss["step1"] = _status_bytes("VmRSS")
                print(TRL_MARKER, flush=True)
            times["begin"].append(time.perf_counter())

        def on_step_end(self, args, state, control, **kw):
            times["end"].append(time.perf_counter())

    trainer.add_callback(Timer())
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h and "rewards/chosen" in h]
    assert len(log) == steps and len(times["end"]) == steps, (len(log), len(times["end"]))
    ends = [times["train_begin"]] + times["end"]
    result = {"step_s": [b - a for a, b in itertools.pairwise(ends)],  # end to end: data + step (+ its log)
              "step_inner_s": [e - b for b, e in zip(times["begin"], times["end"])],  # on_step_begin -> on_step_end
              "loss": [h["loss"] for h in log], "margins": [h["rewards/margins"] for h in log],
              "rss_before_step1_inside": rss.get("step1"), "widths": widths[:steps]}
    Path(out).write_text(json.dumps(result))


def _status_bytes(key: str) -> int:
    with open("/proc/self/status") as f:
        return next(int(line.split()[1]) * 1024 for line in f if line.startswith(key + ":"))


# ---- main -------------------------------------------------------------------------------------------------------
def summarize(side: dict, skip: int, pairs_per_step: float, tokens_per_pair: float) -> dict:
    """`pairs_per_step`: the mean over the steady steps (padding-free steps train the pairs their rows hold)."""
    steady = side["step_s"][skip:]
    step = statistics.median(steady)
    return {"step_ms": step * 1e3, "step_ms_iqr": [q * 1e3 for q in statistics.quantiles(steady, n=4)[::2]]
            if len(steady) > 1 else [step * 1e3] * 2, "pairs_per_step": pairs_per_step,
            "pairs_per_s": pairs_per_step / step, "tokens_per_s": pairs_per_step * tokens_per_pair / step}


SIDES = {  # name: the table's column
    "trainer3d": "trainer3d",
    "trainer3d-padding-free": "trainer3d --dpo-padding-free",
    "trl": "TRL DPOTrainer",
    "trl-precomputed": "TRL, precompute_ref_log_probs",
}
PF_ROWS = 4  # padding-free: rows a step, each PF_WIDTH x the longest pair's side


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--pairs", type=int, default=64, help="preference pairs in the set")
    ap.add_argument("--pairs-per-step", type=int, default=8, help="pairs a step (trainer3d: --global-batch 2×)")
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--pf-width", type=int, default=4, help="padding-free rows: this many times the longest side")
    ap.add_argument("--prompt-words", type=int, nargs=2, default=[48, 64], metavar=("LO", "HI"))
    ap.add_argument("--completion-words", type=int, nargs=2, default=[28, 44], metavar=("LO", "HI"))
    ap.add_argument("--skip", type=int, default=2, help="first steps left out of the timing")
    ap.add_argument("--hidden", type=int, default=384)
    ap.add_argument("--layers", type=int, default=6)
    ap.add_argument("--heads", type=int, default=6)
    ap.add_argument("--kv-heads", type=int, default=2)
    ap.add_argument("--ffn", type=int, default=1024)
    ap.add_argument("--rounds", type=int, default=2, help="runs of each side; even rounds run the sides in reverse")
    ap.add_argument("--sides", nargs="+", default=list(SIDES), choices=list(SIDES))
    ap.add_argument("--out", default=RESULTS)
    ap.add_argument("--child", nargs="+", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        _, model_dir, data, pps, steps, precompute, out_dir, out = args.child
        trl_child(model_dir, data, int(pps), int(steps), precompute == "1", out_dir, out)
        return 0
    assert "trainer3d" in args.sides and args.steps > args.skip

    from bench.harness import fmt_bytes, stamp, table

    cmd_line = "python bench/dpo_vs_trl.py" + "".join(f" {a}" for a in (argv if argv is not None else sys.argv[1:]))
    with tempfile.TemporaryDirectory(prefix="dpo_vs_trl-") as tmp:
        work = Path(tmp)
        model_dir, data = work / "model", work / "pairs.jsonl"
        model = make_model(model_dir, args.hidden, args.layers, args.heads, args.kv_heads, args.ffn)
        rows = make_pairs(args.pairs, prompt=tuple(args.prompt_words), completion=tuple(args.completion_words))
        data.write_text("".join(json.dumps(r) + "\n" for r in rows))
        lengths = pair_lengths(model_dir, rows)
        longest = max(p + max(c, r) for p, c, r in lengths)
        seq_len = longest - 1  # trainer3d's rows are seq_len + 1 tokens: the longest pair just fits
        tokens_per_pair = statistics.mean(2 * p + c + r for p, c, r in lengths)
        print(f"model: Llama d{args.hidden} L{args.layers} h{args.heads}/kv{args.kv_heads} ffn {args.ffn}, vocab "
              f"{model['vocab']}, {model['params'] / 1e6:.2f}M params, fp32; {args.pairs} pairs "
              f"({tokens_per_pair:.1f} tokens a pair, longest side {longest}: --seq-len {seq_len}); "
              f"{args.pairs_per_step} pairs a step, {args.steps} steps, timed from step {args.skip + 1}", flush=True)

        runs = {side: [] for side in args.sides}
        for r in range(args.rounds):
            for side in (args.sides if r % 2 == 0 else args.sides[::-1]):
                t0 = time.perf_counter()
                if side == "trainer3d":
                    res = trainer3d_side(model_dir, data, seq_len, 2 * args.pairs_per_step, args.steps, work, str(r))
                elif side == "trainer3d-padding-free":
                    res = trainer3d_side(model_dir, data, args.pf_width * longest - 1, PF_ROWS, args.steps, work,
                                         str(r), padding_free=True)
                else:
                    res = trl_side(model_dir, data, args.pairs_per_step, args.steps, work, str(r),
                                   precompute=side == "trl-precomputed")
                runs[side].append(res)
                print(f"  round {r + 1} {side}: {time.perf_counter() - t0:.1f} s; step ms "
                      f"{[round(x * 1e3) for x in res['step_s']]}; loss first {res['loss'][0]:.6f} last "
                      f"{res['loss'][-1]:.6f}", flush=True)

    # one summary per side: the median over the rounds' steady steps pooled, the highest peak
    def pooled(side):
        rs = runs[side]
        pairs = statistics.mean(x for r in rs for x in r.get("pairs", [args.pairs_per_step] * args.steps)[args.skip:])
        out = summarize({"step_s": [x for r in rs for x in r["step_s"][args.skip:]]}, 0, pairs, tokens_per_pair)
        out.update(vmhwm=max(r["vmhwm"] for r in rs), rss_before_step1=max(r["rss_before_step1"] or 0 for r in rs),
                   wall_s=statistics.median(r["wall_s"] for r in rs), first_loss=[r["loss"][0] for r in rs],
                   last_loss=[r["loss"][-1] for r in rs], padded_width=statistics.mean(rs[0]["widths"]),
                   round_step_ms=[statistics.median(r["step_s"][args.skip:]) * 1e3 for r in rs],
                   children=sorted({c for r in rs for c in r["children"]}))
        out["rise"] = out["vmhwm"] - out["rss_before_step1"]
        return out

    s = {side: pooled(side) for side in runs}
    ln2 = math.log(2)
    for side, v in s.items():  # policy = reference at step 1: every pair's margin is 0
        assert all(abs(x - ln2) < 1e-5 for x in v["first_loss"]), f"{side}'s first loss {v['first_loss']} is not ln 2"
    t, others = s["trainer3d"], [side for side in args.sides if side != "trainer3d"]

    def row(label, fmt, key, ratio=True):
        cells = [fmt(s[side][key]) for side in args.sides]
        return [label, *cells, *([f"{t[key] / s[o][key]:.2f}" if ratio and s[o][key] else "" for o in others])]

    def ms(v):
        return f"{v['step_ms']:.0f} ({v['step_ms_iqr'][0]:.0f}-{v['step_ms_iqr'][1]:.0f})"

    rows_ = [
        row("pairs/s", lambda x: f"{x:.2f}", "pairs_per_s"),
        row("tokens/s (real tokens)", lambda x: f"{x:,.0f}", "tokens_per_s"),
        ["step ms, median (IQR)", *[ms(s[side]) for side in args.sides],
         *[f"{t['step_ms'] / s[o]['step_ms']:.2f}" for o in others]],
        ["step ms, median of each round", *[" / ".join(f"{x:.0f}" for x in s[side]["round_step_ms"])
                                            for side in args.sides],
         *[" / ".join(f"{a / b:.2f}" for a, b in zip(t["round_step_ms"], s[o]["round_step_ms"])) for o in others]],
        row("row width as run (mean tokens)", lambda x: f"{x:.1f}", "padded_width"),
        row("pairs a step (mean)", lambda x: f"{x:.2f}", "pairs_per_step"),
        row("peak RSS (VmHWM)", fmt_bytes, "vmhwm"),
        row("RSS before step 1", fmt_bytes, "rss_before_step1"),
        row("peak RSS - RSS before step 1", fmt_bytes, "rise"),
        row("process wall s (start-up incl.)", lambda x: f"{x:.1f}", "wall_s"),
        ["loss step 1 / last (round 1)", *[f"{s[side]['first_loss'][0]:.6f} / {s[side]['last_loss'][0]:.6f}"
                                           for side in args.sides], *[""] * len(others)],
    ]
    print()
    print(table(rows_, ["", *[SIDES[side] for side in args.sides], *[f"trainer3d / {SIDES[o]}" for o in others]]))
    inside = {side: fmt_bytes(runs[side][0]["rss_before_step1_inside"]) for side in others if side.startswith("trl")}
    print(f"ln 2 = {ln2:.6f}. RSS at step 1's start read inside the TRL processes (round 1): {inside}. Child "
          f"processes seen: { {side: s[side]['children'] for side in args.sides} }")
    line = stamp(cmd_line) + "; threads: 1 in every process (OMP_NUM_THREADS=1; TRL's child torch.set_num_threads(1))"
    print(line)
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    command = trainer3d_cmd("MODEL", "PAIRS", seq_len, args.pairs_per_step, args.steps, "OUT")
    with open(args.out, "w") as f:
        json.dump({"stamp": line, "model": model, "pairs": args.pairs, "pairs_per_step": args.pairs_per_step,
                   "steps": args.steps, "skip": args.skip, "rounds": args.rounds, "seq_len": seq_len,
                   "tokens_per_pair": tokens_per_pair, "lr": LR, "beta": BETA, "summary": s, "runs": runs,
                   "trainer3d_command": " ".join(["python", *command[1:]])}, f, indent=1)
    print(f"wrote {os.path.relpath(args.out, ROOT)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
