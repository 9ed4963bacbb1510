"""The model families and the one table of presets. A family is a folder (models/<family>/) and one line in FAMILIES;
everything else in trainer3d reaches a model through these functions and the declarations of interface.py."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from trainer3d.models import deepseek_v3, gpt2, llama, mixtral, qwen3, qwen3_5
from trainer3d.models.interface import CausalLM, ModelFamily, canonical_name as _canonical_name, shape_fields

FAMILIES: dict[str, ModelFamily] = {f.name: f for f in (gpt2.FAMILY, llama.FAMILY, qwen3.FAMILY, mixtral.FAMILY,
                                                         deepseek_v3.FAMILY, qwen3_5.FAMILY)}

# --model's choices and the planner's: every family's presets by name
MODEL_PRESETS: dict[str, Any] = {name: cfg for f in FAMILIES.values() for name, cfg in f.presets.items()}
assert len(MODEL_PRESETS) == sum(len(f.presets) for f in FAMILIES.values()), "two families share a preset name"


def family_of(cfg) -> ModelFamily:
    return FAMILIES[cfg.family]


def family_for_hf(model_type: str | None) -> ModelFamily | None:
    """The family whose Hugging Face adapter reads config.json's `model_type` (None: no family does)."""
    return next((f for f in FAMILIES.values() if model_type in f.hf.model_types), None)


def build_model(cfg) -> CausalLM:
    return family_of(cfg).build(cfg)


def canonical_name(cfg, name: str) -> str:
    """The layout-free name of a parameter (a tied head's weight is the embedding's)."""
    return _canonical_name(family_of(cfg).model_cls, cfg, name)


def init_value(cfg, name: str, shape: tuple, seed: int) -> torch.Tensor:
    """The initial value of the full (unsharded) parameter `name`: a pure function of its canonical name and the seed."""
    return family_of(cfg).init_value(cfg, canonical_name(cfg, name), tuple(shape), seed)


def canonical_shapes(cfg) -> dict[str, torch.Size]:
    """Canonical parameter names and full shapes (built on the meta device, so free); a tied head is not listed."""
    with torch.device("meta"):
        model = build_model(cfg)
    return {canonical_name(cfg, n): p.shape for n, p in model.named_parameters()}


def canonical_tables(cfg) -> dict[str, torch.Size]:
    """The model's tables that are state but no parameter (CausalLM.state_tables: routers' selection biases), by name
    and shape (built on the meta device, so free)."""
    with torch.device("meta"):
        model = build_model(cfg)
    model.init_tables(torch.device("meta"))
    return {n: t.shape for n, t in model.state_tables().items()}


def config_to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def config_from_dict(family: str, values: dict):
    """A family's config from `config_to_dict`'s output (meta.json); TypeError/KeyError on anything else. JSON wrote
    tuples (Qwen3's mlp_only_layers) as lists: they become tuples again (configs are frozen and hashed)."""
    return FAMILIES[family].config_cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in values.items()})


def shape_diffs(stored, now) -> list[str]:
    """Where weights on disk (`stored`) and this run's model (`now`) disagree, as 'field=stored (this run: now)'."""
    if stored.family != now.family:
        return [f"family={stored.family} (this run: {now.family})"]
    return [f"{k}={getattr(stored, k)} (this run: {getattr(now, k)})" for k in shape_fields(stored)
            if getattr(stored, k) != getattr(now, k)]


def plain_model(cfg, state: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> CausalLM:
    """The plain model holding `state` (canonical names), in eval mode on `device` (one process: sampling, tests).
    `state` may also hold tables (canonical_tables: a router's selection bias), kept in fp32; a table it lacks keeps
    its initial value."""
    with torch.device("meta"):
        model = build_model(cfg)
    tables = {k: v for k, v in state.items() if k in canonical_tables(cfg)}
    missing = set(canonical_shapes(cfg)) ^ (set(state) - set(tables))
    if missing:
        raise ValueError(f"the weights do not fit the model: {sorted(missing)[:4]} missing or unexpected")
    for name, _ in list(model.named_parameters()):
        module, _, key = name.rpartition(".")
        value = state[canonical_name(cfg, name)].to(device=device, dtype=dtype)
        model.get_submodule(module)._parameters[key] = torch.nn.Parameter(value, requires_grad=False)
    if cfg.tie_embeddings:
        model.head.weight = model.embedding.weight
    model.init_tables(device)
    for name, table in model.state_tables().items():
        if name in tables:
            table.copy_(tables[name].to(device=device, dtype=table.dtype))
    return model.eval()


__all__ = ["FAMILIES", "MODEL_PRESETS", "CausalLM", "ModelFamily", "build_model", "canonical_name", "canonical_shapes",
           "canonical_tables", "config_from_dict", "config_to_dict", "family_for_hf", "family_of", "init_value", "plain_model",
           "shape_diffs"]
