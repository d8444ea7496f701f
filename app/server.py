"""`specvoice app`: the browser voice agent, with what speculative decoding does to its latency shown live.

Gradio builds the page (app/page.py); the voice itself does not go through Gradio. Its streamed gr.Audio starts
playing 1.2-3 s after the first chunk (HLS), which would hide the very latency this app measures, so microphone and
answer audio travel as raw PCM over one WebSocket per tab (app/protocol.py) and play through AudioWorklets
(app/static/). Live panel updates ride the same socket as JSON. This module serves it all: the routes (behind
app/guard.py's checks), the shared model loading (app/loader.py), and one ClientSession (app/session.py) per socket.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass

from starlette.responses import Response
from starlette.staticfiles import StaticFiles
from starlette.websockets import WebSocket, WebSocketDisconnect

from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.timeline import STAGES
from specdec.fields import option

from . import heap, page, protocol
from .background import LoadControl, simulated_users
from .guard import AllowedList, Guard, header_timeout_protocol, host_name, web_origin
from .host import AnswerSlots
from .loader import ModelLoader
from .outbox import CLOSE_SLOW_READER
from .session import EXPORTS, ClientSession

log = logging.getLogger("specvoice.app")

STATIC_PATH = "/specvoice/static"
EXPORT_PATH = "/specvoice/export"
CLOSE_WAIT_S = 2.0  # how long a slow reader's close may wait for it to read
# What the page fetches, found by recording a Chromium session (the Voice tab, then a Case study slider): our own
# routes, and Gradio's page, assets and event queue. Every other Gradio route (uploads, files, the API) is closed.
OPEN_PATHS = (
    "/specvoice/*",
    "/",
    "/config",
    "/theme.css",
    "/favicon.ico",
    "/assets/*",
    "/static/*",
    "/gradio_api/queue/join",
    "/gradio_api/queue/data",
    "/gradio_api/heartbeat/*",
)


MAX_BACKGROUND = 16  # the load control's top: simulated conversations beside the real ones


@dataclass
class ServerOptions:
    """The server's limits; the fields declared with option() are `specvoice app`'s flags (specdec/fields.py)."""

    host: str = option("127.0.0.1", help="interface to listen on (default: loopback only)")
    port: int = option(7860)
    max_concurrent_answers: int = option(  # the in-process engine batches them (specdec/scheduler.py)
        4,
        at_least=1,
        help="answers generated at once over all tabs, batched; more get a 'busy' message (default %(default)s)",
    )
    max_turn_s: float = option(30.0, help="a voice turn is cut at this length")  # caps what the ASR must chew on
    max_text_chars: int = 1000
    max_text_tokens: int = 300  # of the LLM's: what one typed turn may make it read
    max_outbox_bytes: int = 16 * 2**20  # unsent output per tab (~80 s of 96 kHz audio); over it, the tab is closed
    max_message_bytes: int = 256 * 1024  # per WebSocket message; a 32 ms mic frame is 1 KiB
    max_ab_repeats: int = 10
    kept_audio_turns: int = 20  # answers whose audio stays replayable, per tab
    max_background: int = MAX_BACKGROUND
    background_conversations: int = option(  # started once the models are ready
        0, help=f"simulated conversations to start with (the page's load control, 0..{MAX_BACKGROUND})"
    )
    allowed_origins: tuple[str, ...] = option(
        (),
        flag="--allowed-origin",
        parse=web_origin,
        metavar="ORIGIN",
        help="also accept the page from this exact origin, e.g. https://gpu.example.com:8443 behind a reverse proxy "
        "or http://localhost:8080 for docker -p 8080:7860 (repeatable; default: only the app's own host:port)",
    )
    allowed_hosts: tuple[str, ...] = option(
        (),
        flag="--allowed-host",
        parse=host_name,
        metavar="HOST",
        help="also answer requests whose Host header is this name[:port] (any port without one), for a reverse proxy "
        "that rewrites Host, e.g. specvoice:7860 (repeatable; default: loopback names, and IP addresses when "
        "listening on 0.0.0.0, on the app's port, and the host:port of each --allowed-origin)",
    )
    max_sessions: int = option(64, at_least=1, help="open tabs (WebSockets) over all clients")
    max_sessions_per_client: int = option(
        8, at_least=1, help="open tabs (WebSockets) from one client address (behind a proxy, from X-Forwarded-For)"
    )
    header_timeout_s: float = 10.0  # a connection's request line and headers must be in by then

    def allowed(self) -> AllowedList:
        return AllowedList.for_server(self.host, self.port, self.allowed_origins, self.allowed_hosts)


class RevalidatedStaticFiles(StaticFiles):
    """The page's modules import each other by plain URL, so no version can ride on their names: browsers ask
    before reusing one (a 304 while it is unchanged) and never run a stale script against a new server."""

    def file_response(self, *args, **kwargs) -> Response:
        response = super().file_response(*args, **kwargs)
        response.headers["Cache-Control"] = "no-cache"
        return response


# ------------------------------------------------------------------------------------------- the app


class AppServer:
    """Everything shared by the tabs: the loading models, the answer slots, the live sessions, the web app."""

    def __init__(
        self,
        config: AgentConfig,
        options: ServerOptions | None = None,
        build: Callable[[Callable[[int], None]], VoiceAgent] | None = None,
    ) -> None:
        heap.limit_arenas()  # before the loader's and the tabs' threads allocate
        self.options = options or ServerOptions()
        self.slots = AnswerSlots(self.options.max_concurrent_answers)
        self.sessions: dict[str, ClientSession] = {}
        self.background: LoadControl | None = None  # made once the models are up
        self._background_lock = threading.Lock()
        self.loader = ModelLoader(config, self._loading_changed, build)

    # ---- the host of each session (app/host.py)

    def count_tokens(self, text: str) -> int | None:
        agent = self.loader.agent
        if agent is None:
            return None
        if agent.llm.engine is None:  # a remote LLM: its tokenizer is not here
            return -(-len(text) // 4)
        return len(agent.llm.engine.target.tokenizer.encode(text))

    def set_background(self, n: int, owner: str) -> None:
        """The load control: the tab named owner asks for n simulated conversations until it asks again or closes;
        the server runs the most any open tab asked for, at least --background-conversations. Every tab is told."""
        if self.loader.agent is None:
            raise ValueError("the models are still loading")
        if not 0 <= n <= self.options.max_background:
            raise ValueError(f"background conversations must be 0..{self.options.max_background}, got {n}")
        self._load_control().set(n, owner)
        self._loading_changed(self.loader.status())

    def release_background(self, owner: str) -> None:
        """The tab named owner closed: the load it asked for ends with it."""
        if self.background is not None and self.background.release(owner):
            self._loading_changed(self.loader.status())

    def _load_control(self) -> LoadControl:
        """The background load, made on first use once the models are up (ValueError without a batching engine)."""
        agent = self.loader.agent
        assert agent is not None  # callers check: only a loaded agent has an LLM to load
        with self._background_lock:
            if self.background is None:
                self.background = LoadControl(simulated_users(agent.llm), self.options.background_conversations)
            return self.background

    def status(self) -> dict:
        """The loader's status, and once the models are up, how many background conversations run."""
        return self._with_background(self.loader.status())

    def _with_background(self, status: dict) -> dict:
        if status.get("ready"):
            status["background"] = self.background.count if self.background is not None else 0
        return status

    def _loading_changed(self, status: dict) -> None:
        if status.get("ready") and self.background is None and self.options.background_conversations:
            try:
                self._load_control()  # the server's floor starts with the models
            except ValueError as e:
                log.warning("--background-conversations ignored: %s", e)
        self._with_background(status)
        for session in list(self.sessions.values()):
            session.send(status)
            if not self.loader.loading:
                session.loading_finished()

    async def websocket(self, ws: WebSocket) -> None:
        await ws.accept()  # Origin, Host and the session caps are checked before: app/guard.py
        session = ClientSession(self, asyncio.get_running_loop())
        token = session.token
        self.sessions[token] = session
        if not self.loader.loading:  # else _loading_changed will, for this session is listed already
            session.loading_finished()
        session.send(
            {
                "type": "hello",
                "token": token,
                "export": f"{EXPORT_PATH}/{token}",
                "stages": list(STAGES),
                "max_concurrent_answers": self.slots.limit,
                "max_background": self.options.max_background,
            }
        )
        session.send(self.status())
        try:
            refusal = await session.run(ws)
        finally:
            session.close()
            self.sessions.pop(token, None)
        del session  # nothing else holds it: freed now, not after the close below
        asyncio.get_running_loop().run_in_executor(None, heap.return_free_memory)
        if refusal is not None:  # the tab stopped reading: say why, but do not wait long on a peer that reads nothing
            with contextlib.suppress(asyncio.TimeoutError, WebSocketDisconnect, RuntimeError):
                await asyncio.wait_for(ws.close(CLOSE_SLOW_READER, refusal), CLOSE_WAIT_S)

    def build_app(self):
        from fastapi import FastAPI, HTTPException

        gr = page.import_gradio()

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
            return {**self.status(), "sessions": len(self.sessions)}

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
        opts = self.options
        api.add_middleware(
            Guard,
            allowed=opts.allowed(),
            open_paths=OPEN_PATHS,
            max_sessions=opts.max_sessions,
            max_sessions_per_client=opts.max_sessions_per_client,
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
            http=header_timeout_protocol(self.options.header_timeout_s),
        )


# ------------------------------------------------------------------------------------------- serving


def serve(config: AgentConfig, options: ServerOptions) -> int:
    """`specvoice app`: load the models in the background and serve the page until stopped; the exit code."""
    import uvicorn

    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    log.setLevel(logging.INFO)
    server = AppServer(config, options)
    server.loader.prepack()
    app = server.build_app()
    log.info("%s", options.allowed().describe())
    log.info("loading models in the background; open http://%s:%d", _url_host(options.host), options.port)
    server.loader.start()
    serving = uvicorn.Server(server.uvicorn_config(app))
    serving.run()
    # uvicorn catches Ctrl-C itself and re-raises it only at times (a CI run under load exited 0): answer with the
    # CLI's interrupt code whenever a signal stopped it.
    return 130 if serving.should_exit else 0


def _url_host(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "") else f"[{host}]" if ":" in host else host
