"""The code base stays ruff-clean (the rules live in pyproject.toml)."""

import re
import subprocess

from tests.support.engine import ROOT, tool


def test_ruff_clean():
    proc = subprocess.run([tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_pre_commit_clones_nothing():
    """Its hooks run the venv's tools (ruff check, ruff format --check, mypy): one `local` repo, no remote ones."""
    text = (ROOT / ".pre-commit-config.yaml").read_text()
    assert re.findall(r"^\s*- repo:\s*(\S+)", text, re.M) == ["local"]


def test_page_scripts_lint_clean():
    """Biome's recommended rules over the page's ES modules (config: biome.json); warnings fail too."""
    proc = subprocess.run(
        [tool("biome"), "lint", "--error-on-warnings", "app/static"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_python_is_ruff_formatted():
    proc = subprocess.run(
        [tool("ruff"), "format", "--check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
