"""Smart Turn v3.2 (pipeline/smart_turn.py): its 8 s window, its fallbacks, and what it hears in our recordings."""

from __future__ import annotations

import importlib.metadata as md
import json
import os
import threading
from pathlib import Path

import numpy as np
import pytest
import soundfile as sf
import torch

from pipeline import smart_turn
from pipeline.onnx_file import read_graph
from pipeline.smart_turn import WINDOW_S, LogMel, SmartTurn, SmartTurnNet, load_smart_turn, window
from specdec import compute
from tests.support.engine import ROOT

SR = 16_000
HELDOUT = ROOT / "assets" / "utterances-heldout"  # finished questions
PAUSES = ROOT / "assets" / "utterances-pauses"  # an unfinished phrase, 0.5 s of silence, the rest of the question


def read(path: Path) -> np.ndarray:
    audio, sr = sf.read(path, dtype="float32")
    assert sr == SR and audio.ndim == 1, path
    return audio


def threads_now() -> set[int]:
    return {int(task.name) for task in Path("/proc/self/task").iterdir()}


def silence_start(audio: np.ndarray, min_s: float = 0.4, eps: float = 1e-3) -> int | None:
    """The first sample of the first run of at least min_s of near-zero samples."""
    n = int(min_s * SR)
    quiet = np.concatenate([[0], np.cumsum(np.abs(audio) < eps)])
    runs = np.flatnonzero(quiet[n:] - quiet[:-n] == n)
    return int(runs[0]) if len(runs) else None


@pytest.fixture(scope="module")
def model() -> SmartTurn:
    loaded, line = load_smart_turn()
    if loaded is None:
        if os.environ.get("CI"):
            pytest.fail(line)
        pytest.skip(line)
    assert line == f"end of turn: Smart Turn v3.2 (pipecat-ai {md.version('pipecat-ai')}) loaded"
    return loaded


def test_window_pads_short_audio_with_zeros_at_the_start() -> None:
    audio = np.linspace(-0.5, 0.5, SR, dtype=np.float32)  # 1 s
    out = window(audio)
    assert out.dtype == np.float32 and out.shape == (int(WINDOW_S * SR),)
    assert not out[: -len(audio)].any()  # the speech ends where the window ends, right before the pause
    np.testing.assert_array_equal(out[-len(audio) :], audio)


def test_window_keeps_the_last_8_s_of_longer_audio() -> None:
    audio = np.arange(10 * SR, dtype=np.float32)
    np.testing.assert_array_equal(window(audio), audio[-int(WINDOW_S * SR) :])
    exact = np.ones(int(WINDOW_S * SR), np.float32)
    np.testing.assert_array_equal(window(exact), exact)


@pytest.mark.parametrize("bad", [np.zeros((SR, 2), np.float32), np.zeros((1, SR), np.float32), np.zeros(0)])
def test_window_rejects_stereo_other_shapes_and_empty_audio(bad: np.ndarray) -> None:
    with pytest.raises(ValueError, match="mono|empty"):
        window(bad)


def test_a_missing_file_falls_back_to_the_words_rule(tmp_path: Path) -> None:
    model, line = load_smart_turn(tmp_path / "nothing.onnx")
    assert model is None and "not loaded" in line and "words rule" in line


def test_a_corrupt_file_falls_back_without_raising(tmp_path: Path) -> None:
    path = tmp_path / "corrupt.onnx"
    path.write_bytes(np.random.default_rng(0).bytes(4096))
    model, line = load_smart_turn(path)
    assert model is None and "not loaded" in line and "fails to load" in line


def test_without_pipecat_ai_the_line_says_how_to_install_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(smart_turn, "DISTRIBUTION", "no-such-distribution-here")
    model, line = load_smart_turn()
    assert model is None and "not installed" in line
    assert "pip install --no-deps pipecat-ai==1.14.0" in line  # the pin, read from pyproject.toml's turn extra


def test_probability_rejects_bad_input(model: SmartTurn) -> None:
    with pytest.raises(ValueError, match="mono"):
        model.probability(np.zeros((SR, 2), np.float32))
    with pytest.raises(ValueError, match="empty"):
        model.probability(np.zeros(0, np.float32))


