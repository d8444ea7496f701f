"""Audio in: decode files or browser blobs and normalize any PCM array to 16 kHz mono float32."""

from __future__ import annotations

import io
import os
import shutil
import subprocess
from math import gcd

import numpy as np
import soundfile as sf
from scipy.signal import resample_poly

SAMPLE_RATE = 16000  # what silero-vad and Whisper both expect
MIN_RATE, MAX_RATE = 8000, 48000
DEFAULT_MAX_SECONDS = 60.0
SILENT_PEAK = 1e-4  # about -80 dBFS: below this a mic is muted or unplugged, not quiet
SILENT_RMS = 1e-5
_MAX_CHANNELS = 8
_FFMPEG_TIMEOUT_S = 30

# Integer PCM -> float scale and offset, so that full scale maps to [-1, 1).
_INT_SCALE = {
    np.dtype(np.int16): (32768.0, 0.0),
    np.dtype(np.int32): (2147483648.0, 0.0),
    np.dtype(np.uint8): (128.0, 128.0),
}


class AudioError(ValueError):
    """Audio that cannot be used: the message says why, in words a user can act on."""


def resample(samples: np.ndarray, from_rate: int, to_rate: int) -> np.ndarray:
    """Polyphase resampling of a float mono signal; returns float32."""
    if from_rate == to_rate:
        return np.asarray(samples, dtype=np.float32)
    g = gcd(int(from_rate), int(to_rate))
    return resample_poly(samples, to_rate // g, from_rate // g).astype(np.float32)


def _as_frames_first(x: np.ndarray) -> np.ndarray:
    """(n,) or (n, ch) or (ch, n) -> (n, ch)."""
    if x.ndim == 1:
        return x[:, None]
    if x.ndim != 2:
        raise AudioError(f"audio must be 1-D or 2-D (samples, channels); got shape {x.shape}")
    n, ch = x.shape
    if ch <= _MAX_CHANNELS and n >= ch:
        return x
    # Some decoders hand out (channels, samples): accept it when it can only mean that.
    if n <= _MAX_CHANNELS and ch > 16 * n:
        return x.T
    raise AudioError(f"cannot tell samples from channels in shape {x.shape} (at most {_MAX_CHANNELS} channels)")


def _to_float(x: np.ndarray) -> np.ndarray:
    if x.dtype in _INT_SCALE:
        scale, offset = _INT_SCALE[x.dtype]
        return (x.astype(np.float64) - offset) / scale
    if x.dtype in (np.float32, np.float64):
        if not np.all(np.isfinite(x)):
            raise AudioError("audio contains NaN or infinite samples")
        peak = float(np.max(np.abs(x)))
        # Float PCM is [-1, 1]; a peak far above means integer samples were stored as floats.
        if peak > 2.0:
            raise AudioError(f"float audio must be in [-1, 1]; its peak is {peak:.3g} (integer PCM passed as float?)")
        return x.astype(np.float64)
    raise AudioError(f"unsupported sample type {x.dtype}; use int16, int32, uint8, float32 or float64")


def to_mono_16k(samples: np.ndarray, sample_rate: int, max_seconds: float = DEFAULT_MAX_SECONDS) -> np.ndarray:
    """Any PCM array -> 16 kHz mono float32 in [-1, 1], or AudioError saying what is wrong with it."""
    x = np.asarray(samples)
    if x.size == 0:
        raise AudioError("audio is empty")
    if not MIN_RATE <= int(sample_rate) <= MAX_RATE:
        raise AudioError(f"sample rate {sample_rate} Hz is outside the supported {MIN_RATE}-{MAX_RATE} Hz")
    x = _as_frames_first(x)
    seconds = x.shape[0] / sample_rate
    if seconds > max_seconds:  # checked before any work, so a huge upload costs nothing
        raise AudioError(f"audio is {seconds:.1f} s long; the limit is {max_seconds:g} s")
    mono = _to_float(x).mean(axis=1)
    peak = float(np.max(np.abs(mono)))
    rms = float(np.sqrt(np.mean(mono * mono)))
    if peak < SILENT_PEAK or rms < SILENT_RMS:
        raise AudioError(f"audio is silent (peak {peak:.1e}); check that the microphone is on and unmuted")
    out = resample(mono, int(sample_rate), SAMPLE_RATE)
    # Resampling can overshoot full scale slightly at sharp transients.
    return np.ascontiguousarray(np.clip(out, -1.0, 1.0), dtype=np.float32)


def _ffmpeg_decode(source: str | bytes) -> np.ndarray:
    """Decode what libsndfile cannot (webm/opus, mp4/aac, mp3 on old libsndfile) to 16 kHz mono float32."""
    ffmpeg = shutil.which("ffmpeg")
    if ffmpeg is None:
        raise AudioError("this audio format needs ffmpeg, which is not installed")
    from_pipe = isinstance(source, bytes)
    cmd = [
        ffmpeg,
        "-nostdin",
        "-hide_banner",
        "-loglevel",
        "error",
        "-i",
        "pipe:0" if from_pipe else source,
        "-f",
        "f32le",
        "-ac",
        "1",
        "-ar",
        str(SAMPLE_RATE),
        "pipe:1",
    ]
    try:
        proc = subprocess.run(
            cmd, input=source if from_pipe else None, capture_output=True, timeout=_FFMPEG_TIMEOUT_S, check=False
        )
    except subprocess.TimeoutExpired as e:
        raise AudioError(f"decoding audio took over {_FFMPEG_TIMEOUT_S} s; is it a valid audio file?") from e
    if proc.returncode != 0 or not proc.stdout:
        lines = proc.stderr.decode(errors="replace").strip().splitlines()
        raise AudioError(f"could not decode audio: {lines[-1] if lines else 'no audio stream found'}")
    return np.frombuffer(proc.stdout, dtype="<f4").copy()


def load_audio(source: str | os.PathLike[str] | bytes) -> tuple[np.ndarray, int]:
    """A path or the bytes of an audio file -> (samples, sample_rate); samples may be multi-channel.

    Tries libsndfile first (wav, flac, ogg) and falls back to ffmpeg for browser formats (webm, mp4).
    Pass the result to to_mono_16k.
    """
    if isinstance(source, (bytes, bytearray, memoryview)):
        source = bytes(source)
        if not source:
            raise AudioError("audio is empty (0 bytes)")
        opened: str | io.BytesIO = io.BytesIO(source)
    else:
        source = os.fspath(source)
        if not os.path.isfile(source):
            raise AudioError(f"no such audio file: {source}")
        opened = source
    try:
        samples, rate = sf.read(opened, dtype="float32", always_2d=False)
    except sf.SoundFileError:  # not a format libsndfile knows: let ffmpeg try
        return _ffmpeg_decode(source), SAMPLE_RATE
    return samples, int(rate)
