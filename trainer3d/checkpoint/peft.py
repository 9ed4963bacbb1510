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
from trainer3d.models.moe import Experts
from trainer3d.parallel.lora import (
    ALL_LINEAR, EXPERTS, MARK, LoRASpec, adapter_shapes, expert_targets, targets_by_linear,
)

CONFIG = "adapter_config.json"
WEIGHTS = "adapter_model.safetensors"
PREFIX = "base_model.model."


def expert_modules(mcfg) -> dict[str, str]:
    """Each mixture's experts (our prefix, `layers.3.mlp.experts`) -> the module of transformers' model that holds
    their stacked weights (the family adapter's HFAdapter.experts_module)."""
    from trainer3d.models import family_of

    hf = family_of(mcfg).hf
    return {prefix: hf.experts_module(mcfg, prefix)
            for prefix in expert_targets(mcfg, LoRASpec(1, 1.0, targets=(EXPERTS,)))}


def target_parameters(mcfg) -> list[str]:
    """PEFT's target_parameters for the experts' stacked weights, in Experts.STACKED's order (PEFT wraps the first
    innermost: its keys read `base_layer.`): each weight's Hugging Face name, as the dotted suffix every mixture of the
    model shares."""
    modules = list(expert_modules(mcfg).values())
    if not modules:
        return []
    names = [[f"{module}.{w}".split(".") for module in modules] for w in Experts.STACKED]
    shared = [next((k for k in range(1, min(map(len, ns)) + 1) if len({tuple(n[-k:]) for n in ns}) > 1), 0)
              for ns in names]  # the first suffix length at which they differ (0: never, up to the whole name)
    return [".".join(ns[0][-(k - 1):] if k else ns[0]) for ns, k in zip(names, shared)]


def read_spec(path: str | os.PathLike, mcfg) -> LoRASpec:
    """The rank, α, dropout, targets and scaling of a PEFT directory's adapter_config.json over the model `mcfg`;
    CheckpointError naming the problem."""
    file = Path(path) / CONFIG
    try:
        raw = json.loads(file.read_text())
    except (OSError, ValueError) as e:
        raise CheckpointError(f"--lora-from {path}: {file} cannot be read ({first_line(e)}).") from None
    if raw.get("peft_type", "LORA") != "LORA":
        raise CheckpointError(f"--lora-from {path} holds a {raw['peft_type']} adapter; only LoRA is read.")
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "exclude_modules", "layers_to_transform",
                               "layers_pattern", "modules_to_save", "lora_bias") if raw.get(k)]
    unsupported += ["bias"] if raw.get("bias", "none") != "none" else []
    experts = raw.get("target_parameters") or []
    ours = target_parameters(mcfg) if experts else []
    unsupported += [f"target_parameters other than the experts' {', '.join(ours) or '(this model has none)'}"] \
        if experts and sorted(experts) != sorted(ours) else []
    if unsupported:
        raise CheckpointError(f"--lora-from {path} sets {', '.join(unsupported)}, which trainer3d's LoRA does not build.")
    targets = raw.get("target_modules") or []
    targets = (targets,) if isinstance(targets, str) else tuple(sorted(targets))
    return LoRASpec(int(raw["r"]), float(raw.get("lora_alpha", 8)), float(raw.get("lora_dropout", 0.0)),
                    tuple("all-linear" if t == ALL_LINEAR else t for t in targets) + ((EXPERTS,) if experts else ()),
                    bool(raw.get("use_rslora")))


