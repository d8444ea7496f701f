"""`specvoice app`: the browser voice agent, with what speculative decoding does to its latency shown live.

Gradio builds the page (a Voice tab and the Case study tab); the voice itself does not go through Gradio. Its
streamed gr.Audio starts playing 1.2-3 s after the first chunk (HLS), which would hide the very latency this app
measures, so microphone and answer audio travel as raw PCM over one WebSocket per tab (/specvoice/ws) and play
through AudioWorklets (app/static/). Live panel updates ride the same socket as JSON.

Socket protocol (JSON text unless noted):
  browser → server: binary Int16 LE mono 16 kHz mic frames; hello {sample_rate}; pong {ts, tc}; settings {...};
    text {text}; mic {active, mode}; ab {repeats, text}; heard {turn, t, ...}; play {turn}; stop
  server → browser: binary audio packets (pack_audio); hello; status; ping {ts}; vad; partial; transcript; turn;
    token; done; heard; flush; busy; error; info; ab_start; ab_progress; ab_result
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import itertools
import json
import logging
import queue
import secrets
import struct
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path
from urllib.parse import urlsplit

import numpy as np
from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.agent import AgentConfig, Conversation, TurnListener, TurnResult, VoiceAgent, ab_order
from pipeline.asr import Transcriber
from pipeline.audio import SAMPLE_RATE, resample
from pipeline.options import add_agent_arguments, agent_config_from_args
from pipeline.timeline import STAGES, Timeline
from pipeline.tts import make_tts
from pipeline.vad import EndOfTurnDetector
from specdec.metrics import DEFINITIONS

from . import report

log = logging.getLogger("specvoice.app")

STATIC_DIR = Path(__file__).parent / "static"
WS_PATH = "/specvoice/ws"
STATIC_PATH = "/specvoice/static"
EXPORT_PATH = "/specvoice/export"
EXPORTS = {  # file name → (media type, builder(turns, meta))
    "report.html": ("text/html; charset=utf-8", report.render_html),
    "turns.csv": ("text/csv; charset=utf-8", lambda turns, meta: report.turns_csv(turns)),
    "turns.json": ("application/json", report.turns_json),
}
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 7860
    max_concurrent_answers: int = 1
    max_turn_s: float = 30.0  # a voice turn is cut here: caps what one user can make the ASR chew on
    max_text_chars: int = 1000
    max_message_bytes: int = 256 * 1024  # per WebSocket message; a 32 ms mic frame is 1 KiB
    max_ab_repeats: int = 10
    kept_audio_turns: int = 20  # answers whose audio stays replayable, per tab


# ------------------------------------------------------------------------------------------- wire formats

AUDIO_MAGIC = b"SVA1"
# magic, turn, seq, sample rate, flags, server time in ms (time.perf_counter clock); Int16 LE PCM follows.
AUDIO_HEADER = struct.Struct("<4sIIIId")
FLAG_REPLAY = 1  # a replayed answer: the page must not report it as heard
MAX_MIC_FRAME_SAMPLES = SAMPLE_RATE  # one second per message at most
FIRST_PACKET_S = 0.1


def pack_audio(samples: np.ndarray, turn: int, seq: int, rate: int, server_ms: float, flags: int = 0) -> bytes:
    pcm = np.round(np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * 32767).astype("<i2")
    return AUDIO_HEADER.pack(AUDIO_MAGIC, turn, seq, rate, flags, server_ms) + pcm.tobytes()


def unpack_audio(data: bytes) -> tuple[dict, np.ndarray]:
    magic, turn, seq, rate, flags, server_ms = AUDIO_HEADER.unpack_from(data)
    if magic != AUDIO_MAGIC:
        raise ValueError("not an audio packet")
    pcm = np.frombuffer(data, "<i2", offset=AUDIO_HEADER.size).astype(np.float32) / 32767
    return {"turn": turn, "seq": seq, "rate": rate, "flags": flags, "server_ms": server_ms}, pcm


def decode_mic_frame(data: bytes) -> np.ndarray:
    """A browser mic frame (Int16 LE, 16 kHz mono) → float32; ValueError for anything else."""
    if len(data) % 2 or not 0 < len(data) <= 2 * MAX_MIC_FRAME_SAMPLES:
        raise ValueError(f"mic frames are 1..{MAX_MIC_FRAME_SAMPLES} Int16 samples, got {len(data)} bytes")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768


class ClockSync:
    """The page's performance.now() ↔ the server's perf_counter, both in ms, from ping/pong round trips.

    Each round trip gives offset = client − midpoint of send and receive; its error is at most half the round
    trip, so the estimate is the offset of the fastest recent trip (NTP's minimum-delay filter)."""

    def __init__(self, keep: int = 32) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=keep)

    def add(self, sent_ms: float, client_ms: float, received_ms: float) -> None:
        rtt = received_ms - sent_ms
        if rtt >= 0:
            self._samples.append((rtt, client_ms - (sent_ms + received_ms) / 2))

    @property
    def offset_ms(self) -> float | None:
        return min(self._samples)[1] if self._samples else None

    @property
    def rtt_ms(self) -> float | None:
        return min(self._samples)[0] if self._samples else None

    def to_server_ms(self, client_ms: float) -> float | None:
        offset = self.offset_ms
        return None if offset is None else client_ms - offset


