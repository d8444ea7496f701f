"""Stand-ins for the LLM and TTS stages (scripted, instant, and recording what they were given), and for the app's
answer slots."""

from __future__ import annotations

import threading
import time

import numpy as np

from pipeline.llm import LLMDelta


class ScriptedLLM:
    """Speaks a fixed answer word by word, one 'step' every `step_s` seconds, half the words from 'drafts'; an answer
    started at a pause (end_probe) gives end_of_message_probability with its first word, as the engine's does."""

    name = "scripted"
    keeps_cache = False

    def __init__(self, answer: str, step_s: float = 0.01, end_of_message_probability: float | None = None) -> None:
        self.words = answer.split(" ")
        self.step_s = step_s
        self.end_of_message_probability = end_of_message_probability
        self.seen_messages: list[list[dict]] = []

    def configure(self, controls):
        raise ValueError("this LLM stage has no drafter/K/temperature controls")

    def prefill_words(self, messages):
        pass

    def rewind(self):
        pass

    def stream_reply(self, messages, speculation, stats, cancel=None, end_probe=False):
        self.seen_messages.append(messages)
        for i, word in enumerate(self.words):
            if cancel is not None and cancel.is_set():
                return
            time.sleep(self.step_s)
            now = time.perf_counter()
            stats.add(1, now)
            end = self.end_of_message_probability if end_probe and not i else None
            text = (" " if i else "") + word
            yield LLMDelta(text, 1, now, [(text, bool(i % 2))], 1, i % 2, end_of_message_probability=end)


class FakeTTS:
    name, sample_rate = "fake", 16000

    def __init__(self, chunk_s: float = 0.005) -> None:
        self.chunk_s = chunk_s
        self.spoken: list[str] = []

    def stream(self, text):
        self.spoken.append(text)
        for _ in range(3):
            time.sleep(self.chunk_s)
            yield np.full(160, 0.1, np.float32)

    def warmup(self):
        pass


class WordsTTS(FakeTTS):
    """A TTS whose audio lasts seconds_per_word for each word of the chunk, given at once: a speaking pace."""

    def __init__(self, seconds_per_word: float) -> None:
        super().__init__()
        self.seconds_per_word = seconds_per_word

    def stream(self, text):
        self.spoken.append(text)
        yield np.zeros(int(self.sample_rate * self.seconds_per_word * len(text.split())), np.float32)


class Slots:
    """A Capacity like the app's AnswerSlots (pipeline/capacity.py), counting what is in use."""

    def __init__(self, limit: int) -> None:
        self.limit, self.in_use = limit, 0
        self.lock = threading.Lock()

    def try_acquire(self) -> bool:
        with self.lock:
            if self.in_use >= self.limit:
                return False
            self.in_use += 1
            return True

    def release(self) -> None:
        with self.lock:
            self.in_use -= 1

    def busy_message(self) -> str:
        return "Busy: the test holds every slot."
