"""One tab's session in pieces: the paired A/B runs, the outbox bounded in bytes, one pending turn, replays, the
limits on what a tab says, and a closed session freed; over a real socket on loopback with the tiny models."""

from __future__ import annotations

import asyncio
import contextlib
import gc
import json
import socket
import threading
import time
import weakref
from collections.abc import Callable, Iterator
from types import SimpleNamespace

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from app.host import AnswerSlots
from app.outbox import Outbox
from app.protocol import FLAG_REPLAY, ClockSync, unpack_audio
from app.turns import TurnRunner
from commands.bench_server import wait_until
from pipeline.paired import paired_runs
from pipeline.preemptive import Hold
from tests.support.browser import recv_until, running_app, wait_ready

# ---------------------------------------------------------------------------------------------- pure pieces


def test_paired_runs_alternate_and_stop_on_cancel():
    calls: list[tuple[int, bool]] = []

    def run(item: int, speculation: bool) -> str:
        calls.append((item, speculation))
        return f"{item} {'on' if speculation else 'off'}"

    pairs = list(paired_runs(run, range(3)))
    assert [(p.item, p.off, p.on) for p in pairs] == [(i, f"{i} off", f"{i} on") for i in range(3)]
    assert [spec for _, spec in calls] == [False, True, True, False, False, True]  # each mode goes first in turn
    calls.clear()  # bench-voice's order: alternating over the recordings (index) and the repeats (item) both
    list(paired_runs(run, [0, 0, 1, 1], order=lambda index, repeat: repeat + index % 2))
    assert [spec for _, spec in calls[::2]] == [False, True, True, False]

    cancel = threading.Event()

    def stopped_in(pair: int, speculation: bool):
        def run_and_stop(item: int, spec: bool) -> str:
            if (item, spec) == (pair, speculation):  # Stop, pressed during this run
                cancel.set()
            return run(item, spec)

        return run_and_stop

    for speculation, ran in ((True, [(1, True)]), (False, [(1, True), (1, False)])):  # pair 2 runs on, then off
        calls.clear()
        cancel.clear()
        assert [p.item for p in paired_runs(stopped_in(1, speculation), range(5), cancel)] == [0]  # cut: left out
        assert calls == [(0, False), (0, True), *ran]  # and nothing runs after the Stop


def test_an_early_answer_waits_for_the_slot_its_own_turns_asr_pass_holds():
    """With one answer slot, the pass at the pause holds it while the answer started on the pass before it asks: the
    early answer waits for the slot while its turn is undecided, goes quietly when discarded, and its turn is told
    "busy" when it is confirmed with no room."""
    slots = AnswerSlots(1)
    sent: list[dict] = []
    runner = TurnRunner(SimpleNamespace(slots=slots), SimpleNamespace(put=sent.append), ClockSync())

    def early_answer(end: Callable[[Hold], None] | None) -> list[str]:
        ran: list[str] = []
        hold = Hold("what is the capital of France")
        assert slots.try_acquire()  # the ASR pass at the pause
        job = threading.Thread(target=runner._guarded, args=(lambda: ran.append("answered"), hold))
        job.start()
        assert wait_until(lambda: hold._watchers, 5)  # it asked for a slot: none is free, so it waits
        assert not ran and hold.state == "held"  # waiting, not given up
        if end is not None:
            end(hold)
            job.join(timeout=5)  # decided while the pass still runs
        slots.release()  # the pass is done
        job.join(timeout=5)
        assert not job.is_alive()
        return ran

    assert early_answer(None) == ["answered"] and not sent
    assert slots.try_acquire()  # the answer gave its slot back
    slots.release()
    assert early_answer(Hold.discard) == [] and not sent
    assert early_answer(Hold.confirm) == [] and [m["type"] for m in sent] == ["busy"]


