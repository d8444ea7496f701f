"""Issue 23's probes: each attack a hostile page or a broken client can make, played against the app on loopback
with the tiny models, bounded in count and time. Each asserts the fixed behaviour: a clear error or a refusal, the
server still answering /specvoice/status afterwards, and no traceback in its log."""

from __future__ import annotations

import contextlib
import gc
import http.client
import json
import math
import socket
import threading
import time
import urllib.error
import urllib.request
import weakref
from collections.abc import Iterator

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app.protocol import WS_PATH
from commands.bench_server import NON_FINITE, StalledClient, Tracebacks, wait_until
from commands.voice_client import send_speech
from tests.support.browser import RunningApp, gated_build, recv_until, running_app, wait_ready
from tests.support.speech import needs_espeak, speak

pytestmark = pytest.mark.models


@pytest.fixture
def tracebacks() -> Iterator[list[str]]:
    with Tracebacks() as seen:
        yield seen


@pytest.fixture(scope="module")
def app() -> Iterator[RunningApp]:
    with running_app(max_concurrent_answers=1) as running:
        wait_ready(running)
        yield running


@contextlib.contextmanager
def loading_app(**options) -> Iterator[RunningApp]:
    """The app with its models still loading: enough for what is checked before them. They fail to load only after
    the probe (and its traceback check) is over."""
    gate = threading.Event()
    with running_app(build=gated_build(gate, "not needed here"), **options) as app:
        try:
            yield app
        finally:
            gate.set()
            app.server.loader.finished.wait(10)  # its failure logged now, not in a later probe


def status_answers(app: RunningApp) -> bool:
    with urllib.request.urlopen(f"{app.url}/specvoice/status", timeout=10) as r:
        return r.status == 200 and "ready" in json.load(r)


def typed_turn(app: RunningApp, ws, text: str = "Hello there.") -> dict:
    """A typed turn that must be answered: its done message (an error or a closed socket fails the probe)."""
    assert wait_until(lambda: slot_free(app), 30), "an earlier probe's answer still holds the slot"
    ws.send(json.dumps({"type": "text", "text": text}))
    done, _ = recv_until(ws, lambda m: m["type"] in ("done", "error", "busy"))
    assert done["type"] == "done", done
    return done


def slot_free(app: RunningApp) -> bool:
    if not app.server.slots.try_acquire():
        return False
    app.server.slots.release()
    return True


def kernel_send_buffer() -> int:
    """The most a TCP socket's send buffer grows to (Linux: tcp_wmem's maximum)."""
    with open("/proc/sys/net/ipv4/tcp_wmem") as f:
        return int(f.read().split()[2])


def test_a_client_that_never_reads_is_bounded(app, tracebacks):
    assert wait_until(lambda: slot_free(app), 30), "an earlier probe's answer still holds the slot"
    reader = StalledClient(app.ws_url, app.url)
    with contextlib.closing(reader):
        reader.send({"type": "hello", "sample_rate": 192000})
        reader.send({"type": "text", "text": "Tell me a story."})
        messages, answer_bytes = reader.read(lambda m: m["type"] in ("done", "busy"))  # past a refused rate
        assert messages[-1]["type"] == "done" and answer_bytes > 0
        turn = messages[-1]["turn"]
        statuses: list[bool] = []
        for _ in range(40):  # never reading: each replay would queue the whole answer again
            reader.send({"type": "play", "turn": turn})
            if len(statuses) < 10:
                statuses.append(status_answers(app))
        assert all(statuses), "/specvoice/status stopped answering during the flood"
        time.sleep(2)
        _, flood_bytes = reader.read()
        # What the kernel's socket buffer took is out of the server's hands; beyond it, one replay waits at most.
        assert reader.closed or flood_bytes <= kernel_send_buffer() + 2 * answer_bytes, (
            f"the server queued {flood_bytes / answer_bytes:.1f} answers' audio for a client that does not read"
        )
    assert status_answers(app) and not tracebacks


def test_a_closed_session_is_freed_without_the_cycle_collector(app, tracebacks):
    gc.collect()
    gc.disable()  # only reference counting may free it
    try:
        with connect(app.ws_url, origin=app.url, max_size=None) as ws:
            hello, _ = recv_until(ws, lambda m: m["type"] == "hello")
            typed_turn(app, ws)  # a conversation with a KV cache, stored audio, a mic thread
            session = weakref.ref(app.server.sessions[hello["token"]])
        assert wait_until(lambda: hello["token"] not in app.server.sessions, 5)
        assert wait_until(lambda: session() is None, 5), "the closed session is still alive"
    finally:
        gc.enable()
    assert status_answers(app) and not tracebacks


