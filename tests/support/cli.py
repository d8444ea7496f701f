"""`specvoice` as a user runs it. In-process by default (`commands.cli.main`, its stdout and stderr captured): the
same parsing, dispatch and error handling, without a new interpreter's 3–4 s of imports per call. subprocess_run=True
runs the console script's module in a fresh interpreter from the project root, for what only that shows (timeout
applies to that run only)."""

from __future__ import annotations

import contextlib
import io
import subprocess
import sys

from commands import cli
from tests.support.engine import ROOT


def specvoice(
    *args: str, check: bool = True, timeout: float = 300, subprocess_run: bool = False
) -> subprocess.CompletedProcess:
    argv = [sys.executable, "-m", "commands.cli", *args]
    if subprocess_run:
        return subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=timeout, check=check)
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = cli.main(list(args))
        except SystemExit as e:  # argparse: --help, or an option it refuses
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    proc = subprocess.CompletedProcess(argv, code, out.getvalue(), err.getvalue())
    if check:
        proc.check_returncode()
    return proc
