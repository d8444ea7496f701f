"""app/guard.py: the allowed list of Hosts and Origins, the open paths, the session caps and the header timeout;
on a bare Starlette app behind real uvicorn, then wired into the app itself (its models never load here)."""

from __future__ import annotations

import argparse
import contextlib
import http.client
import socket
import threading
import time
from collections.abc import Iterator

import pytest
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route, WebSocketRoute
from starlette.websockets import WebSocket, WebSocketDisconnect
from websockets.exceptions import ConnectionClosedError, InvalidStatus
from websockets.sync.client import ClientConnection, connect

from app.guard import AllowedList, Guard, header_timeout_protocol
from app.protocol import WS_PATH
from commands import app as app_command
from tests.support.browser import free_port, gated_build, recv_until, running_app

DOCKER = "http://localhost:8080"  # the page's origin under docker run -p 8080:7860


# ---------------------------------------------------------------------------------------------- the list


@pytest.mark.parametrize(
    "bind, host, ok",
    [
        ("127.0.0.1", "127.0.0.1:7860", True),
        ("127.0.0.1", "localhost:7860", True),
        ("127.0.0.1", "[::1]:7860", True),
        ("127.0.0.1", "LocalHost:7860", True),
        ("127.0.0.1", "evil.example:7860", False),  # DNS rebinding to loopback
        ("127.0.0.1", "localhost:8000", False),  # another port: not us
        ("127.0.0.1", "10.0.0.5:7860", False),  # not reachable on loopback: not a name of ours
        ("127.0.0.1", "localhost", False),  # port 80
        ("0.0.0.0", "10.0.0.5:7860", True),  # an IP address: no DNS, no rebinding
        ("0.0.0.0", "[fe80::1]:7860", True),
        ("0.0.0.0", "localhost:7860", True),
        ("0.0.0.0", "evil.example:7860", False),
        ("0.0.0.0", "10.0.0.5:8080", False),  # a remapped port must be named
        ("0.0.0.0", "x@127.0.0.1:7860", False),
        ("0.0.0.0", "127.0.0.1:7860/x", False),
        ("0.0.0.0", "127.0.0.1:99999", False),
        ("0.0.0.0", "", False),
        ("gpu-box.lan", "gpu-box.lan:7860", True),
        ("gpu-box.lan", "evil.example:7860", False),
    ],
)
def test_hosts_answered(bind, host, ok):
    assert AllowedList.for_server(bind, 7860).host_ok(host) is ok


def test_configured_names_widen_the_list_exactly():
    allowed = AllowedList.for_server("0.0.0.0", 7860, (DOCKER, "https://gpu.example.com"), ("specvoice", "box:81"))
    assert allowed.host_ok("localhost:8080") and allowed.host_ok("gpu.example.com", "https")
    assert allowed.host_ok("specvoice") and allowed.host_ok("specvoice:7860")  # a bare name: any port
    assert allowed.host_ok("box:81") and not allowed.host_ok("box:82")
    assert not allowed.host_ok("gpu.example.com")  # http: port 80, not the origin's 443
    assert allowed.origin_ok("https://gpu.example.com", "specvoice:7860")  # a proxy that rewrites Host
    text = allowed.describe()
    assert "localhost:8080" in text and "any IP address" in text and "--allowed-origin" in text


def test_options_take_hosts_and_caps(capsys):
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    args = parser.parse_args(["--allowed-host", "specvoice:7860", "--max-sessions", "5", "--max-sessions-per-client=2"])
    options = app_command.server_setup(args)[1]
    assert (options.allowed_hosts, options.max_sessions, options.max_sessions_per_client) == (("specvoice:7860",), 5, 2)
    defaults = app_command.server_setup(parser.parse_args([]))[1]
    assert (defaults.allowed_hosts, defaults.max_sessions, defaults.max_sessions_per_client) == ((), 64, 8)
    for bad in (["--allowed-host", "http://specvoice"], ["--allowed-host", "*.example"], ["--max-sessions", "0"]):
        with pytest.raises(SystemExit):
            parser.parse_args(bad)
    assert "is not a host" in capsys.readouterr().err


# ---------------------------------------------------------------------------------------------- a bare app


