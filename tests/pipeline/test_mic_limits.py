"""MicInput's limits (pipeline/mic.py): the queue is bounded in seconds of audio, not frames, and every final
transcription runs under the capacity shared with the answers. Fake listeners stand in for VAD and ASR."""

from __future__ import annotations

import time
from contextlib import contextmanager

import numpy as np

from app.wire import notice_message
from pipeline.audio import SAMPLE_RATE
from pipeline.listener import HeardTurn
from pipeline.mic import MicInput
from pipeline.preemptive import Hold
from pipeline.timeline import Timeline
from pipeline.vad import VadEvent
from tests.support.fakes import Slots

WORDS = "hello there"


def end_event(kind: str = "end_of_turn") -> VadEvent:
    return VadEvent(kind, 0.0, 1.0, 1.3, 0, SAMPLE_RATE)


class FakeASR:
    """The listener's streaming ASR; with a partial pass in flight it holds a slot until its partials stop."""

    def __init__(self, slots: Slots, pass_in_flight: bool) -> None:
        self.slots, self.partial = slots, ""
        self.in_flight = pass_in_flight and slots.try_acquire()

    def stop_partials(self) -> None:
        if self.in_flight:
            self.in_flight = False
            self.slots.release()


class FakeListener:
    """Hears WORDS; ends the turn after end_after_s of audio (hands-free) or when stopped (push-to-talk); with
    start_early, starts an early answer at its first audio, as a pause would."""

    def __init__(
        self, slots: Slots, start_early=None, end_after_s: float | None = None, pass_in_flight: bool = False
    ) -> None:
        self.slots, self.start_early, self.end_after_s = slots, start_early, end_after_s
        self.asr = FakeASR(slots, pass_in_flight)
        self.fed_samples = 0
        self.hold: Hold | None = None
        self.finished_with_in_use: int | None = None  # slots in use while the final transcription ran
        self.closed = False
        self.polls = 0
        self.end_on_poll = False  # a signal read at the poll ends the turn (TurnListener.poll)

    def poll(self) -> VadEvent | None:
        self.polls += 1
        return end_event() if self.end_on_poll else None

    def feed(self, chunk: np.ndarray, t_start: float) -> VadEvent | None:
        self.fed_samples += len(chunk)
        if self.start_early is not None and self.hold is None:
            self.hold = Hold(WORDS)
            self.start_early(WORDS, Timeline(), self.hold)
        if self.end_after_s is not None and self.fed_samples >= self.end_after_s * SAMPLE_RATE:
            return end_event()
        return None

    def stop(self) -> VadEvent | None:
        return end_event() if self.fed_samples else None

    def finish(self, end: VadEvent | None) -> HeardTurn:
        self.finished_with_in_use = self.slots.in_use
        if self.hold is not None:
            self.hold.confirm()
        return HeardTurn(WORDS, Timeline(), self.hold)

    def close(self) -> None:
        self.closed = True
        if self.hold is not None:
            self.hold.discard()


class FakeAgent:
    def __init__(self, slots: Slots, end_after_s: float | None = None, pass_in_flight: bool = False) -> None:
        self.slots, self.end_after_s, self.pass_in_flight = slots, end_after_s, pass_in_flight
        self.listeners: list[FakeListener] = []
        self.wakes: list = []  # what each listener's ASR thread would call after a pass

    def listen(self, conv=None, start_early=None, notify=None, turn_end=None, capacity=None, wake=None) -> FakeListener:
        assert capacity is self.slots  # its partial passes share the answers' slots
        listener = FakeListener(self.slots, start_early, self.end_after_s, self.pass_in_flight)
        self.listeners.append(listener)
        self.wakes.append(wake)
        return listener


class SpeechGate:
    """The hands-free gate: hears speech start at once."""

    def feed(self, chunk: np.ndarray, t_start: float) -> list[VadEvent]:
        return [end_event("speech_start")]

    def reset(self) -> None:
        pass


