"""Every third-party module the code imports is declared in pyproject.toml by the distribution that provides it,
not only pulled in by another package: a fresh install (README, CI's new venv) would otherwise fail on it."""

from __future__ import annotations

import ast
import importlib.metadata as md
import re
import sys

import tomllib

from tests.support.engine import ROOT

PACKAGES = ("specdec", "pipeline", "casestudy", "app", "commands")
# Imported only where a user picks that option, with an error saying what to install.
OPTIONAL = {
    "TTS": "Coqui TTS (--tts coqui), which cannot run on a CPU-only torch",
    "llama_cpp": "llama-cpp-python (bench --llamacpp), the llama extra, built by scripts/setup.sh --llama; not in CI",
}


def _norm(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def declared_distributions() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + [r for group in project["optional-dependencies"].values() for r in group]
    return {_norm(re.split(r"[\s<>=!~\[;(]", r.strip(), maxsplit=1)[0]) for r in reqs}


def imported_modules() -> dict[str, str]:
    """Top-level module → the first file importing it, over the packages, tests and scripts."""
    files = sorted(f for d in (*PACKAGES, "tests", "scripts") for f in (ROOT / d).rglob("*.py"))
    local = {*PACKAGES, "tests"} | {f.stem for f in files}
    found: dict[str, str] = {}
    for path in files:
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                names = [node.module]
            else:
                continue
            for name in names:
                top = name.split(".")[0]
                if top not in sys.stdlib_module_names and top not in local and top != "__future__":
                    found.setdefault(top, str(path.relative_to(ROOT)))
    return found


def undeclared(modules: dict[str, str]) -> list[str]:
    declared = declared_distributions()
    provides = md.packages_distributions()
    problems = []
    for module, where in sorted(modules.items()):
        if module in OPTIONAL:
            continue
        dists = {_norm(d) for d in provides.get(module, [])}
        if not dists:
            problems.append(f"{module} ({where}) is not installed: declare the distribution that provides it")
        elif not dists & declared:
            problems.append(f"{module} ({where}) comes from {', '.join(sorted(dists))}, not declared in pyproject.toml")
    return problems


def test_every_imported_module_is_declared_directly():
    problems = undeclared(imported_modules())
    assert not problems, "\n".join(problems)


def test_the_check_reports_transitive_and_missing_modules():
    """Teeth: idna arrives only through httpx; no distribution provides the second name."""
    assert undeclared({"idna": "scripts/x.py", "no_such_module_here": "app/y.py"}) == [
        "idna (scripts/x.py) comes from idna, not declared in pyproject.toml",
        "no_such_module_here (app/y.py) is not installed: declare the distribution that provides it",
    ]
