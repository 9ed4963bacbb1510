"""Export a trainer3d checkpoint as a Hugging Face `save_pretrained` directory, without any process group:

    python -m trainer3d.export CKPT OUT [--dtype float32|bfloat16|float16] [--tokenizer DIR|none] [--overwrite]
                                        [--max-shard-size 5GB] [--eos-token TOKEN] [--adapter]

CKPT is a checkpoint directory (`<out-dir>/checkpoints/step_000123`), a `checkpoints` directory or a run's
--out-dir (both follow `latest`). The layout-free pieces are read directly (any layout saved them), tensor by
tensor, every file's sha256 is checked, and OUT is written atomically by hf_save.save_hf_checkpoint with the
tokenizer the run used (the bundled GPT-2 BPE unless the run passed --tokenizer), so the family's class (its
adapter's `hf.architecture`) .from_pretrained(OUT) and `AutoTokenizer.from_pretrained(OUT)` load it.

So that `generate` stops where a reply ends, generation_config.json and config.json list the ids that end one (the
chat template's end of turn, e.g. <|im_end|>, then the eos; --eos-token, or the run's, names another), and a chat
run's tokenizer is shipped with that end of turn as its eos, its --chat-template and the model's context as
model_max_length (data/export_tokenizer.py).

A LoRA run's checkpoint exports merged into its base (each targeted weight plus s · B A), or with --adapter as a PEFT
adapter directory (adapter_config.json, adapter_model.safetensors) that PeftModel.from_pretrained loads over the base.
"""

from __future__ import annotations

import json
import os
import sys
import tempfile
from collections.abc import Mapping
from pathlib import Path

import torch

from trainer3d.checkpoint.format import Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.hf import hf_tables
from trainer3d.checkpoint.hf_source import open_source
from trainer3d.checkpoint.hf_save import parse_size, save_hf_checkpoint
from trainer3d.checkpoint.peft import write_adapter
from trainer3d.data.chat import read_template
from trainer3d.data.export_tokenizer import export_tokenizer, special_ids, tokenizer_dir
from trainer3d.errors import ArgumentParser, CheckpointError, DataError, UsageError, report
from trainer3d.models import FAMILIES, canonical_tables

DTYPES = {
    "float32": torch.float32, "fp32": torch.float32,
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16,
}
class CheckpointWeights(Mapping):
    """A checkpoint's canonical parameters, and the tables the family's Hugging Face format holds (a router's learned
    bias: checkpoint.hf.hf_tables), as a mapping that reads each whole tensor only when asked for it (from every piece that
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


def check_tables_fit(ckpt: Checkpoint) -> None:
    """A learned table the family's Hugging Face format has no place for (a selection bias on a softmax router:
    Qwen3-MoE's, Mixtral's) would be dropped, and the exported model route otherwise than the checkpoint: refused,
    naming it. Zeros (the initial value) lose nothing."""
    mcfg = ckpt.model_config
    held = hf_tables(mcfg)
    for name, shape in canonical_tables(mcfg).items():
        saved = None if name in held else ckpt.table(name, tuple(shape))
        if saved is not None and bool(saved.abs().max() > 0):
            raise CheckpointError(
                f"{ckpt.path} holds a learned {name} (a router's selection bias, nonzero) that the "
                f"{mcfg.family} Hugging Face format has no place for, so the exported model would route otherwise; "
                f"evaluate or sample it from the checkpoint (trainer3d.evaluate, trainer3d.sample) instead.")


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
    check_tables_fit(ckpt)
    source = open_source(ckpt.meta)  # the untrained tensors (a vision tower) and wrapper of the --init-from-hf dir
    state = CheckpointWeights(ckpt)
    name = run.get("tokenizer") if tokenizer == "run" else tokenizer
    template = run.get("chat_template") if tokenizer == "run" else None
    template = read_template(template) if template else None
    with tempfile.TemporaryDirectory() as scratch:
        trust = bool(run.get("trust_remote_code")) and tokenizer == "run"  # the run's --trust-remote-code
        tok_dir, warning = tokenizer_dir(name, Path(scratch) / "source", trust)
        if warning:
            print(f"trainer3d.export: warning: {warning}", file=sys.stderr)
        if tok_dir is None and eos_token is not None:
            raise DataError("--eos-token names a token of the tokenizer, and this export ships none; drop --eos-token "
                            "or --tokenizer none.")
        eos_token = eos_token or run.get("eos_token")
        chat = run.get("data_format", "text") != "text" or template is not None or eos_token is not None
        shipped = None if tok_dir is None else export_tokenizer(
            tok_dir, Path(scratch) / "tokenizer", mcfg.n_positions, eos_token, template, chat, trust)
        ids, generation = ({}, None) if shipped is None else special_ids(shipped[1], shipped[2], mcfg.vocab_size)
        try:
            save_hf_checkpoint(mcfg, state, out, tokenizer_dir=tok_dir if shipped is None else shipped[0],
                               dtype=dtype, overwrite=overwrite, max_shard_size=max_shard_size, generation=generation,
                               source=source, **ids)
        except (OSError, ValueError, TypeError) as e:
            raise CheckpointError(f"could not write {out} ({e}).") from None
    return out


def export_adapter(ckpt_path: str | os.PathLike, out_dir: str | os.PathLike, dtype: torch.dtype = torch.float32,
                   overwrite: bool = False) -> Path:
    """A LoRA checkpoint's adapters as a PEFT directory over the base the run started from."""
    ckpt = Checkpoint(resolve_checkpoint(ckpt_path))
    if ckpt.lora is None:
        raise CheckpointError(f"{ckpt.path} holds no LoRA adapters (the run trained every weight); export it without "
                              "--adapter.")
    ckpt.verify_files([f for f in ckpt.meta["files"] if not f.startswith(("optim-", "rng-"))])
    out = Path(out_dir)
    if out.exists() and not overwrite:
        raise CheckpointError(f"{out} already exists; pass --overwrite to replace it or choose another directory.")
    adapters = {name: ckpt.adapter_tensor(name) for name in ckpt.saved_shapes}
    write_adapter(out, ckpt.model_config, ckpt.lora_spec, adapters, dtype, ckpt.lora["base"].get("path"))
    return out


def main(argv: list[str] | None = None) -> int:
    p = ArgumentParser(
        prog="python -m trainer3d.export",
        description=f"Write a Hugging Face directory "
                    f"({', '.join(sorted({f.hf.architecture for f in FAMILIES.values()}))}) from a trainer3d "
                    "checkpoint (any layout).",
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
    p.add_argument("--adapter", action="store_true",
                   help="a LoRA run: write its adapters as a PEFT directory (default: merged into the base)")
    args = p.parse_args(argv)
    if args.adapter:
        try:
            out = export_adapter(args.checkpoint, args.out, DTYPES[args.dtype], args.overwrite)
        except UsageError as e:
            return report(e)
        print(f"trainer3d.export: wrote {out} (a PEFT LoRA adapter, {args.dtype})")
        return 0
    try:
        parse_size(args.max_shard_size)
    except ValueError as e:
        p.error(str(e))
    try:
        out = export(args.checkpoint, args.out, DTYPES[args.dtype], args.tokenizer, args.overwrite,
                     args.max_shard_size, args.eos_token)
    except UsageError as e:
        return report(e)
    architecture = json.loads((Path(out) / "config.json").read_text())["architectures"][0]  # a MoE's, not its family's
    print(f"trainer3d.export: wrote {out} ({architecture}, {args.dtype})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