def origin_allowed(origin: str | None, host_header: str | None, bind_host: str, port: int) -> bool:
    """Guard against cross-site WebSocket hijacking: only pages this app served may open its socket.

    The Origin must name the same host:port the browser connected to (the Host header), on our port; and when we
    listen on loopback, that host must be a loopback name, so a DNS-rebinding name pointing at 127.0.0.1 fails too.
    """
    if not origin or not host_header:
        return False
    o, h = urlsplit(origin), urlsplit(f"//{host_header}")
    try:
        o_port, h_port = o.port or {"http": 80, "https": 443}.get(o.scheme), h.port
    except ValueError:  # a malformed port
        return False
    if o.scheme not in ("http", "https") or not o.hostname or (o.hostname, o_port) != (h.hostname, h_port):
        return False
    if h_port != port:
        return False
    if bind_host in ("0.0.0.0", "::", ""):
        return True  # listening everywhere: any name may reach us, but the page must come from that name
    allowed = {bind_host.strip("[]").lower()} | (LOOPBACK_NAMES if bind_host in LOOPBACK_NAMES else set())
    return o.hostname.lower() in allowed


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
        return (f"Busy: the server is answering {who} (--max-concurrent-answers {self.limit}). "
                "Your turn was not answered; try again in a moment.")


# ------------------------------------------------------------------------------------------- models


class ModelLoader:
    """Loads the agent on a background thread so the page is up (and says how far loading got) at once, then warms
    every stage: the app is ready only when its first turn is as fast as later ones."""

    LOAD_STEPS = ("speech recognition", "text to speech", "language models")
    STEPS = LOAD_STEPS + tuple(f"warm-up: {step}" for step in VoiceAgent.WARMUP_STEPS)

    def __init__(self, config: AgentConfig, on_change: Callable[[dict], None] = lambda status: None,
                 build: Callable[[Callable[[int], None]], VoiceAgent] | None = None) -> None:
        self.config = config
        self.on_change = on_change
        self._build = build or self._build_agent
        self.agent: VoiceAgent | None = None
        self.error: str | None = None
        self.finished = threading.Event()  # loading is over: ready, or failed
        self.step = -1
        self.step_s: list[tuple[str, float]] = []  # the steps done and their seconds
        self.t0 = self._step_t0 = time.perf_counter()
        self.load_s: float | None = None

    def start(self) -> None:
        self.t0 = self._step_t0 = time.perf_counter()
        threading.Thread(target=self._run, name="model-loader", daemon=True).start()

    def _end_step(self) -> None:
        now = time.perf_counter()
        if self.step >= 0:
            self.step_s.append((self.STEPS[self.step], now - self._step_t0))
        self._step_t0 = now

    def _advance(self, step: int) -> None:
        self._end_step()
        self.step = step
        log.info("loading %s (%.1f s elapsed)", self.stage(), self._step_t0 - self.t0)
        self.on_change(self.status())

    def _build_agent(self, progress: Callable[[int], None]) -> VoiceAgent:
        progress(0)
        transcriber = Transcriber(self.config.asr_model)
        progress(1)
        tts = make_tts(self.config.tts)
        progress(2)
        return VoiceAgent(self.config, transcriber=transcriber, tts=tts)

    def _run(self) -> None:
        try:
            agent = self._build(self._advance)
            agent.warmup(lambda step: self._advance(len(self.LOAD_STEPS) + step))
            self.agent = agent
        except Exception as e:  # shown on the page; the server stays up to say so
            log.exception("loading the models failed")
            self.error = f"{type(e).__name__}: {e}"
        self._end_step()
        self.load_s = time.perf_counter() - self.t0
        if self.agent is not None:
            log.info("models loaded and warmed up in %.1f s: ready", self.load_s)
        self.finished.set()
        self.on_change(self.status())

    @property
    def ready(self) -> bool:
        return self.agent is not None

    @property
    def loading(self) -> bool:
        return not self.finished.is_set()

    def failed_message(self) -> str:
        return f"The models failed to load ({self.error}); nothing can be answered. Restart the app."

    def stage(self) -> str:
        if self.step < 0:
            return "starting"
        return f"step {self.step + 1}/{len(self.STEPS)}: {self.STEPS[self.step]}"

    def status(self) -> dict:
        status = {"type": "status", "ready": self.ready, "error": self.error, "stage": self.stage(),
                  "step": self.step, "steps": len(self.STEPS), "step_s": list(self.step_s),
                  "elapsed_s": time.perf_counter() - self.t0, "load_s": self.load_s}
        if self.agent is not None:
            status.update(drafters=available_drafters(self.agent), k=self.config.engine.k,
                          temperature=self.config.temperature, engine=self.describe())
        return status

    def describe(self) -> dict:
        e = self.config.engine
        llm = self.config.llm_url or f"{e.target} + {e.draft} ({e.dtype}, {e.device})"
        return {"llm": llm, "asr": self.config.asr_model, "tts": self.config.tts, "k": e.k,
                "hangover_ms": self.config.hangover_ms}


