"""One tab's answer audio on the way out: resampled to the page's rate, cut into packets for its player, and the
last answers kept for "play again"."""

from __future__ import annotations

import time

import numpy as np

from pipeline.audio import resample

from .outbox import Outbox
from .protocol import DEFAULT_PLAYBACK_RATE, FLAG_REPLAY, pack_audio

FIRST_PACKET_S = 0.1
REPLAY = "replay"  # the outbox tag of a replayed answer's packets


class AnswerAudio:
    """Sends a tab's TTS chunks as audio packets (any worker thread) and keeps the last answers' samples."""

    def __init__(self, outbox: Outbox) -> None:
        self.outbox = outbox
        self.closed = False  # the tab went away: nothing more is kept or replayed
        self.browser_rate = DEFAULT_PLAYBACK_RATE  # what the page plays at (its hello)
        self.playing_until = 0.0  # perf_counter time the browser should finish playing what it was sent
        self._emitted_ms: dict[int, float] = {}  # turn → server time its first audio packet left
        self._kept: dict[int, tuple[list[np.ndarray], int]] = {}  # turn → (TTS chunks, their rate), replayable

    def send(self, turn: int, seq: int, samples: np.ndarray, now: float, rate: int, flags: int = 0) -> int:
        """Send one TTS chunk (at rate) as packets numbered from seq; returns the next seq."""
        if seq == 0 and not flags & FLAG_REPLAY:
            self._emitted_ms[turn] = now * 1000
        # Resampled here (polyphase) rather than in the worklet, so the player only copies samples.
        browser_rate = self.browser_rate
        pcm = resample(samples, rate, browser_rate)
        # A short first packet can start playing while the (much larger) rest is still in transit.
        cut = int(FIRST_PACKET_S * browser_rate)
        tag = REPLAY if flags & FLAG_REPLAY else None
        for part in (pcm[:cut], pcm[cut:]):
            if len(part):
                self.outbox.put(pack_audio(part, turn, seq, browser_rate, now * 1000, flags), tag)
                seq += 1
        self.playing_until = max(self.playing_until, now) + len(samples) / rate
        return seq

    def emitted_ms(self, turn: int) -> float | None:
        """When turn's first audio packet left (server time, ms); None before it did."""
        return self._emitted_ms.get(turn)

    def keep(self, turn: int, audio: list[np.ndarray], rate: int, turns: int) -> None:
        """Keep turn's answer for a replay, and the last `turns` answers only."""
        if audio and not self.closed:
            self._kept[turn] = (audio, rate)
        while len(self._kept) > turns:
            self._kept.pop(next(iter(self._kept)))

    def kept(self, turn: int) -> tuple[list[np.ndarray], int] | None:
        return self._kept.get(turn)

    def replay(self, turn: int, audio: list[np.ndarray], rate: int) -> None:
        """Send a kept answer again (off the event loop: resampling a long answer takes a while)."""
        now, seq = time.perf_counter(), 0
        for samples in audio:
            if self.closed:
                return
            seq = self.send(turn, seq, samples, now, rate, FLAG_REPLAY)

    def close(self) -> None:
        self.closed = True
        self._kept.clear()
