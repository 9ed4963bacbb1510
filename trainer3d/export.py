"""Export a trainer3d checkpoint as a Hugging Face `save_pretrained` directory, without any process group:

    python -m trainer3d.export CKPT OUT [--dtype float32|bfloat16|float16] [--tokenizer DIR|none] [--overwrite]
                                        [--max-shard-size 5GB]

CKPT is a checkpoint directory (`<out-dir>/checkpoints/step_000123`), a `checkpoints` directory or a run's
--out-dir (both follow `latest`). The layout-free pieces are read directly (any layout saved them), tensor by
tensor, every file's sha256 is checked, and OUT is written atomically by hf.save_hf_checkpoint with the tokenizer the run used
(the bundled GPT-2 BPE unless the run passed --tokenizer), so the family's class (`GPT2LMHeadModel`,
`LlamaForCausalLM`).from_pretrained(OUT) and `AutoTokenizer.from_pretrained(OUT)` load it; config.json carries the
tokenizer's end- and start-of-text ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.hf import parse_size, save_hf_checkpoint
from trainer3d.data import BUNDLED_TOKENIZER_DIR, load_tokenizer
from trainer3d.errors import CheckpointError, DataError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}


def _tokenizer_dir(name: str | None, scratch: Path) -> tuple[Path | None, str | None]:
    """(directory to copy, warning) for the tokenizer a run used: None -> the bundled GPT-2 BPE, a tokenizer folder as
    is; a model directory (--init-from-hf's, which holds the tokenizer beside config.json and the weights) or a Hugging
    Face name: the tokenizer alone, saved from it."""
    if name is None or (name in ("gpt2", "openai-community/gpt2") and not os.path.exists(name)):
        return BUNDLED_TOKENIZER_DIR, None
    if name.lower() == "none":
        return None, None
    if os.path.isdir(name) and not (Path(name) / "config.json").exists():
        return Path(name), None
    try:
        load_tokenizer(name).save_pretrained(str(scratch))
    except (DataError, OSError) as e:
        return None, f"tokenizer {name!r} not exported ({e}); copy its files into the output yourself"
    return scratch, None


def _special_ids(tok_dir: Path | None, vocab_size: int) -> dict:
    """config.json's eos/bos token ids from the tokenizer shipped with the export (generation stops on eos), where
    the model's vocabulary has them."""
    if tok_dir is None:
        return {}
    try:
        tok = load_tokenizer(str(tok_dir))
    except DataError:
        return {}
    ids = {"eos_token_id": tok.eos_token_id, "bos_token_id": tok.bos_token_id}
    return {k: v for k, v in ids.items() if v is not None and v < vocab_size}


class CheckpointWeights(Mapping):
    """A checkpoint's canonical parameters as a mapping that reads each whole tensor only when asked for it (from
    every piece that holds a part of it), so an export holds one output file's tensors at a time."""

    def __init__(self, ckpt: Checkpoint):
        self.ckpt, self.names = ckpt, list(ckpt.shapes)

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.ckpt.model_tensor(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def export(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
           tokenizer: str | None = "run", overwrite: bool = False, max_shard_size: int | str = "5GB") -> Path:
    """Write `out_dir` from a checkpoint; `tokenizer`: "run" (what the run used), a folder, or "none"."""
    ckpt = Checkpoint(resolve_checkpoint(ckpt_path))
    ckpt.verify_files([f for f in ckpt.meta["files"] if not f.startswith(("optim-", "rng-"))])  # (format 1's)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it or choose another directory.")
    mcfg = ckpt.model_config
    state = CheckpointWeights(ckpt)
    name = ckpt.meta["config"].get("tokenizer") if tokenizer == "run" else tokenizer
    with tempfile.TemporaryDirectory() as scratch:
        tok_dir, warning = _tokenizer_dir(name, Path(scratch))
        if warning:
            print(f"trainer3d.export: warning: {warning}", file=sys.stderr)
        ids = _special_ids(tok_dir, mcfg.vocab_size)
        try:
            save_hf_checkpoint(mcfg, state, out, tokenizer_dir=tok_dir, dtype=dtype, overwrite=overwrite,
                               max_shard_size=max_shard_size, **ids)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"could not write {out} ({e}).") from None
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m trainer3d.export",
        description="Write a Hugging Face directory (GPT2LMHeadModel, LlamaForCausalLM) from a trainer3d checkpoint "
                    "(any layout).",
    )
    p.add_argument("checkpoint", help="step_* directory, checkpoints directory, or a run's --out-dir")
    p.add_argument("out", help="output directory (save_pretrained format)")
    p.add_argument("--dtype", default="float32", choices=sorted(DTYPES))
    p.add_argument("--tokenizer", default="run",
                   help="tokenizer folder to copy, 'none', or 'run' (default: the one the run used)")
    p.add_argument("--overwrite", action="store_true", help="replace OUT if it exists")
    p.add_argument("--max-shard-size", default="5GB",
                   help="largest weights file, as Hugging Face spells it (5GB, 500MiB, bytes); bigger models are "
                        "split into model-0000k-of-0000n.safetensors with model.safetensors.index.json")
    args = p.parse_args(argv)
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        p.error(str(e))
    try:
        out = export(args.checkpoint, args.out, DTYPES[args.dtype], args.tokenizer, args.overwrite,
                     args.max_shard_size)
    except CheckpointError as e:
        print(f"trainer3d.export: error: {e}", file=sys.stderr)
        return 2
    print(f"trainer3d.export: wrote {out} ({json.loads((out / 'config.json').read_text())['architectures'][0]}, "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