def available_drafters(agent: VoiceAgent) -> list[str]:
    """Drafters a conversation may switch to (EngineLLM.configure): none for a remote LLM."""
    if agent.engine is None:
        return []
    return (["draft-model"] if agent.engine.has_draft_model else []) + ["ngram"]


# ------------------------------------------------------------------------------------------- one tab


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
            self.session.send({"type": "token", "turn": self.turn, "pieces": [list(p) for p in payload["pieces"]],
                               "step_tokens": n, "drafted": drafted, "accepted": accepted,
                               "tokens": payload["tokens"], "tokens_per_s": payload["tokens_per_s"],
                               "step_tokens_per_s": step_rate})
        elif kind == "audio" and self.stream_audio:
            assert isinstance(payload, np.ndarray)
            self.seq = self.session.send_audio(self.turn, self.seq, payload, now)


class MicInput:
    """Microphone frames → user turns, on a thread of its own so VAD and ASR never block the socket.

    Hands-free: a light VAD gate watches the stream; only once it hears speech does a TurnListener (with a second
    of pre-roll) start, because its streaming ASR re-transcribes its whole buffer every half second, silence
    included. Push-to-talk: pressing starts a listener whose VAD never ends the turn; releasing ends it.

    While the models load, the thread waits and the queue keeps what is said (about 30 s), so a question spoken
    meanwhile is heard, with its real timestamps, and answered once they are ready.
    """

    PREROLL_S = 1.0

    def __init__(self, session: ClientSession) -> None:
        self.session = session
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
        self.released = threading.Event()  # set when loading is over (or the tab closed): the thread may go on
        self.thread = threading.Thread(target=self._run, name="mic", daemon=True)
        self.thread.start()

    def put(self, item: tuple | None) -> None:
        try:
            self.queue.put_nowait(item)
            self.dropping = False
        except queue.Full:
            # The thread is stuck (ASR on an overloaded machine) or waits for the models: drop audio, never the
            # socket, and say so once rather than for each of ~30 frames a second.
            if not self.dropping:
                log.warning("mic queue full; dropping frames")
            self.dropping = True

    def close(self) -> None:
        self.released.set()
        with contextlib.suppress(queue.Full):
            self.queue.put_nowait(None)

    def _run(self) -> None:
        try:
            self.released.wait()
            while not self.session.closed and (item := self.queue.get()) is not None:
                if item[0] == "audio":
                    self._audio(item[1], item[2])
                else:
                    self._control(item[1], item[2])
        except Exception:
            log.exception("microphone input failed")
            self.session.send({"type": "error", "message": "Microphone processing failed; see the server log."})
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
        agent = self.session.server.loader.agent
        if active and agent is None:  # the thread runs once loading is over: this means it failed
            self.session.send({"type": "error", "message": self.session.server.loader.failed_message()})
            return
        if not active:
            if self.mode == "ptt" and self.listener is not None:
                self._end_turn(self.listener.vad.finish())
            self.mode = None
            self._drop_listener()
            return
        self._drop_listener()
        self.mode = mode
        if mode == "ptt":
            self.session.interrupt("push-to-talk")  # pressing to talk while the agent speaks is a barge-in
            # The VAD must not end a held turn at a pause; the release does (or max_turn_s).
            self._new_listener(TurnListener(agent.transcriber, self.session.server.options.max_turn_s * 1000))
        else:
            self.gate = self.gate or EndOfTurnDetector(hangover_ms=agent.config.hangover_ms)
            self.gate.reset()

    def _new_listener(self, listener: TurnListener) -> None:
        self.listener, self.fed_s, self.fed, self.partial = listener, 0.0, [], ""
        self.session.send({"type": "vad", "event": "listening"})

    def _audio(self, chunk: np.ndarray, t_start: float) -> None:
        agent = self.session.server.loader.agent
        if self.mode is None or agent is None or (self.mode == "ptt" and self.listener is None):
            return  # off, or a held turn already cut at max_turn_s: wait for the release
        if self.listener is None:  # hands-free, waiting for speech
            self.preroll.append((chunk, t_start))
            while self.preroll and t_start - self.preroll[0][1] > self.PREROLL_S:
                self.preroll.popleft()
            if not any(ev.kind == "speech_start" for ev in self.gate.feed(chunk, t_start)):
                return
            self.session.send({"type": "vad", "event": "speech_start"})
            self.session.interrupt("barge-in")
            self._new_listener(agent.listen())
            items, self.preroll = list(self.preroll), deque()
        else:
            items = [(chunk, t_start)]
        for c, t in items:
            end = self.listener.feed(c, t)
            self.fed_s += len(c) / SAMPLE_RATE
            self.fed.append(c)
            if end is not None:
                self._end_turn([end])
                return
            if self.fed_s > self.session.server.options.max_turn_s:
                self.session.send({"type": "info", "message": "Turn cut at the length limit."})
                self._end_turn(self.listener.vad.finish())
                return
        self._send_partial()

    def _send_partial(self) -> None:
        now = time.perf_counter()
        if self.listener is not None and now - self.last_partial_t > 0.3:
            self.last_partial_t = now
            text = self.listener.asr.partial
            if text != self.partial:
                self.partial = text
                self.session.send({"type": "partial", "text": text})

    def _end_turn(self, events: list) -> None:
        listener, self.listener = self.listener, None
        if self.gate is not None:
            self.gate.reset()
        self.preroll.clear()
        ev = next((e for e in events if e.kind == "end_of_turn"), None)
        if listener is None:
            return
        if ev is None:
            listener.close()
            self.session.send({"type": "info", "message": "No speech heard."})
            return
        timeline = Timeline()
        try:
            transcript = listener.finish(ev, timeline)
        finally:
            listener.close()
        self.session.send({"type": "vad", "event": "end_of_turn"})
        if not transcript:
            self.session.send({"type": "info", "message": "Speech was heard but nothing intelligible transcribed."})
            return
        self.session.send({"type": "transcript", "text": transcript})
        self.session.start_turn(transcript, timeline, "voice", np.concatenate(self.fed) if self.fed else None)


