"""The app's server pieces without a browser: wire formats, clock sync, origin check, limits, reports, and one
tiny-engine answer over a real WebSocket."""

from __future__ import annotations

import argparse
import contextlib
import csv
import io
import json
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.request

import numpy as np
import pytest
from websockets.exceptions import ConnectionClosed, InvalidStatus
from websockets.sync.client import connect

from app import report, server
from app.page import K_CHOICES
from app.protocol import AUDIO_HEADER, FLAG_REPLAY, ClockSync, decode_mic_frame, pack_audio, unpack_audio
from app.server import ModelLoader, origin_allowed
from app.session import AnswerSlots
from commands.bench_users import send_speech
from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.asr import Transcriber
from pipeline.options import agent_config_from_args
from pipeline.timeline import STAGES
from pipeline.tts import TTS
from pipeline.vad import EndOfTurnDetector
from specdec.cost_grid import COST_BATCHES
from tests.support.browser import free_port, gated_build, recv_until, running_app, shared_agent, tiny_config, wait_ready
from tests.support.fakes import ScriptedLLM
from tests.support.speech import needs_espeak, speak

# ---------------------------------------------------------------------------------------------- pure pieces


def test_audio_packet_round_trip():
    samples = np.sin(np.linspace(0, 20, 4800)).astype(np.float32) * 0.5
    data = pack_audio(samples, turn=7, seq=2, rate=48000, server_ms=1234.5, flags=FLAG_REPLAY)
    assert AUDIO_HEADER.size == 28 and len(data) == 28 + 2 * len(samples)  # Int16 right after a 2-aligned header
    header, pcm = unpack_audio(data)
    assert header == {"turn": 7, "seq": 2, "rate": 48000, "flags": FLAG_REPLAY, "server_ms": 1234.5}
    assert np.max(np.abs(pcm - samples)) < 1e-4
    clipped = unpack_audio(pack_audio(np.array([2.0, -2.0], np.float32), 1, 0, 16000, 0.0))[1]
    assert np.allclose(clipped, [1.0, -1.0], atol=1e-4)
    with pytest.raises(ValueError):
        unpack_audio(b"XXXX" + data[4:])


def test_mic_frames_are_int16_and_capped():
    frame = (np.arange(512) - 256).astype("<i2").tobytes()
    out = decode_mic_frame(frame)
    assert out.dtype == np.float32 and len(out) == 512 and out[0] == -256 / 32768
    for bad in (b"", b"\x00\x01\x02", b"\x00" * (2 * 16000 + 2)):
        with pytest.raises(ValueError):
            decode_mic_frame(bad)


def test_clock_offset_uses_the_fastest_round_trip():
    clock = ClockSync()
    assert clock.to_server_ms(100.0) is None
    true_offset = 5000.0  # client clock = server clock + 5000 ms
    # (send, one-way up, one-way down): a slow trip with asymmetric delays, then a fast symmetric one.
    for sent, up, down in ((100.0, 40.0, 2.0), (300.0, 1.0, 1.0), (500.0, 15.0, 30.0)):
        client = sent + up + true_offset
        clock.add(sent, client, sent + up + down)
    assert clock.rtt_ms == 2.0
    assert clock.offset_ms == pytest.approx(true_offset)
    assert clock.to_server_ms(9000.0) == pytest.approx(4000.0)
    clock.add(1000.0, 0.0, 990.0)  # a negative round trip is a bogus sample: ignored
    assert clock.rtt_ms == 2.0


@pytest.mark.parametrize(
    "origin, host, bind, ok",
    [
        ("http://127.0.0.1:7860", "127.0.0.1:7860", "127.0.0.1", True),
        ("http://localhost:7860", "localhost:7860", "127.0.0.1", True),
        ("http://evil.example:7860", "127.0.0.1:7860", "127.0.0.1", False),  # another site's page
        ("http://127.0.0.1:8000", "127.0.0.1:7860", "127.0.0.1", False),  # another local app's page
        ("http://evil.example:7860", "evil.example:7860", "127.0.0.1", False),  # DNS rebinding to loopback
        (None, "127.0.0.1:7860", "127.0.0.1", False),
        ("null", "127.0.0.1:7860", "127.0.0.1", False),
        ("http://127.0.0.1:7860", "127.0.0.1:9999", "127.0.0.1", False),
        ("http://10.0.0.5:7860", "10.0.0.5:7860", "0.0.0.0", True),
        ("http://evil.example:7860", "10.0.0.5:7860", "0.0.0.0", False),
    ],
)
def test_origin_check(origin, host, bind, ok):
    assert origin_allowed(origin, host, bind, 7860) is ok


