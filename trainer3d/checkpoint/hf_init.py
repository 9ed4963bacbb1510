"""Starting a run from a Hugging Face directory of any known family (--init-from-hf): its config, checked before any
process group, and the `shard_value` hook that materializes each rank's shards from its weights, one tensor at a time
(a rank reads only the tensors of its own stages)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable


from trainer3d.checkpoint.hf import CONFIG_NAME, HFDirectory, read_hf_config
from trainer3d.errors import CheckpointError, first_line
from trainer3d.models import canonical_name, shape_diffs
from trainer3d.parallel.tensor_parallel import from_full


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


def hf_shard_value(path: str | os.PathLike, mcfg) -> Callable:
    """The `shard_value` hook (parallel/tensor_parallel.materialize) from a Hugging Face directory, after checking that its tensors (headers) fit `mcfg`."""
    try:
        directory = HFDirectory(path, dropout=mcfg.dropout)
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

    return from_full(lambda name, shape: directory.tensor(canonical_name(mcfg, name)).float())
