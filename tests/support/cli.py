"""`specvoice` as a user runs it: the console script's module in a subprocess, from the project root."""

from __future__ import annotations

import subprocess
import sys

from tests.support.engine import ROOT


def specvoice(*args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "commands.cli", *args],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=check,
    )
