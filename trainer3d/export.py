"""Export a trainer3d checkpoint as a Hugging Face `save_pretrained` directory, without any process group:

    python -m trainer3d.export CKPT OUT [--dtype float32|bfloat16|float16] [--tokenizer DIR|none] [--overwrite]
                                        [--max-shard-size 5GB] [--eos-token TOKEN]

CKPT is a checkpoint directory (`<out-dir>/checkpoints/step_000123`), a `checkpoints` directory or a run's
--out-dir (both follow `latest`). The layout-free pieces are read directly (any layout saved them), tensor by
tensor, every file's sha256 is checked, and OUT is written atomically by hf.save_hf_checkpoint with the tokenizer the run used
(the bundled GPT-2 BPE unless the run passed --tokenizer), so the family's class (`GPT2LMHeadModel`,
`LlamaForCausalLM`).from_pretrained(OUT) and `AutoTokenizer.from_pretrained(OUT)` load it.

So that `generate` stops where a reply ends, generation_config.json and config.json list the ids that end one
(data/turn_end.py: the chat template's end of turn, e.g. <|im_end|>, then the tokenizer's eos; --eos-token, or the
run's, names another), a chat run's exported tokenizer has that end of turn as its eos_token (as TRL saves chat
fine-tunes; the old eos stays as the pad token where there was none; a text run's keeps the eos its documents end
with), its chat template is the run's --chat-template where one replaced
the tokenizer's, and its model_max_length is the model's context (not transformers' 1e30 "unset" sentinel).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.hf import hf_tables, parse_size, save_hf_checkpoint
from trainer3d.data import BUNDLED_TOKENIZER_DIR, load_tokenizer
from trainer3d.data.chat import read_template
from trainer3d.data.turn_end import end_of_turn_ids
from trainer3d.errors import CheckpointError, DataError, UsageError

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
UNSET_MAX_LENGTH = 1e29  # transformers' model_max_length when a tokenizer names none is VERY_LARGE_INTEGER, 1e30


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


def export_tokenizer(src: Path, scratch: Path, n_positions: int, eos_token: str | None = None,
                     chat_template: str | None = None, chat: bool = True) -> tuple[Path, object, list[int]] | None:
    """(the tokenizer directory to ship, the tokenizer as shipped, the ids that end a reply): the tokenizer under
    `src` with the run's `chat_template` text, the model's context as model_max_length and, for a `chat` run, its end
    of turn as eos_token (the old eos as pad where it had none; a text run keeps its eos, which its documents end
    with), written to `scratch` only where one of them changed. None where transformers cannot load `src` (its
    files are then shipped as they are)."""
    from transformers import AutoTokenizer

    try:
        tok = AutoTokenizer.from_pretrained(str(src))
    except Exception:  # noqa: BLE001 - what load_tokenizer refuses; the export ships the files as they are
        return None
    changed = chat_template is not None and chat_template != tok.chat_template
    if changed:
        tok.chat_template = chat_template
    stop = end_of_turn_ids(tok, eos_token)
    end = tok.convert_ids_to_tokens(stop[0]) if stop else tok.eos_token
    if chat and end != tok.eos_token:
        if tok.pad_token is None:
            tok.pad_token = tok.eos_token
        tok.eos_token, changed = end, True
    if tok.model_max_length > UNSET_MAX_LENGTH or tok.model_max_length > n_positions:
        tok.model_max_length, changed = n_positions, True
    if not changed:
        return src, tok, stop
    shutil.copytree(src, scratch, dirs_exist_ok=True)  # files save_pretrained does not write (a README) go too
    tok.save_pretrained(str(scratch))
    return scratch, tok, stop


def special_ids(tok, stop: list[int], vocab_size: int) -> tuple[dict, dict]:
    """(config.json's eos/bos ids, generation_config.json's eos/bos/pad ids), where the model's vocabulary has them:
    the ids that end a reply, one as an int, several as a list (as published files spell them)."""
    stop = [i for i in stop if i < vocab_size]
    ids = {"eos_token_id": (stop[0] if len(stop) == 1 else stop) if stop else None, "bos_token_id": tok.bos_token_id}
    ids = {k: v for k, v in ids.items() if v is not None and (isinstance(v, list) or v < vocab_size)}
    generation = dict(ids)
    if tok.pad_token_id is not None and tok.pad_token_id < vocab_size:
        generation["pad_token_id"] = tok.pad_token_id
    return ids, generation


class CheckpointWeights(Mapping):
    """A checkpoint's canonical parameters, and the tables the family's Hugging Face format holds (a router's
    e_score_correction_bias), as a mapping that reads each whole tensor only when asked for it (from every piece that
    holds a part of it), so an export holds one output file's tensors at a time."""

    def __init__(self, ckpt: Checkpoint):
        self.tables = {name: tuple(shape) for name, (_, shape) in hf_tables(ckpt.model_config).items()}
        self.ckpt, self.names = ckpt, list(ckpt.shapes) + list(self.tables)

    def __getitem__(self, name: str) -> torch.Tensor:
        if name in self.tables:  # a checkpoint saved before the model had the table: its initial value, zeros
            saved = self.ckpt.table(name, self.tables[name])
            return torch.zeros(self.tables[name]) if saved is None else saved
        return self.ckpt.model_tensor(name)

    def __iter__(self):
        return iter(self.names)

    def __len__(self) -> int:
        return len(self.names)


