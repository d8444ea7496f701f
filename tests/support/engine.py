"""The tiny test engine and the helpers tests share (imported as tests.support.engine; conftest.py keeps only
hooks and fixtures)."""

from __future__ import annotations

import dataclasses
import functools
import os
import shutil
import sysconfig
from pathlib import Path

import pytest
import torch

from specdec.build import TINY_ENGINE, EngineSpec, build_engine, k_policy_factory
from specdec.drafters import DraftModelDrafter
from specdec.engine import GenerationConfig, SpeculativeEngine, collect
from specdec.heads_file import save_heads
from specdec.heads_model import DraftHeads, EagleCache
from specdec.heads_train import heads_config
from specdec.models import LoadedModel, load_model
from specdec.runner import BatchRunner
from specdec.sampling import SamplingParams

ROOT = Path(__file__).resolve().parents[2]
# Where the tiny engine is built: SPECVOICE_TEST_DEVICE=cuda runs the fast suite on a GPU (scripts/gpu-check.sh).
TEST_DEVICE = os.environ.get("SPECVOICE_TEST_DEVICE", "cpu")
ON_CPU = torch.device(TEST_DEVICE).type == "cpu"
# For tests of the CPU-only weight formats (specdec/quant.py), which EngineSpec refuses on another device.
cpu_only = pytest.mark.skipif(not ON_CPU, reason="a CPU weight format (specdec/quant.py)")


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


# Draft heads for the tiny target (tests/specdec/test_heads.py, tests/specdec/test_distribution.py)

WORDS = "the cat sat on a mat while dogs ran far away in cold rain and warm sun".split()
# The tiny target's layers that fused ("eagle3") heads read: the embeddings, after its first layer, the final norm's
# output (its 2 layers are too few for EAGLE-3's own choice)
TINY_FUSE = (0, 1, 2)


def tiny_prompts(target, n: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    texts = [" ".join(WORDS[int(i)] for i in torch.randint(len(WORDS), (5,), generator=g)) for _ in range(n)]
    return [target.tokenizer.chat_ids([{"role": "user", "content": t}]) for t in texts]


def untrained_heads(target: LoadedModel, path: Path, kind: str = "medusa") -> Path:
    """Untrained heads shaped for `target`, saved as trained ones are: for the plumbing and for costs (seconds do not
    depend on the weights), never for acceptance."""
    cfg = heads_config(kind, target.model.config, target.name)
    save_heads(DraftHeads(cfg, torch.arange(cfg.vocab_size)), path)
    return path


def eagle_path_alone(heads: DraftHeads, seq, last: int, path: list[int]) -> list[torch.Tensor]:
    """The eagle layer's predicted features as drafting one path alone computes them: on a fresh cache over the true
    slots 1 … last (seq's tokens and features), then slot last + d for the path's d-th token, reading the prediction
    before it. len(path) + 1 features, the first at slot last."""
    layer = heads.eagle
    assert layer is not None
    cache = EagleCache(heads.cfg.n_kv_heads, layer.head_dim, torch.device("cpu"))
    with torch.inference_mode():
        emb = heads.embed_tokens(torch.tensor([seq.tokens[1 : last + 1]]))
        feats = layer.true_features(seq.features[None, :last].float())
        preds = [layer(emb, feats, torch.arange(1, last + 1), cache)[0, -1]]
        for d, token in enumerate(path, start=1):
            emb = heads.embed_tokens(torch.tensor([[token]]))
            preds.append(layer(emb, preds[-1].view(1, 1, -1), torch.tensor([last + d]), cache)[0, -1])
    return preds


def heads_engine(tiny_engine, tiny_heads, k: int = 3, tree: int = 1, lookup: int = 0):
    """The tiny engine drafting with `tiny_heads` at a fixed K, ungated (tiny heads are never confident), never
    switched off and drafting the opening too (no OpeningEchoDrafter), so every step drafts with the heads; tree:
    --draft-tree (medusa: K nodes of a tree with this many candidates per node); lookup: --draft-lookup."""
    path, _ = tiny_heads
    spec = tiny_engine.spec_with(
        draft="heads",
        heads=str(path),
        draft_min_prob=0.0,
        k=str(k),
        opening_echo=False,
        draft_tree=tree,
        draft_lookup=lookup,
    )
    engine, _ = build_engine(spec)
    engine.auto_off = False
    return engine


# Engines built by hand (tests/specdec)


def make_engine(target, drafter_factory, k="4", min_feed=1, **kw):
    runner = BatchRunner(target.model, target.device, min_feed=min_feed)
    return SpeculativeEngine(target, runner, drafter_factory, k_policy_factory(k), auto_off=False, **kw)


def target_only(target, prompt_ids, n, sampling=None, seed=0):
    engine = make_engine(target, None)
    return collect(engine.stream(prompt_ids, GenerationConfig(n, sampling or SamplingParams(), seed, False)))[0]


def draft_factory(draft, **kw):
    runner = BatchRunner(draft.model, draft.device)
    return lambda: DraftModelDrafter(runner, **kw)