PROXY = "https://gpu.example.com:8443"  # a reverse proxy's HTTPS origin in front of the app on 127.0.0.1:7860


@pytest.mark.parametrize(
    "origin, host, bind, allowed, ok",
    [
        ("http://127.0.0.1:7860", "127.0.0.1:7860", "127.0.0.1", (), True),  # the default: the app's own origin
        ("http://127.0.0.1:7860", "127.0.0.1:7860", "127.0.0.1", (PROXY,), True),  # still, beside an allowed one
        ("http://evil.example:7860", "127.0.0.1:7860", "127.0.0.1", (PROXY,), False),  # another site
        (PROXY, "gpu.example.com:8443", "127.0.0.1", (), False),  # a proxy's page, not allowed
        (PROXY, "127.0.0.1:7860", "127.0.0.1", (PROXY,), True),  # allowed, through a proxy that rewrites Host
        (PROXY, "gpu.example.com:8443", "127.0.0.1", (PROXY,), True),  # allowed, through one that keeps it
        ("https://gpu.example.com", "127.0.0.1:7860", "127.0.0.1", ("https://GPU.example.com:443",), True),
        ("http://gpu.example.com:8443", "127.0.0.1:7860", "127.0.0.1", (PROXY,), False),  # http: another origin
        ("https://gpu.example.com:9443", "127.0.0.1:7860", "127.0.0.1", (PROXY,), False),  # another port
        ("https://evil.gpu.example.com:8443", "127.0.0.1:7860", "127.0.0.1", (PROXY,), False),  # a subdomain
        # docker run -p 8080:7860: the browser's port is not the app's
        ("http://localhost:8080", "localhost:8080", "0.0.0.0", (), False),
        ("http://localhost:8080", "localhost:8080", "0.0.0.0", ("http://localhost:8080",), True),
        ("http://10.0.0.5:8080", "10.0.0.5:8080", "0.0.0.0", ("http://localhost:8080",), False),
    ],
)
def test_allowed_origins(origin, host, bind, allowed, ok):
    assert origin_allowed(origin, host, bind, 7860, allowed) is ok


def test_allowed_origin_option_takes_exact_origins_only(capsys):
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    assert server.server_setup(parser.parse_args([]))[1].allowed_origins == ()  # no other origin by default
    args = parser.parse_args(["--allowed-origin", PROXY, "--allowed-origin", "http://localhost:8080"])
    assert server.server_setup(args)[1].allowed_origins == (PROXY, "http://localhost:8080")
    for bad in ("*", "https://*.example.com", "null", "gpu.example.com", "ftp://gpu.example.com", f"{PROXY}/app"):
        with pytest.raises(SystemExit):
            parser.parse_args(["--allowed-origin", bad])
        assert "is not an origin" in capsys.readouterr().err


def test_a_proxied_origin_opens_the_socket_only_when_allowed():
    """The handshake itself, as a browser behind `docker run -p 8080:7860` makes it (no models needed)."""
    gate = threading.Event()
    gate.set()
    proxied = "http://127.0.0.1:8080"
    with running_app(build=gated_build(gate, "not needed here"), allowed_origins=(proxied,)) as app:
        for origin in (app.url, proxied):
            with connect(app.ws_url, origin=origin):
                pass
        for origin in ("http://127.0.0.1:8081", "http://evil.example:8080"):
            with pytest.raises(InvalidStatus) as err, connect(app.ws_url, origin=origin):
                pass
            assert err.value.response.status_code == 403


def test_answer_slots_refuse_rather_than_queue():
    slots = AnswerSlots(1)
    assert slots.try_acquire() and not slots.try_acquire()
    assert "busy" in slots.busy_message().lower() and "--max-concurrent-answers 1" in slots.busy_message()
    slots.release()
    assert slots.try_acquire()
    with pytest.raises(ValueError):
        AnswerSlots(0)


