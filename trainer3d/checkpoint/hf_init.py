"""Starting a run from a Hugging Face directory of any known family (--init-from-hf): its config, checked before any
process group, and the `shard_value` hook that materializes each rank's shards from its weights, reading only the
byte ranges of its own shard of its own stages' tensors."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable

import torch

from trainer3d.checkpoint.hf import CONFIG_NAME, HFDirectory, read_hf_config
from trainer3d.errors import CheckpointError, first_line
from trainer3d.models import canonical_name, shape_diffs


def hf_model_config(path: str | os.PathLike):
    """Our model config from a Hugging Face directory's config.json (shapes only; nothing else is read)."""
    p = Path(path)
    if not (p / CONFIG_NAME).is_file():
        raise CheckpointError(f"--init-from-hf {p}: {p / CONFIG_NAME} does not exist; pass a save_pretrained directory "
                              "(GPT2LMHeadModel or LlamaForCausalLM).")
    try:
        return read_hf_config(p, dropout=0.0)[1]
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--init-from-hf {p}: {p / CONFIG_NAME} cannot be used ({first_line(e)}).") from None


def open_hf(path: str | os.PathLike, mcfg) -> HFDirectory:
    """A Hugging Face directory whose tensors (headers) are checked to fit `mcfg`; CheckpointError otherwise."""
    try:
        directory = HFDirectory(path, dropout=mcfg.dropout, mtp_layers=getattr(mcfg, "mtp_layers", None))
        diffs = shape_diffs(directory.cfg, mcfg)
        if not diffs:
            directory.check()
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"--init-from-hf {path}: {first_line(e)}.") from None
    if diffs:
        raise CheckpointError(
            f"--init-from-hf {path} holds a different model shape: {', '.join(diffs)}; drop the conflicting "
            "--n-layer/--n-head/--n-embd/--vocab-size flags (the model's shape comes from its config.json)."
        )
    return directory


def hf_shard_value(directory: HFDirectory, mcfg) -> Callable:
    """The `shard_value` hook (parallel/tensor_parallel.materialize) that reads each rank's shards from `directory`.
    A shard holding nan or inf is noted in `directory.nonfinite` (the first one's Hugging Face names) rather than
    raised, so that every rank can refuse the directory together once its shards are read (`nonfinite_error`)."""

    def shard_value(name: str, spec, local_shape: tuple, tp_rank: int, tp: int) -> torch.Tensor:
        canonical = canonical_name(mcfg, name)
        value = directory.shard(canonical, spec, tuple(local_shape), tp_rank, tp)
        if directory.nonfinite is None and not bool(torch.isfinite(value).all()):
            directory.nonfinite = ", ".join(directory.adapter.sources(mcfg, canonical))
        return value

    return shard_value


def nonfinite_error(directory: HFDirectory) -> str | None:
    """The sentence refusing a directory some of whose weights this rank read are not finite, or None."""
    if directory.nonfinite is None:
        return None
    return (f"--init-from-hf {directory.root}: {directory.nonfinite} holds nan or inf values, which no training can "
            "start from; export the weights again from a healthy copy.")
