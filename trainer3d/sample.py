"""Generate text from a checkpoint, without any process group:

    python -m trainer3d.sample CKPT [--prompt TEXT] [--max-new-tokens N] [--temperature T] [--top-k K] [--seed S]
                                    [--num-samples N] [--device cpu|cuda] [--dtype float32|bfloat16|float16]
                                    [--chat [--system TEXT]] [--eos-token TOKEN]

CKPT is a checkpoint directory (`<out-dir>/checkpoints/step_000123`), a `checkpoints` directory or a run's --out-dir
(both follow `latest`), or a Hugging Face directory written by `python -m trainer3d.export`. The weights are read
from safetensors (nothing is unpickled) into the plain model, the prompt is encoded with the tokenizer the run used,
and the samples are drawn with a KV cache (trainer3d/generate.py) from one CPU generator seeded with --seed, so a
seed prints the same text on every run. Samples go to stdout, one header line each; timing goes to stderr. With --chat
the prompt is a user's turn (after --system's, if given), rendered by the tokenizer's chat template with the
assistant's generation prompt, as transformers' `apply_chat_template(..., add_generation_prompt=True)` renders it (the
run's --chat-template where one replaced the tokenizer's), and each sample is the assistant's reply: it stops at the
template's end of turn or the tokenizer's eos (data/turn_end.py; --eos-token, or the run's, names another), as the
export's generation_config.json makes transformers' `generate` stop, and is printed without it. Without --chat a
sample stops at the tokenizer's eos (or at --eos-token).
Bad input (not a checkpoint, a bad number, a prompt longer than the context) is one sentence and exit code 2,
before any weights are read.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path
from typing import Callable, NamedTuple

import torch

from trainer3d.checkpoint.format import META, Checkpoint, resolve_checkpoint
from trainer3d.checkpoint.hf import GENERATION_CONFIG_NAME, load_hf_checkpoint, read_hf_config
from trainer3d.data import load_tokenizer
from trainer3d.data.tokenizer import has_tokenizer_files
from trainer3d.data.turn_end import end_of_turn_ids
from trainer3d.errors import ArgumentParser, CheckpointError, UsageError, first_line, report
from trainer3d.data.chat import read_template
from trainer3d.export import DTYPES
from trainer3d.generate import generate, new_token_budget
from trainer3d.models import CausalLM, plain_model

MAX_SEED = 2**63 - 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = ArgumentParser(prog="python -m trainer3d.sample", description="Generate text from a trainer3d checkpoint.")
    p.add_argument("checkpoint", help="step_* directory, checkpoints directory, a run's --out-dir, or an HF export")
    p.add_argument("--prompt", default="", help="text to continue (default: start from the end-of-text token)")
    p.add_argument("--max-new-tokens", type=int, default=200, help="tokens to add per sample (default 200)")
    p.add_argument("--temperature", type=float, default=0.8, help="0 picks the likeliest token (default 0.8)")
    p.add_argument("--top-k", type=int, default=200, help="sample among the k likeliest tokens (default 200)")
    p.add_argument("--seed", type=int, default=1337)
    p.add_argument("--num-samples", type=int, default=1)
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if available, else cpu")
    p.add_argument("--dtype", choices=sorted(DTYPES), default="float32")
    p.add_argument("--chat", action="store_true", help="--prompt is a user's turn, rendered by the chat template")
    p.add_argument("--system", default=None, help="with --chat: a system turn before the user's")
    p.add_argument("--eos-token", default=None, metavar="TOKEN",
                   help="the token that ends a sample (default with --chat: the run's --eos-token, else the chat "
                        "template's end of turn; without: the tokenizer's eos)")
    p.add_argument("--trust-remote-code", action="store_true",
                   help="run the code a Hugging Face directory's tokenizer ships (a checkpoint follows its run's flag)")
    return p.parse_args(argv)


def check_args(args: argparse.Namespace) -> None:
    """The numbers and the device, before anything is read."""
    if not math.isfinite(args.temperature) or args.temperature < 0:
        raise UsageError(f"--temperature must be a finite number at least 0 (got {args.temperature}).")
    for flag, value in (("--top-k", args.top_k), ("--max-new-tokens", args.max_new_tokens),
                        ("--num-samples", args.num_samples)):
        if value < 1:
            raise UsageError(f"{flag} must be at least 1 (got {value}).")
    if not 0 <= args.seed <= MAX_SEED:
        raise UsageError(f"--seed must be in [0, {MAX_SEED}] (got {args.seed}).")
    if args.system is not None and not args.chat:
        raise UsageError("--system is a turn of a conversation; add --chat.")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise UsageError("--device cuda needs a CUDA GPU and torch sees none; use --device cpu.")


class Source(NamedTuple):
    """What is read and checked before the weights: the model config, the tokenizer the weights were trained with,
    a function reading the canonical state dict, and what ends a chat reply (the run's --chat-template file and
    --eos-token; an export's generation_config.json ids)."""
    cfg: object
    tokenizer: str | None
    read_state: Callable[[], dict[str, torch.Tensor]]
    chat_template: str | None = None
    eos_token: str | None = None
    stop_ids: tuple[int, ...] = ()
    trust_remote_code: bool = False  # the run's --trust-remote-code (its tokenizer's own code)


def open_source(path: str) -> Source:
    """The checkpoint or Hugging Face directory at `path`, everything but its weights read and checked."""
    p = Path(path)
    if p.is_dir() and (p / "config.json").is_file() and not (p / META).is_file():  # a Hugging Face directory
        try:
            cfg = read_hf_config(p, dropout=0.0)[1]
        except (OSError, ValueError) as e:
            raise CheckpointError(f"{p / 'config.json'} cannot be used ({first_line(e)}).") from None
        tokenizer = str(p) if has_tokenizer_files(p) else None

        def read_hf() -> dict[str, torch.Tensor]:
            try:
                return load_hf_checkpoint(p, dropout=0.0, dtype=None)[1]
            except (OSError, ValueError, KeyError, TypeError) as e:
                raise CheckpointError(f"{p} cannot be loaded ({first_line(e)}).") from None

        return Source(cfg, tokenizer, read_hf, stop_ids=_generation_stops(p))
    ckpt = Checkpoint(resolve_checkpoint(p))

    def read_checkpoint() -> dict[str, torch.Tensor]:
        ckpt.verify_files([f for f in ckpt.meta["files"] if f.startswith("model-")])
        return {**ckpt.model_state(), **ckpt.model_tables()}  # the routers' selection biases as trained

    run = ckpt.meta["config"]
    return Source(ckpt.model_config, run.get("tokenizer"), read_checkpoint, run.get("chat_template"),
                  run.get("eos_token"), trust_remote_code=bool(run.get("trust_remote_code")))


def _generation_stops(directory: Path) -> tuple[int, ...]:
    """The eos ids of an export's generation_config.json (an unreadable one adds none)."""
    try:
        ids = json.loads((directory / GENERATION_CONFIG_NAME).read_text()).get("eos_token_id")
    except (OSError, ValueError, AttributeError):
        return ()
    ids = [ids] if isinstance(ids, int) else ids if isinstance(ids, list) else []
    return tuple(i for i in ids if isinstance(i, int))


def stop_ids(tok, args: argparse.Namespace, source: Source) -> list[int]:
    """The ids a sample ends at: with --chat the end of turn and the eos (and an export's generation config's);
    without, the tokenizer's eos, or --eos-token's."""
    if not args.chat:
        return end_of_turn_ids(tok, args.eos_token) if args.eos_token else [tok.eos_token_id]
    ids = end_of_turn_ids(tok, args.eos_token or source.eos_token)
    return ids + [i for i in source.stop_ids if i not in ids]


def chat_prompt(tok, prompt: str, system: str | None) -> list[int]:
    """The conversation [system, user] rendered by the chat template up to the assistant's turn, tokenized with
    nothing added (what the model saw in training: data/chat.py)."""
    from trainer3d.data.chat import check_chat_tokenizer, render

    check_chat_tokenizer(tok, "of this checkpoint")
    turns = ([{"role": "system", "content": system}] if system is not None else []) + [
        {"role": "user", "content": prompt}]
    return tok(render(tok, turns, generation_prompt=True), add_special_tokens=False)["input_ids"]


def encode_prompt(tok, prompt: str, cfg, chat: bool = False, system: str | None = None) -> list[int]:
    """The prompt's token ids (the end-of-text token for an empty prompt, as GPT-2 starts a document; with `chat`,
    the rendered conversation), checked against the model's vocabulary and context."""
    if chat:
        ids = chat_prompt(tok, prompt, system)
    else:
        ids = tok.encode(prompt) if prompt else [tok.eos_token_id]
    bad = [i for i in ids if i >= cfg.vocab_size]
    if bad:
        what = "--prompt" if prompt else "The end-of-text token that starts an empty --prompt"
        raise UsageError(
            f"{what} encodes to token id {bad[0]}, outside the model's vocabulary of {cfg.vocab_size}; "
            "use text the model's tokenizer covers."
        )
    if len(ids) >= cfg.n_positions:
        raise UsageError(
            f"--prompt is {len(ids)} tokens but the model's context is {cfg.n_positions} positions; shorten it to at "
            f"most {cfg.n_positions - 1} tokens."
        )
    return ids


def build_model(cfg, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The family's plain model holding `state` (canonical names), in eval mode."""
    try:
        return plain_model(cfg, state, device, dtype)
    except ValueError as e:
        raise CheckpointError(f"{first_line(e)}.") from None


def load_source(args: argparse.Namespace) -> tuple[Source, object, list[int], list[int]]:
    """(the source, its tokenizer, the prompt's ids, the ids a sample ends at), every input checked, no weights read."""
    source = open_source(args.checkpoint)
    tok = load_tokenizer(source.tokenizer, source.trust_remote_code or args.trust_remote_code)
    if args.chat and source.chat_template:
        tok.chat_template = read_template(source.chat_template)
    ids = encode_prompt(tok, args.prompt, source.cfg, args.chat, args.system)
    return source, tok, ids, stop_ids(tok, args, source)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    try:
        check_args(args)
        source, tok, ids, stops = load_source(args)
        cfg = source.cfg
        device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        model = build_model(cfg, source.read_state(), device, DTYPES[args.dtype])
    except UsageError as e:
        return report(e)
    n = new_token_budget(len(ids), args.max_new_tokens, cfg.n_positions)
    if n < args.max_new_tokens:
        print(f"trainer3d.sample: note: {n} new tokens, not {args.max_new_tokens}: the sequence stops at the model's "
              f"context of {cfg.n_positions} positions.", file=sys.stderr)
    prompt = torch.tensor([ids] * args.num_samples, device=device)
    generator = torch.Generator().manual_seed(args.seed)  # on the CPU: the same draws whatever the device
    t0 = time.perf_counter()
    out = generate(model, prompt, args.max_new_tokens, args.temperature, args.top_k, generator, stops)
    seconds = time.perf_counter() - t0
    new = out[:, len(ids):].tolist()
    for i, row in enumerate(new):
        row = row[: next((k for k, t in enumerate(row) if t in stops), len(row))]  # without the stop token
        text = tok.decode(ids + row) if args.prompt and not args.chat else tok.decode(row)
        print(f"--- sample {i + 1} of {args.num_samples} ---")
        print(text)
    print(f"trainer3d.sample: {args.num_samples} sample(s), {out.shape[1] - len(ids)} steps in {seconds:.2f} s "
          f"({out[:, len(ids):].numel() / max(seconds, 1e-9):.0f} tokens/s, {device.type}, {args.dtype}, "
          f"seed {args.seed})", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