def fake_turn(turn: int, speculation: bool, ttfa: float, **extra) -> dict:
    stages = dict.fromkeys(STAGES, ttfa / len(STAGES))
    return {
        "turn": turn,
        "kind": "typed",
        "speculation": speculation,
        "ttfa_ms": ttfa,
        "stages": stages,
        "timeline": {"ttfa_ms": ttfa},
        "tokens": 20,
        "tokens_per_s": 8.0 + speculation,
        "draft_acceptance_rate": 0.7 if speculation else None,
        "tokens_per_target_forward": 2.1 if speculation else None,
        "transcript": "what <b>is</b> this",
        "answer": "an answer, with a comma",
        "ttfa_heard_ms": ttfa + 80,
        "heard_delay_ms": 80.0 + turn,
        "settings": {"drafter": "ngram", "k": "3", "temperature": 0.0},
        **extra,
    }


def test_report_from_turn_dicts():
    turns = [fake_turn(1, False, 700), fake_turn(2, True, 400)]
    turns += [
        fake_turn(3 + i, spec, 600 - 200 * spec + 10 * i, kind="ab", ab=1, ab_repeat=i // 2)
        for i, spec in enumerate((False, True, True, False))
    ]
    rows = list(csv.DictReader(io.StringIO(report.turns_csv(turns))))
    assert len(rows) == 6 and rows[0]["ttfa_ms"] == "700" and rows[0]["end_of_turn_wait"] == str(700 / len(STAGES))
    assert rows[1]["drafter"] == "ngram" and rows[0]["draft_acceptance_rate"] == ""
    data = json.loads(report.turns_json(turns, {"llm": "tiny"}))
    assert data["definitions"]["draft_acceptance_rate"].startswith("accepted draft tokens")
    assert data["summary"]["off"]["ttfa_ms_median"] == 630 and data["summary"]["heard_delay_ms_median"] == 83.5
    ab = data["summary"]["ab"]["1"]
    assert ab["n"] == 2 and ab["ratio_on_off_median"] == pytest.approx((410 / 600 + 420 / 630) / 2)
    assert ab["ratio_on_off_ci95"][0] <= ab["ratio_on_off_median"] <= ab["ratio_on_off_ci95"][1]
    page = report.render_html(turns, {"llm": "tiny"})
    assert page.count('src="data:image/png;base64,') == 4  # A/B, TTFA per turn, stages, heard delay
    assert "what &lt;b&gt;is&lt;/b&gt; this" in page and "<b>is</b>" not in page  # user text is escaped
    assert "turns.csv" in page and "A/B run 1" in page
    assert report.render_html([]).startswith("<!doctype html>")  # an empty session still exports


# ---------------------------------------------------------------------------------------------- over a socket


@pytest.fixture(scope="module")
def app():
    with running_app(max_concurrent_answers=1) as running:
        wait_ready(running)
        yield running


@pytest.mark.models
def test_foreign_origin_is_refused(app):
    with pytest.raises(InvalidStatus) as err, connect(app.ws_url, origin="http://evil.example:8080"):
        pass
    assert err.value.response.status_code == 403


@pytest.mark.models
def test_tiny_engine_answer_over_the_socket(app):
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        hello, _ = recv_until(ws, lambda m: m["type"] == "hello")
        recv_until(ws, lambda m: m["type"] == "status" and m["ready"])
        ws.send(json.dumps({"type": "hello", "sample_rate": 48000}))
        ws.send(json.dumps({"type": "settings", "speculation": True, "k": "2"}))
        ws.send(json.dumps({"type": "text", "text": "Tell me about the weather."}))
        done, seen = recv_until(ws, lambda m: m["type"] == "done")
        turn = done["turn"]
        tokens = [m for m in seen if isinstance(m, dict) and m["type"] == "token"]
        packets = [unpack_audio(m) for m in seen if isinstance(m, bytes)]
        assert tokens and packets, "the answer produced no tokens or no audio"
        assert all(h["rate"] == 48000 and h["turn"] == turn for h, _ in packets)
        assert [h["seq"] for h, _ in packets] == list(range(len(packets)))
        assert sum(len(p) for _, p in packets) > 0.2 * 48000
        pieces = [p for m in tokens for p in m["pieces"]]
        assert {d for _, d in pieces} <= {True, False} and any(d for _, d in pieces)  # per-token, some drafted
        data = done["data"]
        assert data["speculation"] and data["ttfa_ms"] > 0 and data["audio_seconds"] > 0
        assert set(data["stages"]) == set(STAGES) and data["settings"]["k"] == "2"
        assert "".join(t for t, _ in pieces).strip() == data["answer"]
        # The page reports when it heard the first sample; the server turns that into heard delay and TTFA.
        first = packets[0][0]["server_ms"]
        offset = app.server.sessions[hello["token"]].clock.offset_ms
        heard_client = first + 60.0 + offset
        ws.send(json.dumps({"type": "heard", "turn": turn, "t": heard_client, "method": "test"}))
        heard, _ = recv_until(ws, lambda m: m["type"] == "heard")
        assert heard["heard_delay_ms"] == pytest.approx(60.0, abs=1e-6)
        assert heard["ttfa_heard_ms"] > data["ttfa_ms"]
        session = app.server.sessions[hello["token"]]
        assert session.turns[-1]["heard_delay_ms"] == pytest.approx(60.0)
        media, html_report = session.export("report.html")
        assert media.startswith("text/html") and "data:image/png;base64," in html_report


@pytest.mark.models
def test_busy_and_typed_turn_limits(app):
    with connect(app.ws_url, origin=app.url) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        assert app.server.slots.try_acquire()  # someone else is being answered
        try:
            ws.send(json.dumps({"type": "text", "text": "Hello?"}))
            busy, _ = recv_until(ws, lambda m: m["type"] in ("busy", "turn"))
            assert busy["type"] == "busy" and "max-concurrent-answers" in busy["message"]
        finally:
            app.server.slots.release()
        ws.send("{not json")
        err, _ = recv_until(ws, lambda m: m["type"] == "error")
        assert "bad message" in err["message"]


@pytest.mark.models
def test_disconnect_mid_answer_frees_the_slot(app):
    with connect(app.ws_url, origin=app.url) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(json.dumps({"type": "text", "text": "Talk for a long time please."}))
        recv_until(ws, lambda m: m["type"] == "token")
    deadline = time.monotonic() + 10
    while not app.server.slots.try_acquire():  # the cancelled answer gives its slot back
        assert time.monotonic() < deadline, "the slot was not released after the tab closed"
        time.sleep(0.05)
    app.server.slots.release()
    assert not app.server.sessions


@pytest.mark.models
def test_typed_turns_wait_for_the_models():
    gate = threading.Event()
    with running_app(build=gated_build(gate)) as app, connect(app.ws_url, origin=app.url, max_size=None) as ws:
        status, _ = recv_until(ws, lambda m: m["type"] == "status")
        assert not status["ready"] and f"step 1/{len(ModelLoader.STEPS)}: speech recognition" in status["stage"]
        ws.send(json.dumps({"type": "text", "text": "Are you there?"}))
        queued, _ = recv_until(ws, lambda m: m["type"] in ("info", "error", "turn"))
        assert queued["type"] == "info" and "queued" in queued["message"].lower()
        ws.send(json.dumps({"type": "text", "text": "Is anyone there?"}))  # like a new turn, it replaces the first
        replaced, _ = recv_until(ws, lambda m: m["type"] in ("info", "error", "turn"))
        assert "replaces" in replaced["message"]
        gate.set()
        done, seen = recv_until(ws, lambda m: m["type"] == "done")
        turns = [m["transcript"] for m in seen if isinstance(m, dict) and m["type"] == "turn"]
        assert turns == ["Is anyone there?"] and done["data"]["ttfa_ms"] > 0 and done["data"]["audio_seconds"] > 0
        statuses = [m for m in seen if isinstance(m, dict) and m["type"] == "status"]
        assert [m["stage"].split(": ", 1)[1] for m in statuses[:-1]] == list(ModelLoader.STEPS[1:])
        assert statuses[-1]["ready"] and [name for name, _ in statuses[-1]["step_s"]] == list(ModelLoader.STEPS)


@needs_espeak
@pytest.mark.models
def test_a_spoken_turn_waits_for_the_models():
    speech = speak("What is the capital of France?")
    silence = np.zeros(16000, np.float32)
    gate = threading.Event()
    with running_app(build=gated_build(gate)) as app, connect(app.ws_url, origin=app.url, max_size=None) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
        kept, _ = recv_until(ws, lambda m: m["type"] in ("info", "error"))
        assert kept["type"] == "info" and "kept" in kept["message"]
        send_speech(ws, np.concatenate([silence, speech, silence]))  # all of it while the models load
        assert app.server.loader.loading
        gate.set()
        done, seen = recv_until(ws, lambda m: m["type"] == "done")
        assert done["data"]["kind"] == "voice" and "capital" in done["data"]["transcript"].lower()
        assert any(isinstance(m, dict) and m["type"] == "status" and m["ready"] for m in seen)


def test_turns_queued_while_loading_get_the_loading_error():
    gate = threading.Event()
    with (
        running_app(build=gated_build(gate, "test loader stops here")) as app,
        connect(app.ws_url, origin=app.url) as ws,
    ):
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(json.dumps({"type": "text", "text": "Are you there?"}))
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "ptt"}))
        gate.set()
        failed, _ = recv_until(ws, lambda m: m["type"] == "status" and m["error"])
        assert "test loader stops here" in failed["error"] and not failed["ready"]
        errors = [recv_until(ws, lambda m: m["type"] == "error")[0]["message"] for _ in range(2)]
        assert all("failed to load" in e and "test loader stops here" in e for e in errors)


