"""`specvoice bench-server`: issue 23's goals for the server itself, measured on the app in this process (loopback,
the tiny random engine by default, real ASR and TTS).

- memory: RSS once the app is ready and has answered one turn, then after N connect → typed answer → disconnect
  cycles (goal: within 50 MB of the start);
- status under a flood: /specvoice/status latency while a client that never reads asks for replay after replay of
  its answer at a high playback rate (goal: under 200 ms);
- malformed input: every malformed message the tests know, each on a socket of its own, and the tracebacks the
  server logged meanwhile (goal: none), beside the messages that got no error or lost their socket.
"""

from __future__ import annotations

import argparse
import json
import logging
import socket
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

from websockets.client import ClientProtocol
from websockets.exceptions import ConnectionClosed
from websockets.frames import Frame, Opcode
from websockets.sync.client import connect
from websockets.typing import Origin
from websockets.uri import parse_uri

from app.heap import process_memory_mb
from app.protocol import WS_PATH
from app.server import AppServer, ServerOptions

from .bench_heard import free_port, serving, tiny_config
from .options import add_agent_arguments, agent_config_from_args, option_defaults, positive_int
from .voice_client import recv_until

GOAL_RSS_GROWTH_MB = 50.0
GOAL_STATUS_MS = 200.0
LOGGERS = ("", "uvicorn", "specvoice")  # root, and the two that may stop propagating to it
NON_FINITE = (  # JSON's non-finite numbers (Python's json reads them) where the server expects numbers
    '{"type": "hello", "sample_rate": Infinity}',
    '{"type": "settings", "temperature": NaN}',
    '{"type": "settings", "background": Infinity}',
    '{"type": "ab", "text": "hi", "repeats": Infinity}',
    '{"type": "play", "turn": Infinity}',
    '{"type": "heard", "turn": -Infinity, "t": 1.0}',
)
MALFORMED: tuple[str | bytes, ...] = NON_FINITE + (
    "{not json",
    "[]",
    "null",
    '"text"',
    "{}",
    '{"type": "nope"}',
    '{"type": 7}',
    '{"type": "hello", "sample_rate": "fast"}',
    '{"type": "hello", "sample_rate": 1e300}',
    '{"type": "pong", "ts": "a", "tc": null}',
    '{"type": "settings", "k": 99, "drafter": "nope"}',
    '{"type": "settings", "temperature": "hot"}',
    '{"type": "text", "text": {"a": 1}}',
    '{"type": "mic", "mode": "shout", "active": true}',
    '{"type": "ab", "text": "hi", "repeats": "many"}',
    '{"type": "play", "turn": "one"}',
    '{"type": "play"}',
    '{"type": "heard", "turn": 1, "t": "now"}',
    b"",
    b"\x00",
    b"\x00" * (2 * 16000 + 2),
)
DEFINITIONS_SERVER = {
    "rss_mb": "the process's resident set size (VmRSS), MB of 2^20 bytes; start: ready and one typed turn answered",
    "rss_growth_mb": "RSS after the cycles minus RSS at the start",
    "status_ms": "wall time of one GET /specvoice/status, request to full response, while the flood runs",
    "tracebacks": "log records carrying a traceback, and exceptions that ended a thread, while the malformed "
    "messages were sent",
    "unanswered": "malformed messages that got no 'error' message back within the wait",
    "dropped": "malformed messages after which the socket closed",
}


class Tracebacks(logging.Handler):
    """Counts, while installed, every logged record that carries a traceback and every exception ending a thread."""

    def __init__(self) -> None:
        super().__init__(logging.DEBUG)
        self.seen: list[str] = []
        self._hook = threading.excepthook

    def emit(self, record: logging.LogRecord) -> None:
        if record.exc_info or "Traceback" in record.getMessage():
            self.seen.append(f"{record.name}: {record.getMessage()}")

    def _thread_ended(self, args: threading.ExceptHookArgs) -> None:
        self.seen.append(f"thread {args.thread}: {args.exc_value!r}")

    def __enter__(self) -> list[str]:
        for name in LOGGERS:
            logging.getLogger(name).addHandler(self)
        threading.excepthook = self._thread_ended
        return self.seen

    def __exit__(self, *exc) -> None:
        threading.excepthook = self._hook
        for name in LOGGERS:
            logging.getLogger(name).removeHandler(self)


