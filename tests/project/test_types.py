"""specdec/ type-checks clean (mypy, configured in pyproject.toml's [tool.mypy])."""

import subprocess

from tests.support.engine import ROOT, tool


def test_mypy_clean():
    # A cold run reads torch's annotations: about a minute on 2 cores; later runs reuse .mypy_cache.
    proc = subprocess.run([tool("mypy")], cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
