"""The code base stays ruff-clean (the rules live in pyproject.toml)."""

import subprocess

from conftest import ROOT, tool


def test_ruff_clean():
    proc = subprocess.run([tool("ruff"), "check", "."], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
