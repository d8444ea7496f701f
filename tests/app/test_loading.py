"""The app while its models load: turns typed or spoken meanwhile are kept and answered, ready means warm, and
`specvoice app` starts, loads and stops."""

from __future__ import annotations

import contextlib
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
from websockets.sync.client import connect

from app.page import K_CHOICES
from app.server import ModelLoader
from commands.bench_server import wait_until
from commands.voice_client import send_speech
from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.asr import Transcriber
from pipeline.llm_provider import WARMUP_STEPS_PER_MODE, SharedProvider
from pipeline.tts import TTS
from pipeline.vad import EndOfTurnDetector
from specdec.cost_grid import COST_BATCHES
from tests.support.browser import free_port, gated_build, recv_until, running_app
from tests.support.fakes import ScriptedLLM
from tests.support.speech import needs_espeak, speak


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
        memory = statuses[-1]["memory"]  # the server's resident and peak memory, what the status reports
        assert 0 < memory["resident_mb"] <= memory["peak_mb"]


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
        seen: list[dict] = []  # the failed status and the two errors, in whatever order the threads send them

        def all_in(m: dict) -> bool:
            seen.append(m)
            failed = any(x["type"] == "status" and x["error"] for x in seen)
            return failed and [x["type"] for x in seen].count("error") == 2

        recv_until(ws, all_in)
        failed = next(m for m in seen if m["type"] == "status" and m["error"])
        assert "test loader stops here" in failed["error"] and not failed["ready"]
        errors = [m["message"] for m in seen if m["type"] == "error"]
        assert all("failed to load" in e and "test loader stops here" in e for e in errors)


def test_the_app_is_ready_once_every_stage_is_warm(monkeypatch):
    """Warming up is part of loading: before the loader says ready, the VAD, ASR, TTS and both LLM modes have each
    run once, each in its own step (fakes that record what ran; the VAD is the real one)."""
    ran: list[str] = []
    feed = EndOfTurnDetector.feed

    loader_thread: list[int] = []  # the feed is patched for every thread: a loader left by another test feeds too

    def vad_feed(self, *args):
        if threading.get_ident() in loader_thread:
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
        def stream_reply(self, messages, speculation, stats, cancel=None, end_probe=False):
            ran.append(f"llm, speculation {'on' if speculation else 'off'}")
            return super().stream_reply(messages, speculation, stats, cancel)

    monkeypatch.setattr(EndOfTurnDetector, "feed", vad_feed)
    statuses: list[tuple[dict, set[str]]] = []

    def build(progress):
        loader_thread.append(threading.get_ident())
        return VoiceAgent(
            AgentConfig(), SharedProvider(RecordingLLM("Hi.")), transcriber=RecordingASR(), tts=RecordingTTS()
        )

    loader = ModelLoader(
        AgentConfig(),
        lambda status: statuses.append((status, set(ran))),
        build,
    )
    loader.start()
    assert loader.finished.wait(30) and loader.ready, loader.error
    assert wait_until(lambda: statuses[-1][0]["ready"], 10)  # the ready status is sent just after finished is set
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


def test_the_llm_warm_up_stops_after_a_few_steps_of_each_mode():
    """A prefill and a few steps pay the first-call costs: a long warm-up reply is cut, in both modes."""
    steps: list[bool] = []

    class Counting(ScriptedLLM):
        def stream_reply(self, messages, speculation, stats, cancel=None, end_probe=False):
            for delta in super().stream_reply(messages, speculation, stats, cancel):
                steps.append(speculation)
                yield delta

    SharedProvider(Counting(" ".join(["word"] * 40), step_s=0)).warmup()
    assert steps == [False] * WARMUP_STEPS_PER_MODE + [True] * WARMUP_STEPS_PER_MODE


def test_gradio_is_imported_without_rewriting_its_type_stubs():
    """At import, Gradio rewrites each component's .pyi stub from its source (1.3-1.9 s of every start here): the
    app's import skips that one step, and leaves the import system as it found it."""
    code = (
        "import sys; from app.page import import_gradio; gr = import_gradio(); import gradio.component_meta as m; "
        "print(m.create_or_modify_pyi.__module__, gr.Blocks.__name__, len(sys.meta_path))"
    )
    before = subprocess.run([sys.executable, "-c", "import sys; print(len(sys.meta_path))"], capture_output=True)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["app.page", "Blocks", before.stdout.decode().strip()]


def _described(**engine) -> dict:
    """ModelLoader.describe() of the default config with some engine fields changed."""
    import dataclasses

    config = AgentConfig()
    return ModelLoader(dataclasses.replace(config, engine=dataclasses.replace(config.engine, **engine))).describe()


def test_the_page_says_whether_openings_are_drafted_from_the_question():
    def says(**engine) -> bool:
        return _described(**engine)["opening_echo"]

    assert says() and says(draft="heads")  # the default: the shipped heads, echoing the question at an opening
    assert not says(opening_echo=False) and not says(draft="ngram") and not says(draft="qwen-0.5b")


def test_the_page_says_whether_openings_are_guessed_from_the_shipped_table(tmp_path):
    def guesses(**engine) -> bool:
        return _described(**engine)["opening_guesses"]

    assert guesses()  # the default target ships its table
    assert not guesses(opening_table="none") and not guesses(opening_echo=False) and not guesses(draft="ngram")
    assert guesses(opening_table=str(tmp_path / "any.json"))  # a file asked for by name: its absence fails the load