class ClientSession:
    """One browser tab: its own conversation, settings, turns and clock, for as long as its WebSocket lives."""

    def __init__(self, server: AppServer, loop: asyncio.AbstractEventLoop) -> None:
        self.server = server
        self.loop = loop
        self.token = secrets.token_urlsafe(16)  # names this tab's exports; unguessable by other tabs
        self.outbox: asyncio.Queue = asyncio.Queue()
        self.closed = False
        self.clock = ClockSync()
        self.browser_rate = 48000
        self.settings: dict = {"speculation": True, "drafter": None, "k": None, "temperature": None}
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
        self.mic = MicInput(self)

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
        self.mic.put(("audio", chunk, received - len(chunk) / SAMPLE_RATE))

    def on_message(self, text: str, received: float) -> None:
        try:
            m = json.loads(text)
            kind = m.get("type")
            handler = {"hello": self._hello, "pong": self._pong, "settings": self._settings, "text": self._text,
                       "mic": self._mic, "ab": self._ab, "heard": self._heard_msg, "play": self._play,
                       "stop": self._stop}.get(kind)
            if handler is None:
                raise ValueError(f"unknown message type {kind!r}")
            handler(m, received)
        except (ValueError, TypeError, KeyError, AttributeError) as e:
            self.send({"type": "error", "message": f"bad message: {e}"})

    def _hello(self, m: dict, received: float) -> None:
        rate = int(m.get("sample_rate", 48000))
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
            if m["drafter"] not in ("draft-model", "ngram"):
                raise ValueError(f"unknown drafter {m['drafter']!r}")
            s["drafter"] = m["drafter"]
        if m.get("k") is not None:
            k = str(m["k"])
            if k != "adaptive" and not (k.isdigit() and 1 <= int(k) <= 16):
                raise ValueError("k must be 'adaptive' or 1..16")
            s["k"] = k
        if m.get("temperature") is not None:
            s["temperature"] = min(max(float(m["temperature"]), 0.0), 2.0)
        self.settings = s

    def _text(self, m: dict, received: float) -> None:
        text = str(m.get("text", "")).strip()[: self.server.options.max_text_chars]
        if text:
            self.start_turn(text, Timeline(), "typed")

    def _mic(self, m: dict, received: float) -> None:
        mode = m.get("mode", "handsfree")
        if mode not in ("handsfree", "ptt"):
            raise ValueError(f"unknown mic mode {mode!r}")
        if m.get("active") and self.server.loader.loading:
            self.send({"type": "info", "message": "The models are still loading: what you say now is kept and "
                       "answered when they are ready."})
        self.mic.put(("control", bool(m.get("active")), mode))

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
            self._heard[turn] = {"heard_server_ms": server_ms, "heard_delay_ms": server_ms - emitted,
                                 "heard_method": detail["method"], "heard_detail": detail,
                                 "clock_rtt_ms": self.clock.rtt_ms}
            timeline = self._timelines.get(turn)
            if timeline is not None and timeline.has("speech_end"):
                timeline.heard_ms = server_ms - timeline.marks["speech_end"] * 1000
                self._heard[turn]["ttfa_heard_ms"] = timeline.heard_ms
            update = self._apply_heard(turn)
        self.send({"type": "heard", "turn": turn, **update})

    def _apply_heard(self, turn: int) -> dict:
        """Copy what the page reported hearing into the turn's record (whichever of the two came first)."""
        heard = self._heard.get(turn, {})
        update = {"ttfa_heard_ms": heard.get("ttfa_heard_ms"), "heard_delay_ms": heard.get("heard_delay_ms"),
                  "heard_method": heard.get("heard_method"), "heard_detail": heard.get("heard_detail"),
                  "clock_rtt_ms": heard.get("clock_rtt_ms")}
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

    def start_turn(self, text: str, timeline: Timeline, kind: str, audio: np.ndarray | None = None) -> None:
        self.last_utterance, self.last_utterance_audio = text, audio
        self._start_worker(lambda cancel: self._turn_job(text, timeline, kind, cancel))

    def _start_worker(self, job: Callable[[threading.Event], None]) -> None:
        """Run job on a new thread after the previous answer of this tab was cancelled and has finished; while the
        models load, keep it for loading_finished (the newest only: a new turn interrupts the one before)."""
        loader = self.server.loader
        with self._lock:  # against loading_finished taking the queued job between the check and the store
            if loader.loading:
                replaced, self._queued = self._queued is not None, job
                self.send({"type": "info", "message": f"Queued: the models are still loading ({loader.stage()}); "
                           "this will be answered when they are ready"
                           + ("; it replaces what was queued before." if replaced else ".")})
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
        self.mic.released.set()
        if job is not None:
            self._start_worker(job)

    def _conversation(self) -> Conversation:
        if self.conv is None:
            self.conv = self.server.loader.agent.new_conversation()
        changes = {k: v for k, v in self.settings.items()
                   if k in ("drafter", "k", "temperature") and v is not None and self._applied.get(k) != v}
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

    def _answer(self, text: str, timeline: Timeline, speculation: bool, kind: str, cancel: threading.Event,
                remember: bool = True, replay: np.ndarray | None = None, **extra) -> dict:
        """Answer text, or with replay: that recording, replayed in real time through VAD and ASR first."""
        agent = self.server.loader.agent
        conv = self._conversation()
        turn = next(self._ids)
        self._timelines[turn] = timeline
        self.send({"type": "turn", "turn": turn, "kind": kind, "speculation": speculation, "transcript": text,
                   **extra})
        stream = TurnStream(self, turn, stream_audio=kind != "ab")
        if replay is None:
            result = agent.respond(conv, text, timeline, speculation, stream, cancel, remember)
        else:
            result = agent.turn_from_recording(conv, replay, speculation, stream, cancel, remember, timeline)
        return self._record(turn, kind, result, **extra)

    def _record(self, turn: int, kind: str, result: TurnResult, **extra) -> dict:
        data = result.to_dict()
        data.update(turn=turn, kind=kind, settings=dict(self.settings), llm=getattr(self.conv.llm, "name", None),
                    started_at=datetime.now(timezone.utc).isoformat(timespec="seconds"), **extra)
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

    def _guarded(self, cancel: threading.Event, body: Callable[[], None]) -> None:
        """Run an answer under the server-wide limit, turning failures into one message."""
        if not self.server.slots.try_acquire():
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

    def _turn_job(self, text: str, timeline: Timeline, kind: str, cancel: threading.Event) -> None:
        self._guarded(cancel, lambda: self._answer(text, timeline, self.settings["speculation"], kind, cancel))

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
                    runs[spec] = self._answer(text, Timeline(), spec, "ab", cancel, remember=False, replay=audio,
                                              ab=ab, ab_repeat=rep)
                if len(runs) < 2:
                    break
                pairs.append({"repeat": rep, "off": _ab_run(runs[False]), "on": _ab_run(runs[True])})
                self.send({"type": "ab_progress", "ab": ab, "done": rep + 1, "repeats": repeats})
            summary = report.paired_difference([(p["off"]["ttfa_ms"], p["on"]["ttfa_ms"]) for p in pairs])
            self.send({"type": "ab_result", "ab": ab, "text": text, "pairs": pairs, "summary": summary,
                       "spoken": audio is not None})

        self._guarded(cancel, body)

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
    keys = ("turn", "transcript", "ttfa_ms", "stages", "tokens_per_s", "draft_acceptance_rate", "answer",
            "audio_seconds", "cancelled")
    return {k: turn.get(k) for k in keys}