def export(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
           tokenizer: str | None = "run", overwrite: bool = False, max_shard_size: int | str = "5GB",
           eos_token: str | None = None) -> Path:
    """Write `out_dir` from a checkpoint; `tokenizer`: "run" (what the run used, with its --chat-template), a
    folder, or "none"; `eos_token`: the token that ends a reply (default: the run's --eos-token, else the template's
    end of turn). Bad input raises before anything is written."""
    ckpt = Checkpoint(resolve_checkpoint(ckpt_path))
    ckpt.verify_files([f for f in ckpt.meta["files"] if not f.startswith(("optim-", "rng-"))])  # (format 1's)
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it or choose another directory.")
    mcfg, run = ckpt.model_config, ckpt.meta["config"]
    state = CheckpointWeights(ckpt)
    name = run.get("tokenizer") if tokenizer == "run" else tokenizer
    template = run.get("chat_template") if tokenizer == "run" else None
    template = read_template(template) if template else None
    with tempfile.TemporaryDirectory() as scratch:
        tok_dir, warning = _tokenizer_dir(name, Path(scratch) / "source")
        if warning:
            print(f"trainer3d.export: warning: {warning}", file=sys.stderr)
        if tok_dir is None and eos_token is not None:
            raise DataError("--eos-token names a token of the tokenizer, and this export ships none; drop --eos-token "
                            "or --tokenizer none.")
        eos_token = eos_token or run.get("eos_token")
        chat = run.get("data_format", "text") != "text" or template is not None or eos_token is not None
        shipped = None if tok_dir is None else export_tokenizer(
            tok_dir, Path(scratch) / "tokenizer", mcfg.n_positions, eos_token, template, chat)
        ids, generation = ({}, None) if shipped is None else special_ids(shipped[1], shipped[2], mcfg.vocab_size)
        try:
            save_hf_checkpoint(mcfg, state, out, tokenizer_dir=tok_dir if shipped is None else shipped[0],
                               dtype=dtype, overwrite=overwrite, max_shard_size=max_shard_size, generation=generation,
                               **ids)
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
    p.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="the token that ends a reply, for generation_config.json and the tokenizer's eos (default: "
                        "the run's --eos-token, else the chat template's end of turn, else the tokenizer's eos)")
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
                     args.max_shard_size, args.eos_token)
    except UsageError as e:
        print(f"trainer3d.export: error: {e}", file=sys.stderr)
        return 2
    print(f"trainer3d.export: wrote {out} ({json.loads((out / 'config.json').read_text())['architectures'][0]}, "
          f"{args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
