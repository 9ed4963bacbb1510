"""The run's configuration: a tree of sections (sections.py) with flat names for every field (train_config.py), and
the command line generated from them (cli.py). Flag names are stable (scripts depend on them). Every check of the
values is made before any process group, in train/setup.py's `validate`, which raises one sentence naming the fix."""

from trainer3d.config.cli import build_parser, parse_args
from trainer3d.config.sections import (
    COMPILE_BACKENDS, MTP_LOSS_COEF, PRECISIONS, RECOMPUTE_MODES, SCHEDULE_NAMES,
)
from trainer3d.config.train_config import SECTIONS, SIZE_FLAGS, TrainConfig

__all__ = ["COMPILE_BACKENDS", "MTP_LOSS_COEF", "PRECISIONS", "RECOMPUTE_MODES", "SCHEDULE_NAMES", "SECTIONS",
           "SIZE_FLAGS", "TrainConfig", "build_parser", "parse_args"]