def test_the_app_is_ready_once_every_stage_is_warm(monkeypatch):
    """Warming up is part of loading: before the loader says ready, the VAD, ASR, TTS and both LLM modes have each
    run once, each in its own step (fakes that record what ran; the VAD is the real one)."""
    ran: list[str] = []
    feed = EndOfTurnDetector.feed

    def vad_feed(self, *args):
        ran.append("vad")
        return feed(self, *args)

    class RecordingASR:
        warmup = Transcriber.warmup

        def transcribe(self, audio):
            ran.append("asr")
            return ""

    class RecordingTTS(TTS):
        name, sample_rate = "recording", 16000

        def stream(self, text):
            ran.append("tts")
            yield np.zeros(160, np.float32)

    class RecordingLLM(ScriptedLLM):
        def stream_reply(self, messages, speculation, stats, cancel=None):
            ran.append(f"llm, speculation {'on' if speculation else 'off'}")
            return super().stream_reply(messages, speculation, stats, cancel)

    monkeypatch.setattr(EndOfTurnDetector, "feed", vad_feed)
    statuses: list[tuple[dict, set[str]]] = []
    loader = ModelLoader(
        AgentConfig(),
        lambda status: statuses.append((status, set(ran))),
        lambda progress: VoiceAgent(
            AgentConfig(), llm=RecordingLLM("Hi."), transcriber=RecordingASR(), tts=RecordingTTS()
        ),
    )
    loader.start()
    assert loader.finished.wait(30) and loader.ready, loader.error
    *loading, (ready, ran_when_ready) = statuses
    assert ready["ready"] and not any(status["ready"] for status, _ in loading)
    assert [(status["stage"].split(": ", 1)[1], before) for status, before in loading] == [
        ("warm-up: voice activity detection", set()),
        ("warm-up: speech recognition", {"vad"}),
        ("warm-up: text to speech", {"vad", "asr"}),
        ("warm-up: forward costs for the load-aware K", {"vad", "asr", "tts"}),
        ("warm-up: LLM, speculation off", {"vad", "asr", "tts"}),
        ("warm-up: LLM, speculation on", {"vad", "asr", "tts", "llm, speculation off"}),
    ]
    assert ran_when_ready == {"vad", "asr", "tts", "llm, speculation off", "llm, speculation on"}
    assert ran.count("vad") == ran.count("asr") == ran.count("llm, speculation on") == 1


