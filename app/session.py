"""One browser tab's session: its conversation, settings, turns, clock and answers (typed, spoken, A/B).

Everything a tab says arrives here from AppServer's WebSocket loop; what it sends goes through an outbox that
the loop drains. Answers run on worker threads, at most AnswerSlots.limit at once over all tabs.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import logging
import secrets
import threading
import time
from collections.abc import Callable
from datetime import datetime, timezone
from typing import TYPE_CHECKING

import numpy as np

from app.stats import paired_ratio
from pipeline.agent import Conversation, TurnResult, ab_order
from pipeline.audio import SAMPLE_RATE, resample
from pipeline.mic import MicInput
from pipeline.preemptive import Hold
from pipeline.timeline import Timeline
from specdec.engine import DRAFTER_KINDS

from . import report
from .protocol import DEFAULT_PLAYBACK_RATE, FLAG_REPLAY, ClockSync, decode_mic_frame, pack_audio

if TYPE_CHECKING:
    from .server import AppServer

log = logging.getLogger("specvoice.app.session")

EXPORTS = {  # file name → (media type, builder(turns, meta))
    "report.html": ("text/html; charset=utf-8", report.render_html),
    "turns.csv": ("text/csv; charset=utf-8", lambda turns, meta: report.turns_csv(turns)),
    "turns.json": ("application/json", report.turns_json),
}
FIRST_PACKET_S = 0.1


class AnswerSlots:
    """At most `limit` answers at once over all tabs; a turn that finds none free is told so, never queued."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"--max-concurrent-answers must be ≥ 1, got {limit}")
        self.limit = limit
        self._sem = threading.BoundedSemaphore(limit)

    def try_acquire(self) -> bool:
        return self._sem.acquire(blocking=False)

    def release(self) -> None:
        self._sem.release()

    def busy_message(self) -> str:
        who = "another conversation" if self.limit == 1 else f"{self.limit} other conversations"
        return (
            f"Busy: the server is answering {who} (--max-concurrent-answers {self.limit}). "
            "Your turn was not answered; try again in a moment."
        )


class TurnStream:
    """The on_event sink of one answer: token pieces for the live panels and audio packets for the player."""

    def __init__(self, session: ClientSession, turn: int, stream_audio: bool = True) -> None:
        self.session = session
        self.turn = turn
        self.stream_audio = stream_audio
        self.seq = 0
        self.prev_t: float | None = None

    def __call__(self, kind: str, payload: object) -> None:
        if self.session.closed:
            return
        now = time.perf_counter()
        if kind == "token":
            assert isinstance(payload, dict)
            n = len(payload["from_draft"]) or 1
            # The first step's time is the prefill's: a per-step rate starts at the second step.
            step_rate = n / (now - self.prev_t) if self.prev_t is not None and now > self.prev_t else None
            self.prev_t = now
            drafted, accepted = payload["drafted"], payload["accepted"]
            self.session.send(
                {
                    "type": "token",
                    "turn": self.turn,
                    "pieces": [list(p) for p in payload["pieces"]],
                    "step_tokens": n,
                    "drafted": drafted,
                    "accepted": accepted,
                    "tokens": payload["tokens"],
                    "tokens_per_s": payload["tokens_per_s"],
                    "step_tokens_per_s": step_rate,
                    "batch_size": payload["batch_size"],
                    "k_chosen": payload["k_chosen"],
                }
            )
        elif kind == "audio" and self.stream_audio:
            assert isinstance(payload, np.ndarray)
            self.seq = self.session.send_audio(self.turn, self.seq, payload, now)


