"""A live microphone stream → user turns: the hands-free gate with its pre-roll, and push-to-talk.

Turn detection for audio that arrives as it is spoken (the app's WebSocket); each turn is heard by a TurnListener
(pipeline/agent.py), which also ends and transcribes recordings, so both end a turn the same way.
"""

from __future__ import annotations

import contextlib
import logging
import queue
import threading
import time
from collections import deque
from collections.abc import Callable

import numpy as np

from .agent import Conversation, VoiceAgent
from .audio import SAMPLE_RATE, AudioError
from .listener import StartEarly, TurnListener
from .timeline import Timeline
from .turn_end import TurnEnd
from .vad import EndOfTurnDetector, VadEvent

log = logging.getLogger("specvoice.mic")

# notify(message): what the user should see, {"type": "vad" | "partial" | "transcript" | "info" | "error", ...}
Notify = Callable[[dict], None]
# on_turn(transcript, timeline, audio, answered): a user turn, with its audio as the listener heard it; answered:
# an early answer on these words was confirmed and is this turn's answer, else the turn still needs one
OnTurn = Callable[[str, Timeline, np.ndarray | None, bool], None]


class MicInput:
    """Microphone frames → user turns, on a thread of its own so VAD and ASR never block the caller (a socket).

    Hands-free: a light VAD gate watches the stream; only once it hears speech does a TurnListener (with a second
    of pre-roll) start, because its streaming ASR re-transcribes its whole buffer every half second, silence
    included. Push-to-talk: pressing starts a listener whose VAD never ends the turn; releasing ends it.

    Until release(), while the models load, the thread waits and the queue keeps what is said (about 30 s), so a
    question spoken meanwhile is heard, with its real timestamps, and answered once they are ready.
    """

    PREROLL_S = 1.0
    PARTIAL_EVERY_S = 0.3

    def __init__(
        self,
        notify: Notify,
        interrupt: Callable[[str], None],
        on_turn: OnTurn,
        max_turn_s: float,
        start_early: StartEarly | None = None,
        conversation: Callable[[], Conversation] | None = None,
    ) -> None:
        self.notify = notify
        self.interrupt = interrupt  # interrupt(reason): the user speaks, so the answer being given stops
        self.on_turn = on_turn
        self.start_early = start_early  # an answer started at a pause (preemptive generation), held until the end
        self.conversation = conversation  # whose KV cache the user's words are prefilled into as they come
        self.max_turn_s = max_turn_s
        self.agent: VoiceAgent | None = None
        self.unavailable = ""  # why there is no agent, once loading is over
        self.closed = False
        self.queue: queue.Queue = queue.Queue(maxsize=1000)  # ~30 s of 32 ms frames
        self.mode: str | None = None  # None (off), "handsfree", "ptt"
        self.listener: TurnListener | None = None
        self.gate: EndOfTurnDetector | None = None
        self.preroll: deque[tuple[np.ndarray, float]] = deque()
        self.fed_s = 0.0
        self.fed: list[np.ndarray] = []  # this turn's audio as the listener got it, for A/B replays
        self.partial = ""
        self.last_partial_t = 0.0
        self.dropping = False
        self.released = threading.Event()  # loading is over (or the stream closed): the thread may go on
        self.thread = threading.Thread(target=self._run, name="mic", daemon=True)
        self.thread.start()

    def feed(self, chunk: np.ndarray, t_start: float) -> None:
        """16 kHz audio whose first sample was spoken at t_start (perf_counter clock)."""
        self._put(("audio", chunk, t_start))

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
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)

    def _put(self, item: tuple) -> None:
        try:
            self.queue.put_nowait(item)
            self.dropping = False
        except queue.Full:
            # The thread is stuck (ASR on an overloaded machine) or waits for the models: drop audio, never the
            # caller, and say so once rather than for each of ~30 frames a second.
            if not self.dropping:
                log.warning("mic queue full; dropping frames")
            self.dropping = True

    def _run(self) -> None:
        try:
            self.released.wait()
            while not self.closed and (item := self.queue.get()) is not None:
                if item[0] == "audio":
                    self._audio(item[1], item[2])
                else:
                    self._control(item[1], item[2])
        except Exception:
            log.exception("microphone input failed")
            self.notify({"type": "error", "message": "Microphone processing failed; see the server log."})
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
            self.notify({"type": "error", "message": self.unavailable})
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
            self._new_listener(self.agent.listen(self._conv(), turn_end=held))
        else:
            self.gate = self.gate or EndOfTurnDetector()  # only its speech_start is read
            self.gate.reset()

    def _conv(self) -> Conversation | None:
        return self.conversation() if self.conversation is not None else None

    def _new_listener(self, listener: TurnListener) -> None:
        self.listener, self.fed_s, self.fed, self.partial = listener, 0.0, [], ""
        self.notify({"type": "vad", "event": "listening"})

    def _audio(self, chunk: np.ndarray, t_start: float) -> None:
        if self.mode is None or self.agent is None or (self.mode == "ptt" and self.listener is None):
            return  # off, or a held turn already cut at max_turn_s: wait for the release
        if self.listener is None:  # hands-free, waiting for speech
            self.preroll.append((chunk, t_start))
            while self.preroll and t_start - self.preroll[0][1] > self.PREROLL_S:
                self.preroll.popleft()
            if not any(ev.kind == "speech_start" for ev in self.gate.feed(chunk, t_start)):
                return
            self.notify({"type": "vad", "event": "speech_start"})
            self.interrupt("barge-in")
            self._new_listener(self.agent.listen(self._conv(), self.start_early, self.notify))
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
                self.notify({"type": "info", "message": "Turn cut at the length limit."})
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
                self.notify({"type": "partial", "text": text})

    def _end_turn(self, end: VadEvent | None) -> None:
        listener, self.listener = self.listener, None
        if self.gate is not None:
            self.gate.reset()
        self.preroll.clear()
        if listener is None:
            return
        if end is not None:
            self.notify({"type": "vad", "event": "end_of_turn"})
        try:
            heard = listener.finish(end)
        except AudioError as e:
            self.notify({"type": "info", "message": f"Not answered: {e}."})
            return
        finally:
            listener.close()
        self.notify({"type": "transcript", "text": heard.transcript})
        audio = np.concatenate(self.fed) if self.fed else None
        self.on_turn(heard.transcript, heard.timeline, audio, heard.early is not None)