# ------------------------------------------------------------------------------------------- the app


def _definition(name: str) -> str:
    return f'<div class="sv-def">{html.escape(DEFINITIONS[name])}</div>'


def controls_html(max_text_chars: int, max_ab_repeats: int) -> str:
    k_options = "".join(f'<option value="{k}">{k}</option>' for k in ("adaptive", *map(str, range(1, 9))))
    return f"""
<div class="sv-card" id="sv-status-card">
  <div id="model-status" class="sv-status">Connecting…</div>
  <progress id="model-progress" max="1" value="0"></progress>
  <div id="model-steps" class="sv-def"></div>
  <div id="sv-messages" role="status" aria-live="polite"></div>
</div>
<div class="sv-card">
  <h3>Talk</h3>
  <div class="sv-row">
    <button id="handsfree" class="sv-btn" aria-pressed="false">● Hands-free: off</button>
    <button id="ptt" class="sv-btn">Hold to talk</button>
    <button id="stop-answer" class="sv-btn sv-secondary">Stop</button>
  </div>
  <div class="sv-row"><meter id="mic-level" min="0" max="0.3" value="0"></meter>
    <span id="vad-state">mic off</span></div>
  <div id="partial-transcript"></div>
  <div class="sv-row">
    <input id="text-input" type="text" maxlength="{max_text_chars}" placeholder="…or type a message, Enter sends"
      autocomplete="off">
    <button id="send-text" class="sv-btn">Send</button>
  </div>
</div>
<div class="sv-card">
  <h3>Speculative decoding</h3>
  <label class="sv-switch"><input type="checkbox" id="speculation" checked> speculation</label>
  <label>drafter <select id="drafter"><option value="draft-model">draft model</option>
    <option value="ngram">n-gram</option></select></label>
  <label>K <select id="k-policy">{k_options}</select></label>
  <label>temperature <input id="temperature" type="range" min="0" max="1.5" step="0.1" value="0">
    <output id="temperature-value">0.0</output></label>
</div>
<div class="sv-card">
  <h3>A/B: the same utterance, speculation off vs on</h3>
  <div class="sv-row">
    <input id="ab-text" type="text" maxlength="{max_text_chars}" placeholder="(the last utterance)">
    <label>× <input id="ab-repeats" type="number" min="1" max="{max_ab_repeats}" value="3"></label>
    <button id="ab-run" class="sv-btn">Run A/B</button>
  </div>
  <div class="sv-def">Each run starts from the same conversation state (KV cache rolled back to the system prompt,
    A/B turns not remembered); the order alternates. A spoken utterance is replayed in real time through VAD and ASR,
    so its TTFA has every stage; typed text starts when it is submitted (no VAD/ASR).</div>
  <div id="ab-results"></div>
</div>
<div class="sv-card">
  <h3>Export</h3>
  <div class="sv-row"><a id="export-report" class="sv-btn" href="#" download="specvoice-report.html">Report (HTML)</a>
    <a id="export-csv" href="#" download="specvoice-turns.csv">CSV</a>
    <a id="export-json" href="#" download="specvoice-turns.json">JSON</a></div>
</div>"""