def test_outbox_counts_bytes_and_gives_up_on_a_reader_over_its_cap():
    class HeldUp:
        """A socket whose peer reads nothing: the first send never returns."""

        def __init__(self) -> None:
            self.sent: list[str | bytes] = []

        async def send_text(self, data: str) -> None:
            self.sent.append(data)
            await asyncio.Event().wait()

        send_bytes = send_text

    async def scenario() -> None:
        outbox = Outbox(asyncio.get_running_loop(), max_bytes=1000)
        ws = HeldUp()
        pump = asyncio.create_task(outbox.pump(ws))
        message = {"type": "info", "message": "café"}
        assert outbox.put(message) and outbox.queued_bytes == len(json.dumps(message).encode())  # JSON in bytes
        await asyncio.sleep(0.01)  # the pump takes it, and its send is held up
        assert ws.sent == [json.dumps(message)]
        assert outbox.put(b"\0" * 500, "replay") and outbox.queued("replay") == 1
        assert not outbox.ended.is_set()
        assert not outbox.put(b"\0" * 500)  # over 1000 bytes unsent: refused, and the reader given up on
        await asyncio.wait_for(outbox.ended.wait(), 1)  # at once, though the pump is still held up
        assert "too slow" in outbox.overflow and outbox.queued_bytes == 0 and outbox.queued("replay") == 0
        assert not outbox.put({"type": "ping"})  # nothing more is taken
        pump.cancel()

    asyncio.run(scenario())


# ---------------------------------------------------------------------------------------------- over a socket


@pytest.fixture(scope="module")
def app():
    with running_app(max_concurrent_answers=1) as running:
        wait_ready(running)
        yield running


@contextlib.contextmanager
def open_tab(app, **kwargs) -> Iterator[tuple[ClientConnection, str]]:
    """A tab whose models are ready: its socket and its session's token."""
    with connect(app.ws_url, origin=app.url, max_size=None, **kwargs) as ws:
        hello, _ = recv_until(ws, lambda m: m["type"] == "hello")
        recv_until(ws, lambda m: m["type"] == "status" and m["ready"])
        yield ws, hello["token"]


def answer_threads() -> int:
    return sum(t.name == "answer" for t in threading.enumerate())


@pytest.mark.models
def test_rate_text_in_tokens_and_one_replay_at_a_time(app):
    with open_tab(app) as (ws, _):
        ws.send(json.dumps({"type": "hello", "sample_rate": 192000}))
        err, _ = recv_until(ws, lambda m: m["type"] == "error")
        assert "8000..96000" in err["message"]
        # 100 characters, far under the character limit, but 400 of the tiny LLM's (byte) tokens
        ws.send(json.dumps({"type": "text", "text": "\U00013000" * 100}))
        err, _ = recv_until(ws, lambda m: m["type"] in ("error", "turn"))
        assert err["type"] == "error" and "400 tokens" in err["message"] and "at most 300 tokens" in err["message"]
        ws.send(json.dumps({"type": "hello", "sample_rate": 96000}))
        ws.send(json.dumps({"type": "text", "text": "Hello there."}))
        done, _ = recv_until(ws, lambda m: m["type"] in ("done", "error"))
        assert done["type"] == "done" and done["data"]["audio_seconds"] > 0
        for _ in range(10):  # at once: each would queue the whole answer again
            ws.send(json.dumps({"type": "play", "turn": done["turn"]}))
        refused = started = 0
        while refused + started < 10:  # each play is answered by a replay or a refusal
            raw = ws.recv(timeout=10)
            if isinstance(raw, bytes):
                header, _ = unpack_audio(raw)
                assert header["flags"] & FLAG_REPLAY and header["rate"] == 96000
                started += header["seq"] == 0
            else:
                refused += "still being sent" in json.loads(raw).get("message", "")
    assert refused > 0


