"""A LoRA run's checkpoint holds the adapters and the run's state, and the frozen base by reference: its
--init-from-hf directory and a fingerprint of it, or the seed it was initialised from (`record`). Resuming,
sampling, evaluating and exporting read the base from there (`Base`), refused in one sentence if it is gone or
differs; a merged tensor is the base's plus s · B A on each adapter's rows (`merged`).

Why by reference: the base is most of the bytes (140 GB for a 70B model in bf16) and never changes, so a checkpoint
of a 70B LoRA run is the adapters' megabytes and their AdamW moments. The fingerprint reads config.json and each
weight file's size and first and last MiB (a different model of the same shape differs there), not every byte."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import torch

from trainer3d.checkpoint.hf import CONFIG_NAME, WEIGHT_FILES, HFDirectory
from trainer3d.errors import CheckpointError, first_line
from trainer3d.models import init_value
from trainer3d.parallel.lora import EXPERT_PAIRS, MARK, LoRASpec, expert_targets, targets_by_linear

_EDGE = 1 << 20  # bytes read from each end of a weight file


def fingerprint(path: str | os.PathLike) -> str:
    """sha256 over config.json and every weight file's name, size and first and last MiB."""
    root, h = Path(path), hashlib.sha256()
    h.update((root / CONFIG_NAME).read_bytes())
    files = sorted(f for f in root.iterdir() if f.name in WEIGHT_FILES or f.suffix in (".safetensors", ".bin"))
    for f in files:
        size = f.stat().st_size
        h.update(f"{f.name}:{size}".encode())
        with open(f, "rb") as fh:
            h.update(fh.read(_EDGE))
            fh.seek(max(0, size - _EDGE))
            h.update(fh.read(_EDGE))
    return h.hexdigest()


def record(cfg, spec: LoRASpec) -> dict:
    """meta.json's `lora`: the adapters' settings and the base's identity."""
    base = {"seed": cfg.seed} if not cfg.init_from_hf else {
        "path": str(Path(cfg.init_from_hf).resolve()), "fingerprint": fingerprint(cfg.init_from_hf)}
    return {"rank": spec.rank, "alpha": spec.alpha, "dropout": spec.dropout, "targets": list(spec.targets),
            "rslora": spec.rslora, "base": base}


def spec_of(saved: dict) -> LoRASpec:
    return LoRASpec(saved["rank"], saved["alpha"], saved["dropout"], tuple(saved["targets"]), saved["rslora"])


class Base:
    """The frozen base a LoRA checkpoint names, checked: whole tensors (`tensor`) and a tp rank's shards
    (`shard_value`), by canonical name."""

    def __init__(self, saved: dict, mcfg, where: str):
        self.mcfg, self.base = mcfg, saved["base"]
        self.directory = None
        if "path" in self.base:
            path = self.base["path"]
            try:
                same = fingerprint(path) == self.base["fingerprint"]
                self.directory = HFDirectory(path, dropout=mcfg.dropout) if same else None
            except (OSError, ValueError) as e:
                raise CheckpointError(f"{where} holds LoRA adapters over the base in {path}, which cannot be read "
                                      f"({first_line(e)}); restore that directory.") from None
            if not same:
                raise CheckpointError(f"{where} holds LoRA adapters over the base in {path}, whose files have "
                                      "changed since (another fingerprint); restore the base the adapters were "
                                      "trained on.")

    def tensor(self, name: str, shape: tuple) -> torch.Tensor:
        if self.directory is not None:
            return self.directory.tensor(name).float()
        return init_value(self.mcfg, name, shape, self.base["seed"])

    def shard_value(self, name, spec, local_shape, rank, size) -> torch.Tensor:
        from trainer3d.checkpoint.hf_init import hf_shard_value
        from trainer3d.parallel.shards import from_full

        if self.directory is not None:
            return hf_shard_value(self.directory, self.mcfg)(name, spec, local_shape, rank, size)
        return from_full(lambda n, s: init_value(self.mcfg, n, s, self.base["seed"]))(
            name, spec, local_shape, rank, size)


def merged(mcfg, spec: LoRASpec, name: str, base: torch.Tensor, adapter) -> torch.Tensor:
    """Canonical weight `name` with its adapters merged in: W[rows of pair j] += s · B_j A_j. `adapter(name)`: a
    saved adapter tensor, whole."""
    prefix, _, weight = name.rpartition(".")
    if prefix in expert_targets(mcfg, spec) and weight in EXPERT_PAIRS:  # W_e + s · B_e A_e
        pair = f"{prefix}{MARK}{EXPERT_PAIRS[weight]}"
        return base + spec.scale * torch.bmm(adapter(f"{pair}.B"), adapter(f"{pair}.A"))
    target = targets_by_linear(mcfg, spec).get(name.removesuffix(".weight"))
    if target is None or not name.endswith(".weight"):
        return base
    prefix = name.removesuffix(".weight")
    A, B = adapter(f"{prefix}{MARK}A"), adapter(f"{prefix}{MARK}B")
    out, r = base.clone(), spec.rank
    offset, j, b_row = 0, 0, 0
    for pair, rows in zip(target.pairs, target.rows):
        if pair is not None:
            delta = B[b_row:b_row + rows] @ A[j * r:(j + 1) * r]
            out[offset:offset + rows] += spec.scale * delta
            j, b_row = j + 1, b_row + rows
        offset += rows
    return out
