"""One browser tab's session: what it says, checked and dispatched; its microphone; its export.

AppServer (the host, app/host.py) makes one per WebSocket and runs it until the socket closes. Its answers run in
app/turns.py (a worker thread per tab, at most AnswerSlots.limit answers at once over all tabs); everything it
sends goes through its outbox (app/outbox.py), bounded in bytes.
"""

from __future__ import annotations

import asyncio
import contextlib
import secrets
import time

from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.audio import SAMPLE_RATE
from pipeline.mic import MicInput
from pipeline.timeline import Timeline

from . import report
from .answer_audio import REPLAY
from .host import SessionHost
from .messages import MessageLimits, parse_message
from .outbox import Outbox
from .protocol import ClockSync, decode_mic_frame
from .turns import TurnRunner
from .wire import notice_message

EXPORTS = {  # file name → (media type, builder(turns, meta))
    "report.html": ("text/html; charset=utf-8", report.render_html),
    "turns.csv": ("text/csv; charset=utf-8", lambda turns, meta: report.turns_csv(turns)),
    "turns.json": ("application/json", report.turns_json),
}


class ClientSession:
    """One browser tab: its own conversation, settings, turns and clock, for as long as its WebSocket lives.

    Nothing it owns refers back to it (the mic and the worker call the runner and the outbox), so it is freed by
    reference counting as soon as the server lets go of it."""

    def __init__(self, host: SessionHost, loop: asyncio.AbstractEventLoop) -> None:
        self.host = host
        self.loop = loop
        self.token = secrets.token_urlsafe(16)  # names this tab's exports; unguessable by other tabs
        self.outbox = Outbox(loop, host.options.max_outbox_bytes)
        self.closed = False
        self.clock = ClockSync()
        self.runner = TurnRunner(host, self.outbox, self.clock)
        o = host.options
        self.limits = MessageLimits(o.max_text_chars, o.max_ab_repeats, o.max_background)
        self._replaying: asyncio.Future | None = None  # resampling a kept answer for "play"
        r, outbox = self.runner, self.outbox  # not self: the mic must not keep the session alive
        self.mic: MicInput = MicInput(
            lambda notice: outbox.put(notice_message(notice)),
            r.interrupt,
            r.voice_turn,
            o.max_turn_s,
            r.early_turn,
            r.conversation,
            capacity=host.slots,
        )

    @property
    def turns(self) -> list[dict]:
        """The records of this tab's answered turns, oldest first."""
        return self.runner.records.records

    def send(self, message: dict | bytes) -> None:
        """Queue a message for the tab (any thread)."""
        self.outbox.put(message)

    async def run(self, ws: WebSocket) -> str | None:
        """Serve the tab until it disconnects (None) or falls too far behind reading (why it must be closed)."""
        coroutines = (self._receive(ws), self.outbox.pump(ws), self.outbox.ended.wait(), self.outbox.pinger())
        tasks = [asyncio.create_task(c) for c in coroutines]
        try:  # until the tab disconnects, a send fails, or the outbox ends (a pump held up by a slow reader too)
            await asyncio.wait(tasks[:3], return_when=asyncio.FIRST_COMPLETED)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
        return self.outbox.overflow

    async def _receive(self, ws: WebSocket) -> None:
        with contextlib.suppress(WebSocketDisconnect, RuntimeError):  # the tab closed mid-message: nothing to say
            while (msg := await ws.receive())["type"] != "websocket.disconnect":
                now = time.perf_counter()
                if msg.get("bytes") is not None:
                    self.on_audio(msg["bytes"], now)
                elif msg.get("text") is not None:
                    self.on_message(msg["text"], now)

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
        """One JSON message, parsed and checked (app/messages.py), to its handler, which may trust its fields."""
        handlers = {
            "hello": self._hello,
            "pong": self._pong,
            "settings": self._settings,
            "text": self._text,
            "mic": self._mic,
            "ab": self._ab,
            "heard": self._heard,
            "play": self._play,
            "stop": self._stop,
        }
        try:
            m = parse_message(text, self.limits)
            handlers[m["type"]](m, received)
        except ValueError as e:  # BadMessage, or what only the session can tell (the text's tokens, the load)
            self.send({"type": "error", "message": f"bad message: {e}"})

    def _hello(self, m: dict, received: float) -> None:
        self.runner.audio.browser_rate = m["sample_rate"]

    def _pong(self, m: dict, received: float) -> None:
        self.clock.add(m["ts"], m["tc"], received * 1000)

    def _settings(self, m: dict, received: float) -> None:
        changes = {k: v for k, v in m.items() if k in self.runner.settings}  # only what the message sets
        self.runner.settings = {**self.runner.settings, **changes}
        if "background" in m:  # the server's load, shared by every tab while this one is open
            self.host.set_background(m["background"], self.token)

    def _user_text(self, text: str) -> str:
        """The user's text, stripped and within max_text_chars already; ValueError over the LLM's tokens."""
        self.runner.check_text(text)
        return text

    def _text(self, m: dict, received: float) -> None:
        if text := self._user_text(m["text"]):
            self.runner.start_turn(text, Timeline(), "typed")

    def _mic(self, m: dict, received: float) -> None:
        if m["active"] and self.host.loader.loading:
            self.send(
                {
                    "type": "info",
                    "message": "The models are still loading: what you say now is kept and "
                    "answered when they are ready.",
                }
            )
        self.mic.switch(m["active"], m["mode"])

    def _ab(self, m: dict, received: float) -> None:
        typed = self._user_text(m["text"])
        text = typed or self.runner.last_utterance
        if not text:
            self.send({"type": "error", "message": "A/B needs an utterance: say or type something first."})
            return
        audio = None if typed else self.runner.last_utterance_audio
        self.runner.start_ab(text, audio, m["repeats"])

    def _heard(self, m: dict, received: float) -> None:
        server_ms = self.clock.to_server_ms(m["t"])
        if server_ms is None:
            return
        received_ms = None if m["received_t"] is None else self.clock.to_server_ms(m["received_t"])
        detail = {k: m[k] for k in ("method", "output_latency_ms", "base_latency_ms", "output_timestamp")}
        self.runner.heard(m["turn"], server_ms, received_ms, detail)

    def _play(self, m: dict, received: float) -> None:
        turn = m["turn"]
        if (self._replaying is not None and not self._replaying.done()) or self.outbox.queued(REPLAY):
            self.send({"type": "error", "message": "A replay is still being sent; play again once it has arrived."})
            return
        kept = self.runner.audio.kept(turn)
        if kept is None:
            self.send({"type": "error", "message": f"the audio of turn {turn} is no longer kept"})
            return
        self.runner.interrupt("replay")
        self._replaying = self.loop.run_in_executor(None, self.runner.audio.replay, turn, *kept)

    def _stop(self, m: dict, received: float) -> None:
        self.runner.interrupt("stop")

    # ---- the models, the export, the end

    def loading_finished(self) -> None:
        """The models are ready or failed to load: hear what was said and answer what was typed meanwhile (or say
        why not). Called once loading is over, maybe twice (AppServer's broadcast and a tab that just connected)."""
        models = self.host.loader
        self.mic.release(models.agent, "" if models.ready else models.failed_message())
        self.runner.loading_finished()

    def export(self, name: str) -> tuple[str, str]:
        media, build = EXPORTS[name]
        turns = list(self.runner.records.records)
        meta = {**self.host.loader.describe(), "clock_rtt_ms": self.clock.rtt_ms}
        return media, build(turns, meta)

    def close(self) -> None:
        """The tab went away: stop its answer, its replay and its mic thread, drop what waits to be sent, let go of
        its conversation, and end the load it set."""
        self.closed = True
        self.runner.close()
        self.mic.close()
        self.outbox.close()
        self.host.release_background(self.token)
