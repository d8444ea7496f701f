import io
import shutil
import subprocess

import numpy as np
import pytest
import soundfile as sf

from pipeline.audio import SAMPLE_RATE, AudioError, load_audio, resample, to_mono_16k


def tone(rate: int, seconds: float = 0.5, freq: float = 440.0, amp: float = 0.5) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (amp * np.sin(2 * np.pi * freq * t)).astype(np.float32)


def peak_hz(x: np.ndarray, rate: int = SAMPLE_RATE) -> float:
    spectrum = np.abs(np.fft.rfft(x))
    return float(np.fft.rfftfreq(len(x), 1 / rate)[np.argmax(spectrum)])


def test_audio_error_is_a_value_error():
    assert issubclass(AudioError, ValueError)


@pytest.mark.parametrize("rate", [8000, 16000, 22050, 44100, 48000])
def test_rates_resample_to_16k_and_keep_pitch(rate):
    out = to_mono_16k(tone(rate), rate)
    assert out.dtype == np.float32 and out.ndim == 1
    assert abs(len(out) - SAMPLE_RATE // 2) <= 1
    assert abs(peak_hz(out) - 440) < 5


def test_stereo_int16_44k1_frames_first_and_channels_first():
    left = (tone(44100) * 32767).astype(np.int16)
    stereo = np.stack([left, np.zeros_like(left)], axis=1)  # (n, 2)
    out = to_mono_16k(stereo, 44100)
    assert out.dtype == np.float32 and abs(len(out) - 8000) <= 1
    assert 0.2 < np.max(np.abs(out)) < 0.3  # mean of a 0.5 tone and silence
    np.testing.assert_allclose(to_mono_16k(stereo.T, 44100), out)  # (2, n) is recognized too


@pytest.mark.parametrize(
    ("dtype", "full_scale", "zero"),
    [(np.int16, 32767, 0), (np.int32, 2**31 - 1, 0), (np.uint8, 255, 128), (np.float64, 1.0, 0.0)],
)
def test_sample_types_scale_to_unit_range(dtype, full_scale, zero):
    x = np.full(1600, zero, dtype=dtype)
    x[::2] = full_scale
    out = to_mono_16k(x, 16000)
    assert out.dtype == np.float32
    assert 0.98 < out.max() <= 1.0


@pytest.mark.parametrize(
    ("samples", "rate", "message"),
    [
        (np.zeros(0, np.float32), 16000, "empty"),
        (np.array([0.1, np.nan, 0.2] * 100, np.float32), 16000, "NaN"),
        (np.array([0.1, np.inf] * 100, np.float64), 16000, "NaN or infinite"),
        (np.zeros(16000, np.int16), 16000, "silent"),
        (np.full(16000, 1e-6, np.float32), 16000, "silent"),
        (np.full(800, 128, np.uint8), 8000, "silent"),
        (tone(16000), 4000, "outside the supported"),
        (tone(16000), 96000, "outside the supported"),
        (tone(16000).astype(np.int64), 16000, "unsupported sample type"),
        (tone(16000) * 32767, 16000, "integer PCM passed as float"),
        (np.zeros((2, 2, 100), np.float32), 16000, "1-D or 2-D"),
        (np.ones((20, 20), np.float32), 16000, "samples from channels"),
    ],
)
def test_bad_input_raises_clear_error(samples, rate, message):
    with pytest.raises(AudioError, match=message):
        to_mono_16k(samples, rate)


def test_over_long_audio_rejected_before_work():
    with pytest.raises(AudioError, match="61.0 s long; the limit is 60 s"):
        to_mono_16k(np.ones(8000 * 61, np.int16), 8000)
    with pytest.raises(AudioError, match="limit is 1 s"):
        to_mono_16k(tone(16000, seconds=1.5), 16000, max_seconds=1)


def test_resample_round_trip_length():
    x = tone(48000, seconds=1.0)
    assert len(resample(x, 48000, 24000)) == 24000
    assert resample(x, 48000, 48000).dtype == np.float32


def wav_bytes(x: np.ndarray, rate: int) -> bytes:
    buf = io.BytesIO()
    sf.write(buf, x, rate, format="WAV", subtype="PCM_16")
    return buf.getvalue()


def test_load_audio_wav_bytes_and_path(tmp_path):
    x = np.stack([tone(22050), tone(22050)], axis=1)
    samples, rate = load_audio(wav_bytes(x, 22050))
    assert rate == 22050 and samples.shape == x.shape
    path = tmp_path / "a.wav"
    path.write_bytes(wav_bytes(x, 22050))
    samples2, _ = load_audio(path)
    np.testing.assert_array_equal(samples, samples2)
    assert abs(len(to_mono_16k(samples, rate)) - 8000) <= 1


@pytest.mark.parametrize("data", [b"", b"not audio at all " * 50, b"RIFF" + bytes(200)])
def test_load_audio_corrupt_or_empty_bytes(data):
    with pytest.raises(AudioError, match="empty|could not decode|ffmpeg"):
        load_audio(data)


def test_load_audio_missing_file(tmp_path):
    with pytest.raises(AudioError, match="no such audio file"):
        load_audio(tmp_path / "nope.wav")


@pytest.mark.skipif(shutil.which("ffmpeg") is None, reason="ffmpeg is not installed")
def test_load_audio_webm_opus_via_ffmpeg(tmp_path):
    # What a browser's MediaRecorder sends; libsndfile cannot read it.
    src, webm = tmp_path / "a.wav", tmp_path / "a.webm"
    src.write_bytes(wav_bytes(tone(48000), 48000))
    subprocess.run(
        ["ffmpeg", "-nostdin", "-loglevel", "error", "-i", str(src), "-c:a", "libopus", str(webm)],
        check=True,
        timeout=30,
    )
    samples, rate = load_audio(webm.read_bytes())
    assert rate == SAMPLE_RATE and samples.dtype == np.float32
    assert abs(len(samples) - 8000) < 800
    assert abs(peak_hz(samples) - 440) < 10
