"""LoRA adapters <-> a PEFT adapter directory (`adapter_config.json` and `adapter_model.safetensors`, keys
`base_model.model.<Hugging Face module>.lora_A.weight` / `.lora_B.weight`), which `PeftModel.from_pretrained` loads
over the base. Our pairs of a fused linear (parallel/lora.py: A stacked by pair, B by rows) are PEFT's modules'
tensors stacked, so either way is a split or a concatenation along dim 0."""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from trainer3d.errors import CheckpointError, first_line
from trainer3d.fsio import temp_name, replace_durably, write_text_atomic
from trainer3d.parallel.lora import ALL_LINEAR, MARK, LoRASpec, Target, targets_by_linear

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def read_spec(path: str | os.PathLike) -> LoRASpec:
    """The rank, α, dropout, targets and scaling of a PEFT directory's adapter_config.json; CheckpointError naming
    the problem."""
    file = Path(path) / CONFIG
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--lora-from {path}: {file} cannot be read ({first_line(e)}).") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"--lora-from {path} holds a {raw['peft_type']} adapter; only LoRA is read.")
    unsupported = [k for k in ("use_dora", "target_parameters", "rank_pattern", "alpha_pattern", "exclude_modules",
                               "layers_to_transform", "layers_pattern", "modules_to_save", "lora_bias") if raw.get(k)]
    unsupported += ["bias"] if raw.get("bias", "none") != "none" else []
    if unsupported:
        raise CheckpointError(f"--lora-from {path} sets {', '.join(unsupported)}, which trainer3d's LoRA does not build.")
    targets = raw.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return LoRASpec(int(raw["r"]), float(raw.get("lora_alpha", 8)), float(raw.get("lora_dropout", 0.0)),
                    tuple("all-linear" if t == ALL_LINEAR else t for t in targets), bool(raw.get("use_rslora")))


def _keys(t: Target, factor: str) -> list[str]:
    return [f"{PREFIX}{p.hf_module}.lora_{factor}.weight" for p in t.pairs if p is not None]


def adapter_reader(path: str | os.PathLike, mcfg, spec: LoRASpec):
    """`full_value(name, shape)` of our adapter parameters from a PEFT directory (parallel/shards.from_full)."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"--lora-from {path}: {file} does not exist (a PEFT save_pretrained directory has it).")
    targets = targets_by_linear(mcfg, spec)
    with safe_open(str(file), framework="pt", device="cpu") as f:
        stored = set(f.keys())
    wanted = {k for t in targets.values() for factor in "AB" for k in _keys(t, factor)}
    missing, extra = sorted(wanted - stored), sorted(stored - wanted)
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which this model's targets do not name"
        raise CheckpointError(f"--lora-from {path} does not fit the base: its {WEIGHTS} {which}.")

    def full_value(name: str, shape: tuple) -> torch.Tensor:
        prefix, _, factor = name.rpartition(MARK)
        with safe_open(str(file), framework="pt", device="cpu") as f:
            value = torch.cat([f.get_tensor(k).float() for k in _keys(targets[prefix], factor)], dim=0)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"--lora-from {path}: {name}'s tensors have shape {tuple(value.shape)}, the run's "
                                  f"{tuple(shape)}.")
        return value

    return full_value


def peft_tensors(mcfg, spec: LoRASpec, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's tensors from our full adapter tensors (canonical names)."""
    targets, out = targets_by_linear(mcfg, spec), {}
    for name, value in adapters.items():
        prefix, _, factor = name.rpartition(MARK)
        t = targets[prefix]
        sizes = [spec.rank] * len(_keys(t, "A")) if factor == "A" else [p.rows for p in t.pairs if p is not None]
        for key, part in zip(_keys(t, factor), value.split(sizes, dim=0)):
            out[key] = part.contiguous()
    return out


def peft_config(mcfg, spec: LoRASpec, base: str | None) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for what the run built."""
    from trainer3d.models import family_of

    names = sorted({p.hf_module.rpartition(".")[2] for t in targets_by_linear(mcfg, spec).values()
                    for p in t.pairs if p is not None})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "use_rslora": spec.rslora, "target_modules": names, "bias": "none",
            "fan_in_fan_out": family_of(mcfg).name == "gpt2", "init_lora_weights": True, "inference_mode": True,
            "base_model_name_or_path": base, "modules_to_save": None}


def write_adapter(out_dir: str | os.PathLike, mcfg, spec: LoRASpec, adapters: dict[str, torch.Tensor],
                  dtype: torch.dtype, base: str | None) -> None:
    """A PEFT directory of `adapters` (canonical names -> full tensors), each file written atomically."""
    from safetensors.torch import save_file

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tensors = {k: v.to(dtype) for k, v in peft_tensors(mcfg, spec, adapters).items()}
    tmp = temp_name(out / WEIGHTS)
    save_file(tensors, str(tmp), metadata={"format": "pt"})
    replace_durably(tmp, out / WEIGHTS)
    write_text_atomic(out / CONFIG, json.dumps(peft_config(mcfg, spec, base), indent=2) + "\n")