def test_finished_questions_sound_finished(model: SmartTurn) -> None:
    """Seen: 0.96–0.99 on all 12 held-out questions (onnxruntime on the file's int8 graph: 0.94–0.99)."""
    probs = {f.stem: model.probability(read(f)) for f in sorted(HELDOUT.glob("*.wav"))}
    assert len(probs) == 12 and all(0.0 <= p <= 1.0 for p in probs.values())
    assert min(probs.values()) > 0.8, probs


def test_speech_cut_off_mid_question_sounds_unfinished(model: SmartTurn) -> None:
    """The same questions cut at half their length, mid-word: seen below the whole question in 12 of 12, median
    0.03 against 0.99 (onnxruntime's int8: 0.12)."""
    lower, cut_probs = 0, []
    for f in sorted(HELDOUT.glob("*.wav")):
        audio = read(f)
        cut = model.probability(audio[: len(audio) // 2])
        lower += cut < model.probability(audio)
        cut_probs.append(cut)
    assert lower >= 10 and np.median(cut_probs) < 0.4, cut_probs


def test_the_pause_is_found_where_the_unfinished_phrase_ends() -> None:
    files = sorted(PAUSES.glob("*.wav"))
    assert {f.stem for f in files} == set(json.loads((PAUSES / "transcripts.json").read_text())) and len(files) == 12
    for f in files:
        audio = read(f)
        start = silence_start(audio)
        assert start is not None and 0.5 * SR < start < 1.6 * SR, f.stem
        resumes = start + int(np.flatnonzero(np.abs(audio[start:]) >= 1e-3)[0])
        assert (resumes - start) / SR == pytest.approx(0.5, abs=0.05), f.stem


def test_a_phrase_spoken_on_into_a_pause_sounds_unfinished(model: SmartTurn) -> None:
    """assets/utterances-turns-tune-flow: each sentence synthesized whole, a pause inserted after an unfinished
    phrase. Seen: median 0.04 before the pause against 0.25 for the whole sentence, lower in 24 of 36 (onnxruntime's
    int8: 0.10 against 0.56, 24 of 36). (Where the phrase is synthesized apart, as in assets/utterances-pauses, it
    falls like a finished sentence, and the model hears it as finished: 0.93-0.99 in 11 of 12.)"""
    folder = ROOT / "assets" / "utterances-turns-tune-flow"
    before, whole = [], []
    for name, turn in sorted(json.loads((folder / "turns.json").read_text()).items()):
        audio = read(folder / f"{name}.wav")
        start = silence_start(audio, min_s=turn["pause_ms"] / 1000 - 0.01)
        assert start is not None, name
        before.append(model.probability(audio[:start]))
        whole.append(model.probability(audio))
    assert len(before) == 36 and np.median(before) < 0.1 < np.median(whole), (before, whole)
    assert sum(b < w for b, w in zip(before, whole)) >= 20


@pytest.mark.parametrize("samples", [SR // 4, 2 * SR, int(WINDOW_S + 1) * SR])
def test_features_equal_transformers_whisper_features(samples: int) -> None:
    """The model was trained on transformers' WhisperFeatureExtractor(chunk_length=8) of the normalized window; ours
    is numpy-only (see LogMel for why), and must give the same features for turns shorter and longer than the
    window."""
    from transformers import WhisperFeatureExtractor

    speech = read(HELDOUT / "sky.wav")
    speech = speech[np.flatnonzero(np.abs(speech) > 0.01)[0] :]
    audio = np.resize(speech, samples)  # repeated to length: voiced from the first sample to the last
    want = WhisperFeatureExtractor(chunk_length=int(WINDOW_S))(
        window(audio), sampling_rate=SR, return_tensors="np", do_normalize=True
    ).input_features[0]
    got = LogMel()(audio)
    assert got.shape == want.shape == (80, 800) and got.dtype == np.float32
    assert np.abs(got - want).max() < 1e-4


def features(audio: np.ndarray) -> torch.Tensor:
    return torch.from_numpy(LogMel()(audio))


@pytest.fixture(scope="module")
def float32_net(model: SmartTurn) -> SmartTurnNet:
    return SmartTurnNet(read_graph(model.path), torch.float32)


def test_the_encoder_is_whispers_on_the_files_weights(model: SmartTurn, float32_net: SmartTurnNet) -> None:
    """The weights read from the ONNX graph (named by the biases and norms around them, dequantized along their
    channel axis), run by transformers' own WhisperEncoder, give the states ours gives: any weight misnamed,
    transposed or scaled on the wrong axis, or a wrong attention scale, breaks this."""
    from transformers import WhisperConfig
    from transformers.models.whisper.modeling_whisper import WhisperEncoder

    config = WhisperConfig(
        num_mel_bins=80,
        d_model=384,
        encoder_layers=4,
        encoder_attention_heads=6,
        encoder_ffn_dim=1536,
        max_source_positions=400,
        activation_function="gelu",
    )
    encoder = WhisperEncoder(config).eval()
    graph, net = read_graph(model.path), float32_net
    weights = smart_turn._dequantized_weights(graph)
    state = {}
    for name, param in encoder.state_dict().items():
        full = f"inner.encoder.{name.removesuffix('.weight').removesuffix('.bias')}"
        if name.endswith(".weight") and full in weights:
            state[name] = weights[full].reshape(param.shape)
        else:
            state[name] = smart_turn._float(graph, f"inner.encoder.{name}").reshape(param.shape)
    encoder.load_state_dict(state)
    mel = features(read(HELDOUT / "sky.wav"))
    with torch.inference_mode():
        want = encoder(mel[None]).last_hidden_state[0]
        got = net.encode(mel)
    assert got.shape == want.shape == (400, 384)
    assert torch.allclose(got, want, atol=1e-3), (got - want).abs().max()


def test_bf16_gives_the_float32_probability(model: SmartTurn, float32_net: SmartTurnNet) -> None:
    """Where the CPU multiplies bf16 the model runs in it; its P(finished) stays the float32 model's."""
    for f in sorted(HELDOUT.glob("*.wav"))[:4]:
        assert model.probability(read(f)) == pytest.approx(float32_net(features(read(f))), abs=0.05), f.stem


def test_the_onnx_reader_finds_every_layer(model: SmartTurn) -> None:
    graph = read_graph(model.path)
    assert len(graph.nodes) == 406 and {"DequantizeLinear", "MatMul", "Gemm", "Conv"} <= {n.op for n in graph.nodes}
    names = set(smart_turn._dequantized_weights(graph))
    per_layer = {f"inner.encoder.layers.{i}.{p}" for i in range(4) for p in ("fc1", "fc2")}
    per_layer |= {f"inner.encoder.layers.{i}.self_attn.{p}_proj" for i in range(4) for p in ("q", "k", "v", "out")}
    others = {"inner.encoder.conv1", "inner.encoder.conv2", "inner.pool_attention.0", "inner.pool_attention.2"}
    assert names == per_layer | others | {f"inner.classifier.{i}" for i in (0, 4, 6)}


def test_a_file_that_is_not_onnx_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "text.onnx"
    path.write_text("not a model")
    with pytest.raises(ValueError, match="not a readable ONNX model"):
        read_graph(path)


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="counts the process's threads in /proc")
@pytest.mark.skipif(torch.get_num_threads() < 2, reason="one torch thread: no OpenMP pool to start")
def test_smart_turn_runs_on_one_core_of_its_own_and_starts_no_openmp_pool(model: SmartTurn) -> None:
    """A pool of OpenMP workers beside the compute thread's made every later LLM forward ~1.6x slower
    (specdec/compute.py): Smart Turn loads and runs on a thread of its own kept to one core, and the thread count
    torch gives every other thread, later ones included, stays as it was."""
    compute.run(lambda: torch.ones(4_000_000).mul_(2))  # the compute thread's own pool, started first
    compute.run(lambda: torch.ones(512, 512) @ torch.ones(512, 512))  # and MKL's, as an LLM forward starts them
    threads = torch.get_num_threads()
    seen: dict[str, set[int]] = {}

    def load_and_score() -> None:
        seen["before"] = threads_now()
        loaded = SmartTurn(model.path)
        loaded.probability(read(HELDOUT / "sky.wav"))
        seen["after"] = threads_now()
        seen["own"] = {loaded._thread.submit(threading.get_native_id).result()}

    loader = threading.Thread(target=load_and_score)
    loader.start()
    loader.join(60)
    # By thread id, not count: an earlier test's executor may end its worker meanwhile.
    assert seen["after"] - seen["before"] == seen["own"]  # its own thread, and no workers
    assert model._thread.submit(torch.get_num_threads).result() == 1
    assert torch.get_num_threads() == threads
    later: list[int] = []
    newcomer = threading.Thread(target=lambda: later.append(torch.get_num_threads()))
    newcomer.start()
    newcomer.join()
    assert later == [threads]
