"""trainer3d's supervised fine-tuning equals TRL's SFTTrainer step by step (issue 43): a random Hugging Face Llama with
a chat tokenizer, fine-tuned on the same conversations under the same chat template (TRL's qwen3_training.jinja and
qwen2_5_training.jinja, and a ChatML one written here whose {% generation %} tags end at <|im_end|>) by
trl.SFTTrainer(assistant_only_loss=True) and by trainer3d's entry point at one process and at tp 2 × pp 2: fp32, the
whole set in one batch a step (so each step's loss is the mean over all of the set's supervised tokens, whatever the
batching), constant lr, AdamW with TRL's defaults, clipping at 1.0. Per step: the same loss and gradient norm (before
clipping) within tests/helpers/parity.py's tolerances, over the same count of supervised tokens; the losses move. Unpacked
(--no-pack against packing=False) and packed (trainer3d's best-fit-decreasing rows against TRL's padding-free "bfd"
packing, whose per-conversation attention on CPU is checked here too)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

import datasets
import torch
import transformers
import trl

from helpers.chat_data import chat_tokenizer, conversations
from helpers.distributed import run_world
from helpers.parity import LOSS_RTOL, NORM_RTOL
from test_llama import hf_llama

N, STEPS, LR = 16, 4, 1e-3  # conversations (all in every step's batch), steps; lr as parity.py's (see parity_config)
# The tolerances are parity.py's (1e-5). The losses agree to 1.5e-7; the gradient norms differ by 1-4e-6 at every
# step, layout and packing alike, because TRL's norm (torch.nn.utils.clip_grad_norm_) is reduced in float32: the
# same fp32 gradients' squares summed in float64 give trainer3d's norm to 1e-7, and so does the model run in float64.
# ChatML whose generation tags close exactly at the end-of-turn token: the "\n" after it is a prompt token
CHATML = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
          "{%- if message['role'] == 'assistant' %}{% generation %}{{ message['content'] + '<|im_end|>' }}"
          "{% endgeneration %}{%- else %}{{ message['content'] + '<|im_end|>' }}{%- endif %}{{ '\\n' }}{%- endfor %}"
          "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")
TEMPLATES = ("chatml", "qwen3_training", "qwen2_5_training")
LAYOUTS = {"1 process": [], "tp2 pp2": ["--tp", "2", "--pp", "2"]}


def template_text(name: str) -> str:
    return CHATML if name == "chatml" else (Path(trl.__file__).parent / "chat_templates" / f"{name}.jinja").read_text()


def rendered(tok, template: str) -> list[tuple[int, int]]:
    """Each conversation's (tokens, supervised targets) under `template`, from transformers' assistant mask (what TRL
    trains on): a conversation's first token is never a target."""
    out = []
    for messages in conversations(N, seed=6):
        enc = tok.apply_chat_template(messages, chat_template=template, return_dict=True,
                                      return_assistant_tokens_mask=True)
        out.append((len(enc["input_ids"]), sum(enc["assistant_masks"][1:])))
    return out


def shapes(lengths: list[int], packed: bool) -> tuple[int, int]:
    """(--seq-len, --global-batch) holding the whole set in one step: one conversation per row, or rows of
    ceil(T/2) + the longest conversation's tokens, where any fit-based packing (best-fit-decreasing) needs two rows
    (a third is opened only if both are fuller than ceil(T/2), more than T tokens) and one cannot hold T."""
    if not packed:
        return max(lengths), len(lengths)
    seq = math.ceil(sum(lengths) / 2) + max(lengths)
    assert sum(lengths) > seq + 1, "the conversations fit one row: lengthen them"
    return seq, 2


