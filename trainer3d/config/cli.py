"""The trainer's command line, generated from the config's sections: one argument group a section, one flag a field,
its help the field's description. Which flags were typed is recorded in the same parse (a namespace that starts with
every field unset), so a DeepSpeed JSON or --layout auto may fill what the user left open."""

from __future__ import annotations

import argparse
import dataclasses

from trainer3d.config.fields import argparse_kwargs, option_strings
from trainer3d.config.train_config import OWNER, SECTIONS, TrainConfig
from trainer3d.errors import ArgumentParser

_UNSET = object()  # a field the command line did not type


def build_parser() -> argparse.ArgumentParser:
    p = ArgumentParser(
        prog="train_gpt2.py",
        description="Train a GPT-2 or Llama model at any data × tensor × pipeline layout (python, torchrun, deepspeed "
                    "or srun).",
        formatter_class=argparse.ArgumentDefaultsHelpFormatter,
    )
    for section in SECTIONS.values():
        group = p.add_argument_group(section.TITLE)
        for f in dataclasses.fields(section):
            group.add_argument(*option_strings(f), **argparse_kwargs(f))
    # the deepspeed launcher passes it; what we read is LOCAL_RANK, which it also sets
    p.add_argument("--local_rank", "--local-rank", type=int, default=None, help=argparse.SUPPRESS)
    return p


def parse_args(argv: list[str] | None = None) -> TrainConfig:
    unset = argparse.Namespace(**{name: _UNSET for name in OWNER})
    typed = {k: v for k, v in vars(build_parser().parse_args(argv, namespace=unset)).items()
             if v is not _UNSET and k != "local_rank"}
    return TrainConfig(**typed, explicit_flags=tuple(sorted(typed)))