class Mic:
    """A MicInput with what it told the user and the turns it gave."""

    def __init__(self, slots: Slots | None = None, start_early=None, max_turn_s: float = 100.0) -> None:
        self.messages: list[dict] = []
        self.turns: list[tuple[str, bool]] = []
        self.input = MicInput(
            lambda notice: self.messages.append(notice_message(notice)),  # as the page gets it
            lambda reason: None,
            lambda text, timeline, audio, answered: self.turns.append((text, answered)),
            max_turn_s,
            start_early,
            capacity=slots,
        )

    def wait_for(self, condition, what: str) -> None:
        deadline = time.monotonic() + 10
        while not condition():
            assert time.monotonic() < deadline, f"no {what}; told: {self.messages}"
            time.sleep(0.01)

    def of_type(self, kind: str) -> list[dict]:
        return [m for m in self.messages if m["type"] == kind]

    def push_to_talk(self, seconds: float = 0.5) -> None:
        self.input.switch(True, "ptt")
        self.input.feed(np.zeros(int(seconds * SAMPLE_RATE), np.float32), time.perf_counter())
        self.input.switch(False, "ptt")


def test_a_flood_faster_than_real_time_is_cut_at_the_queues_seconds_and_nothing_else_is_lost():
    slots = Slots(1)
    mic = Mic(slots)
    second = np.zeros(SAMPLE_RATE, np.float32)  # one object: the old frame-count bound would hold 1000 of them
    try:
        # While the models load the thread waits, so everything stays queued.
        mic.input.switch(True, "ptt")
        for _ in range(1000):
            mic.input.feed(second, time.perf_counter())
        mic.input.switch(False, "ptt")  # the release after the flood still counts
        queued = [item for item in list(mic.input.queue.queue) if item is not None]
        audio_s = sum(len(item[1]) for item in queued if item[0] == "audio") / SAMPLE_RATE
        assert audio_s == MicInput.MAX_QUEUED_S
        errors = mic.of_type("error")
        assert len(errors) == 1 and "Microphone audio dropped" in errors[0]["message"]  # one per burst
        agent = FakeAgent(slots)
        mic.input.release(agent)
        mic.wait_for(lambda: mic.turns, "turn")
        assert agent.listeners[0].fed_samples == MicInput.MAX_QUEUED_S * SAMPLE_RATE  # every kept second heard
        assert mic.turns == [(WORDS, False)]
    finally:
        mic.input.close()


def test_tiny_frames_are_bounded_too():
    mic = Mic()
    try:
        sample = np.zeros(1, np.float32)
        for _ in range(MicInput.MAX_QUEUED_FRAMES + 100):
            mic.input.feed(sample, 0.0)
        assert mic.input.queue.qsize() == MicInput.MAX_QUEUED_FRAMES and len(mic.of_type("error")) == 1
    finally:
        mic.input.close()


def test_push_to_talk_is_transcribed_under_the_answer_capacity():
    slots = Slots(1)
    mic, agent = Mic(slots), FakeAgent(slots)
    mic.input.release(agent)
    try:
        mic.push_to_talk()
        mic.wait_for(lambda: mic.turns, "turn")
        assert agent.listeners[0].finished_with_in_use == 1 and slots.in_use == 0
    finally:
        mic.input.close()


def test_a_turn_is_not_refused_for_its_own_partial_pass_in_flight():
    slots = Slots(1)
    mic, agent = Mic(slots), FakeAgent(slots, pass_in_flight=True)
    mic.input.release(agent)
    try:
        mic.push_to_talk()
        mic.wait_for(lambda: mic.turns or mic.of_type("busy"), "turn")
        assert mic.turns == [(WORDS, False)] and not mic.of_type("busy")
        assert agent.listeners[0].finished_with_in_use == 1 and slots.in_use == 0
    finally:
        mic.input.close()