class StalledClient:
    """A tab that reads only when told to: a WebSocket client over a plain socket with a small receive buffer, so
    what the server sends while it does not read stays with the server."""

    def __init__(self, ws_url: str, origin: str) -> None:
        uri = parse_uri(ws_url)
        self.sock = socket.socket()
        self.sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
        self.sock.connect((uri.host, uri.port))
        self.ws = ClientProtocol(uri, origin=Origin(origin), max_size=None)
        self.ws.send_request(self.ws.connect())
        self.closed = False
        self.flush()
        while self.ws.state.name == "CONNECTING":
            if self._read(10) is None:
                raise TimeoutError("no handshake response")
        if self.ws.handshake_exc is not None:
            raise self.ws.handshake_exc

    def flush(self) -> None:
        self.sock.sendall(b"".join(self.ws.data_to_send()))  # pongs to the server's pings included

    def send(self, message: dict) -> None:
        self.ws.send_text(json.dumps(message).encode())
        self.flush()

    def close(self) -> None:
        self.sock.close()

    def _read(self, timeout: float) -> list | None:
        """One read's complete events (maybe none yet); None when the server sent nothing within timeout."""
        self.sock.settimeout(timeout)
        try:
            data = self.sock.recv(1 << 16)
        except TimeoutError:
            return None
        except OSError:  # reset by the server
            data = b""
        if not data:
            self.closed = True
            self.ws.receive_eof()
        else:
            self.ws.receive_data(data)
        events = [e for e in self.ws.events_received() if isinstance(e, Frame)]  # the handshake's Response aside
        self.closed |= any(e.opcode == Opcode.CLOSE for e in events)
        if not self.closed:
            self.flush()
        return events

    def read(
        self, until: Callable[[dict], bool] = lambda m: False, idle_s: float = 3.0, limit_s: float = 30.0
    ) -> tuple[list[dict], int]:
        """Read until a JSON message satisfies until, the server closes, or it is silent for idle_s: (the JSON
        messages, the bytes of audio)."""
        messages, audio = [], 0
        deadline = time.monotonic() + limit_s
        while not self.closed and time.monotonic() < deadline:
            events = self._read(idle_s)
            if events is None:
                break
            for e in events:
                if e.opcode == Opcode.BINARY:
                    audio += len(e.data)
                elif e.opcode == Opcode.TEXT:
                    messages.append(json.loads(e.data))
                    if until(messages[-1]):
                        return messages, audio
        return messages, audio


def rss_mb() -> float:
    memory = process_memory_mb()
    if memory is None:
        raise RuntimeError("bench-server reads the resident memory from /proc/self/status (Linux)")
    return memory["resident_mb"]