@needs_espeak
@pytest.mark.models
def test_voice_turns_barge_in_and_push_to_talk(app):
    speech = speak("What is the capital of France?")
    silence = np.zeros(16000, np.float32)
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        hello, _ = recv_until(ws, lambda m: m["type"] == "hello")
        with connect(app.ws_url, origin=app.url) as other:
            other_hello, _ = recv_until(other, lambda m: m["type"] == "hello")
            assert len(app.server.sessions) == 2 and other_hello["token"] != hello["token"]  # one per tab
        ws.send(json.dumps({"type": "text", "text": "Say something long."}))
        recv_until(ws, lambda m: m["type"] == "done")  # generated; its audio is still "playing" in the page
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
        feeder = threading.Thread(target=send_speech, args=(ws, np.concatenate([silence, speech, silence])))
        feeder.start()
        flush, _ = recv_until(ws, lambda m: m["type"] == "flush")
        assert flush["reason"] == "barge-in"
        voice, seen = recv_until(ws, lambda m: m["type"] == "done")
        feeder.join()
        assert voice["data"]["kind"] == "voice" and "capital" in voice["data"]["transcript"].lower()
        # preemptive generation: the answer started at the pause on the same words, held until the turn ended
        early = [m["event"] for m in seen if isinstance(m, dict) and m["type"] == "early"]
        assert early == ["started", "kept"] and voice["data"]["saved_ms"]["preemptive"] > 0
        (announced,) = [m for m in seen if isinstance(m, dict) and m["type"] == "turn"]
        kinds = [(m["type"], m.get("event")) for m in seen if isinstance(m, dict)]
        assert announced["early"] and kinds.index(("early", "kept")) < kinds.index(("turn", None))  # held till then
        # a finished question: the short hang-over of --end-of-turn words, on frame boundaries
        assert voice["data"]["stages"]["end_of_turn_wait"] >= app.server.loader.config.turn_end.complete_ms - 40
        # Push-to-talk: releasing ends the turn, whatever the VAD thinks.
        ws.send(json.dumps({"type": "mic", "active": False, "mode": "handsfree"}))
        ws.send(json.dumps({"type": "mic", "active": True, "mode": "ptt"}))
        # Real time matters: the server stamps each frame with its arrival, so a burst would squeeze the speech.
        send_speech(ws, np.concatenate([silence[:4000], speech]))
        ws.send(json.dumps({"type": "mic", "active": False, "mode": "ptt"}))
        ptt, _ = recv_until(ws, lambda m: m["type"] == "done")
        assert ptt["data"]["kind"] == "voice" and "france" in ptt["data"]["transcript"].lower()
        assert [t["kind"] for t in app.server.sessions[hello["token"]].turns] == ["typed", "voice", "voice"]