class ClientSession:
    """One browser tab: its own conversation, settings, turns and clock, for as long as its WebSocket lives."""

    def __init__(self, server: AppServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.token = secrets.token_urlsafe(16)  # names this tab's exports; unguessable by other tabs
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.clock = ClockSync()
        self.browser_rate = DEFAULT_PLAYBACK_RATE
        self.settings: dict = {
            "speculation": True,
            "drafter": None,
            "k": None,
            "temperature": None,
            "load_aware": None,
        }
        self._applied: dict = {}
        self.conv: Conversation | None = None
        self.turns: list[dict] = []
        self.last_utterance = ""
        self.last_utterance_audio: np.ndarray | None = None  # set when the last utterance was spoken
        self._audio: dict[int, tuple[list[np.ndarray], int]] = {}
        self._emitted_ms: dict[int, float] = {}  # turn → server time its first audio packet left
        self._timelines: dict[int, Timeline] = {}
        self._heard: dict[int, dict] = {}
        self._records: dict[int, dict] = {}
        self._ids = itertools.count(1)
        self._ab_ids = itertools.count(1)
        self._lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._cancel = threading.Event()
        self._queued: Callable[[threading.Event], None] | None = None  # the turn asked for while the models load
        self.playing_until = 0.0  # perf_counter time the browser should finish playing what it was sent
        self.mic = MicInput(
            self.send, self.interrupt, self._voice_turn, server.options.max_turn_s, self._early_turn, self._conversation
        )

    # ---- sending (any thread)

    def send(self, message: dict | bytes) -> None:
        if self.closed:
            return
        try:
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, message)
        except RuntimeError:  # the loop is gone: the server is shutting down
            pass

    def send_audio(self, turn: int, seq: int, samples: np.ndarray, now: float, flags: int = 0) -> int:
        """Send one TTS chunk as packets numbered from seq; returns the next seq."""
        tts_rate = self.server.loader.agent.tts.sample_rate
        if seq == 0 and not flags & FLAG_REPLAY:
            self._emitted_ms[turn] = now * 1000
        # Resampled here (polyphase) rather than in the worklet, so the player only copies samples.
        pcm = resample(samples, tts_rate, self.browser_rate)
        # A short first packet can start playing while the (much larger) rest is still in transit.
        cut = int(FIRST_PACKET_S * self.browser_rate)
        for part in (pcm[:cut], pcm[cut:]):
            if len(part):
                self.send(pack_audio(part, turn, seq, self.browser_rate, now * 1000, flags))
                seq += 1
        self.playing_until = max(self.playing_until, now) + len(samples) / tts_rate
        return seq

    async def pump(self, ws) -> None:
        while (message := await self.outbox.get()) is not None:
            if isinstance(message, bytes):
                await ws.send_bytes(message)
            else:
                await ws.send_text(json.dumps(message, default=float))

    async def pinger(self) -> None:
        """Ping quickly at first (the first answer needs the clock offset, and the page is busy rendering while
        it loads, which slows some round trips), then every couple of seconds to catch a faster trip."""
        for i in itertools.count():
            self.send({"type": "ping", "ts": time.perf_counter() * 1000})
            await asyncio.sleep(0.1 if i < 20 else 2.0)

    # ---- receiving (event loop)

    def on_audio(self, data: bytes, received: float) -> None:
        try:
            chunk = decode_mic_frame(data)
        except ValueError as e:
            self.send({"type": "error", "message": str(e)})
            return
        # The frame's first sample was spoken one frame ago (network and worklet delays ignored: ~ms).
        self.mic.feed(chunk, received - len(chunk) / SAMPLE_RATE)

    def on_message(self, text: str, received: float) -> None:
        try:
            m = json.loads(text)
            kind = m.get("type")
            handler = {
                "hello": self._hello,
                "pong": self._pong,
                "settings": self._settings,
                "text": self._text,
                "mic": self._mic,
                "ab": self._ab,
                "heard": self._heard_msg,
                "play": self._play,
                "stop": self._stop,
            }.get(kind)
            if handler is None:
                raise ValueError(f"unknown message type {kind!r}")
            handler(m, received)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.send({"type": "error", "message": f"bad message: {e}"})

    def _hello(self, m: dict, received: float) -> None:
        rate = int(m.get("sample_rate", DEFAULT_PLAYBACK_RATE))
        if not 8000 <= rate <= 192000:
            raise ValueError(f"sample_rate {rate} out of range")
        self.browser_rate = rate

    def _pong(self, m: dict, received: float) -> None:
        self.clock.add(float(m["ts"]), float(m["tc"]), received * 1000)

    def _settings(self, m: dict, received: float) -> None:
        s = dict(self.settings)
        if "speculation" in m:
            s["speculation"] = bool(m["speculation"])
        if m.get("drafter") is not None:
            if m["drafter"] not in DRAFTER_KINDS:
                raise ValueError(f"unknown drafter {m['drafter']!r}")
            s["drafter"] = m["drafter"]
        if m.get("k") is not None:
            k = str(m["k"])
            if k != "adaptive" and not (k.isdigit() and 1 <= int(k) <= 16):
                raise ValueError("k must be 'adaptive' or 1..16")
            s["k"] = k
        if m.get("temperature") is not None:
            s["temperature"] = min(max(float(m["temperature"]), 0.0), 2.0)
        if m.get("load_aware") is not None:
            s["load_aware"] = bool(m["load_aware"])
        self.settings = s
        if m.get("background") is not None:  # the server's load, shared by every tab
            self.server.set_background(int(m["background"]))

    def _text(self, m: dict, received: float) -> None:
        text = str(m.get("text", "")).strip()[: self.server.options.max_text_chars]
        if text:
            self.start_turn(text, Timeline(), "typed")

    def _mic(self, m: dict, received: float) -> None:
        mode = m.get("mode", "handsfree")
        if mode not in ("handsfree", "ptt"):
            raise ValueError(f"unknown mic mode {mode!r}")
        if m.get("active") and self.server.loader.loading:
            self.send(
                {
                    "type": "info",
                    "message": "The models are still loading: what you say now is kept and "
                    "answered when they are ready.",
                }
            )
        self.mic.switch(bool(m.get("active")), mode)

    def _ab(self, m: dict, received: float) -> None:
        typed = str(m.get("text") or "").strip()[: self.server.options.max_text_chars]
        text = typed or self.last_utterance
        if not text:
            self.send({"type": "error", "message": "A/B needs an utterance: say or type something first."})
            return
        audio = None if typed else self.last_utterance_audio
        repeats = min(max(int(m.get("repeats", 3)), 1), self.server.options.max_ab_repeats)
        self._start_worker(lambda cancel: self._ab_job(text, audio, repeats, cancel))

    def _heard_msg(self, m: dict, received: float) -> None:
        turn = int(m["turn"])
        server_ms = self.clock.to_server_ms(float(m["t"]))
        if server_ms is None or turn not in self._emitted_ms:
            return
        detail = {k: m.get(k) for k in ("method", "output_latency_ms", "base_latency_ms", "output_timestamp")}
        emitted = self._emitted_ms[turn]
        if m.get("received_t") is not None:  # split the delay: socket + page up to the player, then playout
            received = self.clock.to_server_ms(float(m["received_t"]))
            detail.update(delivery_ms=received - emitted, playout_ms=server_ms - received)
        with self._lock:
            self._heard[turn] = {
                "heard_server_ms": server_ms,
                "heard_delay_ms": server_ms - emitted,
                "heard_method": detail["method"],
                "heard_detail": detail,
                "clock_rtt_ms": self.clock.rtt_ms,
            }
            timeline = self._timelines.get(turn)
            if timeline is not None and timeline.has("speech_end"):
                timeline.heard_ms = server_ms - timeline.marks["speech_end"] * 1000
                self._heard[turn]["ttfa_heard_ms"] = timeline.heard_ms
            update = self._apply_heard(turn)
        self.send({"type": "heard", "turn": turn, **update})

    def _apply_heard(self, turn: int) -> dict:
        """Copy what the page reported hearing into the turn's record (whichever of the two came first)."""
        heard = self._heard.get(turn, {})
        update = {
            "ttfa_heard_ms": heard.get("ttfa_heard_ms"),
            "heard_delay_ms": heard.get("heard_delay_ms"),
            "heard_method": heard.get("heard_method"),
            "heard_detail": heard.get("heard_detail"),
            "clock_rtt_ms": heard.get("clock_rtt_ms"),
        }
        record = self._records.get(turn)
        if record is not None and heard:
            record.update(update)
            record["timeline"]["ttfa_heard_ms"] = update["ttfa_heard_ms"]
        return update

    def _play(self, m: dict, received: float) -> None:
        turn = int(m["turn"])
        audio, _ = self._audio.get(turn, ([], 0))
        if not audio:
            self.send({"type": "error", "message": f"the audio of turn {turn} is no longer kept"})
            return
        self.interrupt("replay")
        now, seq = time.perf_counter(), 0
        for samples in audio:
            seq = self.send_audio(turn, seq, samples, now, FLAG_REPLAY)

    def _stop(self, m: dict, received: float) -> None:
        self.interrupt("stop")

    # ---- answers (worker threads)

    def answer_active(self) -> bool:
        return bool(self._worker and self._worker.is_alive()) or time.perf_counter() < self.playing_until

    def interrupt(self, reason: str) -> None:
        """Barge-in: stop the answer being generated and empty the page's playback buffer."""
        if self.answer_active():
            self._cancel.set()
            self.playing_until = 0.0
            self.send({"type": "flush", "reason": reason})

    def start_turn(
        self, text: str, timeline: Timeline, kind: str, audio: np.ndarray | None = None, hold: Hold | None = None
    ) -> None:
        self.last_utterance, self.last_utterance_audio = text, audio
        self._start_worker(lambda cancel: self._turn_job(text, timeline, kind, cancel, hold))

    def _early_turn(self, words: str, timeline: Timeline, hold: Hold) -> None:
        """The user paused: answer what they said so far, held until their turn ends with the same words."""
        self.start_turn(words, timeline, "voice", hold=hold)

    def _voice_turn(self, transcript: str, timeline: Timeline, audio: np.ndarray | None, answered: bool) -> None:
        if answered:  # the early answer on these words is this turn's answer
            self.last_utterance, self.last_utterance_audio = transcript, audio
        else:
            self.start_turn(transcript, timeline, "voice", audio)

    def _start_worker(self, job: Callable[[threading.Event], None]) -> None:
        """Run job on a new thread after the previous answer of this tab was cancelled and has finished; while the
        models load, keep it for loading_finished (the newest only: a new turn interrupts the one before)."""
        loader = self.server.loader
        with self._lock:  # against loading_finished taking the queued job between the check and the store
            if loader.loading:
                replaced, self._queued = self._queued is not None, job
                self.send(
                    {
                        "type": "info",
                        "message": f"Queued: the models are still loading ({loader.stage()}); "
                        "this will be answered when they are ready"
                        + ("; it replaces what was queued before." if replaced else "."),
                    }
                )
                return
        if not loader.ready:
            self.send({"type": "error", "message": loader.failed_message()})
            return
        with self._lock:
            self.interrupt("new turn")
            previous, cancel = self._worker, threading.Event()
            self._cancel = cancel

            def run() -> None:
                if previous is not None:
                    previous.join()
                if not cancel.is_set() and not self.closed:
                    job(cancel)

            self._worker = threading.Thread(target=run, name="answer", daemon=True)
            self._worker.start()

    def loading_finished(self) -> None:
        """The models are ready or failed to load: hear what was said and answer what was typed meanwhile (or say
        why not). Called once loading is over, maybe twice (AppServer's broadcast and a tab that just connected)."""
        with self._lock:
            job, self._queued = self._queued, None
        loader = self.server.loader
        self.mic.release(loader.agent, "" if loader.ready else loader.failed_message())
        if job is not None:
            self._start_worker(job)

    def _conversation(self) -> Conversation:
        with self._lock:  # the mic's thread (prefill while speaking) and answers both ask for it
            if self.conv is None:
                self.conv = self.server.loader.agent.new_conversation()
        changes = {
            k: v
            for k, v in self.settings.items()
            if k in ("drafter", "k", "temperature", "load_aware") and v is not None and self._applied.get(k) != v
        }
        if changes:
            configure = getattr(self.conv.llm, "configure", None)
            try:
                if configure is None:
                    raise ValueError("this LLM stage has no drafter/K/temperature controls")
                configure(**changes)
                self._applied.update(changes)
            except ValueError as e:  # answer anyway, with the settings the conversation already has
                self.send({"type": "error", "message": f"settings not applied: {e}"})
                self.settings = {**self.settings, **dict.fromkeys(changes)}
        return self.conv

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
        agent = self.server.loader.agent
        conv = self._conversation()
        turn = next(self._ids)
        self._timelines[turn] = timeline
        announce = {"type": "turn", "turn": turn, "kind": kind, "speculation": speculation, "transcript": text}
        if hold is None:
            self.send({**announce, **extra})
        else:
            hold.post(lambda: self.send({**announce, **extra, "early": True}))
        stream = TurnStream(self, turn, stream_audio=kind != "ab")
        if replay is None:
            result = agent.respond(conv, text, timeline, speculation, stream, cancel, remember, hold)
        else:
            result = agent.turn_from_recording(conv, replay, speculation, stream, cancel, remember)
            self._timelines[turn] = result.timeline
        if result.discarded:
            return None
        return self._record(turn, kind, result, **extra)

    def _record(self, turn: int, kind: str, result: TurnResult, **extra) -> dict:
        data = result.to_dict()
        data.update(
            turn=turn,
            kind=kind,
            settings=dict(self.settings),
            llm=getattr(self.conv.llm, "name", None),
            started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"),
            **extra,
        )
        with self._lock:
            self._records[turn] = data
            data.update(self._apply_heard(turn))
            self.turns.append(data)
            if result.audio:
                self._audio[turn] = (result.audio, result.sample_rate)
            while len(self._audio) > self.server.options.kept_audio_turns:
                self._audio.pop(next(iter(self._audio)))
        self.send({"type": "done", "turn": turn, "data": data})
        return data

    def _guarded(self, body: Callable[[], object], hold: Hold | None = None) -> None:
        """Run an answer under the server-wide limit, turning failures into one message. An early answer (hold) that
        finds no room is given up quietly: its turn asks again, as any turn, once it has ended."""
        if not self.server.slots.try_acquire():
            if hold is not None:
                hold.discard()
                return
            self.send({"type": "busy", "message": self.server.slots.busy_message()})
            return
        try:
            body()
        except Exception as e:
            if not self.closed:
                log.exception("answer failed")
                self.send({"type": "error", "message": f"answer failed: {type(e).__name__}: {e}"})
        finally:
            self.server.slots.release()

    def _turn_job(
        self, text: str, timeline: Timeline, kind: str, cancel: threading.Event, hold: Hold | None = None
    ) -> None:
        self._guarded(lambda: self._answer(text, timeline, self.settings["speculation"], kind, cancel, hold=hold), hold)

    def _ab_job(self, text: str, audio: np.ndarray | None, repeats: int, cancel: threading.Event) -> None:
        def body() -> None:
            agent = self.server.loader.agent
            ab = next(self._ab_ids)
            self.send({"type": "ab_start", "ab": ab, "text": text, "repeats": repeats, "spoken": audio is not None})
            pairs: list[dict] = []
            for rep in range(repeats):
                runs = {}
                # Alternate which mode goes first, so neither profits from running second.
                for spec in ab_order(rep):
                    if cancel.is_set() or self.closed:
                        break
                    agent.rewind(self._conversation())  # every run starts from the same KV state
                    run = self._answer(
                        text, Timeline(), spec, "ab", cancel, remember=False, replay=audio, ab=ab, ab_repeat=rep
                    )
                    assert run is not None  # only an early answer is ever discarded
                    runs[spec] = run
                if len(runs) < 2:
                    break
                pairs.append({"repeat": rep, "off": _ab_run(runs[False]), "on": _ab_run(runs[True])})
                self.send({"type": "ab_progress", "ab": ab, "done": rep + 1, "repeats": repeats})
            summary = paired_ratio([(p["off"]["ttfa_ms"], p["on"]["ttfa_ms"]) for p in pairs])
            self.send(
                {
                    "type": "ab_result",
                    "ab": ab,
                    "text": text,
                    "pairs": pairs,
                    "summary": summary,
                    "spoken": audio is not None,
                }
            )

        self._guarded(body)

    # ---- export

    def export(self, name: str) -> tuple[str, str]:
        media, build = EXPORTS[name]
        with self._lock:
            turns = list(self.turns)
        meta = {**self.server.loader.describe(), "clock_rtt_ms": self.clock.rtt_ms}
        return media, build(turns, meta)

    def close(self) -> None:
        """The tab went away: stop its answer and its mic thread; nothing is sent any more."""
        self.closed = True
        self._cancel.set()
        self.mic.close()
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(self.outbox.put_nowait, None)


def _ab_run(turn: dict) -> dict:
    keys = (
        "turn",
        "transcript",
        "ttfa_ms",
        "stages",
        "tokens_per_s",
        "draft_acceptance_rate",
        "answer",
        "audio_seconds",
        "cancelled",
    )
    return {k: turn.get(k) for k in keys}
