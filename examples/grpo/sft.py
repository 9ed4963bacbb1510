"""The model the GRPO example starts from: an SFT export, made the way a user makes one.

    python examples/grpo/sft.py --out-dir runs/grpo_sft       # -> runs/grpo_sft/hf (about a minute on 2 cores)

It writes the task's chat rows (task.py), trains a small Llama from scratch on them with trainer3d's SFT
(`launch/train.py --data-format chat`, the GPT-2 tokenizer, this folder's chat template), and exports the last
checkpoint with `trainer3d.export` (weights, tokenizer, template).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path.insert(0, HERE)

from task import write_sft  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out-dir", default="runs/grpo_sft")
    ap.add_argument("--steps", type=int, default=80)
    ap.add_argument("--rows", type=int, default=4000)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out_dir, exist_ok=True)
    data = os.path.join(args.out_dir, "sft.jsonl")
    write_sft(data, args.rows, args.seed)
    train = [sys.executable, os.path.join(ROOT, "launch", "train.py"), "--model", "llama-tiny", "--n-embd", "64",
             "--n-layer", "2", "--n-head", "4", "--n-kv-heads", "2", "--ffn-hidden", "192", "--data", data,
             "--data-format", "chat", "--chat-template", os.path.join(HERE, "template.jinja"), "--seq-len", "32",
             "--global-batch", "16", "--max-steps", str(args.steps), "--lr", "5e-3", "--min-lr", "5e-4",
             "--warmup-steps", "10", "--eval-every", "0", "--val-fraction", "0", "--seed", str(args.seed),
             "--out-dir", os.path.join(args.out_dir, "run"), "--overwrite"]
    subprocess.run(train, check=True)
    export = [sys.executable, "-m", "trainer3d.export", os.path.join(args.out_dir, "run"),
              os.path.join(args.out_dir, "hf")]
    subprocess.run(export, check=True, cwd=ROOT)
    print(f"SFT export: {os.path.join(args.out_dir, 'hf')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