class HeldLLM(ScriptedLLM):
    """Starts answering only once `go` is set: slow to a first token, like a first turn on a busy, cold machine."""

    def __init__(self) -> None:
        super().__init__("Paris is the capital of France. It is also its largest city.")
        self.go = threading.Event()
        self.go.set()

    def stream_reply(self, messages, speculation, stats, cancel=None):
        self.go.wait(30)
        yield from super().stream_reply(messages, speculation, stats, cancel)


@needs_espeak
@pytest.mark.models
def test_an_answer_interrupted_before_its_first_audio_has_no_ttfa():
    """Why the browser test once read ttfa_ms None: Chromium's fake microphone looped the question, and on a
    cold first run the first answer had no audio yet when the question came round again. That is a barge-in: the
    answer is cancelled before any audio, so it has no TTFA and says it was cancelled; the next turn is measured."""
    shared = shared_agent()
    llm = HeldLLM()
    speech = speak("What is the capital of France?")
    silence = np.zeros(16000, np.float32)

    def build(progress):
        return VoiceAgent(tiny_config(), llm=llm, transcriber=shared.transcriber, tts=shared.tts)

    with running_app(build=build) as app:
        wait_ready(app)
        llm.go.clear()
        with connect(app.ws_url, origin=app.url, max_size=None) as ws:
            recv_until(ws, lambda m: m["type"] == "status")
            ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
            send_speech(ws, np.concatenate([silence, speech, silence]))
            first, _ = recv_until(ws, lambda m: m["type"] == "turn")
            send_speech(ws, np.concatenate([speech, silence]))  # asked again before any answer was heard
            flush, _ = recv_until(ws, lambda m: m["type"] == "flush")
            llm.go.set()
            interrupted, _ = recv_until(ws, lambda m: m["type"] == "done")
            second, _ = recv_until(ws, lambda m: m["type"] == "done")
    assert flush["reason"] == "barge-in" and interrupted["turn"] == first["turn"]
    data = interrupted["data"]
    assert data["cancelled"] and data["ttfa_ms"] is None and data["audio_seconds"] == 0
    assert "tts_first_audio" not in data["stages"] and "capital" in data["transcript"].lower()
    data = second["data"]
    assert data["kind"] == "voice" and not data["cancelled"] and data["ttfa_ms"] > 0 and data["audio_seconds"] > 0


