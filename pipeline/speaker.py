"""One answer spoken as it is generated, on the thread that asked for it: the LLM's steps are read as they come (they
run on the compute thread, specdec/compute.py), chunked, and each chunk is spoken before the next step is read, so
a token crosses the compute thread, this one and the caller's event loop, and no queue of chunks between."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import numpy as np

from .chunker import SpeechChunker
from .events import AnswerStep, Audio, Chunk, EventSink
from .llm import LLMDelta, ReplyStats
from .preemptive import Hold
from .timeline import Timeline
from .tts import TTS

# A later chunk waits for its sentence's end unless the answer's speech out so far ends within this: a token or two
# on this CPU, and the TTS's first samples of the chunk.
RUN_DRY_MARGIN_S = 0.3


class SpokenAnswer:
    """Reads an answer's deltas, stamps the timeline, and speaks its chunks through tts. Once cancel is set nothing
    more is spoken, and the deltas are read to the stream's end (the engine stops at its next step). With hold (an
    answer started before its turn ended), audio waits until the turn is confirmed, and stops if it is discarded."""

    def __init__(
        self,
        tts: TTS,
        timeline: Timeline,
        emit: EventSink,
        cancel: threading.Event,
        hold: Hold | None,
        first_chunk_words: int,
    ) -> None:
        self.tts, self.timeline, self.emit, self.cancel, self.hold = tts, timeline, emit, cancel, hold
        self.chunker = SpeechChunker(first_chunk_words)
        self.stats = ReplyStats()
        self.text: list[str] = []  # every delta's
        self.spoken: list[str] = []  # the chunks played whole
        self.spoken_tokens = 0  # tokens up to the last chunk played whole
        self.audio: list[np.ndarray] = []

    def run(self, deltas: Iterator[LLMDelta]) -> None:
        done_t = None
        for delta in deltas:
            done_t = delta.done_t
            self._read(delta)
        for chunk in self.chunker.flush():
            self._speak(chunk, done_t)

    def _read(self, delta: LLMDelta) -> None:
        if self.hold is not None and delta.end_of_message_probability is not None:
            self.hold.vote(delta.end_of_message_probability)
        self.timeline.mark("llm_first_token", delta.t)
        self.text.append(delta.text)
        self.emit(AnswerStep(delta, self.stats.tokens, self.stats.tokens_per_s))
        running_dry = self.timeline.runs_dry(time.perf_counter() + RUN_DRY_MARGIN_S)
        for chunk in self.chunker.push(delta.text, running_dry):
            self._speak(chunk, delta.done_t)

    def _speak(self, text: str, done_t: float | None) -> None:
        if self.cancel.is_set():
            return
        now = time.perf_counter()
        if not self.timeline.has("first_chunk_ready"):
            self.timeline.first_chunk(now, self.stats.tokens, self.stats.spec.target_forwards)
        self.timeline.chunk_to_tts(now, done_t)
        self.emit(Chunk(text))
        for samples in self.tts.stream(text):
            if self.cancel.is_set():  # checked before sending: an interrupted answer plays nothing more
                return
            self.timeline.audio_ready(time.perf_counter())
            if self.hold is not None:  # an early answer plays once its turn is confirmed
                self.hold.can_play()
                if not self.hold.wait():
                    return
            self.timeline.audio_out(time.perf_counter(), len(samples) / self.tts.sample_rate)
            self.audio.append(samples)
            self.emit(Audio(samples))
        self.spoken.append(text)
        self.spoken_tokens = self.stats.tokens
