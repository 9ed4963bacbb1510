"""TRAINER3D_PLUGINS: comma-separated module names that every entry point (training, prepare) imports first, before
anything runs: the place for site- or test-specific hooks that patch trainer3d from outside (tests/helpers/fault_plugin.py
injects faults and pauses there), so that the runtime path holds none of them."""

from __future__ import annotations

import importlib
import os

from trainer3d.errors import UsageError, first_line

ENV = "TRAINER3D_PLUGINS"


def load_plugins() -> list[str]:
    """Import every module TRAINER3D_PLUGINS names (found on sys.path / PYTHONPATH); the names imported."""
    names = [n.strip() for n in os.environ.get(ENV, "").split(",") if n.strip()]
    for name in names:
        try:
            importlib.import_module(name)
        except ImportError as e:
            raise UsageError(f"{ENV} names {name!r}, which cannot be imported ({first_line(e)}); put it on PYTHONPATH "
                             f"or unset {ENV}.") from None
    return names
