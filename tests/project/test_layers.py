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