async def echo(ws: WebSocket) -> None:
    await ws.accept()
    with contextlib.suppress(WebSocketDisconnect):
        async for text in ws.iter_text():
            await ws.send_text(text)


async def answer(request: Request) -> PlainTextResponse:
    return PlainTextResponse(f"{request.method} ok")


BARE_ROUTES = [
    Route("/specvoice/status", answer),
    Route("/specvoice/change", answer, methods=["POST"]),
    Route("/closed", answer, methods=["GET", "POST"]),
    WebSocketRoute(WS_PATH, echo),
]


@contextlib.contextmanager
def serving(app, port: int, header_timeout_s: float = 10.0) -> Iterator[None]:
    config = uvicorn.Config(
        app, host="127.0.0.1", port=port, log_level="warning", http=header_timeout_protocol(header_timeout_s)
    )
    uv = uvicorn.Server(config)
    thread = threading.Thread(target=uv.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not uv.started:
        assert thread.is_alive() and time.monotonic() < deadline, "uvicorn did not start"
        time.sleep(0.02)
    try:
        yield
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


@contextlib.contextmanager
def bare_app(bind: str = "127.0.0.1", origins=(), hosts=(), sessions=64, per_client=8, **kw) -> Iterator[int]:
    """A bare Starlette app behind the Guard on a free loopback port, its list as if bound to bind; yields the port."""
    port = free_port()
    allowed = AllowedList.for_server(bind, port, origins, hosts)
    with serving(
        Guard(Starlette(routes=BARE_ROUTES), allowed, ("/specvoice/*", "/"), sessions, per_client), port, **kw
    ):
        yield port


def request(port: int, method: str, path: str, host: str, origin: str | None = None) -> tuple[int, str]:
    """(status, body) of one request sent to 127.0.0.1:port with the given Host (what a rebound name sends)."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    with contextlib.closing(conn):
        conn.putrequest(method, path, skip_host=True)
        conn.putheader("Host", host)
        if origin:
            conn.putheader("Origin", origin)
        conn.putheader("Content-Length", "0")
        conn.endheaders()
        response = conn.getresponse()
        return response.status, response.read().decode()


def open_socket(port: int, host: str, origin: str, source: str = "127.0.0.1") -> ClientConnection:
    """A WebSocket to 127.0.0.1:port from source, whose handshake says Host: host and Origin: origin."""
    sock = socket.create_connection(("127.0.0.1", port), timeout=10, source_address=(source, 0))
    return connect(f"ws://{host}{WS_PATH}", sock=sock, origin=origin, open_timeout=10)


def refused_handshake(port: int, host: str, origin: str) -> int:
    """The HTTP status that refused a handshake (it fails the test if the socket opens)."""
    with pytest.raises(InvalidStatus) as refused:
        open_socket(port, host, origin).close()
    return refused.value.response.status_code


def echoes(ws: ClientConnection) -> bool:
    ws.send("hi")
    return ws.recv(timeout=10) == "hi"


def test_a_rebound_name_reaches_nothing_when_bound_everywhere():
    with bare_app("0.0.0.0") as port:
        evil = f"evil.example:{port}"
        assert refused_handshake(port, evil, f"http://{evil}") == 403
        status, body = request(port, "GET", "/specvoice/status", "evil.example")
        assert status == 403 and "evil.example" in body
        assert request(port, "GET", "/specvoice/status", f"127.0.0.1:{port}") == (200, "GET ok")
        assert request(port, "GET", "/specvoice/status", f"10.0.0.5:{port}")[0] == 200  # the LAN address
        with open_socket(port, f"10.0.0.5:{port}", f"http://10.0.0.5:{port}") as ws:
            assert echoes(ws)


def test_changes_come_only_from_pages_this_server_served():
    with bare_app() as port:
        own = f"127.0.0.1:{port}"
        assert request(port, "POST", "/specvoice/change", own, f"http://{own}") == (200, "POST ok")
        for origin in ("http://evil.example", None, "null", f"http://localhost:{port}"):
            status, body = request(port, "POST", "/specvoice/change", own, origin)
            assert status == 403 and "only pages this server served" in body, origin
        assert refused_handshake(port, own, "http://evil.example") == 403
        assert request(port, "GET", "/closed", own)[0] == 404  # not an open path, whoever asks
        assert request(port, "POST", "/closed", own, f"http://{own}")[0] == 404


def test_a_proxy_or_a_remapped_port_works_once_named():
    with bare_app("0.0.0.0") as port:
        assert request(port, "GET", "/specvoice/status", "localhost:8080")[0] == 403
        assert refused_handshake(port, "localhost:8080", DOCKER) == 403
    with bare_app("0.0.0.0", origins=(DOCKER, "https://gpu.example.com:8443"), hosts=("specvoice",)) as port:
        assert request(port, "GET", "/specvoice/status", "localhost:8080")[0] == 200
        with open_socket(port, "localhost:8080", DOCKER) as ws:  # docker run -p 8080:7860
            assert echoes(ws)
        with open_socket(port, "specvoice", "https://gpu.example.com:8443") as ws:  # a proxy that rewrites Host
            assert echoes(ws)
        assert request(port, "POST", "/specvoice/change", "specvoice", "https://gpu.example.com:8443")[0] == 200
        assert refused_handshake(port, f"evil.example:{port}", f"http://evil.example:{port}") == 403


def cap_refusal(ws: ClientConnection) -> str:
    """The reason of a session refused over a cap: accepted, then closed with 1013."""
    with pytest.raises(ConnectionClosedError) as closed:
        ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
    return closed.value.rcvd.reason


def test_sessions_are_capped_per_address_and_in_all():
    with bare_app(sessions=3, per_client=2) as port, contextlib.ExitStack() as tabs:
        own = f"127.0.0.1:{port}"

        def tab(source: str) -> ClientConnection:
            return tabs.enter_context(open_socket(port, own, f"http://{own}", source))

        first, second = tab("127.0.0.1"), tab("127.0.0.1")
        assert "from your address" in cap_refusal(tab("127.0.0.1"))
        assert echoes(tab("127.0.0.2"))  # another address: its own allowance
        assert "try again later" in cap_refusal(tab("127.0.0.3"))  # three open: the server's cap
        first.close()
        assert echoes(tab("127.0.0.3")) and echoes(second)  # a closed tab frees its place


def test_a_header_sent_slowly_is_cut_and_a_complete_one_is_not():
    with bare_app(header_timeout_s=0.5) as port:
        own = f"127.0.0.1:{port}"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(b"GET /specvoice/status HT")  # half a request line, then nothing
            assert sock.recv(1024) == b"", "the server answered an unfinished request"  # closed, within 10 s
        with open_socket(port, own, f"http://{own}") as ws:
            time.sleep(1)  # past the timeout: an upgraded connection is no longer timed
            assert echoes(ws)
        conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
        with contextlib.closing(conn):
            for _ in range(2):  # one kept-alive connection, two requests: the timer restarts after the first
                conn.request("GET", "/specvoice/status")
                assert conn.getresponse().read() == b"GET ok"


# ---------------------------------------------------------------------------------------------- the app


def test_the_app_answers_only_its_names_and_the_routes_its_page_uses():
    gate = threading.Event()  # the page and its routes need no models
    try:
        with running_app(build=gated_build(gate), host="0.0.0.0", allowed_origins=(DOCKER,), header_timeout_s=1) as app:
            port = app.server.options.port
            own, evil = f"127.0.0.1:{port}", f"evil.example:{port}"
            assert request(port, "GET", "/", own)[0] == 200
            assert request(port, "GET", "/specvoice/status", own)[0] == 200
            assert request(port, "GET", "/specvoice/status", "evil.example")[0] == 403
            assert request(port, "GET", "/", evil)[0] == 403
            assert refused_handshake(port, evil, f"http://{evil}") == 403
            for origin in ("http://evil.example", f"http://{own}"):  # closed: no page of ours uploads
                assert request(port, "POST", "/gradio_api/upload", own, origin)[0] == 404
            assert request(port, "GET", "/gradio_api/info", own)[0] == 404
            assert request(port, "POST", "/gradio_api/queue/join", own, f"http://{own}")[0] not in (403, 404)
            with open_socket(port, "localhost:8080", DOCKER) as ws:
                assert recv_until(ws, lambda m: m["type"] == "hello")[0]["token"]
            with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
                sock.sendall(b"GET / HT")
                assert sock.recv(1024) == b""
    finally:
        gate.set()
