"""Who may reach the app, and how much of it: one allowed list of Host names and page Origins, checked by one ASGI
middleware on every request and WebSocket handshake, beside the routes the page uses, the session caps, and a
timeout for request headers.

DNS rebinding: a hostile page on evil.example can re-point its name at this server, and the browser then sends
Host: evil.example with it, reading our GET routes and opening our socket as if it were our own page. So every
request's Host must be a name this server answers to (loopback names, IP addresses, or names the user gave), and
every request that changes something (any method but GET and HEAD, and the WebSocket handshake) must come from a
page this server served (its Origin the Host it was sent to, or an origin the user gave for a proxy).
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
from collections import Counter
from dataclasses import dataclass
from urllib.parse import urlsplit

from starlette.datastructures import Headers
from starlette.responses import PlainTextResponse
from starlette.types import ASGIApp, Receive, Scope, Send
from starlette.websockets import WebSocket

log = logging.getLogger("specvoice.app")

DEFAULT_PORTS = {"http": 80, "https": 443, "ws": 80, "wss": 443}
LOOPBACK_NAMES = frozenset({"127.0.0.1", "localhost", "::1"})
WILDCARD_BINDS = frozenset({"0.0.0.0", "::", ""})
SAFE_METHODS = frozenset({"GET", "HEAD"})
TRY_AGAIN_LATER = 1013  # the WebSocket close code for a server over its capacity


def origin_key(origin: str) -> tuple[str, str, int] | None:
    """(scheme, host, port) of one http(s) origin, scheme://host[:port]; None for anything else: "null", a path,
    credentials or a wildcard (an origin names exactly one site, so no pattern can widen the check)."""
    try:
        o = urlsplit(origin)
        port = o.port if o.port is not None else DEFAULT_PORTS.get(o.scheme)
    except ValueError:  # a malformed port
        return None
    if o.scheme not in ("http", "https") or not o.hostname or port is None or "*" in o.netloc:
        return None
    if o.username is not None or o.path or o.query or o.fragment:
        return None
    return o.scheme, o.hostname, port


def host_key(host: str, default_port: int | None) -> tuple[str, int | None] | None:
    """(name, port) of a Host header or an --allowed-host value, host[:port]; None when it is anything else."""
    try:
        h = urlsplit(f"//{host}")
        port = h.port
    except ValueError:  # a malformed port or bracket
        return None
    if not h.hostname or "*" in h.netloc or h.username is not None or h.path or h.query or h.fragment:
        return None
    return h.hostname, port if port is not None else default_port


def web_origin(value: str) -> str:
    """--allowed-origin read: one exact origin (ValueError saying why not)."""
    if origin_key(value) is None:
        raise ValueError(
            f"{value!r} is not an origin: give scheme://host[:port] as the browser's address bar shows it, "
            "e.g. https://gpu.example.com:8443 (no path, no wildcard)"
        )
    return value


def host_name(value: str) -> str:
    """--allowed-host read: one name, with or without a port (ValueError saying why not)."""
    if host_key(value, None) is None:
        raise ValueError(
            f"{value!r} is not a host: give a name or name:port as a proxy sends it in the Host header, "
            "e.g. specvoice or specvoice:7860 (no scheme, no path, no wildcard)"
        )
    return value


def _is_ip(name: str) -> bool:
    try:
        ipaddress.ip_address(name)
    except ValueError:
        return False
    return True


def _url_name(name: str) -> str:
    return f"[{name}]" if ":" in name else name


@dataclass(frozen=True)
class AllowedList:
    """The Host names this server answers to and the page origins beside its own that may change something."""

    port: int
    hosts: frozenset[tuple[str, int | None]]  # (name, port); port None: any port
    origins: frozenset[tuple[str, str, int]]
    any_ip: bool  # listening everywhere: an IP address on our port names this server (no DNS, so no rebinding)

    @classmethod
    def for_server(
        cls, bind_host: str, port: int, allowed_origins: tuple[str, ...] = (), allowed_hosts: tuple[str, ...] = ()
    ) -> AllowedList:
        """Loopback names on our port when bound to loopback, the bound name on a named interface, and loopback
        names and IP addresses on our port when bound everywhere; plus the host:port of each allowed origin (a proxy
        that keeps Host, or a remapped port) and each allowed host (a proxy that rewrites Host)."""
        bind = bind_host.strip("[]").lower()
        wildcard = bind in WILDCARD_BINDS
        loopback = wildcard or bind in LOOPBACK_NAMES or (_is_ip(bind) and ipaddress.ip_address(bind).is_loopback)
        names = (LOOPBACK_NAMES if loopback else set()) | (set() if wildcard else {bind})
        origins = frozenset(origin_key(o) for o in allowed_origins)
        hosts = {(name, port) for name in names} | {(host, port) for _, host, port in origins}
        hosts |= {host_key(h.lower(), None) for h in allowed_hosts}
        return cls(port, frozenset(hosts), origins, wildcard)

    def host_ok(self, host: str | None, scheme: str = "http") -> bool:
        key = host_key(host, DEFAULT_PORTS.get(scheme)) if host else None
        if key is None:
            return False
        name, port = key
        return key in self.hosts or (name, None) in self.hosts or (self.any_ip and port == self.port and _is_ip(name))

    def origin_ok(self, origin: str | None, host: str | None, scheme: str = "http") -> bool:
        """A page this server served: its origin the very host:port the browser sent the request to (a name this
        server answers to), or one the user allowed (a proxy's, whose page lives at another host:port)."""
        o = origin_key(origin) if origin else None
        if o is None or not self.host_ok(host, scheme):
            return False
        return o in self.origins or o[1:] == host_key(host, DEFAULT_PORTS.get(scheme))

    def describe(self) -> str:
        """What is allowed, for the startup log."""
        named = sorted(f"{_url_name(n)}:{p}" if p else f"{_url_name(n)} (any port)" for n, p in self.hosts)
        text = f"requests are answered for the hosts {', '.join(named)}"
        if self.any_ip:
            text += f" and any IP address of this machine on port {self.port}"
        if self.origins:
            text += f"; pages are also accepted from {', '.join(sorted(f'{s}://{h}:{p}' for s, h, p in self.origins))}"
        if self.any_ip or not self.origins:
            text += (
                ". A host name, a reverse proxy or a remapped port (docker run -p 8080:7860) must be named: "
                "--allowed-origin with the page's origin as the browser shows it (e.g. http://localhost:8080), "
                "and --allowed-host for a proxy that rewrites Host"
            )
        return text


def _client(scope: Scope) -> str:
    """The client's address (behind a proxy, uvicorn's ProxyHeadersMiddleware has put X-Forwarded-For's here)."""
    return scope["client"][0] if scope.get("client") else ""


def path_open(path: str, open_paths: tuple[str, ...]) -> bool:
    """Whether path is one of open_paths: an entry ending in * opens every path it starts, any other just itself."""
    return any(path.startswith(p[:-1]) if p.endswith("*") else path == p for p in open_paths)


class Guard:
    """ASGI middleware: refuses, before the app sees them, requests under a foreign Host (403 with the reason),
    requests for paths the page does not use (404), changes from foreign pages (403), and WebSocket sessions over the
    caps (accepted, then closed with 1013 and the reason, which a browser's close event carries and a refused
    handshake cannot)."""

    def __init__(
        self,
        app: ASGIApp,
        allowed: AllowedList,
        open_paths: tuple[str, ...],
        max_sessions: int,
        max_sessions_per_client: int,
    ) -> None:
        self.app = app
        self.allowed = allowed
        self.open_paths = open_paths
        self.max_sessions = max_sessions
        self.max_sessions_per_client = max_sessions_per_client
        self.sessions: Counter[str] = Counter()  # live sockets by client address

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] not in ("http", "websocket"):
            await self.app(scope, receive, send)
            return
        refusal = self.refusal(scope)
        if refusal is not None:
            status, text = refusal
            if scope["type"] == "http":
                await PlainTextResponse(text, status)(scope, receive, send)
            else:  # a close before accept: HTTP 403 (uvicorn logs a denial response with a body as an error)
                log.info("WebSocket handshake from %s refused: %s", _client(scope), text)
                await send({"type": "websocket.close", "code": 1008})
            return
        if scope["type"] == "websocket":
            await self.session(scope, receive, send)
        else:
            await self.app(scope, receive, send)

    def refusal(self, scope: Scope) -> tuple[int, str] | None:
        """(status, reason) when the request is refused; None when it may go on."""
        headers = Headers(scope=scope)
        host, scheme = headers.get("host"), scope.get("scheme", "http")
        if not self.allowed.host_ok(host, scheme):
            return 403, f"this server does not answer to the host {host!r} (see --allowed-host, --allowed-origin)"
        if not path_open(scope["path"], self.open_paths):
            return 404, "not found"
        if scope["type"] == "websocket" or scope["method"] not in SAFE_METHODS:
            if not self.allowed.origin_ok(headers.get("origin"), host, scheme):
                return 403, "only pages this server served may do this (see --allowed-origin)"
        return None

    async def session(self, scope: Scope, receive: Receive, send: Send) -> None:
        client = _client(scope)
        reason = None
        if self.sessions.total() >= self.max_sessions:
            reason = f"the server has {self.max_sessions} sessions open, its most: try again later"
        elif self.sessions[client] >= self.max_sessions_per_client:
            reason = f"{self.max_sessions_per_client} tabs are open from your address, the most: close one"
        if reason is not None:
            log.info("WebSocket refused for %s: %s", client, reason)
            ws = WebSocket(scope, receive, send)
            await ws.accept()
            await ws.close(TRY_AGAIN_LATER, reason)
            return
        self.sessions[client] += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.sessions[client] -= 1
            if not self.sessions[client]:
                del self.sessions[client]


