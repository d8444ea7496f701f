"""End of turn by sound: Pipecat's Smart Turn v3.2, a small ONNX model that hears from the last 8 s of a turn whether
the speaker has finished (intonation, a trailing "and …"), without waiting for the words.

The model ships inside the pipecat-ai wheel, pinned once in pyproject.toml's `turn` extra and installed with
--no-deps: its own dependencies are heavy and only the file is used. The pipecat package is never imported; the
file is found through the distribution's metadata.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from pathlib import Path

import numpy as np
import onnxruntime as ort  # type: ignore[import-untyped]  # ships no type hints

SAMPLE_RATE = 16_000
WINDOW_S = 8.0  # the model was trained on the last 8 s of a turn
WINDOW = int(WINDOW_S * SAMPLE_RATE)
DISTRIBUTION = "pipecat-ai"
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"


def window(audio16k: np.ndarray) -> np.ndarray:
    """The model's input audio: the last 8 s, shorter audio zero-padded at the start (as in training, so the
    speech ends where the window ends, right before the pause)."""
    audio = np.asarray(audio16k, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"Smart Turn takes mono audio (a 1-D array at 16 kHz), got shape {audio.shape}")
    if audio.size == 0:
        raise ValueError("Smart Turn needs some audio, got an empty array")
    audio = audio[-WINDOW:]
    return np.pad(audio, (WINDOW - audio.size, 0))


class SmartTurn:
    """P(the speaker has finished) for the audio of a turn up to its pause."""

    def __init__(self, path: str | Path | None = None, threads: int = 1) -> None:
        self.path = Path(path) if path is not None else model_path()
        options = ort.SessionOptions()
        # One call at a time from the pipeline: parallelism only inside operators, so it never takes more cores
        # than `threads` from the ASR and the LLM running beside it.
        options.execution_mode = ort.ExecutionMode.ORT_SEQUENTIAL
        options.inter_op_num_threads = 1
        options.intra_op_num_threads = threads
        self.session = ort.InferenceSession(str(self.path), sess_options=options, providers=["CPUExecutionProvider"])
        # Whisper's log-mel features over an 8 s chunk, (80, 800), in numpy: transformers' extractor computes them
        # with torch when it is installed, and torch on this thread would start an OpenMP pool of its own, beside
        # the compute thread's, that made every later LLM forward ~1.7x slower (specdec/compute.py). Equal to
        # transformers' WhisperFeatureExtractor(chunk_length=8) within 2e-5.
        from faster_whisper.feature_extractor import FeatureExtractor  # on first use, as pipeline/asr.py does

        self.features = FeatureExtractor(feature_size=80, chunk_length=int(WINDOW_S))

    def probability(self, audio16k: np.ndarray) -> float:
        """P(finished) in [0, 1] for the turn's audio up to the pause (1-D float32 at 16 kHz)."""
        audio = window(audio16k)
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + 1e-7)  # the waveform normalized, as in training
        features = self.features(audio, padding=0)[None].astype(np.float32)
        (out,) = self.session.run(None, {"input_features": features})
        return float(np.clip(np.asarray(out).reshape(-1)[0], 0.0, 1.0))  # the model ends in a sigmoid


def model_path() -> Path:
    """The ONNX file inside the installed pipecat-ai (PackageNotFoundError when it is not installed)."""
    return Path(str(md.distribution(DISTRIBUTION).locate_file(MODEL_FILE)))


def pin() -> str:
    """The `turn` extra's requirement, from pyproject.toml in a checkout, else from specvoice's installed metadata."""
    if sys.version_info >= (3, 11):  # tomllib, like pipecat-ai itself, needs 3.11
        import tomllib

        try:
            pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
            return str(pyproject["project"]["optional-dependencies"]["turn"][0])
        except (OSError, KeyError, IndexError, tomllib.TOMLDecodeError):
            pass
    try:
        extra = re.compile(r"""extra\s*==\s*["']turn["']""")
        found = [r.split(";")[0].strip() for r in md.requires("specvoice") or [] if extra.search(r)]
        return found[0] if found else DISTRIBUTION
    except md.PackageNotFoundError:
        return DISTRIBUTION


def load_smart_turn(path: str | Path | None = None) -> tuple[SmartTurn | None, str]:
    """The model and a status line; never raises, as the words rule is the fallback for any failure."""
    fallback = "using the words rule"
    try:
        if path is None:
            version = md.version(DISTRIBUTION)
            source = f"pipecat-ai {version}"
            file = model_path()
        else:
            source, file = str(path), Path(path)
    except md.PackageNotFoundError:
        how = f"pip install --no-deps {pin()}, as scripts/setup.sh does"
        return None, f"end of turn: Smart Turn not loaded (pipecat-ai is not installed: {how}): {fallback}"
    if not file.is_file():
        return None, f"end of turn: Smart Turn not loaded (no model file at {file}): {fallback}"
    try:
        model = SmartTurn(file)
    except Exception as e:  # onnxruntime raises its own error types for a corrupt or foreign file
        reason = f"{file} fails to load: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None, f"end of turn: Smart Turn not loaded ({reason}): {fallback}"
    return model, f"end of turn: Smart Turn v3.2 ({source}) loaded"
