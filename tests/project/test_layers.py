"""Imports point one way: commands → app → casestudy → pipeline → specdec. A package may import its own modules and the
layers below it, never one above (lazy imports inside functions included)."""

from __future__ import annotations

import ast
from pathlib import Path

from tests.support.engine import ROOT

LAYERS = ("specdec", "pipeline", "casestudy", "app", "commands")  # lowest first


def imported_packages(source: str, module: str) -> set[str]:
    """Top-level packages that `module` (dotted, e.g. "pipeline.llm") imports, relative imports resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name.split(".")[0] for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level == 0:
                found.add((node.module or "").split(".")[0])
            else:  # relative: "." is this module's package, each further dot one package up
                base = module.split(".")[: -node.level]
                found.add((base or [""])[0])
    return found


def upward_imports(source: str, path: Path) -> list[str]:
    """'FILE imports LAYER' for each layer above the file's own that it imports."""
    module = ".".join(path.with_suffix("").parts)
    rank = LAYERS.index(path.parts[0])
    above = set(LAYERS[rank + 1 :])
    return [f"{path} imports {pkg}" for pkg in sorted(imported_packages(source, module) & above)]


def test_no_layer_imports_a_layer_above_it():
    problems = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            rel = path.relative_to(ROOT)
            problems += upward_imports(path.read_text(encoding="utf-8"), rel)
    assert not problems, "\n".join(problems)


def test_the_check_finds_upward_imports():
    """Teeth: top-level and lazy imports of a higher layer are reported; a relative import stays in its package."""
    source = "import app.cli\nfrom .tokenizer import Tokenizer\n\ndef f():\n    from pipeline.llm import LLMDelta\n"
    assert upward_imports(source, Path("specdec/x.py")) == ["specdec/x.py imports app", "specdec/x.py imports pipeline"]
    assert upward_imports("from specdec.engine import GenerationConfig\n", Path("pipeline/x.py")) == []


def imported_modules(source: str, module: str, known: set[str]) -> set[str]:
    """The project modules (of `known`) that `module` imports, lazy and TYPE_CHECKING imports included: `from pkg
    import name` counts pkg.name when that is a module, else pkg."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                package = module.split(".")[: -node.level]
                base = ".".join([*package, *([base] if base else [])])
            found.update(f"{base}.{a.name}" if f"{base}.{a.name}" in known else base for a in node.names)
    return found & known


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected groups of more than one module (Tarjan): each is an import circle."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    cycles = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if nxt not in index:
                visit(nxt)
                low[node] = min(low[node], low[nxt])
            elif nxt in stack:
                low[node] = min(low[node], index[nxt])
        if low[node] == index[node]:
            group = []
            while (member := stack.pop()) != node:
                group.append(member)
            if group:
                cycles.append(sorted([node, *group]))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return cycles


def test_no_module_imports_itself_through_others():
    paths = {
        ".".join(p.relative_to(ROOT).with_suffix("").parts): p for layer in LAYERS for p in (ROOT / layer).rglob("*.py")
    }
    modules = {name.removesuffix(".__init__"): path for name, path in paths.items()}
    known = set(modules)
    graph = {
        name: imported_modules(path.read_text(encoding="utf-8"), name, known) - {name} for name, path in modules.items()
    }
    assert not import_cycles(graph)


def test_the_check_finds_an_import_circle():
    """Teeth: the circle this check was written for (server ↔ session, one side under TYPE_CHECKING) is found."""
    known = {"app.server", "app.session", "app.protocol"}
    session = (
        "from typing import TYPE_CHECKING\nfrom .protocol import pack_audio\n"
        "if TYPE_CHECKING:\n    from .server import AppServer\n"
    )
    graph = {
        "app.server": imported_modules("from .session import ClientSession\n", "app.server", known),
        "app.session": imported_modules(session, "app.session", known),
        "app.protocol": set(),
    }
    assert import_cycles(graph) == [["app.server", "app.session"]]