def test_cli_options_reach_the_server():
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(
        [
            "--port",
            "9000",
            "--max-concurrent-answers",
            "2",
            "--hangover-ms",
            "200",
            "--end-of-turn",
            "silence",
            "--no-preemptive",
            "--draft",
            "ngram",
            "--asr",
            "base",
            "--tts",
            "piper",
            "--k",
            "adaptive",
        ]
    )
    assert (args.host, args.port, args.max_concurrent_answers) == ("127.0.0.1", 9000, 2)  # loopback by default
    config = agent_config_from_args(args)
    assert (config.turn_end.mode, config.turn_end.silence_ms, config.preemptive) == ("silence", 200, False)
    assert (config.prefill_while_speaking, config.asr_model, config.tts) == (True, "base", "piper")
    assert (config.engine.draft, config.engine.k) == ("ngram", "adaptive")
    config, options = server.server_setup(args)
    assert config.engine.batched and config.engine.load_aware and options.max_concurrent_answers == 2
    parser = argparse.ArgumentParser()
    server.add_arguments(parser)
    args = parser.parse_args(["--llm-url", "http://gpu:8000/v1", "--background-conversations", "3"])
    config, options = server.server_setup(args)
    assert not config.engine.batched  # the remote server batches; nothing to batch here
    assert options.max_concurrent_answers == server.ServerOptions.max_concurrent_answers
    assert options.background_conversations == 3


@pytest.mark.models
def test_load_control_batches_background_conversations_with_a_turn(app):
    """The presenter's load control: simulated conversations share the target's forwards with a real turn, whose
    token messages report the batch size and the K chosen; every tab hears the new load; out of range is refused."""
    with connect(app.ws_url, origin=app.url, max_size=None) as ws:
        status, _ = recv_until(ws, lambda m: m["type"] == "status" and m["ready"])
        assert status["batched"] and status["background"] == 0
        try:
            ws.send(json.dumps({"type": "settings", "background": 2}))
            recv_until(ws, lambda m: m["type"] == "status" and m.get("background") == 2)
            ws.send(json.dumps({"type": "text", "text": "Tell me about the weather."}))
            done, seen = recv_until(ws, lambda m: m["type"] == "done")
            tokens = [m for m in seen if isinstance(m, dict) and m["type"] == "token"]
            assert max(m["batch_size"] for m in tokens) == 3  # two simulated conversations and this turn
            assert all(0 <= m["k_chosen"] <= 16 for m in tokens) and done["data"]["answer"]
            assert done["data"]["settings"]["load_aware"] is None  # never touched: the default, load-aware
            ws.send(json.dumps({"type": "settings", "load_aware": False}))
            ws.send(json.dumps({"type": "text", "text": "And tomorrow?"}))
            done, _ = recv_until(ws, lambda m: m["type"] == "done")
            assert done["data"]["settings"]["load_aware"] is False and done["data"]["answer"]
            ws.send(json.dumps({"type": "settings", "background": 99}))
            err, _ = recv_until(ws, lambda m: m["type"] == "error")
            assert "0..16" in err["message"]
        finally:
            ws.send(json.dumps({"type": "settings", "background": 0}))
            recv_until(ws, lambda m: m["type"] == "status" and m.get("background") == 0)
    scheduler = app.server.loader.agent.scheduler
    deadline = time.monotonic() + 10
    while scheduler.active:  # the simulated conversations stop at their next step
        assert time.monotonic() < deadline, "background conversations kept running"
        time.sleep(0.05)


