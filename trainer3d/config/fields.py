"""One field of a config section: its default, its one description (the flag's --help), the numbers it takes, and
how argparse reads it, so that the parser is generated (config/cli.py), no flag is described twice and a section
checks its own fields (`Section.check`)."""

from __future__ import annotations

import dataclasses
import math

from trainer3d.errors import ConfigError


def flag(default, help: str | None = None, *, low=None, high=None, high_excluded: bool = False,  # noqa: A002
         positive: bool = False, **argparse_kwargs):
    """A section field. `low`/`high`: the numbers it takes (`high_excluded`: below `high`), `positive`: above 0;
    checked only where given (not None). `argparse_kwargs`: what the field's type does not say (choices, metavar,
    nargs/const, action, `flags` for option strings other than --the-field-name)."""
    bounds = {"low": low, "high": high, "high_excluded": high_excluded, "positive": positive}
    return dataclasses.field(default=default, metadata={"help": help, "argparse": argparse_kwargs, "bounds": bounds})


def option_name(field: str) -> str:
    """A field's flag as a user types it: `global_batch` -> `--global-batch`."""
    return "--" + field.replace("_", "-")


class Section:
    """What every config section does with its fields: check the numbers they take, one sentence for the first that
    is out of its range, naming its flag."""

    def check(self) -> None:
        for f in dataclasses.fields(self):
            _check_bounds(f.name, getattr(self, f.name), **f.metadata["bounds"])


def _check_bounds(name: str, value, low, high, high_excluded: bool, positive: bool) -> None:
    if value is None or (low is None and high is None and not positive):
        return
    option = option_name(name)
    if positive and not (value > 0 and math.isfinite(value)):
        raise ConfigError(f"{option} must be a positive finite number (got {value}).")
    if not math.isfinite(value):
        raise ConfigError(f"{option} must be a finite number (got {value}).")
    too_high = high is not None and (value >= high if high_excluded else value > high)
    if (low is not None and value < low) or too_high:
        need = f"at least {low}" if high is None else f"in [{low}, {high}{')' if high_excluded else ']'}"
        raise ConfigError(f"{option} must be {need} (got {value}).")


def option_strings(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["argparse"].get("flags") or (option_name(f.name),)


def argparse_kwargs(f: dataclasses.Field) -> dict:
    """add_argument's keywords for field `f`: its default and help, its type from the annotation (int or float; a
    string is argparse's own; a bool is a switch), and the field's own argparse keywords."""
    kw = {k: v for k, v in f.metadata["argparse"].items() if k != "flags"}
    kw.update(dest=f.name, default=f.default, help=f.metadata["help"])
    kind = str(f.type).split("|")[0].strip()
    if kind == "bool":
        kw.setdefault("action", "store_true")
    elif kind in ("int", "float") and "action" not in kw:
        kw["type"] = {"int": int, "float": float}[kind]
    return kw
