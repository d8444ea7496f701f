"""Test helper: real speech from espeak-ng, so audio tests need no recordings or downloads.

from tests.support.speech import ESPEAK, needs_espeak, speak
"""

from __future__ import annotations

import os
import shutil
import subprocess
import tempfile

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio import resample

ESPEAK = shutil.which("espeak-ng")
needs_espeak = pytest.mark.skipif(ESPEAK is None, reason="espeak-ng is not installed (apt-get install espeak-ng)")


def speak(text: str, path: str | os.PathLike[str] | None = None, rate: int = 16000) -> np.ndarray:
    """Synthesize text with espeak-ng -> float32 mono at `rate`; also written to `path` (16-bit WAV) if given."""
    if ESPEAK is None:
        raise RuntimeError("espeak-ng is not installed")
    with tempfile.TemporaryDirectory() as tmp:
        wav = os.path.join(tmp, "speech.wav")
        subprocess.run([ESPEAK, "-w", wav, text], check=True, capture_output=True, timeout=30)
        samples, native_rate = sf.read(wav, dtype="float32")
    audio = resample(samples, native_rate, rate)
    if path is not None:
        sf.write(os.fspath(path), audio, rate, subtype="PCM_16")
    return audio