def typed_answer(ws_url: str, origin: str, text: str = "Hello there.") -> None:
    """One tab: open, ask, wait for the answer, close."""
    with connect(ws_url, origin=origin, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status" and m["ready"], timeout=60)
        ws.send(json.dumps({"type": "text", "text": text}))
        done, _ = recv_until(ws, lambda m: m["type"] in ("done", "error", "busy"), timeout=120)
        if done["type"] != "done":
            raise RuntimeError(f"a typed turn was not answered: {done}")


def wait_until(condition: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def measure_memory(server: AppServer, url: str, ws_url: str, cycles: int) -> dict:
    typed_answer(ws_url, url)  # the first turn's allocations belong to the start
    wait_until(lambda: not server.sessions, 10)
    start = rss_mb()
    for i in range(cycles):
        typed_answer(ws_url, url, f"Question number {i + 1}?")
    wait_until(lambda: not server.sessions, 10)
    end = rss_mb()
    return {
        "cycles": cycles,
        "start_mb": start,
        "end_mb": end,
        "rss_growth_mb": end - start,
        "sessions_left": len(server.sessions),
        "goal_growth_mb": GOAL_RSS_GROWTH_MB,
        "met": end - start <= GOAL_RSS_GROWTH_MB,
    }


def status_ms(url: str) -> float:
    import urllib.request

    t0 = time.perf_counter()
    with urllib.request.urlopen(f"{url}/specvoice/status", timeout=30) as r:
        r.read()
    return (time.perf_counter() - t0) * 1000


def measure_flood(url: str, ws_url: str, requests: int, flood_requests: int, rate: int) -> dict:
    client = StalledClient(ws_url, url)
    try:
        client.send({"type": "hello", "sample_rate": rate})
        client.send({"type": "text", "text": "Tell me a story."})
        messages, answer_bytes = client.read(lambda m: m["type"] in ("done", "busy"), limit_s=120)
        if not messages or messages[-1]["type"] != "done":
            raise RuntimeError(f"the flooding client's turn was not answered: {messages[-1:]}")
        turn = messages[-1]["turn"]

        def flood() -> None:
            for _ in range(flood_requests):  # never reading: each would queue the whole answer again
                client.send({"type": "play", "turn": turn})

        flooding = threading.Thread(target=flood, name="flood")
        flooding.start()
        latencies = [status_ms(url) for _ in range(requests)]
        flooding.join()
        _, flood_bytes = client.read(idle_s=3.0, limit_s=60)
    finally:
        client.close()
    return {
        "requests": requests,
        "flood_requests": flood_requests,
        "flood_sample_rate": rate,
        "median_ms": statistics.median(latencies),
        "max_ms": max(latencies),
        "answer_audio_bytes": answer_bytes,
        "flood_audio_bytes_read": flood_bytes,
        "client_closed_by_server": client.closed,
        "goal_ms": GOAL_STATUS_MS,
        "met": max(latencies) < GOAL_STATUS_MS,
    }


def send_malformed(ws_url: str, origin: str, message: str | bytes) -> tuple[bool, bool]:
    """(answered with an error, socket dropped) for one malformed message on a fresh socket."""
    with connect(ws_url, origin=origin, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status", timeout=30)
        ws.send(message)
        try:
            recv_until(ws, lambda m: m["type"] == "error", timeout=2)
            return True, False
        except TimeoutError:
            return False, False
        except ConnectionClosed:
            return False, True


def measure_malformed(url: str, ws_url: str) -> dict:
    unanswered, dropped = [], []
    with Tracebacks() as tracebacks:
        for message in MALFORMED:
            shown = message if isinstance(message, str) else f"binary frame of {len(message)} bytes"
            answered, lost = send_malformed(ws_url, url, message)
            if not answered:
                unanswered.append(shown)
            if lost:
                dropped.append(shown)
        time.sleep(0.5)  # a traceback logged as the last socket closes
    return {
        "messages": len(MALFORMED),
        "tracebacks": len(tracebacks),
        "traceback_lines": tracebacks[:20],
        "unanswered": unanswered,
        "dropped": dropped,
        "met": not tracebacks,
    }


def bench_server(args: argparse.Namespace) -> dict:
    agent_config = agent_config_from_args(args)
    server = AppServer(agent_config, ServerOptions(port=free_port()))
    with serving(server) as url:
        if not server.loader.finished.wait(300) or server.loader.error:
            raise RuntimeError(f"the models did not load: {server.loader.error}")
        ws_url = url.replace("http://", "ws://", 1) + WS_PATH
        memory = measure_memory(server, url, ws_url, args.cycles)
        print(f"RSS {memory['start_mb']:.0f} → {memory['end_mb']:.0f} MB after {args.cycles} cycles")
        flood = measure_flood(url, ws_url, args.status_requests, args.flood_requests, args.flood_rate)
        malformed = measure_malformed(url, ws_url)
        status_after = status_ms(url)
    config = {k: getattr(args, k) for k in ("cycles", "status_requests", "flood_requests", "flood_rate")}
    return {
        "config": {**config, "agent": asdict(agent_config)},
        "memory": memory,
        "status_under_flood": flood,
        "malformed": malformed,
        "status_after_ms": status_after,
        "definitions": DEFINITIONS_SERVER,
    }


def describe(result: dict) -> str:
    m, f, b = result["memory"], result["status_under_flood"], result["malformed"]

    def verdict(ok: bool) -> str:
        return "met" if ok else "NOT met"

    return "\n".join(
        (
            f"memory: RSS {m['start_mb']:.0f} → {m['end_mb']:.0f} MB over {m['cycles']} cycles "
            f"({m['rss_growth_mb']:+.0f} MB; goal ≤ {m['goal_growth_mb']:.0f}: {verdict(m['met'])})",
            f"status under a flood of {f['flood_requests']} replays at {f['flood_sample_rate']} Hz: median "
            f"{f['median_ms']:.0f} ms, max {f['max_ms']:.0f} ms (goal < {f['goal_ms']:.0f}: {verdict(f['met'])}); "
            f"the stalled client was {'closed' if f['client_closed_by_server'] else 'not closed'} by the server",
            f"malformed messages: {b['messages']} sent, {b['tracebacks']} tracebacks ({verdict(b['met'])}), "
            f"{len(b['unanswered'])} without an error, {len(b['dropped'])} lost their socket",
        )
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--cycles", type=positive_int, default=100, help="connect → typed answer → disconnect cycles")
    parser.add_argument("--status-requests", type=positive_int, default=50, help="status requests during the flood")
    parser.add_argument(
        "--flood-requests", type=positive_int, default=40, help="replay requests the stalled client sends"
    )
    parser.add_argument("--flood-rate", type=positive_int, default=96000, help="the stalled client's playback rate, Hz")
    parser.add_argument("--json", default=None, help="write the measurements and the options here")
    add_agent_arguments(parser)
    parser.set_defaults(**option_defaults(tiny_config()))


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    result = bench_server(args)
    print(describe(result))
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=2, default=float))
        print(f"wrote {args.json}")
    return 0
