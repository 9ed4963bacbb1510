"""Starting a run from a Hugging Face GPT2LMHeadModel directory (--init-from-hf): its shape, checked before any
process group, and the `full_value` hook that materializes each rank's shards from its weights."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Callable

import torch

from trainer3d.checkpoint.format import shape_diffs
from trainer3d.checkpoint.hf import CONFIG_NAME, gpt_config_from_hf, load_hf_checkpoint
from trainer3d.errors import CheckpointError, first_line
from trainer3d.model import GPTConfig, canonical_name


def hf_model_config(path: str | os.PathLike) -> GPTConfig:
    """Our GPTConfig from a Hugging Face directory's config.json (shapes only; nothing else is read)."""
    p = Path(path)
    if not (p / CONFIG_NAME).is_file():
        raise CheckpointError(
            f"--init-from-hf {p}: {p / CONFIG_NAME} does not exist; pass a GPT2LMHeadModel save_pretrained directory."
        )
    try:
        return gpt_config_from_hf(json.loads((p / CONFIG_NAME).read_text()), dropout=0.0)
    except ValueError as e:
        raise CheckpointError(f"--init-from-hf {p}: {p / CONFIG_NAME} cannot be used ({first_line(e)}).") from None


def hf_full_value(path: str | os.PathLike, mcfg: GPTConfig) -> Callable[[str, tuple], torch.Tensor]:
    """The `full_value` hook from a Hugging Face GPT2LMHeadModel directory, after checking its shape is `mcfg`'s."""
    try:
        hcfg, state = load_hf_checkpoint(path, dropout=mcfg.dropout)
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--init-from-hf {path}: {first_line(e)}.") from None
    diffs = shape_diffs(hcfg, mcfg)
    if diffs:
        raise CheckpointError(
            f"--init-from-hf {path} holds a different model shape: {', '.join(diffs)}; drop the conflicting "
            "--n-layer/--n-head/--n-embd/--vocab-size flags (the model's shape comes from its config.json)."
        )

    def value(name: str, shape: tuple) -> torch.Tensor:
        return state[canonical_name(name)]

    return value
