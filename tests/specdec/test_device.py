"""The device the user picks decides the defaults where the engine is built (EngineSpec), the ASR's device, the
memory counter, and the online GPU preset. Configuration only: nothing here needs a GPU or reaches a hub."""

import argparse
import dataclasses
import types

import pytest
import torch

from commands.options import add_engine_arguments, spec_from_args
from pipeline import asr
from specdec import build, models
from specdec.build import TINY_ENGINE, EngineSpec, build_engine, build_engines, device_defaults
from specdec.drafters import restrict_vocab
from specdec.engine import GenerationConfig, collect
from specdec.heads_drafter import HEADS_MIN_PROB
from specdec.models import PRESETS, ModelLoadError, memory_bytes, resolve_source
from specdec.quant import TARGET_QUANTS
from specdec.runner import fastest_min_feed
from specdec.sampling import SamplingParams

# draft_min_prob None: each drafter's gate on the device (EngineSpec.gate), no gate on a GPU.
GPU_DEFAULTS = {"target_quant": "none", "draft_quant": "none", "dtype": "bfloat16", "draft_min_prob": None}
# What the CPU has always got (docs/results.md): the w8a8 target, the int8 draft, each drafter's measured gate.
CPU_DEFAULTS = {"target_quant": "w8a8", "draft_quant": "int8", "dtype": "bfloat16", "draft_min_prob": None}
DRAFTERS = ("heads", "heads:my.heads", "qwen-0.5b", "tiny-random-draft", "org/some-draft")
CPU_ONLY = [("target_quant", q) for q in TARGET_QUANTS if q != "none"] + [("draft_quant", "int8")]


def defaults(spec: EngineSpec) -> dict[str, object]:
    return {name: getattr(spec, name) for name in GPU_DEFAULTS}


def cli_spec(*argv: str) -> EngineSpec:
    parser = argparse.ArgumentParser()
    add_engine_arguments(parser)
    return spec_from_args(parser.parse_args(list(argv)))


@pytest.mark.parametrize("device", ["cuda", "cuda:0", "cuda:1"])
def test_any_cuda_device_gets_the_gpu_defaults(device):
    spec = EngineSpec(device=device)
    assert defaults(spec) == GPU_DEFAULTS and spec.draft == "heads"
    assert cli_spec("--device", device) == spec
    assert [spec.gate(drafter) for drafter in DRAFTERS] == [0.0] * len(DRAFTERS)


def test_the_cpu_keeps_its_defaults():
    assert defaults(EngineSpec()) == defaults(EngineSpec(device="cpu")) == CPU_DEFAULTS
    assert EngineSpec().draft == "heads"
    assert cli_spec() == EngineSpec()
    # each drafter's gate measured here: the heads' (HEADS_MIN_PROB), the 0.5B draft's, none for an unknown model
    gates = [EngineSpec().gate(drafter) for drafter in DRAFTERS]
    assert gates == [HEADS_MIN_PROB, HEADS_MIN_PROB, PRESETS["qwen-0.5b"].draft_min_prob, 0.0, 0.0]
    assert PRESETS["qwen-0.5b"].draft_min_prob == 0.35


def test_the_device_defaults_are_decided_in_one_place():
    for device in ("cpu", "cuda", "cuda:1"):
        d = device_defaults(device)
        spec = EngineSpec(device=device)
        assert (spec.target_quant, spec.draft_quant) == (d.target_quant, d.draft_quant)
        assert spec.gate("qwen-0.5b") == device_defaults(device, "qwen-0.5b").draft_min_prob
        assert d.cpu_formats == (device == "cpu")


def test_the_tiny_engine_is_the_same_on_every_device():
    assert (TINY_ENGINE.target_quant, TINY_ENGINE.draft_quant, TINY_ENGINE.dtype) == ("none", "none", "float32")
    on_gpu = dataclasses.replace(TINY_ENGINE, device="cuda:0")  # a test-device switch does this
    assert dataclasses.replace(on_gpu, device="cpu") == TINY_ENGINE  # the gate is not the GPU's once made


@pytest.mark.parametrize(("field", "value"), CPU_ONLY)
@pytest.mark.parametrize("device", ["cuda", "cuda:0"])
def test_a_cpu_format_asked_for_on_a_gpu_is_refused_by_name(device, field, value):
    option = "--" + field.replace("_", "-")
    with pytest.raises(ValueError, match=f"{option} {value} is a CPU format .*--device {device}"):
        EngineSpec(device=device, **{field: value})
    with pytest.raises(ValueError, match=f"{option} {value} is a CPU format"):
        cli_spec("--device", device, option, value)


@pytest.mark.parametrize(("field", "value"), CPU_ONLY)
def test_a_cpu_format_is_taken_on_the_cpu(field, value):
    assert getattr(EngineSpec(**{field: value}), field) == value


def test_a_gate_the_user_gives_is_kept_on_a_gpu():
    assert EngineSpec(device="cuda", draft_min_prob=0.35).gate("heads") == 0.35
    assert EngineSpec(draft_min_prob=0.2).gate("qwen-0.5b") == 0.2
    assert cli_spec("--device", "cuda:0", "--draft-min-prob", "0.2").draft_min_prob == 0.2


def test_an_unknown_device_is_refused_by_name():
    with pytest.raises(ValueError, match="--device must be cpu, cuda or cuda:N, got 'gpu0'"):
        EngineSpec(device="gpu0")