def test_a_turn_that_finds_no_capacity_is_told_busy_and_the_next_one_is_heard():
    slots = Slots(1)
    mic, agent = Mic(slots), FakeAgent(slots)
    mic.input.release(agent)
    try:
        assert slots.try_acquire()  # another conversation is being answered
        mic.push_to_talk(1.5)
        mic.wait_for(lambda: mic.of_type("busy"), "busy message")
        busy = mic.of_type("busy")[0]["message"]
        assert busy.startswith("Busy: the test holds every slot.") and "1.5 s of speech was not transcribed" in busy
        first = agent.listeners[0]
        assert first.finished_with_in_use is None and first.closed and not mic.turns
        slots.release()
        mic.push_to_talk()
        mic.wait_for(lambda: mic.turns, "turn")
        assert mic.turns == [(WORDS, False)] and slots.in_use == 0
    finally:
        mic.input.close()


def test_the_hands_free_end_of_turn_is_transcribed_under_the_capacity():
    slots = Slots(1)
    mic, agent = Mic(slots), FakeAgent(slots, end_after_s=0.5)
    mic.input.gate = SpeechGate()
    mic.input.release(agent)
    try:
        mic.input.switch(True, "handsfree")
        mic.input.feed(np.zeros(SAMPLE_RATE, np.float32), time.perf_counter())
        mic.wait_for(lambda: mic.turns, "turn")
        assert agent.listeners[0].finished_with_in_use == 1 and slots.in_use == 0
        assert slots.try_acquire()
        mic.input.feed(np.zeros(SAMPLE_RATE, np.float32), time.perf_counter())  # the next turn finds none
        mic.wait_for(lambda: mic.of_type("busy"), "busy message")
        assert len(mic.turns) == 1
    finally:
        mic.input.close()


def test_a_turn_whose_early_answer_holds_the_slot_is_transcribed_under_it():
    slots = Slots(1)

    def start_early(words: str, timeline: Timeline, hold: Hold) -> None:
        assert slots.try_acquire()  # as the app's answer does: this turn's one slot

    mic, agent = Mic(slots, start_early), FakeAgent(slots, end_after_s=0.5)
    mic.input.gate = SpeechGate()
    mic.input.release(agent)
    try:
        mic.input.switch(True, "handsfree")
        mic.input.feed(np.zeros(SAMPLE_RATE, np.float32), time.perf_counter())
        mic.wait_for(lambda: mic.turns, "turn")
        assert mic.turns == [(WORDS, True)] and not mic.of_type("busy")  # the early answer is this turn's
        assert agent.listeners[0].finished_with_in_use == 1 and agent.listeners[0].hold.state == "confirmed"
    finally:
        mic.input.close()


@contextmanager
def one_frame_heard():
    """A hands-free mic that heard one frame of speech: its listener has started (and been given a wake)."""
    slots = Slots(1)
    mic, agent = Mic(slots), FakeAgent(slots)
    mic.input.gate = SpeechGate()
    mic.input.release(agent)
    try:
        mic.input.switch(True, "handsfree")
        mic.input.feed(np.zeros(512, np.float32), time.perf_counter())
        mic.wait_for(lambda: agent.listeners, "listener")
        yield mic, agent
    finally:
        mic.input.close()


def test_an_asr_pass_has_the_hands_free_listener_polled_between_frames():
    """The words of a pause may come in between two frames: the ASR thread's wake has the mic thread poll the listener
    at once, so the early answer need not wait for the next frame, and a poll is not counted as queued audio."""
    with one_frame_heard() as (mic, agent):
        (wake,) = agent.wakes
        wake()
        mic.wait_for(lambda: agent.listeners[0].polls == 1, "poll")
        assert mic.input._queued["audio"] == 0 and "poll" not in mic.input._queued


def test_a_poll_that_ends_the_turn_has_it_transcribed_with_no_more_audio():
    """The target's vote, in between two frames, ends the turn at the poll it wakes: the mic thread transcribes it
    then, not at the next frame."""
    with one_frame_heard() as (mic, agent):
        agent.listeners[0].end_on_poll = True
        (wake,) = agent.wakes
        wake()
        mic.wait_for(lambda: mic.turns, "turn")
        assert [text for text, _ in mic.turns] == [WORDS] and agent.listeners[0].closed
        assert agent.listeners[0].fed_samples == 512 and mic.input.listener is None  # the next speech starts anew