def upload(url: str, origin: str) -> int:
    body = b'--b\r\nContent-Disposition: form-data; name="files"; filename="x.txt"\r\n\r\nhello\r\n--b--\r\n'
    request = urllib.request.Request(
        f"{url}/gradio_api/upload",
        body,
        {"Content-Type": "multipart/form-data; boundary=b", "Origin": origin},
    )
    try:
        with urllib.request.urlopen(request, timeout=10) as r:
            return r.status
    except urllib.error.HTTPError as e:
        return e.code


def handshake_status(port: int, host: str, origin: str) -> int:
    """The HTTP status of a WebSocket handshake sent to 127.0.0.1:port under a forged Host header."""
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=10)
    conn.putrequest("GET", WS_PATH, skip_host=True)
    headers = {
        "Host": host,
        "Origin": origin,
        "Upgrade": "websocket",
        "Connection": "Upgrade",
        "Sec-WebSocket-Key": "dGhlIHNhbXBsZSBub25jZQ==",
        "Sec-WebSocket-Version": "13",
    }
    for name, value in headers.items():
        conn.putheader(name, value)
    conn.endheaders()
    with contextlib.closing(conn):
        return conn.getresponse().status


def test_another_sites_page_cannot_upload(app, tracebacks):
    assert upload(app.url, "http://evil.example") >= 400, "another site's page wrote a file to disk"
    assert status_answers(app) and not tracebacks


def test_a_rebound_name_cannot_read_the_status(app, tracebacks):
    request = urllib.request.Request(f"{app.url}/specvoice/status", headers={"Host": "evil.example"})
    with pytest.raises(urllib.error.HTTPError):
        urllib.request.urlopen(request, timeout=10)
    assert status_answers(app) and not tracebacks


def test_a_rebound_name_cannot_open_the_socket_of_an_app_bound_everywhere(tracebacks):
    with loading_app(host="0.0.0.0") as everywhere:  # no models needed: the handshake is checked before them
        port = everywhere.server.options.port
        evil = f"evil.example:{port}"
        assert handshake_status(port, evil, f"http://{evil}") == 403, "a rebound name opened the socket"
        assert upload(f"http://127.0.0.1:{port}", f"http://{evil}") >= 400
        request = urllib.request.Request(f"http://127.0.0.1:{port}/specvoice/status", headers={"Host": evil})
        with pytest.raises(urllib.error.HTTPError):
            urllib.request.urlopen(request, timeout=10)
        assert not tracebacks


@pytest.mark.parametrize("message", NON_FINITE)
def test_non_finite_numbers_are_refused_and_the_session_goes_on(app, tracebacks, message):
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(message)
        error, _ = recv_until(ws, lambda m: m["type"] in ("error", "ab_start", "turn"), timeout=10)
        assert error["type"] == "error", f"{message} was accepted"
        field = next(k for k, v in json.loads(message).items() if isinstance(v, float) and not math.isfinite(v))
        assert field in error["message"], error["message"]  # it says what was wrong
        typed_turn(app, ws)  # the socket is open and answers are not poisoned (a NaN temperature fails sampling)
    assert status_answers(app) and not tracebacks


def test_text_is_limited_in_tokens(app, tracebacks):
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(json.dumps({"type": "text", "text": "\U00013000" * 1000}))  # 1000 characters, ~3000 tokens
        refused, _ = recv_until(ws, lambda m: m["type"] in ("error", "turn"))
        assert refused["type"] == "error" and "token" in refused["message"], refused
        typed_turn(app, ws)
    assert status_answers(app) and not tracebacks


def test_rapid_text_messages_do_not_each_start_a_thread(app, tracebacks):
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        before = threading.active_count()
        for i in range(50):
            ws.send(json.dumps({"type": "text", "text": f"Question {i}?"}))
        peak = before
        deadline = time.monotonic() + 2
        while time.monotonic() < deadline:
            peak = max(peak, threading.active_count())
            time.sleep(0.01)
        ws.send(json.dumps({"type": "stop"}))
        assert peak - before <= 5, f"50 messages started {peak - before} threads"
    assert wait_until(lambda: slot_free(app), 30)
    assert status_answers(app) and not tracebacks


def queued_samples(mic) -> int:
    return sum(x.size for item in list(mic.queue.queue) if item for x in item if isinstance(x, np.ndarray))