@pytest.mark.models
def test_a_new_turn_replaces_the_pending_one(app):
    with open_tab(app) as (ws, token):
        conv = app.server.sessions[token].runner.conversation()
        with conv.lock:  # the first answer waits here (as behind a long prefill) while 29 more turns arrive
            for i in range(30):
                ws.send(json.dumps({"type": "text", "text": f"Question {i}?"}))
            peak, deadline = 0, time.monotonic() + 1
            while time.monotonic() < deadline:
                peak = max(peak, answer_threads())
                time.sleep(0.005)
        done, seen = recv_until(ws, lambda m: m["type"] == "done" and m["data"]["transcript"] == "Question 29?")
    assert peak == 1, f"30 turns made {peak} answer threads"
    announced = [m["transcript"] for m in seen if isinstance(m, dict) and m["type"] == "turn"]
    assert announced[-1] == "Question 29?" and len(announced) <= 2  # those between were replaced while pending


@pytest.mark.models
def test_a_spoken_ab_replay_stops_on_stop(app):
    with open_tab(app) as (ws, token):
        runner = app.server.sessions[token].runner
        # The tab's last utterance, as if spoken: 20 s of it to replay in real time (silence: no model hears it)
        runner.last_utterance, runner.last_utterance_audio = "Hello?", np.zeros(20 * 16000, np.float32)
        ws.send(json.dumps({"type": "ab", "repeats": 2}))
        recv_until(ws, lambda m: m["type"] == "turn" and m["kind"] == "ab")  # the first replay is under way
        ws.send(json.dumps({"type": "stop"}))
        result, seen = recv_until(ws, lambda m: m["type"] in ("ab_result", "error"), timeout=10)
        assert result["type"] == "ab_result" and result["spoken"] and result["pairs"] == []
        assert not any(isinstance(m, dict) and m["type"] == "done" for m in seen)  # the cut run is not recorded
    assert wait_until(app.server.slots.try_acquire, 5)  # its answer slot is free again
    app.server.slots.release()


@pytest.mark.models
def test_a_reader_over_the_cap_is_closed_and_its_session_freed(app):
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    sock.connect(("127.0.0.1", app.server.options.port))
    # max_queue=1: the client stops reading its socket while one message waits unread, as a hung page would
    with open_tab(app, sock=sock, max_queue=1) as (ws, token):
        ws.send(json.dumps({"type": "hello", "sample_rate": 96000}))
        ws.send(json.dumps({"type": "text", "text": "Hello there."}))
        done, _ = recv_until(ws, lambda m: m["type"] == "done")
        app.server.sessions[token].outbox.max_bytes = 64 * 1024  # the cap, small enough to reach with one replay
        deadline = time.monotonic() + 30
        while token in app.server.sessions:  # replays fill the socket's buffers, then the outbox
            assert time.monotonic() < deadline, "a client that reads nothing was never closed"
            ws.send(json.dumps({"type": "play", "turn": done["turn"]}))
            time.sleep(0.1)
        with pytest.raises(ConnectionClosed) as closed:
            while True:  # what was sent before, then the close
                ws.recv(timeout=10)
    assert closed.value.rcvd is not None and closed.value.rcvd.code == 1008 and "too slow" in closed.value.rcvd.reason


@pytest.mark.models
def test_a_closed_session_is_freed_by_reference_counting(app):
    gc.collect()
    gc.disable()  # no cycle collector: only reference counting may free it
    try:
        with open_tab(app) as (ws, token):
            ws.send(json.dumps({"type": "settings", "background": 1}))  # this tab's load, which ends with it
            recv_until(ws, lambda m: m["type"] == "status" and m.get("background") == 1)
            ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
            ws.send(json.dumps({"type": "text", "text": "Talk for a long time please."}))
            recv_until(ws, lambda m: m["type"] == "token")  # gone mid-answer
            session = app.server.sessions[token]
            parts = (session, session.runner, session.mic, session.outbox, session.runner.conv)
            alive = [weakref.ref(part) for part in parts]
            del session, parts
        assert wait_until(lambda: token not in app.server.sessions, 10)
        assert wait_until(lambda: all(ref() is None for ref in alive), 10), [ref() for ref in alive]
        assert app.server.status()["background"] == 0  # the load this tab set ended with it
    finally:
        gc.enable()
