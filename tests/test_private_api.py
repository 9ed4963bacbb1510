"""The private names of torch and DeepSpeed that trainer3d relies on (trainer3d/private_api.py): the installed
versions have every one, the package uses none the table does not list, and a missing one is reported in one
sentence naming the versions the code was written for. A torch or DeepSpeed upgrade that moves one fails here."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from trainer3d import private_api

PACKAGE = Path(__file__).resolve().parents[1] / "trainer3d"
# Private names trainer3d defines itself (its own classes' and functions' attributes), found by the scan below.
OWN_DEFINITIONS = re.compile(r"(?:def |class |self\.|^\s*)(_[a-z]\w*)\s*[=(:]", re.M)


def test_the_installed_versions_have_every_private_name():
    assert private_api.missing() == [], [e.path for e in private_api.missing()]


def _dotted(node: ast.AST, aliases: dict[str, str]) -> str | None:
    """`a.b.c` of an attribute chain, its first name expanded where the module imported it under an alias
    (`import torch.distributed as dist`: `dist.x` is `torch.distributed.x`)."""
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([aliases.get(node.id, node.id)] + parts[::-1])
    return None


def _aliases(tree: ast.AST) -> dict[str, str]:
    out = {}
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            out.update({a.asname: a.name for a in node.names if a.asname})
        elif isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "deepspeed"):
            out.update({a.asname or a.name: f"{node.module}.{a.name}" for a in node.names})
    return out


# zero/ reaches into DeepSpeed's objects, whose undocumented attributes need not start with an underscore: an
# attribute read there must be trainer3d's own, Python's or torch's, a table entry, or one of these (the standard
# library's, py-cpuinfo's and DeepSpeed's documented API: deepspeed.initialize's engine, deepspeed.utils, op builders).
ZERO_PUBLIC = {
    "ArgumentParser", "Enum", "ExitStack", "Init", "JSONDecodeError", "LOCK_EX", "Module", "Parameter", "WARNING",
    "W_OK", "X_OK", "abspath", "access", "add_argument", "asdict", "basename", "check_config", "contextmanager",
    "create_op_builder", "current_device", "deepcopy", "dirname", "dp_rank", "dumps", "enter_context", "environ",
    "exit", "filterwarnings", "findall", "flock", "get_backend", "get_cpu_info", "get_process_group_ranks", "get_rank",
    "get_world_size", "getsize", "getsource", "is_available", "is_compatible", "isdir", "isfile", "lineno", "makedirs",
    "module", "normpath", "parse_known_args", "pp_rank", "print_help", "returncode", "sep", "setLevel",
    "set_gradient_accumulation_boundary", "stderr", "submod", "suppress", "time", "tp_rank", "walk", "which",
    "offload_states", "reload_states",  # DeepSpeedEngine's documented offload API (its docstrings, DeepSpeed 0.16+)
}


def _own_names(sources: dict) -> set[str]:
    """Names trainer3d defines: functions, classes, attributes it assigns, module-level and local names."""
    own = set()
    for text in sources.values():
        own.update(OWN_DEFINITIONS.findall(text))
        for groups in re.findall(r"(?:def |class )(\w+)|self\.(\w+)\s*[=:]|^\s*(\w+)\s*[:=]", text, re.M):
            own.update(n for n in groups if n)
        own.update(re.findall(r"\.(trainer3d_\w+)\s*=", text))  # what trainer3d puts on a library's objects
    return own


def test_the_package_uses_no_private_name_the_table_does_not_list():
    """Scans every module: a private component in a `torch.`/`deepspeed.` path or import (aliases expanded) must be
    covered by an entry; an attribute `._name` anywhere that trainer3d does not define itself must be the name of an
    entry (torch's Module._parameters, DeepSpeed's optimizer internals); and under zero/, any attribute that is
    not trainer3d's, Python's, torch's or DeepSpeed's documented API must be an entry too."""
    import torch
    import torch.nn as nn

    listed = [e.path for e in private_api.PRIVATE]
    covered = lambda path: any(p == path or p.startswith(path + ".") or path.startswith(p + ".") for p in listed)  # noqa: E731
    sources = {f: f.read_text() for f in PACKAGE.rglob("*.py")}
    own = _own_names(sources)
    names = {e.name for e in private_api.PRIVATE}
    python_or_torch = set().union(*(dir(t) for t in (torch, torch.Tensor, nn.Module, nn.Parameter,
                                                     torch.optim.Optimizer, dict, list, str, Path)))
    unlisted = []
    for file, text in sources.items():
        rel = file.relative_to(PACKAGE)
        tree = ast.parse(text)
        aliases = _aliases(tree)
        for node in ast.walk(tree):
            paths = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "deepspeed"):
                paths = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                paths = [a.name for a in node.names if a.name.split(".")[0] in ("torch", "deepspeed")]
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node, aliases)
                if dotted and dotted.split(".")[0] in ("torch", "deepspeed"):
                    paths = [dotted]
                elif node.attr.startswith("_") and not node.attr.startswith("__") and node.attr not in own \
                        and node.attr not in names:
                    unlisted.append(f"{rel}:{node.lineno} .{node.attr}")
                elif rel.parts[0] == "zero" and node.attr not in own | names | python_or_torch | ZERO_PUBLIC:
                    unlisted.append(f"{rel}:{node.lineno} .{node.attr} (not a documented API)")
            for path in paths:
                if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")) \
                        and not covered(path):
                    unlisted.append(f"{rel}:{node.lineno} {path}")
    assert not unlisted, f"private names not in trainer3d/private_api.py: {sorted(set(unlisted))}"


def test_set_entries_are_real_assignments():
    """A "set" entry is found where the library assigns the attribute, not anywhere its name appears."""
    assignment = private_api.Private("deepspeed.runtime.zero.stage3.fp32_partitioned_groups_flat", "x", "x", "set")
    only_read = private_api.Private("deepspeed.runtime.zero.stage3.no_such_attribute_anywhere", "x", "x", "set")
    assert private_api.present(assignment) and not private_api.present(only_read)
    renamed = private_api.Private("torch.ops.aten._scaled_dot_product_flash_attention_for_cpu_backward", "x", "x",
                                  params=("grad_out", "query", "value"))  # a signature that changed
    assert not private_api.present(renamed)


def test_a_missing_name_is_one_sentence_naming_the_versions(monkeypatch):
    gone = private_api.Private("torch._no_such_thing", "parallel/ddp.py", "a test")
    monkeypatch.setattr(private_api, "PRIVATE", private_api.PRIVATE + (gone,))
    with pytest.raises(RuntimeError) as e:
        private_api.require("parallel/ddp.py")
    message = str(e.value)
    assert "torch._no_such_thing (a test)" in message and private_api.WRITTEN_FOR in message
    assert "\n" not in message and message.count(". ") == 0
    private_api.require("parallel/compile.py")  # another user's names are all there


def test_a_name_used_only_on_older_torch_is_required_only_there(monkeypatch):
    """An entry with `torch_before` (a mend for older torch) is required below that version and nowhere else."""
    old_only = private_api.Private("torch._no_such_thing", "parallel/ddp.py", "a test", torch_before="2.0")
    monkeypatch.setattr(private_api, "PRIVATE", private_api.PRIVATE + (old_only,))
    private_api.require("parallel/ddp.py")  # this torch is newer: not needed
    still_used = private_api.Private("torch._no_such_thing", "parallel/ddp.py", "a test", torch_before="999.0")
    monkeypatch.setattr(private_api, "PRIVATE", private_api.PRIVATE + (still_used,))
    with pytest.raises(RuntimeError, match="torch._no_such_thing"):
        private_api.require("parallel/ddp.py")