@pytest.mark.models
def test_specvoice_app_starts_loads_and_stops(tiny_engine):
    """The real entry point: models load in the background while the page is already served; Ctrl-C stops it
    cleanly (130, the CLI's code for an interrupt, and no traceback)."""
    port = free_port()
    cmd = [sys.executable, "-m", "commands.cli", "app", "--port", str(port), *tiny_engine.cli_args]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        statuses, deadline = [], time.monotonic() + 120
        while not (statuses and statuses[-1]["ready"]):
            assert proc.poll() is None and time.monotonic() < deadline, "the app exited or never got ready"
            with contextlib.suppress(OSError):
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/specvoice/status", timeout=5) as r:
                    statuses.append(json.load(r))
            time.sleep(0.2)
        assert statuses[-1]["error"] is None and statuses[-1]["drafters"] == ["draft-model", "ngram"]
        costs = statuses[-1]["forward_costs"]  # the grid the load-aware K measured (or read) at warm-up, for the page
        assert costs["grid"]["batches"] == list(COST_BATCHES) and len(costs["batch1_ms"]) == 1 + max(K_CHOICES)
        assert costs["batch1_ms"][0] == pytest.approx(1000 * costs["grid"]["seconds"][0][0])
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/", timeout=10) as r:
            page = r.read().decode()
        assert "/specvoice/static/app.js" in page
    finally:
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=20)
    assert proc.returncode == 130 and "Traceback" not in out, out
    steps = ModelLoader.STEPS
    for i, step in enumerate(steps):  # the terminal shows each loading step, warm-up included, as it starts
        assert re.search(rf"loading step {i + 1}/{len(steps)}: {re.escape(step)} \(\d+\.\d s elapsed\)", out), out
    assert re.search(r"warmed up in \d+\.\d s: ready", out), out


@pytest.mark.models
def test_uploads_are_capped(app):
    with connect(app.ws_url, origin=app.url) as ws:
        recv_until(ws, lambda m: m["type"] == "status")
        ws.send(b"\x00" * (2 * 16000 + 2))  # over one second in one mic frame: refused, the socket stays
        err, _ = recv_until(ws, lambda m: m["type"] == "error")
        assert "mic frames" in err["message"]
        ws.send(b"\x00" * (app.server.options.max_message_bytes + 2))  # over the message cap: the socket closes
        with pytest.raises(ConnectionClosed) as closed:
            recv_until(ws, lambda m: False, timeout=10)
        assert closed.value.rcvd is not None and closed.value.rcvd.code == 1009  # message too big


@needs_espeak
@pytest.mark.models
def test_a_held_turn_is_cut_at_the_length_limit():
    speech = speak("What is the capital of France?")
    with running_app(max_turn_s=1.0) as app:
        wait_ready(app)
        with connect(app.ws_url, origin=app.url, max_size=None) as ws:
            recv_until(ws, lambda m: m["type"] == "status")
            ws.send(json.dumps({"type": "mic", "active": True, "mode": "ptt"}))
            send_speech(ws, speech)
            cut, _ = recv_until(ws, lambda m: m["type"] == "info")
            assert "length limit" in cut["message"]
            done, _ = recv_until(ws, lambda m: m["type"] == "done")
            ws.send(json.dumps({"type": "mic", "active": False, "mode": "ptt"}))
            assert done["data"]["kind"] == "voice" and "france" not in done["data"]["transcript"].lower()


@pytest.mark.models
def test_unavailable_drafter_is_refused_but_the_turn_answered():
    shared = shared_agent()
    config = tiny_config()
    config.engine.draft = "ngram"  # no draft model loaded

    def build(progress):
        return VoiceAgent(config, transcriber=shared.transcriber, tts=shared.tts)

    with running_app(build=build) as app, connect(app.ws_url, origin=app.url, max_size=None) as ws:
        status, _ = recv_until(ws, lambda m: m["type"] == "status" and m["ready"])
        assert status["drafters"] == ["ngram"]
        ws.send(json.dumps({"type": "settings", "speculation": True, "drafter": "draft-model"}))
        ws.send(json.dumps({"type": "text", "text": "Hello?"}))
        err, _ = recv_until(ws, lambda m: m["type"] == "error")
        assert "settings not applied" in err["message"] and "no draft model" in err["message"]
        done, _ = recv_until(ws, lambda m: m["type"] == "done")
        assert done["data"]["settings"]["drafter"] is None and done["data"]["answer"]
