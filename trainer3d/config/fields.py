"""One field of a config section: its default, its one description (the flag's --help), and how argparse reads it,
so that the parser is generated (config/cli.py) and no flag is described twice."""

from __future__ import annotations

import dataclasses


def flag(default, help: str | None = None, **argparse_kwargs):  # noqa: A002 - argparse's own word
    """A section field. `argparse_kwargs`: what the field's type does not say (choices, metavar, nargs/const, action,
    `flags` for option strings other than --the-field-name)."""
    return dataclasses.field(default=default, metadata={"help": help, "argparse": argparse_kwargs})


def option_strings(f: dataclasses.Field) -> tuple[str, ...]:
    return f.metadata["argparse"].get("flags") or ("--" + f.name.replace("_", "-"),)


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
