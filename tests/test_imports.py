"""The package's layers: every module imports only from layers below its own (or from its own package), with no
import circle, imports inside functions included. The layer order lives here, in LAYERS, and nowhere else.

    python -m pytest tests/test_imports.py
"""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "trainer3d"

# Lowest first. A module belongs to the first entry whose name is a prefix of its own (longest prefixes first within
# a layer do not matter: entries never overlap except the entry points, listed in the top layer and matched first).
LAYERS: list[tuple[str, ...]] = [
    ("trainer3d.errors", "trainer3d.fsio", "trainer3d.private_api", "trainer3d.rundir"),  # no imports of the package
    ("trainer3d.models",),  # the model families: plain modules, their parallel plans and HF adapters; no distributed code
    ("trainer3d.config", "trainer3d.optim", "trainer3d.generate", "trainer3d.plugins"),  # the flags; the optimizer's
    # rules; decoding; TRAINER3D_PLUGINS
    ("trainer3d.distributed",),  # topology, collectives, failure reports
    ("trainer3d.data",),  # corpus -> tokens -> packed blocks -> dp batches
    ("trainer3d.parallel",),  # tensor parallel, pipeline, the data-parallel engine interface + DDP, parallelize
    ("trainer3d.zero",),  # DeepSpeed's engine (implements parallel.engine) and its JSON's rules
    ("trainer3d.plan",),  # the offline planner: trainer3d's own rules (pipeline, ZeRO buckets) priced for a cluster
    ("trainer3d.checkpoint",),  # format, save, load, signals, Hugging Face interop
    ("trainer3d.train",),  # setup (validation), the Trainer, the loop and its reporting
    ("trainer3d.engine",),  # the Trainer as another program's training side (log-probs, a caller's loss, weights)
]
ENTRY_POINTS = (
    "trainer3d.export", "trainer3d.evaluate", "trainer3d.prepare", "trainer3d.sample", "trainer3d.zero.__main__",
    "trainer3d.plan.__main__", "trainer3d.assets",
)


def module_name(path: Path, root: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imports_of(path: Path, module: str, known: set[str]) -> set[str]:
    """Modules of the package that `path` imports anywhere in its body (functions included)."""
    is_pkg = path.name == "__init__.py"
    base = module.split(".") if is_pkg else module.split(".")[:-1]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            prefix = base[: len(base) - node.level + 1] if node.level else []
            target = ".".join(prefix + ([node.module] if node.module else []))
            names = [target] + [f"{target}.{a.name}" for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in known:
                name = name.rpartition(".")[0]
            if name and name != module:
                out.add(name)
    return out


def layer_of(module: str) -> tuple[int, str]:
    """(layer index, the LAYERS entry it matched); entry points sit above every layer."""
    for entry in ENTRY_POINTS:
        if module == entry or module.startswith(entry + "."):
            return len(LAYERS), entry
    for i, entries in enumerate(LAYERS):
        for entry in entries:
            if module == entry or module.startswith(entry + "."):
                return i, entry
    raise AssertionError(f"{module} is in no layer: add it to tests/test_imports.py LAYERS")


def import_graph(root: Path) -> dict[str, set[str]]:
    files = {module_name(p, root): p for p in root.rglob("*.py")}
    known = set(files)
    graph = {m: imports_of(p, m, known) & known for m, p in files.items()}
    for m, p in files.items():  # a package's __init__ re-exporting its own modules is no dependency on them
        if p.name == "__init__.py":
            graph[m] = {n for n in graph[m] if not n.startswith(m + ".")}
    return graph


def violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that reaches up a layer or sideways into another entry of the same layer."""
    out = []
    for module, targets in sorted(graph.items()):
        if module == "trainer3d":
            continue
        layer, entry = layer_of(module)
        for target in sorted(targets):
            if target == "trainer3d":
                continue
            t_layer, t_entry = layer_of(target)
            if t_layer > layer or (t_layer == layer and t_entry != entry and layer < len(LAYERS)):
                out.append(f"{module} (layer {layer}) imports {target} (layer {t_layer})")
    return out


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                found.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def test_every_import_goes_down_a_layer():
    assert violations(import_graph(PACKAGE)) == []


def test_no_import_circle():
    assert circles(import_graph(PACKAGE)) == []


def test_modules_stay_readable():
    """One concern per module: none over 450 lines (the mark ../shared/tools/import_graph.py also checks)."""
    sizes = {module_name(p, PACKAGE): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")}
    assert {m: n for m, n in sizes.items() if n > 450} == {}


def test_the_checker_catches_an_upward_import_and_a_circle(tmp_path):
    """The rules above can fail: a copy of the package with one upward import added (the model importing the
    trainer, which closes a circle through it) is reported on both counts."""
    import shutil

    copy = tmp_path / "trainer3d"
    shutil.copytree(PACKAGE, copy, ignore=shutil.ignore_patterns("__pycache__", "assets"))
    model = copy / "models" / "interface.py"
    model.write_text(model.read_text() + "\n\ndef _late():\n    from trainer3d.train.trainer import Trainer  # upward\n")
    graph = import_graph(copy)
    assert "trainer3d.models.interface (layer 1) imports trainer3d.train.trainer (layer 9)" in violations(graph)
    assert any("trainer3d.models.interface" in c and "trainer3d.train.trainer" in c for c in circles(graph))
