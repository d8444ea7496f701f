"""`specvoice app`: the browser voice agent, with what speculative decoding does to its latency shown live.

Gradio builds the page (app/page.py); the voice itself does not go through Gradio. Its streamed gr.Audio starts
playing 1.2-3 s after the first chunk (HLS), which would hide the very latency this app measures, so microphone and
answer audio travel as raw PCM over one WebSocket per tab (app/protocol.py) and play through AudioWorklets
(app/static/). Live panel updates ride the same socket as JSON. This module serves it all: the routes, the shared
model loading, and one ClientSession (app/session.py) per open socket.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.agent import AgentConfig, VoiceAgent, make_transcriber
from pipeline.options import add_agent_arguments, agent_config_from_args
from pipeline.timeline import STAGES
from pipeline.tts import make_tts

from . import page, protocol
from .session import EXPORTS, AnswerSlots, ClientSession

log = logging.getLogger("specvoice.app")

STATIC_PATH = "/specvoice/static"
EXPORT_PATH = "/specvoice/export"
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})


@dataclass
class ServerOptions:
    host: str = "127.0.0.1"
    port: int = 7860
    max_concurrent_answers: int = 4  # the in-process engine batches them (specdec/scheduler.py)
    max_turn_s: float = 30.0  # a voice turn is cut here: caps what one user can make the ASR chew on
    max_text_chars: int = 1000
    max_message_bytes: int = 256 * 1024  # per WebSocket message; a 32 ms mic frame is 1 KiB
    max_ab_repeats: int = 10
    kept_audio_turns: int = 20  # answers whose audio stays replayable, per tab
    max_background: int = 16  # the load control's top: simulated conversations beside the real ones
    background_conversations: int = 0  # started once the models are ready
    allowed_origins: tuple[str, ...] = ()  # pages served elsewhere (a proxy) that may open the socket too


class RevalidatedStaticFiles(StaticFiles):
    """The page's modules import each other by plain URL, so no version can ride on their names: browsers ask
    before reusing one (a 304 while it is unchanged) and never run a stale script against a new server."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