def header_timeout_protocol(timeout_s: float) -> type[asyncio.Protocol]:
    """uvicorn's h11 protocol, closing a connection whose request line and headers are not complete timeout_s after
    it opened (or after its last response). uvicorn has no such timeout: its keep-alive timer starts only after a
    response and any byte received cancels it, so a client dribbling a header (slowloris) holds a connection for
    ever. Given to uvicorn.Config(http=...); it replaces httptools where that is installed, which this app's few
    requests do not miss."""
    from uvicorn.protocols.http.h11_impl import H11Protocol

    class HeaderTimeoutProtocol(H11Protocol):
        _header_timer: asyncio.TimerHandle | None = None

        def _arm_header_timer(self) -> None:
            self._cancel_header_timer()
            self._header_timer = self.loop.call_later(timeout_s, self._header_timed_out)

        def _cancel_header_timer(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _header_timed_out(self) -> None:
            self._header_timer = None
            if not self.transport.is_closing():
                self.transport.close()

        def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
            super().connection_made(transport)
            self._arm_header_timer()

        def handle_events(self) -> None:
            scope = self.scope
            super().handle_events()
            if self.scope is not scope:  # a new request's line and headers are in (an upgrade's too)
                self._cancel_header_timer()

        def on_response_complete(self) -> None:
            self._arm_header_timer()  # before: a pipelined request handled inside cancels it again
            super().on_response_complete()

        def connection_lost(self, exc: Exception | None) -> None:
            self._cancel_header_timer()
            super().connection_lost(exc)

    return HeaderTimeoutProtocol