def trl_run(hf_dir: Path, template: Path, packed: bool, seq: int, out: Path) -> dict:
    """TRL's SFTTrainer with the flags trainer3d is given; the step's batch (every row at once) kept for its
    supervised count and the packed attention check."""
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir)
    args = trl.SFTConfig(
        output_dir=str(out), assistant_only_loss=True, packing=packed, packing_strategy="bfd",
        chat_template_path=str(template), max_length=seq + 1, per_device_train_batch_size=N,
        gradient_accumulation_steps=1, max_steps=STEPS, learning_rate=LR, lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, adam_beta1=0.9, adam_beta2=0.999, adam_epsilon=1e-8,
        bf16=False, fp16=False, activation_checkpointing=False, logging_steps=1, report_to="none", save_strategy="no",
        seed=0, use_cpu=True, disable_tqdm=True, dataset_num_proc=None)
    data = datasets.Dataset.from_list([{"messages": m} for m in conversations(N, seed=6)])
    trainer = trl.SFTTrainer(model=model, args=args, train_dataset=data, processing_class=tok)
    trainer.remove_callback(transformers.PrinterCallback)  # its per-step dicts would bury the table under -s
    batch = next(iter(trainer.get_train_dataloader()))
    trainer.train()
    log = [h for h in trainer.state.log_history if "loss" in h]
    return {"loss": [h["loss"] for h in log], "grad_norm": [h["grad_norm"] for h in log], "batch": batch,
            "supervised": int((batch["labels"][:, 1:] != -100).sum())}  # the model's shift: label 0 is no target


def packed_attention_gap(hf_dir: Path, batch: dict) -> dict[str, float]:
    """TRL's padding-free batch (one row, positions restarting per conversation, no attention mask) against each
    conversation alone, float64 logits, under sdpa and eager: transformers' masking_utils must find the
    conversations from position_ids and keep each to itself, else packed is no comparison. (It does so only without
    a cache: with use_cache, as in generation, the row is one causal sequence.)"""
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, dtype=torch.float64).eval()
    pos, ids = batch["position_ids"][0], batch["input_ids"][0]
    starts = (pos == 0).nonzero().flatten().tolist() + [len(pos)]
    assert len(starts) == N + 1, starts  # every conversation in the one row
    gaps = {}
    for impl in ("sdpa", "eager"):
        model.set_attn_implementation(impl)
        with torch.no_grad():
            whole = model(input_ids=ids[None], position_ids=pos[None], use_cache=False).logits[0]
            alone = torch.cat([model(input_ids=ids[None, a:b]).logits[0] for a, b in zip(starts, starts[1:])])
        gaps[impl] = (whole - alone).abs().max().item()
    return gaps


def t3d_argv(hf_dir: Path, data: Path, template: Path, seq: int, batch: int, packed: bool, layout: list[str],
             out: Path) -> list[str]:
    """trainer3d's flags for what the SFTConfig says: constant lr (the cosine's floor at lr), AdamW's betas and eps
    as TRL's, no weight decay, clipping at 1.0, fp32, every row trained on (no validation), logged every step; the
    run's directory last."""
    return ["--init-from-hf", str(hf_dir), "--data", str(data), "--data-format", "chat", "--chat-template",
            str(template), "--seq-len", str(seq), "--global-batch", str(batch), "--max-steps", str(STEPS), "--lr",
            str(LR), "--warmup-steps", "0", "--min-lr", str(LR), "--weight-decay", "0", "--beta1", "0.9", "--beta2",
            "0.999", "--adam-eps", "1e-8", "--grad-clip", "1.0", "--precision", "fp32", "--val-fraction", "0",
            "--eval-every", "0", "--log-every", "1", *([] if packed else ["--no-pack"]), *layout, "--out-dir",
            str(out)]


def _trainer3d(rank: int, world_size: int, runs: list[list[str]]) -> list[int]:
    """trainer3d's entry point for each argv, in this world (its layout flags in the argv)."""
    from trainer3d.train.loop import main

    return [main(argv) for argv in runs]