def test_mic_frames_faster_than_real_time_are_bounded_in_samples(tracebacks):
    with loading_app() as loading, connect(loading.ws_url, origin=loading.url, max_size=None) as ws:
        hello, _ = recv_until(ws, lambda m: m["type"] == "hello")
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))  # kept while the models load
        second = np.zeros(16000, "<i2").tobytes()
        for _ in range(100):  # 100 s of audio in a burst
            ws.send(second)
        ws.send(json.dumps({"type": "play", "turn": 999}))  # answered once every frame was taken in
        recv_until(ws, lambda m: m["type"] == "error" and "999" in m["message"])
        kept_s = queued_samples(loading.server.sessions[hello["token"]].mic) / 16000
        assert kept_s <= 35, f"the mic queue holds {kept_s:.0f} s of audio"
        assert status_answers(loading) and not tracebacks


def test_sessions_are_capped_per_address(app, tracebacks):
    refused = 0
    with contextlib.ExitStack() as tabs:
        for _ in range(40):
            try:
                ws = tabs.enter_context(connect(app.ws_url, origin=app.url, max_size=None))
                recv_until(ws, lambda m: m["type"] == "status", timeout=5)
            except (InvalidStatus, ConnectionClosed):
                refused += 1
        assert refused, "40 sessions from one address were all accepted"
        assert status_answers(app)
    assert wait_until(lambda: not app.server.sessions, 10) and not tracebacks


def test_a_header_sent_slowly_is_cut(tracebacks):
    with loading_app(header_timeout_s=1.0) as app:
        with socket.create_connection(("127.0.0.1", app.server.options.port)) as sock:
            sock.sendall(b"GET /specvoice/status HT")  # half a request line, then nothing
            sock.settimeout(15)
            try:
                while sock.recv(1024):  # maybe a response, then the close
                    pass
            except TimeoutError:
                pytest.fail("the unfinished request held its connection for 15 s")
        assert status_answers(app) and not tracebacks


@needs_espeak
@pytest.mark.parametrize("how", ["stop", "disconnect"])
def test_a_spoken_ab_replay_honours_stop_and_disconnect(app, tracebacks, how):
    speech = speak("Tell me about the history of the old lighthouse on the northern coast, and its keepers.")
    silence = np.zeros(8000, np.float32)
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
        send_speech(ws, np.concatenate([silence, speech, silence, silence]))
        recv_until(ws, lambda m: m["type"] == "done")
        ws.send(json.dumps({"type": "mic", "active": False, "mode": "handsfree"}))
        ws.send(json.dumps({"type": "ab", "repeats": 3}))
        recv_until(ws, lambda m: m["type"] == "turn" and m["kind"] == "ab")  # the first replay is under way
        if how == "stop":
            ws.send(json.dumps({"type": "stop"}))
            recv_until(ws, lambda m: m["type"] == "flush")
        else:
            ws.close()
        replay_s = len(speech) / 16000  # what a replay that ignores them goes on for
        assert wait_until(lambda: slot_free(app), replay_s / 2), f"{how} left the replay running"
    assert status_answers(app) and not tracebacks


@needs_espeak
@pytest.mark.parametrize("mode", ["ptt", "handsfree"])
def test_speech_is_not_transcribed_while_every_answer_slot_is_taken(app, tracebacks, mode):
    speech = speak("What is the tallest mountain in the whole of Europe, and how high is it?")
    silence = np.zeros(8000, np.float32)
    assert wait_until(lambda: slot_free(app), 30), "an earlier probe's answer still holds the slot"
    assert app.server.slots.try_acquire()  # another tab's answer, as far as this one can tell
    try:
        with connect(app.ws_url, origin=app.url, max_size=None) as ws:
            recv_until(ws, lambda m: m["type"] == "status")
            ws.send(json.dumps({"type": "mic", "active": True, "mode": mode}))
            send_speech(ws, np.concatenate([silence, speech, *[silence] * (1 if mode == "ptt" else 4)]))
            if mode == "ptt":
                ws.send(json.dumps({"type": "mic", "active": False, "mode": mode}))
            busy, seen = recv_until(ws, lambda m: m["type"] in ("busy", "transcript"))
            assert busy["type"] == "busy" and "not transcribed" in busy["message"], busy
            partials = [m["text"] for m in seen if isinstance(m, dict) and m["type"] == "partial"]
            assert not partials, f"partial transcripts ran beside a full server: {partials}"
    finally:
        app.server.slots.release()
    assert status_answers(app) and not tracebacks
