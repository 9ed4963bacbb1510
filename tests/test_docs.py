"""What the documents say must stay true of the code: the README states the suite's counts as tests/helpers/counts.py derives
them from the tests' markers, every `trainer3d.` name and every repository path that README.md, bench/*.md (the
benchmarks' index and one page per benchmark) and docs/ mention exists, every relative link in them resolves, and the
index links every benchmark's page."""

from __future__ import annotations

import ast
import importlib
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "bench").glob("*.md")), *sorted((ROOT / "docs").glob("*.md"))]
SOURCES = [p for p in (ROOT / "trainer3d").rglob("*.py")] + [p for p in (ROOT / "tests").rglob("*.py")] + \
    [p for p in (ROOT / "bench").glob("*.py")] + [p for p in (ROOT / "launch").rglob("*.py")]
PACKAGE = "parallel|zero|checkpoint|train|data|models|plan|distributed"
DOTTED = re.compile(r"\btrainer3d(?:\.[A-Za-z_][A-Za-z0-9_]*)+")
# a path: from a top-level folder of the repository (or of the package), to a file or folder name
PATH = re.compile(r"(?<![\w./-])((?:trainer3d|tests|bench|docs|launch|ds_configs|\.ci)/[\w./-]*[\w/])")
PACKAGE_PATH = re.compile(rf"(?<![\w./-])((?:{PACKAGE})/[\w/]*\w+\.py)\b")
# `module/path.name`: a function or class of a package module
MODULE_ATTR = re.compile(rf"(?<![\w./-])(?:trainer3d/)?((?:{PACKAGE})/[\w/]*\w+)\.([A-Za-z_]\w*)")
# `Class.attribute` where the class is one of ours
CLASS_ATTR = re.compile(r"`([A-Z]\w+)\.([a-z_]\w*)")
MARKDOWN = re.compile(r"\b([\w-]+\.md)\b")
LINK = re.compile(r"\]\(([^()\s]+)\)")  # a markdown link's (or image's) target
PRIVATE = re.compile(r"`(_[a-z]\w+)`")


def _our_classes() -> dict[str, str]:
    """Class name -> its module, for every class trainer3d defines."""
    out = {}
    for path in (ROOT / "trainer3d").rglob("*.py"):
        for name in re.findall(r"^class (\w+)", path.read_text(), re.M):
            out[name] = ".".join(path.relative_to(ROOT).with_suffix("").parts)
    return out


def _path_exists(path: str) -> bool:
    """A file or folder of the repository (`bench/README` for its .md), or `dir/module.name` naming a function."""
    if (ROOT / path).exists() or (ROOT / f"{path}.md").exists():
        return True
    module, _, attr = path.rpartition(".")
    return bool(module) and (ROOT / f"{module}.py").exists() and _resolves(module.replace("/", ".") + "." + attr)


def _has(classes: dict[str, str], cls: str, attr: str) -> bool:
    """`cls.attr` exists: on a class of ours (or set on its instances); a library's class, as the library's."""
    if cls in classes:
        return _resolves(f"{classes[cls]}.{cls}.{attr}") or _sets(classes[cls], attr)
    return _in_libraries(f"class {cls}")


def _sets(module: str, attr: str) -> bool:
    """An instance attribute the module's classes set (`self.attr = ...`)."""
    return f"self.{attr} =" in (ROOT / (module.replace(".", "/") + ".py")).read_text()


def _in_libraries(name: str) -> bool:
    """A name in torch's, DeepSpeed's, transformers' or PEFT's Python sources, which the documents may cite."""
    import deepspeed
    import peft
    import torch
    import transformers

    dirs = [str(Path(m.__file__).parent) for m in (torch, deepspeed, transformers, peft)]
    return subprocess.run(["grep", "-rqsF", "--include=*.py", name, *dirs]).returncode == 0


def test_readme_states_the_suite_counts():
    counts = ROOT / "tests" / "helpers" / "counts.py"
    out = subprocess.run([sys.executable, str(counts), "--json"], capture_output=True, text=True, timeout=300,
                         cwd=str(ROOT))
    assert out.returncode == 0, out.stderr[-2000:]
    readme = (ROOT / "README.md").read_text()
    from helpers.counts import line

    for machine, (passed, skipped) in json.loads(out.stdout.splitlines()[-1]).items():
        assert f"| {machine} | `{line(passed, skipped)}` |" in readme, (machine, line(passed, skipped))


def _defined_in_source(parts: list[str]) -> bool:
    """Where a module imports an optional library the suite keeps apart (verl: tests/helpers/verl_site.py), its names are
    read from its source: a top-level definition, then a name in that class's body."""
    for i in range(len(parts), 0, -1):
        path = ROOT.joinpath(*parts[:i]).with_suffix(".py")
        if path.exists():
            break
    else:
        return False
    scope, names = ast.parse(path.read_text()).body, parts[i:]
    for name in names:
        found = [n for n in scope if getattr(n, "name", None) == name
                 or any(getattr(t, "id", None) == name for t in getattr(n, "targets", [getattr(n, "target", None)]))]
        if not found:
            return False
        scope = getattr(found[0], "body", [])
    return True


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for i in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:i]))
        except ModuleNotFoundError as e:
            if e.name and not e.name.startswith("trainer3d") and parts[0] == "trainer3d":
                return _defined_in_source(parts)
            continue
        except ImportError:
            continue
        try:
            for attr in parts[i:]:
                obj = getattr(obj, attr)
        except AttributeError:
            return False
        return True
    return False


def test_every_name_and_path_in_the_documents_exists():
    missing = []
    classes = _our_classes()
    source = "\n".join(p.read_text() for p in SOURCES)
    markdown = {p.name for p in ROOT.rglob("*.md")}
    for doc in DOCUMENTS:
        text = doc.read_text()
        where = doc.relative_to(ROOT)
        missing += [f"{where}: {n}" for n in sorted(set(DOTTED.findall(text))) if not _resolves(n.rstrip("."))]
        missing += [f"{where}: {p}" for p in sorted(set(PATH.findall(text))) if not _path_exists(p.rstrip("."))]
        missing += [f"{where}: {p}" for p in sorted(set(PACKAGE_PATH.findall(text)))
                    if not (ROOT / "trainer3d" / p).exists()]
        missing += [f"{where}: {m}.{a}" for m, a in sorted(set(MODULE_ATTR.findall(text)))
                    if a != "py" and not _resolves("trainer3d." + m.replace("/", ".") + "." + a)]
        missing += [f"{where}: {c}.{a}" for c, a in sorted(set(CLASS_ATTR.findall(text))) if not _has(classes, c, a)]
        missing += [f"{where}: {m}" for m in sorted(set(MARKDOWN.findall(text))) if m not in markdown]
        missing += [f"{where}: {n}" for n in sorted(set(PRIVATE.findall(text)))
                    if n not in source and not _in_libraries(n)]
        missing += [f"{where}: link {t}" for t in sorted(set(LINK.findall(text)))  # relative links resolve
                    if t.split("#")[0] and not re.match(r"[a-z]+:", t) and not (doc.parent / t.split("#")[0]).exists()]
    # each index (bench/README.md, docs/README.md) links every page beside it
    for folder in ("bench", "docs"):
        index = {t.split("#")[0] for t in LINK.findall((ROOT / folder / "README.md").read_text())}
        missing += [f"{folder}/README.md: no link to {p.name}" for p in sorted((ROOT / folder).glob("*.md"))
                    if p.name != "README.md" and p.name not in index]
    assert not missing, "\n".join(missing)
