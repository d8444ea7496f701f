"""The app's pieces without a socket: wire formats, clock sync, origin check, answer slots, reports, options."""

from __future__ import annotations

import argparse
import csv
import io
import json
import threading

import numpy as np
import pytest
from websockets.exceptions import InvalidStatus
from websockets.sync.client import connect

from app import report, server
from app.guard import AllowedList
from app.host import AnswerSlots
from app.protocol import (
    AUDIO_HEADER,
    FLAG_REPLAY,
    ClockSync,
    decode_mic_frame,
    encode_mic_frame,
    pack_audio,
    unpack_audio,
)
from commands import app as app_command
from commands.options import agent_config_from_args
from pipeline.preemptive import Hold
from pipeline.timeline import STAGES
from tests.support.browser import gated_build, running_app

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
    for cut in (data[:10], data[:-1]):  # a short header, half a sample
        with pytest.raises(ValueError):
            unpack_audio(cut)


def test_mic_frames_encode_as_the_page_writes_them():
    samples = np.array([0.5, -0.25, 2.0, -2.0, 0.7 / 32767], np.float32)
    frame = encode_mic_frame(samples)
    assert np.frombuffer(frame, "<i2").tolist() == [16384, -8192, 32767, -32767, 1]  # rounded, clipped: worklets.js
    assert np.allclose(decode_mic_frame(frame), np.clip(samples, -1, 1), atol=1e-4)


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
    assert AllowedList.for_server(bind, 7860).origin_ok(origin, host) is ok


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
    assert AllowedList.for_server(bind, 7860, allowed).origin_ok(origin, host) is ok


def test_allowed_origin_option_takes_exact_origins_only(capsys):
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    assert app_command.server_setup(parser.parse_args([]))[1].allowed_origins == ()  # no other origin by default
    args = parser.parse_args(["--allowed-origin", PROXY, "--allowed-origin", "http://localhost:8080"])
    assert app_command.server_setup(args)[1].allowed_origins == (PROXY, "http://localhost:8080")
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


def test_an_early_answer_waits_for_a_slot_while_its_turn_is_undecided():
    """Woken by the slot's release or the turn's decision (a condition, not a poll)."""
    slots = AnswerSlots(1)
    assert slots.try_acquire()
    results: list[bool] = []

    def wait_for(hold: Hold) -> threading.Thread:
        thread = threading.Thread(target=lambda: results.append(slots.acquire_for(hold)))
        thread.start()
        return thread

    freed = wait_for(Hold("freed"))
    slots.release()  # the slot goes to the waiting early answer
    freed.join(10)
    assert results == [True] and not slots.try_acquire()
    for decide, expected in ((Hold.confirm, False), (Hold.discard, False)):
        hold = Hold("undecided")
        thread = wait_for(hold)
        decide(hold)  # confirmed with no room: told busy; discarded: goes quietly
        thread.join(10)
        assert not thread.is_alive() and results[-1] is expected
    slots.release()
    gone = Hold("gone")
    gone.discard()
    assert not slots.acquire_for(gone) and slots.acquire_for(None)  # a discarded answer takes no free slot
    slots.release()
    with pytest.raises(ValueError, match="more often"):
        slots.release()


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


def test_cli_options_reach_the_server():
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
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
            "--max-prompt-tokens",
            "900",
            "--prefill-chunk",
            "64",
        ]
    )
    assert (args.host, args.port, args.max_concurrent_answers) == ("127.0.0.1", 9000, 2)  # loopback by default
    config = agent_config_from_args(args)
    assert (config.turn_end.mode, config.turn_end.silence_ms, config.preemptive) == ("silence", 200, False)
    assert (config.prefill_while_speaking, config.asr_model, config.tts) == (True, "base", "piper")
    assert (config.engine.draft, config.engine.k) == ("ngram", "adaptive")
    assert (config.prompt_tokens, config.prefill_chunk) == (900, 64)
    config, options = app_command.server_setup(args)
    assert config.engine.batched and config.engine.load_aware and options.max_concurrent_answers == 2
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    args = parser.parse_args(["--llm-url", "http://gpu:8000/v1", "--background-conversations", "3"])
    config, options = app_command.server_setup(args)
    assert not config.engine.batched  # the remote server batches; nothing to batch here
    assert options.max_concurrent_answers == server.ServerOptions.max_concurrent_answers
    assert options.background_conversations == 3