DEFAULT_PORTS = {"http": 80, "https": 443}


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of one http(s) origin, scheme://host[:port]; None for anything else: "null", a path,
    credentials or a wildcard (an origin names exactly one site, so no pattern can widen the check)."""
    try:
        o = urlsplit(origin)
        port = o.port if o.port is not None else DEFAULT_PORTS.get(o.scheme)
    except ValueError:  # a malformed port
        return None
    if o.scheme not in DEFAULT_PORTS or not o.hostname or port is None or "*" in o.netloc:
        return None
    if o.username is not None or o.path or o.query or o.fragment:
        return None
    return o.scheme, o.hostname, port


def web_origin(value: str) -> str:
    """argparse type of --allowed-origin: one exact origin."""
    if origin_key(value) is None:
        raise argparse.ArgumentTypeError(
            f"{value!r} is not an origin: give scheme://host[:port] as the browser's address bar shows it, "
            "e.g. https://gpu.example.com:8443 (no path, no wildcard)"
        )
    return value


def origin_allowed(
    origin: str | None, host_header: str | None, bind_host: str, port: int, allowed: Iterable[str] = ()
) -> bool:
    """Guard against cross-site WebSocket hijacking: only pages this app served may open its socket.

    The Origin must name the same host:port the browser connected to (the Host header), on our port; and when we
    listen on loopback, that host must be a loopback name, so a DNS-rebinding name pointing at 127.0.0.1 fails too.
    Or it is one of `allowed` (--allowed-origin): behind a reverse proxy or a remapped port (docker -p 8080:7860)
    the page comes from another host:port than ours, and the proxy may rewrite Host, so only the user can name it.
    """
    o = origin_key(origin) if origin else None
    if o is None:
        return False
    if o in {origin_key(a) for a in allowed}:
        return True
    if not host_header:
        return False
    h = urlsplit(f"//{host_header}")
    try:
        h_port = h.port
    except ValueError:  # a malformed port
        return False
    _, o_host, o_port = o
    if (o_host, o_port) != (h.hostname, h_port) or h_port != port:
        return False
    if bind_host in ("0.0.0.0", "::", ""):
        return True  # listening everywhere: any name may reach us, but the page must come from that name
    allowed_hosts = {bind_host.strip("[]").lower()} | (LOOPBACK_NAMES if bind_host in LOOPBACK_NAMES else set())
    return o_host in allowed_hosts


# ------------------------------------------------------------------------------------------- models


class ModelLoader:
    """Loads the agent on a background thread so the page is up (and says how far loading got) at once, then warms
    every stage: the app is ready only when its first turn is as fast as later ones."""

    LOAD_STEPS = ("speech recognition", "text to speech", "language models")
    STEPS = LOAD_STEPS + tuple(f"warm-up: {step}" for step in VoiceAgent.WARMUP_STEPS)

    def __init__(
        self,
        config: AgentConfig,
        on_change: Callable[[dict], None] = lambda status: None,
        build: Callable[[Callable[[int], None]], VoiceAgent] | None = None,
    ) -> None:
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
        transcriber = make_transcriber(self.config)
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
        status = {
            "type": "status",
            "ready": self.ready,
            "error": self.error,
            "stage": self.stage(),
            "step": self.step,
            "steps": len(self.STEPS),
            "step_s": list(self.step_s),
            "elapsed_s": time.perf_counter() - self.t0,
            "load_s": self.load_s,
        }
        if self.agent is not None:
            background = self.agent.background
            status.update(
                batched=self.agent.scheduler is not None,
                background=background.count if background else 0,
                drafters=self.agent.engine.switchable_drafters() if self.agent.engine else [],
                k=self.config.engine.k,
                temperature=self.config.temperature,
                engine=self.describe(),
                forward_costs=self.forward_costs(),
            )
        return status

    def forward_costs(self) -> dict | None:
        """The forward-cost grid measured at warm-up, for the page's verify-cost curve and predicted speedup: the
        batch-1 forward in ms by tokens fed (n = 1 + K for every K an answer may draft, interpolated between the
        measured sizes as the load-aware K reads them), and the whole grid. None without one (a remote LLM, or the
        load-aware K off)."""
        scheduler = self.agent.scheduler if self.agent else None
        if scheduler is None or scheduler.costs is None:
            return None
        e = self.config.engine
        k_most = max(*page.K_CHOICES, e.k_max, int(e.k) if e.k.isdigit() else 0)
        return {
            "batch1_ms": [1000 * scheduler.costs(1, n) for n in range(1, k_most + 2)],
            "grid": scheduler.costs.as_dict(),
        }

    def describe(self) -> dict:
        """The configuration in words, for the page. Its defaults are the measured fastest (docs/results.md)."""
        c, e = self.config, self.config.engine
        target = f"{e.target} {e.dtype if e.target_quant == 'none' else e.target_quant}"
        draft = e.draft if e.draft in ("none", "ngram") else f"{e.draft} {e.draft_quant}"
        window = f"{c.asr_window_s:g} s window" if c.asr_window_s else "30 s window"
        return {
            "llm": c.llm_url or f"{target} + {draft} ({e.device})",
            "asr": f"{c.asr_model}, beam {c.asr_beam_size}, {window}",
            "tts": c.tts,
            "k": e.k,
            "end_of_turn": c.turn_end.describe(),
            "preemptive": c.preemptive,
            "prefill_while_speaking": c.prefill_while_speaking,
            "first_chunk_words": c.first_chunk_words,
        }


# ------------------------------------------------------------------------------------------- the app


class AppServer:
    """Everything shared by the tabs: the loading models, the answer slots, the live sessions, the web app."""

    def __init__(
        self,
        config: AgentConfig,
        options: ServerOptions | None = None,
        build: Callable[[Callable[[int], None]], VoiceAgent] | None = None,
    ) -> None:
        self.options = options or ServerOptions()
        self.slots = AnswerSlots(self.options.max_concurrent_answers)
        self.sessions: dict[str, ClientSession] = {}
        self._start_background = self.options.background_conversations > 0
        self.loader = ModelLoader(config, self._loading_changed, build)

    def set_background(self, n: int) -> None:
        """The load control: n simulated conversations, told to every tab."""
        agent = self.loader.agent
        if agent is None:
            raise ValueError("the models are still loading")
        if not 0 <= n <= self.options.max_background:
            raise ValueError(f"background conversations must be 0..{self.options.max_background}, got {n}")
        agent.set_background(n)
        self._loading_changed(self.loader.status())

    def _loading_changed(self, status: dict) -> None:
        if status.get("ready") and self._start_background:
            self._start_background = False
            self.set_background(self.options.background_conversations)  # tells the tabs itself
            return
        for session in list(self.sessions.values()):
            session.send(status)
            if not self.loader.loading:
                session.loading_finished()

    async def websocket(self, ws: WebSocket) -> None:
        opts = self.options
        if not origin_allowed(
            ws.headers.get("origin"), ws.headers.get("host"), opts.host, opts.port, opts.allowed_origins
        ):
            await ws.close(code=1008)  # before accept(): the handshake is refused with HTTP 403
            return
        await ws.accept()
        session = ClientSession(self, asyncio.get_running_loop())
        self.sessions[session.token] = session
        if not self.loader.loading:  # else _loading_changed will, for this session is listed already
            session.loading_finished()
        tasks = [asyncio.create_task(session.pump(ws)), asyncio.create_task(session.pinger())]
        session.send(
            {
                "type": "hello",
                "token": session.token,
                "export": f"{EXPORT_PATH}/{session.token}",
                "stages": list(STAGES),
                "max_concurrent_answers": self.slots.limit,
                "max_background": self.options.max_background,
            }
        )
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
        from fastapi import FastAPI, HTTPException

        api = FastAPI(openapi_url=None, docs_url=None, redoc_url=None)

        @api.get(f"{EXPORT_PATH}/{{token}}/{{name}}")
        def export(token: str, name: str) -> Response:
            session = self.sessions.get(token)
            if session is None or name not in EXPORTS:
                raise HTTPException(404, "no such export (the tab's connection may have closed)")
            media, body = session.export(name)
            return Response(
                body, media_type=media, headers={"Content-Disposition": f'attachment; filename="specvoice-{name}"'}
            )

        @api.get("/specvoice/status")
        def status() -> dict:
            return {**self.loader.status(), "sessions": len(self.sessions)}

        protocol_js = protocol.page_module()

        # Beside the static scripts, which import it as ./protocol.js; routed before the mount, so it wins.
        @api.get(f"{STATIC_PATH}/protocol.js")
        def protocol_module() -> Response:
            return Response(protocol_js, media_type="text/javascript", headers={"Cache-Control": "no-cache"})

        api.add_api_websocket_route(protocol.WS_PATH, self.websocket)
        api.mount(STATIC_PATH, RevalidatedStaticFiles(directory=page.STATIC_DIR), name="specvoice-static")
        blocks = page.build_blocks(
            self.options.max_text_chars, self.options.max_ab_repeats, self.options.max_background
        )
        # Mounted last: our routes above take precedence over Gradio's catch-all at "/".
        gr.mount_gradio_app(
            api,
            blocks,
            path="/",
            server_name=self.options.host,
            server_port=self.options.port,
            head=page.head_html(STATIC_PATH),
            footer_links=[],
            run_history=False,
            max_file_size=self.options.max_message_bytes,
            show_error=True,
        )
        return api

    def uvicorn_config(self, app):
        import uvicorn

        return uvicorn.Config(
            app,
            host=self.options.host,
            port=self.options.port,
            log_level="warning",
            ws_max_size=self.options.max_message_bytes,
            timeout_graceful_shutdown=2,
        )


# ------------------------------------------------------------------------------------------- CLI


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = ServerOptions()
    parser.add_argument("--host", default=d.host, help="interface to listen on (default: loopback only)")
    parser.add_argument("--port", type=int, default=d.port)
    parser.add_argument(
        "--allowed-origin",
        dest="allowed_origins",
        action="append",
        type=web_origin,
        default=[],
        metavar="ORIGIN",
        help="also accept the page from this exact origin, e.g. https://gpu.example.com:8443 behind a reverse proxy "
        "or http://localhost:8080 for docker -p 8080:7860 (repeatable; default: only the app's own host:port)",
    )
    parser.add_argument(
        "--max-concurrent-answers",
        type=int,
        default=None,
        help="answers generated at once over all tabs, batched; more get a 'busy' message "
        f"(default {d.max_concurrent_answers})",
    )
    parser.add_argument(
        "--background-conversations",
        type=int,
        default=0,
        help=f"simulated conversations to start with (the page's load control, 0..{d.max_background})",
    )
    parser.add_argument("--max-turn-s", type=float, default=d.max_turn_s, help="a voice turn is cut at this length")
    add_agent_arguments(parser)


def server_setup(args: argparse.Namespace) -> tuple[AgentConfig, ServerOptions]:
    """`specvoice app`'s configuration from its options."""
    config = agent_config_from_args(args)
    limit = args.max_concurrent_answers or ServerOptions.max_concurrent_answers
    options = ServerOptions(args.host, args.port, limit, args.max_turn_s)
    options.background_conversations = args.background_conversations
    options.allowed_origins = tuple(args.allowed_origins)
    return config, options


def main(args: argparse.Namespace) -> int:
    import uvicorn

    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    log.setLevel(logging.INFO)
    server = AppServer(*server_setup(args))
    app = server.build_app()
    log.info("loading models in the background; open http://%s:%d", _url_host(args.host), args.port)
    server.loader.start()
    serving = uvicorn.Server(server.uvicorn_config(app))
    serving.run()
    # uvicorn catches Ctrl-C itself and re-raises it only at times (a CI run under load exited 0): answer with the
    # CLI's interrupt code whenever a signal stopped it.
    return 130 if serving.should_exit else 0


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
