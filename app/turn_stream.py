"""What the page sees of one answer as it is generated: token pieces for the live panels, audio for the player."""

from __future__ import annotations

import time
from collections.abc import Callable

import numpy as np

from pipeline.events import AnswerEvent, AnswerStep, Audio

from .wire import token_message


class TurnStream:
    """The on_event sink of one answer. put(message) queues a message for the page; send_audio(turn, seq, samples,
    now, rate) sends one TTS chunk and returns the next packet number; closed() is true once the tab is gone."""

    def __init__(
        self,
        put: Callable[[dict], None],
        send_audio: Callable[[int, int, np.ndarray, float, int], int],
        closed: Callable[[], bool],
        turn: int,
        rate: int,
        stream_audio: bool = True,
    ) -> None:
        self.put = put
        self.send_audio = send_audio
        self.closed = closed
        self.turn = turn
        self.rate = rate
        self.stream_audio = stream_audio
        self.seq = 0
        self.prev_t: float | None = None

    def __call__(self, event: AnswerEvent) -> None:
        if self.closed():
            return
        now = time.perf_counter()
        if isinstance(event, AnswerStep):
            n = event.delta.step_tokens or 1
            # The first step's time is the prefill's: a per-step rate starts at the second step.
            step_rate = n / (now - self.prev_t) if self.prev_t is not None and now > self.prev_t else None
            self.prev_t = now
            self.put(token_message(event, self.turn, step_rate))
        elif isinstance(event, Audio) and self.stream_audio:
            self.seq = self.send_audio(self.turn, self.seq, event.samples, now, self.rate)
