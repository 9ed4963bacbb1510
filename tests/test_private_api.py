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


def _dotted(node: ast.AST) -> str | None:
    parts = []
    while isinstance(node, ast.Attribute):
        parts.append(node.attr)
        node = node.value
    if isinstance(node, ast.Name):
        return ".".join([node.id] + parts[::-1])
    return None


def test_the_package_uses_no_private_name_the_table_does_not_list():
    """Scans every module: a private component in a `torch.`/`deepspeed.` path or import must be covered by an
    entry; an attribute `._name` under zero/ (DeepSpeed's objects) that trainer3d does not define itself must be the
    name of an entry."""
    listed = [e.path for e in private_api.PRIVATE]
    covered = lambda path: any(p == path or p.startswith(path + ".") or path.startswith(p + ".") for p in listed)  # noqa: E731
    own = set()
    sources = {f: f.read_text() for f in PACKAGE.rglob("*.py")}
    for text in sources.values():
        own.update(OWN_DEFINITIONS.findall(text))
    names = {e.name for e in private_api.PRIVATE}
    unlisted = []
    for file, text in sources.items():
        rel = file.relative_to(PACKAGE)
        for node in ast.walk(ast.parse(text)):
            paths = []
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("torch", "deepspeed"):
                paths = [f"{node.module}.{a.name}" for a in node.names]
            elif isinstance(node, ast.Import):
                paths = [a.name for a in node.names if a.name.split(".")[0] in ("torch", "deepspeed")]
            elif isinstance(node, ast.Attribute):
                dotted = _dotted(node)
                if dotted and dotted.split(".")[0] in ("torch", "deepspeed"):
                    paths = [dotted]
                elif rel.parts[0] == "zero" and node.attr.startswith("_") and not node.attr.startswith("__") \
                        and node.attr not in own and node.attr not in names:
                    unlisted.append(f"{rel}:{node.lineno} .{node.attr}")
            for path in paths:
                if any(part.startswith("_") and not part.startswith("__") for part in path.split(".")) \
                        and not covered(path):
                    unlisted.append(f"{rel}:{node.lineno} {path}")
    assert not unlisted, f"private names not in trainer3d/private_api.py: {sorted(set(unlisted))}"


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
