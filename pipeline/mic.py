"""A live microphone stream → user turns: the hands-free gate with its pre-roll, and push-to-talk.

Turn detection for audio that arrives as it is spoken (the app's WebSocket); each turn is heard by a TurnListener
(pipeline/listener.py), which also ends and transcribes recordings, so both end a turn the same way.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from .agent import Conversation, VoiceAgent
from .audio import SAMPLE_RATE, AudioError
from .capacity import Capacity, NoLimit
from .events import Busy, Failure, Info, Notify, Partial, Transcript, VoiceActivity
from .listener import StartEarly, TurnListener
from .preemptive import Hold
from .timeline import Timeline
from .turn_end import TurnEnd
from .vad import EndOfTurnDetector, VadEvent

log = logging.getLogger("specvoice.mic")

# on_turn(transcript, timeline, audio, answered): a user turn, with its audio as the listener heard it; answered:
# an early answer on these words was confirmed and is this turn's answer, else the turn still needs one
OnTurn = Callable[[str, Timeline, np.ndarray | None, bool], None]


class MicInput:
    """Microphone frames → user turns, on a thread of its own so VAD and ASR never block the caller (a socket).

    Hands-free: a light VAD gate watches the stream; only once it hears speech does a TurnListener (with a second
    of pre-roll) start, because its streaming ASR re-transcribes its whole buffer every half second, silence
    included. Push-to-talk: pressing starts a listener whose VAD never ends the turn; releasing ends it.

    Until release(), while the models load, the thread waits and the queue keeps what is said (MAX_QUEUED_S), so a
    question spoken meanwhile is heard, with its real timestamps, and answered once they are ready. Audio beyond
    that (a client sending faster than real time, or a thread that fell behind) is dropped, and the user told.

    Each turn's final transcription runs under capacity (shared with the answers): when none is free the user gets
    its busy message and the turn is not answered, as a typed turn would not be. A turn whose early answer is held
    is transcribed under that answer's slot, which is this turn's already.
    """

    PREROLL_S = 1.0
    PARTIAL_EVERY_S = 0.3
    MAX_QUEUED_S = 30.0  # audio waiting to be heard
    MAX_QUEUED_FRAMES = 4096  # against tiny frames: ~4 times the page's 32 ms frames in MAX_QUEUED_S
    MAX_QUEUED_SWITCHES = 64  # mic on/off messages waiting

    def __init__(
        self,
        notify: Notify,
        interrupt: Callable[[str], None],
        on_turn: OnTurn,
        max_turn_s: float,
        start_early: StartEarly | None = None,
        conversation: Callable[[], Conversation] | None = None,
        capacity: Capacity | None = None,
    ) -> None:
        self.notify = notify
        self.interrupt = interrupt  # interrupt(reason): the user speaks, so the answer being given stops
        self.on_turn = on_turn
        self.start_early = start_early  # an answer started at a pause (preemptive generation), held until the end
        self.conversation = conversation  # whose KV cache the user's words are prefilled into as they come
        self.max_turn_s = max_turn_s
        self.capacity = capacity or NoLimit()
        self.agent: VoiceAgent | None = None
        self.unavailable = ""  # why there is no agent, once loading is over
        self.closed = False
        self.queue: queue.Queue = queue.Queue()  # bounded by _put, in samples and items
        self._queued = {"samples": 0, "audio": 0, "control": 0}
        self._queue_lock = threading.Lock()
        self.mode: str | None = None  # None (off), "handsfree", "ptt"
        self.listener: TurnListener | None = None
        self.gate: EndOfTurnDetector | None = None
        self.preroll: deque[tuple[np.ndarray, float]] = deque()
        self.fed_s = 0.0
        self.fed: list[np.ndarray] = []  # this turn's audio as the listener got it, for A/B replays
        self.partial = ""
        self.last_partial_t = 0.0
        self.dropping = False  # something was refused and the queue has not drained to half since
        self.early: Hold | None = None  # the early answer started on this turn's words, if any
        self.released = threading.Event()  # loading is over (or the stream closed): the thread may go on
        self.thread = threading.Thread(target=self._run, name="mic", daemon=True)
        self.thread.start()

    def feed(self, chunk: np.ndarray, t_start: float) -> None:
        """16 kHz audio whose first sample was spoken at t_start (perf_counter clock)."""
        self._put(("audio", chunk, t_start), len(chunk))

    def switch(self, active: bool, mode: str) -> None:
        """Turn the microphone on or off in mode "handsfree" or "ptt" (releasing push-to-talk ends its turn)."""
        self._put(("control", active, mode))

    def release(self, agent: VoiceAgent | None, unavailable: str = "") -> None:
        """Loading is over: hear what was kept with agent or, when there is none, say why (unavailable)."""
        self.agent, self.unavailable = agent, unavailable
        self.released.set()

    def close(self) -> None:
        self.closed = True
        self.released.set()
        self.queue.put_nowait(None)

    def _put(self, item: tuple, samples: int = 0) -> None:
        """Queue item unless that would pass a limit. The thread is stuck (ASR on an overloaded machine), waits for
        the models, or the client sends faster than real time: drop what is over, never block the caller, and say
        so once per burst rather than for each of ~30 frames a second."""
        kind = item[0]
        with self._queue_lock:
            q = self._queued
            if kind == "audio":
                fits = q["samples"] + samples <= self.MAX_QUEUED_S * SAMPLE_RATE and q["audio"] < self.MAX_QUEUED_FRAMES
            else:
                fits = q["control"] < self.MAX_QUEUED_SWITCHES
            if fits:
                q["samples"] += samples
                q[kind] += 1
                self.queue.put_nowait(item)
                return
            first, self.dropping = not self.dropping, True
        if first:
            log.warning("mic queue full; dropping %s", kind)
            waiting = (
                f"Microphone audio dropped: {self.MAX_QUEUED_S:g} s of it are already waiting to be heard"
                if kind == "audio"
                else f"Microphone on/off dropped: {self.MAX_QUEUED_SWITCHES} switches are already waiting"
            )
            why = "it arrives faster than real time, or the server is behind"
            self.notify(Failure(f"{waiting} ({why}). What was queued before is kept."))

    def _taken(self, item: tuple) -> None:
        """item left the queue: its room is free again; a burst of drops ends once the queue has drained to half."""
        with self._queue_lock:
            q = self._queued
            q["samples"] -= len(item[1]) if item[0] == "audio" else 0
            q[item[0]] -= 1
            if (
                q["samples"] <= self.MAX_QUEUED_S * SAMPLE_RATE / 2
                and q["audio"] <= self.MAX_QUEUED_FRAMES / 2
                and q["control"] <= self.MAX_QUEUED_SWITCHES / 2
            ):
                self.dropping = False

    def _run(self) -> None:
        try:
            self.released.wait()
            while not self.closed and (item := self.queue.get()) is not None:
                if item[0] == "poll":  # a signal of a pause came in (a few a pause): outside the queue's limits
                    if self.listener is not None and (end := self.listener.poll()) is not None:
                        self._end_turn(end)
                    continue
                self._taken(item)
                if item[0] == "audio":
                    self._audio(item[1], item[2])
                else:
                    self._control(item[1], item[2])
        except Exception:
            log.exception("microphone input failed")
            self.notify(Failure("Microphone processing failed; see the server log."))
        finally:
            self._drop_listener()

    def _drop_listener(self) -> None:
        if self.listener is not None:
            self.listener.close()
        self.listener = None
        self.preroll.clear()
        if self.gate is not None:
            self.gate.reset()

    def _control(self, active: bool, mode: str) -> None:
        if active and self.agent is None:  # the thread runs once loading is over: this means it failed
            self.notify(Failure(self.unavailable))
            return
        if not active:
            if self.mode == "ptt" and self.listener is not None:
                self._end_turn(self.listener.stop())
            self.mode = None
            self._drop_listener()
            return
        self._drop_listener()
        self.mode = mode
        if mode == "ptt":
            self.interrupt("push-to-talk")  # pressing to talk while the agent speaks is a barge-in
            # The VAD must not end a held turn at a pause; the release does (or max_turn_s).
            held = TurnEnd("silence", silence_ms=self.max_turn_s * 1000)
            self._new_listener(self.agent.listen(self._conv(), turn_end=held, capacity=self.capacity))
        else:
            self.gate = self.gate or EndOfTurnDetector()  # only its speech_start is read
            self.gate.reset()

    def _conv(self) -> Conversation | None:
        return self.conversation() if self.conversation is not None else None

    def _new_listener(self, listener: TurnListener) -> None:
        self.listener, self.fed_s, self.fed, self.partial, self.early = listener, 0.0, [], "", None
        self.notify(VoiceActivity("listening"))

    def _start_early(self, words: str, timeline: Timeline, hold: Hold) -> None:
        self.early = hold  # remembered: its answer's slot covers this turn's final transcription
        assert self.start_early is not None
        self.start_early(words, timeline, hold)

    def _wake(self) -> None:
        """On the ASR's, Smart Turn's or the answer's thread: a signal of a pause may be in, and its decision need not
        wait for the next frame."""
        self.queue.put_nowait(("poll",))

    def _audio(self, chunk: np.ndarray, t_start: float) -> None:
        if self.mode is None or self.agent is None or (self.mode == "ptt" and self.listener is None):
            return  # off, or a held turn already cut at max_turn_s: wait for the release
        if self.listener is None:  # hands-free, waiting for speech
            self.preroll.append((chunk, t_start))
            while self.preroll and t_start - self.preroll[0][1] > self.PREROLL_S:
                self.preroll.popleft()
            if not any(ev.kind == "speech_start" for ev in self.gate.feed(chunk, t_start)):
                return
            self.notify(VoiceActivity("speech_start"))
            self.interrupt("barge-in")
            start_early = self._start_early if self.start_early is not None else None
            listener = self.agent.listen(
                self._conv(), start_early, self.notify, capacity=self.capacity, wake=self._wake
            )
            self._new_listener(listener)
            items, self.preroll = list(self.preroll), deque()
        else:
            items = [(chunk, t_start)]
        for c, t in items:
            end = self.listener.feed(c, t)
            self.fed_s += len(c) / SAMPLE_RATE
            self.fed.append(c)
            if end is not None:
                self._end_turn(end)
                return
            if self.fed_s > self.max_turn_s:
                self.notify(Info("Turn cut at the length limit."))
                self._end_turn(self.listener.stop())
                return
        self._send_partial()

    def _send_partial(self) -> None:
        now = time.perf_counter()
        if self.listener is not None and now - self.last_partial_t > self.PARTIAL_EVERY_S:
            self.last_partial_t = now
            text = self.listener.asr.partial
            if text != self.partial:
                self.partial = text
                self.notify(Partial(text))

    def _end_turn(self, end: VadEvent | None) -> None:
        listener, self.listener = self.listener, None
        if self.gate is not None:
            self.gate.reset()
        self.preroll.clear()
        if listener is None:
            return
        if end is not None:
            self.notify(VoiceActivity("end_of_turn"))
        # No speech: nothing to transcribe. An early answer still held has its slot (or is about to take one), and
        # that is this turn's: it needs no second.
        needs_slot = end is not None and not (self.early is not None and self.early.state == "held")
        listener.asr.stop_partials()  # a partial pass in flight holds a slot: this turn must not be refused for it
        if needs_slot and not self.capacity.try_acquire():
            listener.close()  # its early answer, if any, is discarded
            said = f"Your {self.fed_s:.1f} s of speech was not transcribed."
            self.notify(Busy(f"{self.capacity.busy_message()} {said}"))
            return
        try:
            heard = listener.finish(end)
        except AudioError as e:
            self.notify(Info(f"Not answered: {e}."))
            return
        finally:
            listener.close()
            if needs_slot:
                self.capacity.release()
        self.notify(Transcript(heard.transcript))
        audio = np.concatenate(self.fed) if self.fed else None
        self.on_turn(heard.transcript, heard.timeline, audio, heard.early is not None)
