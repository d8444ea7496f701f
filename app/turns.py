"""One tab's turns: the answers it asks for (typed, spoken, A/B), run one at a time on a worker thread of its own,
which reads each answer as it is generated and speaks it (pipeline/speaker.py). Its audio out is app/answer_audio.py,
its records app/records.py, its A/B app/ab.py."""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone

import numpy as np

from pipeline.agent import Conversation, VoiceAgent
from pipeline.audio import AudioError
from pipeline.llm import Controls
from pipeline.preemptive import Hold
from pipeline.timeline import Timeline
from pipeline.turn_result import TurnResult

from .ab import run_ab
from .answer_audio import AnswerAudio
from .host import SessionHost
from .outbox import Outbox
from .protocol import ClockSync
from .records import TurnRecords
from .turn_stream import TurnStream

log = logging.getLogger("specvoice.app.session")

# job(cancel): one answer (or A/B run) of a tab, on its worker thread; it stops once cancel is set
Job = Callable[[threading.Event], None]


class TurnRunner:
    """One tab's answers and their records. At most one answer runs and one waits: a new turn cancels the running
    one and replaces the waiting one, so a flood of messages makes no more threads than one turn does."""

    def __init__(self, host: SessionHost, outbox: Outbox, clock: ClockSync) -> None:
        self.host = host
        self.outbox = outbox
        self.clock = clock
        self.closed = False
        self.audio = AnswerAudio(outbox)  # no reference back: a closed tab's runner is freed by reference counting
        self.records = TurnRecords()
        self.settings: dict = {"speculation": True, "drafter": None, "k": None, "temperature": None, "load_aware": None}
        self._applied: dict = {}
        self.conv: Conversation | None = None
        self.last_utterance = ""
        self.last_utterance_audio: np.ndarray | None = None  # set when the last utterance was spoken
        self._ids = itertools.count(1)
        self._ab_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None  # alive while a job runs or waits
        self._pending: tuple[Job, threading.Event] | None = None  # the job the worker runs next
        self._cancel = threading.Event()  # the running job's
        self._queued: tuple[Job, str] | None = None  # the job asked for while the models load, and its text

    # ---- starting and stopping answers (any thread)

    def check_text(self, text: str) -> None:
        """ValueError when text is longer than one turn may ask the LLM to read, in its tokens (unknown while the
        models load: loading_finished checks then)."""
        limit = self.host.options.max_text_tokens
        tokens = self.host.count_tokens(text)
        if tokens is not None and tokens > limit:
            raise ValueError(f"the text is {tokens} tokens long; at most {limit} tokens are allowed")

    def answer_active(self) -> bool:
        return self._worker is not None or time.perf_counter() < self.audio.playing_until

    def interrupt(self, reason: str) -> None:
        """Barge-in: stop the answer being generated and empty the page's playback buffer."""
        if self.answer_active():
            self._cancel.set()
            self.audio.playing_until = 0.0
            self.outbox.put({"type": "flush", "reason": reason})

    def start_turn(
        self, text: str, timeline: Timeline, kind: str, audio: np.ndarray | None = None, hold: Hold | None = None
    ) -> None:
        self.last_utterance, self.last_utterance_audio = text, audio
        self.start(lambda cancel: self._turn_job(text, timeline, kind, cancel, hold), text)

    def early_turn(self, words: str, timeline: Timeline, hold: Hold) -> None:
        """The user paused: answer what they said so far, held until their turn ends with the same words."""
        self.start_turn(words, timeline, "voice", hold=hold)

    def voice_turn(self, transcript: str, timeline: Timeline, audio: np.ndarray | None, answered: bool) -> None:
        if answered:  # the early answer on these words is this turn's answer
            self.last_utterance, self.last_utterance_audio = transcript, audio
        else:
            self.start_turn(transcript, timeline, "voice", audio)

    def start_ab(self, text: str, audio: np.ndarray | None, repeats: int) -> None:
        self.start(lambda cancel: self._ab_job(text, audio, repeats, cancel), text)

    def start(self, job: Job, text: str) -> None:
        """Run job (which answers text) on the worker once the answer before it was cancelled and has finished;
        while the models load, keep it for loading_finished (the newest only: a new turn interrupts the one
        before)."""
        models = self.host.loader
        with self._lock:  # against loading_finished taking the queued job between the check and the store
            if models.loading:
                replaced, self._queued = self._queued is not None, (job, text)
                stage, then = models.stage(), "; it replaces what was queued before." if replaced else "."
                message = f"Queued: the models are still loading ({stage}); this will be answered when they are ready"
                self.outbox.put({"type": "info", "message": message + then})
                return
        if not models.ready:
            self.outbox.put({"type": "error", "message": models.failed_message()})
            return
        with self._lock:
            if self.closed:
                return
            self.interrupt("new turn")
            self._cancel = cancel = threading.Event()
            self._pending = (job, cancel)  # replaces one still waiting: it is never started
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name="answer", daemon=True)
                self._worker.start()

    def _work(self) -> None:
        while True:
            with self._lock:
                pending, self._pending = self._pending, None
                if pending is None or self.closed:
                    self._worker = None
                    return
            job, cancel = pending
            if not cancel.is_set():
                job(cancel)

    def loading_finished(self) -> None:
        """The models are ready or failed to load: answer what was asked meanwhile (or say why not)."""
        with self._lock:
            queued, self._queued = self._queued, None
        if queued is None:
            return
        job, text = queued
        try:
            self.check_text(text)
        except ValueError as e:
            self.outbox.put({"type": "error", "message": f"not answered: {e}"})
            return
        self.start(job, text)

    def close(self) -> None:
        """The tab went away: stop its answer and let go of what it held (its conversation and KV cache, audio)."""
        with self._lock:
            self.closed = True
            self._cancel.set()
            self._pending = self._queued = None  # closures over this runner
            self.conv = None
            self.audio.close()

    # ---- heard delay (event loop)

    def heard(self, turn: int, server_ms: float, received_ms: float | None, detail: dict) -> None:
        """The page heard turn's first sample at server_ms (its player got it at received_ms)."""
        emitted = self.audio.emitted_ms(turn)
        if emitted is None:
            return
        if received_ms is not None:  # split the delay: socket + page up to the player, then playout
            detail.update(delivery_ms=received_ms - emitted, playout_ms=server_ms - received_ms)
        update = self.records.heard(turn, server_ms, emitted, detail, self.clock.rtt_ms)
        self.outbox.put({"type": "heard", "turn": turn, **update})

    # ---- answers (the worker thread)

    def conversation(self) -> Conversation:
        """This tab's conversation, made on first use (the mic's thread, for prefill while speaking, or an answer)."""
        agent = self._agent()
        with self._lock:
            conv = self.conv
        if conv is None:
            # Built outside the tab's lock: it prefills the system prompt, and the event loop takes that lock too.
            built = agent.new_conversation()
            with self._lock:
                if self.conv is None and not self.closed:  # a closed tab's last caller keeps its own, dropped with it
                    self.conv = built
                conv = self.conv or built
        return conv

    def _apply_settings(self, conv: Conversation) -> None:
        """The page's drafter/K/temperature changes, applied between answers: under the conversation's lock, so a
        drafter switch (which resets caches) never lands in the middle of a prefill or a step."""
        changes = {
            k: v
            for k, v in self.settings.items()
            if k in ("drafter", "k", "temperature", "load_aware") and v is not None and self._applied.get(k) != v
        }
        if not changes:
            return
        try:
            with conv.lock:
                conv.llm.configure(Controls(**changes))
            self._applied.update(changes)
        except ValueError as e:  # answer anyway, with the settings the conversation already has
            self.outbox.put({"type": "error", "message": f"settings not applied: {e}"})
            self.settings = {**self.settings, **dict.fromkeys(changes)}

    def _answer(
        self,
        text: str,
        timeline: Timeline,
        speculation: bool,
        kind: str,
        cancel: threading.Event,
        remember: bool = True,
        replay: np.ndarray | None = None,
        hold: Hold | None = None,
        **extra,
    ) -> dict | None:
        """Answer text, or with replay: that recording, replayed in real time through VAD and ASR first. With hold
        (an early answer): nothing is sent until the turn is confirmed; None when it was discarded."""
        agent = self._agent()
        conv = self.conversation()
        self._apply_settings(conv)
        turn = next(self._ids)
        self.records.timeline(turn, timeline)
        announce = {"type": "turn", "turn": turn, "kind": kind, "speculation": speculation, "transcript": text}
        if hold is None:
            self.outbox.put({**announce, **extra})
        else:
            hold.post(lambda: self.outbox.put({**announce, **extra, "early": True}))
        stream = TurnStream(
            self.outbox.put, self.audio.send, lambda: self.closed, turn, agent.tts.sample_rate, kind != "ab"
        )
        if replay is None:
            result = agent.respond(conv, text, timeline, speculation, stream, cancel, remember, hold)
        else:
            result = agent.turn_from_recording(conv, replay, speculation, stream, cancel, remember)
            self.records.timeline(turn, result.timeline)
        if result.discarded:
            return None
        return self._record(turn, kind, result, conv.llm.name, **extra)

    def _agent(self) -> VoiceAgent:
        agent = self.host.loader.agent
        assert agent is not None  # asked for once the models are loaded
        return agent

    def _record(self, turn: int, kind: str, result: TurnResult, llm: str, **extra) -> dict:
        data = result.to_dict()
        data.update(
            turn=turn,
            kind=kind,
            settings=dict(self.settings),
            llm=llm,
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **extra,
        )
        self.records.add(turn, data)
        self.audio.keep(turn, result.audio, result.sample_rate, self.host.options.kept_audio_turns)
        self.outbox.put({"type": "done", "turn": turn, "data": data})
        return data

    def _guarded(self, body: Callable[[], object], hold: Hold | None = None) -> None:
        """Run an answer under the server-wide limit, turning failures into one message. An early answer (hold) waits
        for room until its turn ends: discarded, it goes quietly; confirmed with no room, its turn is told so."""
        slots = self.host.slots
        if not slots.acquire_for(hold):
            if hold is None or hold.state == "confirmed":  # a turn with no room, told so and not queued
                self.outbox.put({"type": "busy", "message": slots.busy_message()})
            return
        try:
            body()
        except Exception as e:
            if not self.closed:
                log.exception("answer failed")
                self.outbox.put({"type": "error", "message": f"answer failed: {type(e).__name__}: {e}"})
        finally:
            slots.release()

    def _turn_job(
        self, text: str, timeline: Timeline, kind: str, cancel: threading.Event, hold: Hold | None = None
    ) -> None:
        self._guarded(lambda: self._answer(text, timeline, self.settings["speculation"], kind, cancel, hold=hold), hold)

    def _ab_job(self, text: str, audio: np.ndarray | None, repeats: int, cancel: threading.Event) -> None:
        ab = next(self._ab_ids)

        def run(repeat: int, speculation: bool) -> dict | None:
            self._agent().rewind(self.conversation())  # every run starts from the same KV state
            try:
                return self._answer(text, Timeline(), speculation, "ab", cancel, False, audio, ab=ab, ab_repeat=repeat)
            except AudioError:
                if cancel.is_set():  # Stop (or a closed tab) ended the replay: paired_runs stops here
                    return None
                raise

        head = {"ab": ab, "text": text, "spoken": audio is not None}
        self._guarded(lambda: run_ab(run, self.outbox.put, head, repeats, cancel))
