"""The Hugging Face directory a run started from (--init-from-hf), as far as an export of the run needs it: the
tensors the family neither trains nor drops (HFAdapter.passthrough: a multimodal model's vision tower, Qwen3.5's
multi-token-prediction module) and the config.json that wraps the language model (a Qwen3_5ForConditionalGeneration's).

Why by reference and not copied into every checkpoint: such tensors are gigabytes (Qwen3.5-397B's MTP module is one
MoE block of 512 experts) and never change; each checkpoint records where they are, their shapes and the config
(`record`), and the export reads them from there, checked (`open_source`), refusing in one sentence if the directory
is gone or changed."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from trainer3d.checkpoint.hf import CONFIG_NAME, HFDirectory
from trainer3d.errors import CheckpointError


def record(directory: HFDirectory) -> dict | None:
    """What a checkpoint keeps of the directory a run started from: None where an export needs nothing of it."""
    tensors = directory.passthrough()
    if not tensors:
        return None
    return {"path": str(directory.root.resolve()), "config": json.loads((directory.root / CONFIG_NAME).read_text()),
            "tensors": {name: list(shape) for name, shape in tensors.items()}}


class SourceTensors:
    """The recorded directory, opened and checked: its config (`config`), and each recorded tensor (`read`)."""

    def __init__(self, kept: dict):
        self.config, self.shapes = kept["config"], {k: tuple(v) for k, v in kept["tensors"].items()}
        root = Path(kept["path"])
        what = f"the {len(self.shapes)} tensors this export copies unchanged (e.g. {next(iter(self.shapes))})"
        try:
            self.directory = HFDirectory(root)
            found = self.directory.passthrough()
        except (OSError, ValueError) as e:
            raise CheckpointError(f"The run started from {root}, which holds {what}, and it cannot be read now ({e}); "
                                  "restore that directory and export again.") from None
        changed = sorted(n for n, shape in self.shapes.items() if found.get(n) != shape)
        if changed:
            raise CheckpointError(f"{root} no longer holds {what} as the run recorded them ({changed[0]} is missing or "
                                  "of another shape); restore the directory the run started from and export again.")

    def read(self, name: str) -> torch.Tensor:
        return self.directory.hf_tensor(name)


def open_source(meta: dict) -> SourceTensors | None:
    """The source a checkpoint's meta.json recorded, opened and checked; None where it recorded none."""
    kept = meta.get("hf_source")
    return None if kept is None else SourceTensors(kept)