def metrics(out_dir: Path) -> dict:
    rows = [json.loads(x) for x in (out_dir / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if "loss" in r]
    return {k: [r.get(k) for r in steps] for k in ("loss", "grad_norm", "supervised_tokens")}


def rel(a: list[float], b: list[float]) -> float:
    return max(abs(x - y) / abs(y) for x, y in zip(a, b))


def compare(label: str, ref: dict, got: dict, supervised: int) -> tuple[list[str], list[str]]:
    """One trainer3d run against TRL's: the table's lines and the failures (tolerances, steps, supervised count)."""
    d_loss, d_norm = rel(got["loss"], ref["loss"]), rel(got["grad_norm"], ref["grad_norm"])
    lines = [f"{label}: supervised TRL {ref['supervised']} trainer3d {got['supervised_tokens']}; max relative "
             f"difference loss {d_loss:.1e} grad_norm {d_norm:.1e}"]
    lines += [f"  step {k + 1}: loss TRL {a:.7f} trainer3d {b:.7f} ({abs(a - b) / a:.1e}) | grad_norm TRL {c:.7f} "
              f"trainer3d {d:.7f} ({abs(c - d) / c:.1e})"
              for k, (a, b, c, d) in enumerate(zip(ref["loss"], got["loss"], ref["grad_norm"], got["grad_norm"]))]
    failures = []
    if len(got["loss"]) != STEPS or d_loss > LOSS_RTOL or d_norm > NORM_RTOL:
        failures.append(f"{label}: loss {d_loss:.1e} grad_norm {d_norm:.1e} over {len(got['loss'])} steps")
    if got["supervised_tokens"] != [supervised] * STEPS:
        failures.append(f"{label}: supervised tokens {got['supervised_tokens']}, TRL's {supervised}")
    return lines, failures


def test_sft_equals_trl_per_step(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRAINER3D_CACHE", str(tmp_path / "cache"))  # the ranks' data cache: this test's own
    hf_dir = tmp_path / "hf"
    hf_llama(tie=True, seed=5).save_pretrained(hf_dir)
    chat_tokenizer(hf_dir)  # its own template (no <|im_end|>, no tags): the runs' --chat-template file replaces it
    tok = transformers.AutoTokenizer.from_pretrained(hf_dir)
    data = tmp_path / "chat.jsonl"
    data.write_text("".join(json.dumps({"messages": m}) + "\n" for m in conversations(N, seed=6)))

    cases, runs = [], {layout: {} for layout in LAYOUTS}  # cases: (template, packed, seq, supervised count)
    for name in TEMPLATES:
        template = tmp_path / f"{name}.jinja"
        template.write_text(template_text(name))
        convs = rendered(tok, template_text(name))
        for packed in (False, True):
            seq, batch = shapes([n for n, _ in convs], packed)
            cases.append((name, packed, seq, sum(s for _, s in convs)))
            for layout, flags in LAYOUTS.items():
                out = tmp_path / f"{name}-{packed}-{layout}".replace(" ", "_")
                runs[layout][name, packed] = t3d_argv(hf_dir, data, template, seq, batch, packed, flags, out)
    start = time.perf_counter()
    codes = {}  # a world of 1, then one of 4 for every tp 2 × pp 2 run
    for layout, argvs in runs.items():
        world = 4 if LAYOUTS[layout] else 1
        codes[layout] = dict(zip(argvs, run_world(world, _trainer3d, list(argvs.values()), timeout=600)[0]))

    worlds_s = time.perf_counter() - start
    trl_runs = [trl_run(hf_dir, tmp_path / f"{name}.jinja", packed, seq, tmp_path / f"trl-{name}-{packed}")
                for name, packed, seq, _ in cases]
    gaps = packed_attention_gap(hf_dir, next(r["batch"] for r, c in zip(trl_runs, cases) if c[1]))
    trl_s = time.perf_counter() - start - worlds_s

    lines, failures = [f"TRL's padding-free packing against each conversation alone (float64 logits): {gaps}"], []
    for (name, packed, _, supervised), ref in zip(cases, trl_runs):
        assert ref["supervised"] == supervised, (name, packed, ref["supervised"], supervised)  # TRL's = the masks'
        assert len(ref["loss"]) == STEPS and ref["loss"][-1] < ref["loss"][0] - 0.05, ref["loss"]  # it trains
        for layout in LAYOUTS:
            label = f"{name} {'packed' if packed else 'unpacked'} {layout}"
            if codes[layout][name, packed] != 0:
                failures.append(f"{label}: trainer3d exited {codes[layout][name, packed]}")
                continue
            more, failed = compare(label, ref, metrics(Path(runs[layout][name, packed][-1])), supervised)
            lines, failures = lines + more, failures + failed
    lines.append(f"trainer3d's worlds of 1 and 4: {worlds_s:.0f} s; TRL's {len(cases)} runs: {trl_s:.0f} s")
    with capsys.disabled():
        print("\n" + "\n".join(lines))
    assert max(gaps.values()) < 1e-9, f"TRL's packed rows attend across conversations on CPU: {gaps}"
    assert not failures, "\n".join(failures)