def panels_html() -> str:
    legend = "".join(f'<span class="sv-stage sv-stage-{i}">{html.escape(name)}</span>'
                     for i, name in enumerate(STAGES))
    return f"""
<div class="sv-metrics">
  <div class="sv-metric"><div class="sv-label">TTFA (server)</div>
    <div class="sv-value"><span id="ttfa-ms">–</span> <small>ms</small></div>{_definition("ttfa_ms")}</div>
  <div class="sv-metric"><div class="sv-label">TTFA (heard)</div>
    <div class="sv-value"><span id="ttfa-heard-ms">–</span> <small>ms</small></div>
    <div class="sv-sub">heard delay <span id="heard-delay-ms">–</span> ms</div>{_definition("heard_delay_ms")}</div>
  <div class="sv-metric"><div class="sv-label">tokens/s</div>
    <div class="sv-value"><span id="tokens-per-s">–</span></div>{_definition("tokens_per_s")}</div>
  <div class="sv-metric"><div class="sv-label">draft acceptance rate</div>
    <div class="sv-value"><span id="acceptance-rate">–</span></div>{_definition("draft_acceptance_rate")}</div>
  <div class="sv-metric"><div class="sv-label">tokens per target forward</div>
    <div class="sv-value"><span id="tokens-per-forward">–</span></div>{_definition("tokens_per_target_forward")}</div>
</div>
<div class="sv-card"><h3>Where the TTFA went <small id="waterfall-mode"></small></h3>
  <div id="waterfall"></div><div class="sv-legend">{legend}</div></div>
<div class="sv-plots">
  <div class="sv-card"><h3>This answer, per target step</h3><canvas id="plot-steps" width="460" height="200">
    </canvas></div>
  <div class="sv-card"><h3>TTFA per turn</h3><canvas id="plot-ttfa" width="460" height="200"></canvas></div>
</div>
<div class="sv-card"><h3>Transcript</h3>
  <div class="sv-legend"><span class="tok-draft">from an accepted draft</span>
    <span class="tok-target">from the target</span><span class="tok-unknown">not reported</span></div>
  <div id="transcript"></div></div>"""