class PeftLayout:
    """Our adapter tensors <-> PEFT's keys and layouts. A linear's pairs: each HF module's A and B, stacked by rows in
    ours. An expert pair (target_parameters): PEFT nests the second parameter's wrapper over the first's, so gate_up's
    keys read `experts.base_layer.lora_*` and down's `experts.lora_*`; its A is ours [E, r, in] as [E·r, in], its B
    ours [E, out, r] as [out, r·E] with B_e[o, k] at column k·E + e."""

    def __init__(self, mcfg, spec: LoRASpec):
        self.spec, self.linears = spec, targets_by_linear(mcfg, spec)
        self.experts = {prefix: PREFIX + module for prefix, module in expert_modules(mcfg).items()} \
            if expert_targets(mcfg, spec) else {}

    def keys(self, name: str) -> list[str]:
        prefix, _, factor = name.rpartition(MARK)
        if prefix in self.experts:
            weight, _, factor = factor.partition(".")
            return [f"{self.experts[prefix]}{'.base_layer' if weight == 'gate_up' else ''}.lora_{factor}.weight"]
        return [f"{PREFIX}{p.hf_module}.lora_{factor}.weight" for p in self.linears[prefix].pairs if p is not None]

    def to_peft(self, name: str, value: torch.Tensor) -> dict[str, torch.Tensor]:
        prefix, _, factor = name.rpartition(MARK)
        if prefix in self.experts:
            flat = value.reshape(-1, value.shape[-1]) if factor.endswith("A") else value.permute(1, 2, 0).reshape(
                value.shape[1], -1)
            return {self.keys(name)[0]: flat.contiguous()}
        t = self.linears[prefix]
        sizes = [self.spec.rank] * len(self.keys(name)) if factor == "A" else [p.rows for p in t.pairs if p is not None]
        return {k: part.contiguous() for k, part in zip(self.keys(name), value.split(sizes, dim=0))}

    def from_peft(self, name: str, tensors: list[torch.Tensor], shape: tuple) -> torch.Tensor:
        prefix, _, factor = name.rpartition(MARK)
        if prefix in self.experts:
            E, r = shape[0], self.spec.rank
            t = tensors[0]
            return t.reshape(E, r, -1) if factor.endswith("A") else t.reshape(t.shape[0], r, E).permute(2, 0, 1)
        return torch.cat(tensors, dim=0)


def adapter_reader(path: str | os.PathLike, mcfg, spec: LoRASpec):
    """`full_value(name, shape)` of our adapter parameters from a PEFT directory (parallel/shards.from_full)."""
    from safetensors import safe_open

    file = Path(path) / WEIGHTS
    if not file.is_file():
        raise CheckpointError(f"--lora-from {path}: {file} does not exist (a PEFT save_pretrained directory has it).")
    layout = PeftLayout(mcfg, spec)
    f = safe_open(str(file), framework="pt", device="cpu")  # one handle, read tensor by tensor as they are asked for
    stored = set(f.keys())
    wanted = {k for name in adapter_shapes(mcfg, spec) for k in layout.keys(name)}
    missing, extra = sorted(wanted - stored), sorted(stored - wanted)
    if missing or extra:
        which = f"lacks {missing[0]}" if missing else f"holds {extra[0]}, which this model's targets do not name"
        raise CheckpointError(f"--lora-from {path} does not fit the base: its {WEIGHTS} {which}.")

    def full_value(name: str, shape: tuple) -> torch.Tensor:
        value = layout.from_peft(name, [f.get_tensor(k).float() for k in layout.keys(name)], shape)
        if tuple(value.shape) != tuple(shape):
            raise CheckpointError(f"--lora-from {path}: {name}'s tensors have shape {tuple(value.shape)}, the run's "
                                  f"{tuple(shape)}.")
        return value.contiguous()

    return full_value


def peft_tensors(mcfg, spec: LoRASpec, adapters: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """PEFT's tensors from our full adapter tensors (canonical names)."""
    layout = PeftLayout(mcfg, spec)
    return {k: v for name, value in adapters.items() for k, v in layout.to_peft(name, value).items()}


def peft_config(mcfg, spec: LoRASpec, base: str | None) -> dict:
    """adapter_config.json: PEFT's LoraConfig fields for what the run built."""
    from trainer3d.models import family_of

    names = sorted({p.hf_module.rpartition(".")[2] for t in targets_by_linear(mcfg, spec).values()
                    for p in t.pairs if p is not None})
    return {"peft_type": "LORA", "task_type": "CAUSAL_LM", "r": spec.rank, "lora_alpha": spec.alpha,
            "lora_dropout": spec.dropout, "use_rslora": spec.rslora, "target_modules": names, "bias": "none",
            "target_parameters": target_parameters(mcfg) if expert_targets(mcfg, spec) else None,
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
