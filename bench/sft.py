"""Supervised fine-tuning's data and what packing buys, in one run (issue 34).

A. Building the rows (`data/sft.build_chat_rows`, a fresh cache each time): conversations rendered by a ChatML-like
   template over the bundled GPT-2 BPE, masked by the prefix-rendering rule, or with {% generation %} tags by
   transformers' tag mask, then packed best-fit-decreasing ("bfd", data/packing.py), in the corpus's order ("in-order":
   the rule bfd replaced, `in_order` below patched in for `best_fit_decreasing`, so the same code writes both), or one
   per row. Conversations per second, rows, how full they are, and the shares of padding and of supervised tokens.
B. One epoch over the same conversations, bfd and in-order (attention and positions per conversation: SDPA with a
   boolean document mask on CPU) against one per row (causal SDPA, padding at the end): steps, time per step, and the
   epoch's time, as ratios inside this run. The model is a small GPT-2 (4 blocks, 256 wide) in one process.

The conversations are synthetic: 1-4 user/assistant exchanges of the bundled plays' sentences, turn lengths drawn
from a log-normal (median ~25 tokens, a long tail), half of them with a system turn.

    python bench/sft.py                       # 2000 conversations, seq 512 and 2048
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import sys
import tempfile
import time
from contextlib import nullcontext
from unittest import mock

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path[:0] = [ROOT]

from bench.harness import stamp, table  # noqa: E402

TEMPLATE = ("{%- for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
            "{%- if message['role'] == 'assistant' and TAGS %}{% generation %}{{ message['content'] + '<|im_end|>\\n' }}"
            "{% endgeneration %}{%- else %}{{ message['content'] + '<|im_end|>\\n' }}{%- endif %}{%- endfor %}"
            "{%- if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{%- endif %}")


def sentences() -> list[str]:
    from trainer3d.data import bundled_corpus_files

    text = " ".join(f.read_text(encoding="utf-8") for f in bundled_corpus_files()[:6])
    return [s.strip() for s in re.split(r"(?<=[.!?])\s+", re.sub(r"[*#\n]+", " ", text)) if len(s.split()) > 2]


def conversations(n: int, seed: int = 0) -> list[list[dict]]:
    rng, pool = random.Random(seed), sentences()

    def turn() -> str:
        words = max(3, int(rng.lognormvariate(3.0, 0.8)))
        out: list[str] = []
        while len(out) < words:
            out += rng.choice(pool).split()
        return " ".join(out[:words])

    convs = []
    for _ in range(n):
        c = [{"role": "system", "content": "You are a helpful assistant."}] if rng.random() < 0.5 else []
        for _ in range(rng.randint(1, 4)):
            c += [{"role": "user", "content": turn()}, {"role": "assistant", "content": turn()}]
        convs.append(c)
    return convs


def tokenizer_dir(root: str, tags: bool) -> str:
    from transformers import AutoTokenizer

    from trainer3d.data import BUNDLED_TOKENIZER_DIR

    path = os.path.join(root, f"tok-{int(tags)}")
    tok = AutoTokenizer.from_pretrained(str(BUNDLED_TOKENIZER_DIR))
    tok.add_special_tokens({"additional_special_tokens": ["<|im_start|>", "<|im_end|>"], "pad_token": "<|pad|>"})
    tok.chat_template = TEMPLATE.replace("TAGS", "true" if tags else "false")
    if not tags:
        tok.chat_template = tok.chat_template.replace("{% generation %}", "").replace("{% endgeneration %}", "")
    tok.save_pretrained(path)
    return path


PACKINGS = ("bfd", "in-order", "one per row")


def in_order(lengths, capacity: int) -> list[list[int]]:
    """The packing best-fit-decreasing replaced: conversations in the corpus's order, each into the current row, a
    conversation that does not fit in the rest of it opening the next row (same shape as `best_fit_decreasing`)."""
    rows: list[list[int]] = []
    room = 0
    for i, n in enumerate(lengths):
        n = int(n)
        if not rows or n > room:
            rows.append([])
            room = capacity
        rows[-1].append(i)
        room -= n
    return rows


def build(data: str, tok: str, seq: int, packing: str, root: str):
    from trainer3d.data.sft import build_chat_rows
    from trainer3d.data.sources import DataConfig

    cfg = DataConfig(data=data, tokenizer=tok, format="chat", pack=packing != "one per row", val_fraction=0.0,
                     cache_dir=tempfile.mkdtemp(dir=root))
    with mock.patch("trainer3d.data.sft.best_fit_decreasing", in_order) if packing == "in-order" else nullcontext():
        t0 = time.perf_counter()
        blocks = build_chat_rows(cfg, seq)
        seconds = time.perf_counter() - t0
    assert blocks.stats["bad"] == 0 and blocks.stats["conversations"] > 0, blocks.stats
    return blocks, seconds


def section_a(data: str, toks: dict, seqs: list[int], root: str, n: int) -> dict:
    build(data, toks[False], seqs[0], "bfd", root)  # warm-up, untimed: jinja compiles the template once per process
    build(data, toks[True], seqs[0], "bfd", root)
    rows, built = [], {}
    for seq in seqs:
        for tags in (False, True):
            for packing in PACKINGS:
                if tags and packing != "bfd":
                    continue  # the masks do not depend on packing
                blocks, seconds = build(data, toks[tags], seq, packing, root)
                r, st = blocks.train, blocks.stats
                pad = 1 - st["tokens"] / r.tokens.size
                rows.append([seq, "yes" if tags else "no", packing, f"{n / seconds:,.0f}", f"{st['tokens'] / seconds:,.0f}",
                             len(r), f"{st['fill']:.1%}", f"{pad:.1%}", f"{st['supervised'] / r.tokens.size:.1%}",
                             st["truncated"]])
                if not tags:
                    built[(seq, packing)] = blocks
    print(table(rows, ["seq", "tags", "packing", "conv/s", "tok/s", "rows", "fill", "padding", "supervised",
                       "truncated"]))
    return built


def _epoch(rank: int, world: int, rows, seq: int, pack: bool, gb: int, steps: int) -> dict:
    import torch

    from trainer3d.config import TrainConfig
    from trainer3d.data import BatchLoader
    from trainer3d.train.setup import validate
    from trainer3d.train.trainer import Trainer

    cfg = TrainConfig(model="tiny", n_layer=4, n_embd=256, n_head=4, n_positions=seq, seq_len=seq, global_batch=gb, max_steps=steps,
                      precision="fp32", document_mask=pack, reset_position_ids=pack, eval_every=0)
    setup = validate(cfg, 1, 50260)
    topo = setup.topology([0])
    trainer = Trainer(setup, topo, torch.device("cpu"), cfg.model_config(50260), boundary=50256)
    loader = BatchLoader(rows, gb, 0, 1, seed=0)
    trainer.train_step(loader.next_batch())  # warm-up
    t0 = time.perf_counter()
    for _ in range(steps):
        trainer.train_step(loader.next_batch())
    seconds = (time.perf_counter() - t0) / steps
    topo.destroy()
    return {"step_s": seconds}


def section_b(built: dict, seq: int, gb: int, steps: int) -> list:
    from helpers.distributed import run_world

    step, n, rows = {}, {}, []
    for packing in PACKINGS:
        r = built[(seq, packing)].train
        n[packing] = len(r)
        step[packing] = run_world(1, _epoch, r, seq, packing != "one per row", gb, steps, timeout=1800)[0]["step_s"]
        epoch_steps = len(r) / gb
        rows.append([packing, len(r), f"{epoch_steps:.0f}", f"{step[packing]:.3f}", f"{epoch_steps * step[packing]:.0f}"])
    print(table(rows, ["packing", "rows", "steps/epoch", "s/step", "s/epoch"]))
    for other in PACKINGS[1:]:
        epoch = (n[other] * step[other]) / (n["bfd"] * step["bfd"])
        print(f"bfd against {other}: {n[other] / n['bfd']:.2f}x fewer rows, {step['bfd'] / step[other]:.2f}x the time "
              f"per step, {epoch:.2f}x faster epoch")
    return rows


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--conversations", type=int, default=2000)
    p.add_argument("--seq", type=int, nargs="+", default=[512, 2048])
    p.add_argument("--train-seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=8)
    args = p.parse_args()
    print(stamp(" ".join(["python bench/sft.py", *sys.argv[1:]])))
    root = tempfile.mkdtemp(prefix="bench-sft-")
    data = os.path.join(root, "chat.jsonl")
    with open(data, "w") as f:
        for c in conversations(args.conversations):
            f.write(json.dumps({"messages": c}) + "\n")
    toks = {tags: tokenizer_dir(root, tags) for tags in (False, True)}
    built = section_a(data, toks, args.seq, root, args.conversations)
    section_b(built, args.train_seq, 8, args.steps)


if __name__ == "__main__":
    main()