def test_the_pad_width_is_one_on_a_gpu_without_timing():
    def timing_refused():
        raise AssertionError("timed on a GPU")

    runner = types.SimpleNamespace(device=torch.device("cuda:0"), new_cache=timing_refused)
    assert fastest_min_feed(runner) == 1


@pytest.mark.gpu
def test_memory_on_a_gpu_is_what_torch_holds_there():
    device = torch.device("cuda")
    before = memory_bytes(device)
    held = torch.empty(1 << 20, device=device)
    assert memory_bytes(device) - before >= held.numel() * held.element_size()


def test_memory_is_read_from_the_device_that_holds_the_models(monkeypatch):
    asked = []
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device: asked.append(device) or 7 << 30)
    monkeypatch.setattr(models, "resident_bytes", lambda: 3 << 30)
    assert memory_bytes(torch.device("cuda:1")) == 7 << 30 and asked == [torch.device("cuda:1")]
    assert memory_bytes(torch.device("cpu")) == 3 << 30


@pytest.mark.parametrize(
    ("device", "want"),
    [
        ("cpu", {"device": "cpu", "compute_type": "int8", "cpu_threads": asr.DEFAULT_CPU_THREADS}),
        ("cuda", {"device": "cuda", "device_index": 0, "compute_type": "float16"}),
        ("cuda:1", {"device": "cuda", "device_index": 1, "compute_type": "float16"}),
    ],
)
@pytest.mark.parametrize("window_s", [None, 10.0])
def test_the_asr_runs_on_the_engines_device(monkeypatch, device, want, window_s):
    got = {}

    def fake_init(self, path, **kwargs):  # WhisperModel's own loading, skipped
        got.update(kwargs)

    monkeypatch.setattr(pytest.importorskip("faster_whisper").WhisperModel, "__init__", fake_init)
    asr.Transcriber(device=device, window_s=window_s)
    assert got == want


def test_the_asr_refuses_a_device_it_cannot_use():
    with pytest.raises(ValueError, match="faster-whisper runs on cpu or cuda, not 'mps'"):
        asr.whisper_device("mps", 2)


@pytest.mark.parametrize(
    ("name", "hub_id"), [("qwen-7b", "Qwen/Qwen2.5-7B-Instruct"), ("qwen-0.5b-instruct", "Qwen/Qwen2.5-0.5B-Instruct")]
)
def test_the_gpu_pair_comes_from_the_hub_when_online(monkeypatch, name, hub_id):
    monkeypatch.setenv("SPECVOICE_ONLINE", "1")
    assert resolve_source(name) == (hub_id, PRESETS[name])  # names the source; nothing is fetched


@pytest.mark.parametrize("name", ["qwen-7b", "qwen-0.5b-instruct"])
def test_the_gpu_pair_offline_says_what_it_needs(monkeypatch, name):
    monkeypatch.delenv("SPECVOICE_ONLINE", raising=False)
    with pytest.raises(ModelLoadError, match=f"{name!r} is Qwen/.* no offline package: it needs SPECVOICE_ONLINE=1"):
        resolve_source(name)


def test_the_7b_target_picks_its_draft(monkeypatch):
    assert EngineSpec(target="qwen-7b", device="cuda").draft == "qwen-0.5b-instruct"
    assert cli_spec("--target", "qwen-7b", "--device", "cuda").draft == "qwen-0.5b-instruct"
    assert EngineSpec(target="qwen-7b", draft="ngram").draft == "ngram"
    monkeypatch.delenv("SPECVOICE_ONLINE", raising=False)
    with pytest.raises(ModelLoadError, match="SPECVOICE_ONLINE=1"):  # before any weights or memory check
        build_engines(EngineSpec(target="qwen-7b"), ["qwen-0.5b-instruct"])


def test_a_draft_with_a_narrower_head_samples_over_the_targets_vocabulary(tiny_engine, monkeypatch):
    """Qwen2.5-7B's head has 152064 rows, its 0.5B draft's 151936 (one tokenizer): rejection sampling needs q as wide
    as p. The tiny draft cut to 200 rows stands in."""
    spec = tiny_engine.spec_with(k="4")
    load = build.load_model

    def narrow_draft(name, *args):
        loaded = load(name, *args)
        if name == spec.draft:
            restrict_vocab(loaded.model, torch.arange(200, device=loaded.device))
        return loaded

    monkeypatch.setattr(build, "load_model", narrow_draft)
    engine, target = build_engine(spec)
    proposal = engine.drafter_factory().propose(list(range(40, 60)), 4, SamplingParams(temperature=1.0), None)
    assert proposal.probs is not None and proposal.probs.shape == (4, target.model.config.vocab_size)
    assert proposal.probs[:, 200:].sum() == 0
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "hello there"}])
    tokens, _ = collect(engine.stream(ids, GenerationConfig(30, SamplingParams(temperature=1.0), seed=1)))
    assert tokens  # verified against the draft's q without a shape error


def test_the_voice_agent_puts_its_asr_on_the_engines_device(monkeypatch):
    from pipeline.agent import AgentConfig, make_transcriber
    from specdec.build import EngineSpec

    got = {}
    whisper_model = pytest.importorskip("faster_whisper").WhisperModel
    monkeypatch.setattr(whisper_model, "__init__", lambda self, path, **kwargs: got.update(kwargs))
    make_transcriber(AgentConfig(engine=EngineSpec(device="cuda:1")))
    assert (got["device"], got["device_index"], got["compute_type"]) == ("cuda", 1, "float16")
