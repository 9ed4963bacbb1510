"""TrainConfig: the run's configuration as a tree of sections (config/sections.py), which also answers by the flat
names every flag and script uses today: `TrainConfig(tp=2, seq_len=1024)`, `cfg.tp`, `dataclasses.replace(cfg,
lr=1e-5)` read and write the section that owns the name (each name is in one section only). A component that needs
one section can be handed it (`cfg.parallel`); checkpoints and W&B record the flat view (`flat()`), as before."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

from trainer3d.config.sections import (
    ArchConfig, BatchConfig, CheckpointConfig, DatasetConfig, EvalConfig, LoggingConfig, LoRAConfig, LossConfig,
    MoEConfig, OptimConfig, ParallelConfig, RuntimeConfig,
)
from trainer3d.models import MODEL_PRESETS

SECTIONS = {"arch": ArchConfig, "parallel": ParallelConfig, "batch": BatchConfig, "optim": OptimConfig,
            "moe": MoEConfig, "loss": LossConfig, "lora": LoRAConfig, "dataset": DatasetConfig, "eval": EvalConfig,
            "checkpoint": CheckpointConfig, "logging": LoggingConfig, "runtime": RuntimeConfig}
# flat name -> its section, and its default
OWNER = {f.name: name for name, cls in SECTIONS.items() for f in dataclasses.fields(cls)}
DEFAULTS = {f.name: f.default for cls in SECTIONS.values() for f in dataclasses.fields(cls)}
assert len(OWNER) == sum(len(dataclasses.fields(c)) for c in SECTIONS.values()), "a field name in two sections"
assert not set(OWNER) & set(SECTIONS), "a field named like a section"

# The flags that size a model: every family has the first four; the rest name fields of some families only.
SIZE_FLAGS = ("n_layer", "n_head", "n_embd", "n_positions", "n_kv_heads", "ffn_hidden", "n_experts", "top_k",
              "moe_ffn_hidden", "mtp_layers")


@dataclass(init=False)
class TrainConfig:
    arch: ArchConfig
    parallel: ParallelConfig
    batch: BatchConfig
    optim: OptimConfig
    moe: MoEConfig
    loss: LossConfig
    lora: LoRAConfig
    dataset: DatasetConfig
    eval: EvalConfig
    checkpoint: CheckpointConfig
    logging: LoggingConfig
    runtime: RuntimeConfig
    # flags typed on the command line (config/cli.parse_args); None for programmatic configs, where a value that
    # differs from its default counts as given. The DeepSpeed JSON may not contradict a given flag (zero/config.py).
    explicit_flags: tuple[str, ...] | None = None
    # --layout auto's pick, runner-up and why (plan/auto.py): set by train/setup.py, recorded in meta.json and W&B
    layout_choice: dict | None = None

    def __init__(self, explicit_flags: tuple[str, ...] | None = None, layout_choice: dict | None = None, **values):
        """Sections (copied: a config never shares one with another) and flat names, in any mix; a flat name
        overrides what a section passed beside it holds."""
        for name, cls in SECTIONS.items():
            section = values.pop(name, None)
            object.__setattr__(self, name, cls() if section is None else dataclasses.replace(section))
        object.__setattr__(self, "explicit_flags", explicit_flags)
        object.__setattr__(self, "layout_choice", layout_choice)
        for name, value in values.items():
            if name not in OWNER:
                raise TypeError(f"TrainConfig.__init__() got an unexpected keyword argument {name!r}")
            setattr(getattr(self, OWNER[name]), name, value)

    def __getattr__(self, name: str):  # only where no attribute is found: a flat name
        if name not in OWNER:
            raise AttributeError(f"'TrainConfig' object has no attribute {name!r}")
        return getattr(object.__getattribute__(self, OWNER[name]), name)

    def __setattr__(self, name: str, value) -> None:
        if name in OWNER:
            setattr(getattr(self, OWNER[name]), name, value)
        elif name in SECTIONS or name in ("explicit_flags", "layout_choice"):
            object.__setattr__(self, name, value)
        else:
            raise AttributeError(f"'TrainConfig' object has no field {name!r}")

    def check(self) -> None:
        """Each section's own checks (the numbers its fields take); what needs more than one field, the model or
        the world is train/setup.py's."""
        for name in SECTIONS:
            getattr(self, name).check()

    def flat(self) -> dict:
        """Every field by its flat name (and the two run records): what meta.json and W&B record."""
        out = {name: getattr(self, name) for name in OWNER}
        return dict(out, explicit_flags=self.explicit_flags, layout_choice=self.layout_choice)

    def given(self, name: str) -> bool:
        """Did the user set this flag? From the command line: it was typed. Programmatic configs: it differs from
        its default."""
        if self.explicit_flags is not None:
            return name in self.explicit_flags
        return getattr(self, name) != DEFAULTS[name]

    @property
    def compiled_backend(self) -> str | None:  # the blocks' torch.compile backend; None without --compile
        return self.compile_backend if self.compile else None

    @property
    def uses_documents(self) -> bool:
        """The run needs each token's document (--document-mask or --reset-position-ids)."""
        return self.document_mask or self.reset_position_ids

    def resolved_precision(self, device_type: str) -> str:
        if self.precision == "auto":
            return "bf16" if device_type == "cuda" else "fp32"
        return self.precision

    def model_config(self, vocab_size: int, base=None):
        """The model's config (its family's): the preset (or `base`, the config of weights being loaded, with their own
        vocabulary) with the size flags applied. A size flag the family has no field for is left to
        train/setup.py, which refuses it."""
        if base is not None:
            vocab_size = base.vocab_size
        else:
            base = MODEL_PRESETS[self.model]
        fields = {f.name for f in dataclasses.fields(base)}
        sizes = {k: getattr(self, k) for k in SIZE_FLAGS if getattr(self, k) and k in fields}
        if "mtp_layers" in fields and (self.mtp_layers == 0 or self.mtp_loss_coef == 0):
            sizes["mtp_layers"] = 0  # multi-token prediction off: its modules are not built
        return dataclasses.replace(base, vocab_size=self.vocab_size or vocab_size, dropout=self.dropout, **sizes)