def _asset_version() -> str:
    """Changes when a static file does, so browsers never run a stale script against a new server."""
    return str(max(int(p.stat().st_mtime) for p in STATIC_DIR.iterdir()))


def build_blocks(options: ServerOptions):
    import gradio as gr

    from .casestudy import build_tab

    with gr.Blocks(title="specvoice") as demo:
        with gr.Tab("Voice agent"):
            with gr.Row(equal_height=False):
                with gr.Column(scale=2, min_width=320):
                    gr.HTML(controls_html(options.max_text_chars, options.max_ab_repeats), elem_id="sv-controls",
                            js_on_load=None)
                with gr.Column(scale=3, min_width=420):
                    gr.HTML(panels_html(), elem_id="sv-panels", js_on_load=None)
        build_tab()
    return demo


class AppServer:
    """Everything shared by the tabs: the loading models, the answer slots, the live sessions, the web app."""

    def __init__(self, config: AgentConfig, options: ServerOptions | None = None,
                 build: Callable[[Callable[[int], None]], VoiceAgent] | None = None) -> None:
        self.options = options or ServerOptions()
        self.slots = AnswerSlots(self.options.max_concurrent_answers)
        self.sessions: dict[str, ClientSession] = {}
        self.loop: asyncio.AbstractEventLoop | None = None
        self.loader = ModelLoader(config, self._loading_changed, build)

    def _loading_changed(self, status: dict) -> None:
        for session in list(self.sessions.values()):
            session.send(status)
            if not self.loader.loading:
                session.loading_finished()

    async def websocket(self, ws: WebSocket) -> None:
        if not origin_allowed(ws.headers.get("origin"), ws.headers.get("host"), self.options.host,
                              self.options.port):
            await ws.close(code=1008)  # before accept(): the handshake is refused with HTTP 403
            return
        await ws.accept()
        session = ClientSession(self, asyncio.get_running_loop())
        self.sessions[session.token] = session
        if not self.loader.loading:  # else _loading_changed will, for this session is listed already
            session.loading_finished()
        tasks = [asyncio.create_task(session.pump(ws)), asyncio.create_task(session.pinger())]
        session.send({"type": "hello", "token": session.token, "export": f"{EXPORT_PATH}/{session.token}",
                      "colors": {"off": report.MODE_COLORS[False], "on": report.MODE_COLORS[True]},
                      "stages": list(STAGES), "max_concurrent_answers": self.slots.limit})
        session.send(self.loader.status())
        try:
            while True:
                msg = await ws.receive()
                if msg["type"] == "websocket.disconnect":
                    break
                now = time.perf_counter()
                if msg.get("bytes") is not None:
                    session.on_audio(msg["bytes"], now)
                elif msg.get("text") is not None:
                    session.on_message(msg["text"], now)
        except (WebSocketDisconnect, RuntimeError):
            pass  # the tab closed mid-message: nothing to report
        finally:
            session.close()
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            self.sessions.pop(session.token, None)

    def build_app(self):
        import gradio as gr
        from fastapi import FastAPI, HTTPException, Response
        from fastapi.staticfiles import StaticFiles

        api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @api.get(f"{EXPORT_PATH}/{{token}}/{{name}}")
        def export(token: str, name: str) -> Response:
            session = self.sessions.get(token)
            if session is None or name not in EXPORTS:
                raise HTTPException(404, "no such export (the tab's connection may have closed)")
            media, body = session.export(name)
            return Response(body, media_type=media,
                            headers={"Content-Disposition": f'attachment; filename="specvoice-{name}"'})

        @api.get("/specvoice/status")
        def status() -> dict:
            return {**self.loader.status(), "sessions": len(self.sessions)}

        api.add_api_websocket_route(WS_PATH, self.websocket)
        api.mount(STATIC_PATH, StaticFiles(directory=STATIC_DIR), name="specvoice-static")
        v = _asset_version()
        head = (f'<link rel="stylesheet" href="{STATIC_PATH}/app.css?v={v}">'
                f'<script src="{STATIC_PATH}/app.js?v={v}" data-worklets="{STATIC_PATH}/worklets.js?v={v}" '
                'defer></script>')
        # Mounted last: our routes above take precedence over Gradio's catch-all at "/".
        gr.mount_gradio_app(api, build_blocks(self.options), path="/", server_name=self.options.host,
                            server_port=self.options.port, head=head, footer_links=[], run_history=False,
                            max_file_size=self.options.max_message_bytes, show_error=True)
        return api

    def uvicorn_config(self, app):
        import uvicorn

        return uvicorn.Config(app, host=self.options.host, port=self.options.port, log_level="warning",
                              ws_max_size=self.options.max_message_bytes, timeout_graceful_shutdown=2)


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    parser.add_argument("--host", default=d.host, help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument("--max-concurrent-answers", type=int, default=None,
                        help="answers generated at once over all tabs; more get a 'busy' message (default: "
                        f"{d.max_concurrent_answers} for the in-process engine on CPU, else 4)")
    parser.add_argument("--max-turn-s", type=float, default=d.max_turn_s, help="a voice turn is cut at this length")
    add_agent_arguments(parser)


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    log.setLevel(logging.INFO)
    limit = args.max_concurrent_answers
    if limit is None:  # one CPU answer already uses every core; a GPU or a vLLM server batches
        limit = ServerOptions.max_concurrent_answers if args.device == "cpu" and not args.llm_url else 4
    options = ServerOptions(args.host, args.port, limit, args.max_turn_s)
    server = AppServer(agent_config_from_args(args), options)
    app = server.build_app()
    log.info("loading models in the background; open http://%s:%d", _url_host(args.host), args.port)
    server.loader.start()
    uvicorn.Server(server.uvicorn_config(app)).run()
    return 0


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
