"""Test helpers for the app: the tiny-engine agent (loaded once per test process) and an in-process app server.

    from browser_util import running_app, shared_agent, gated_build, CHROMIUM
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator

import numpy as np
import soundfile as sf

from app.server import AppServer, ServerOptions
from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.audio import SAMPLE_RATE
from specdec.build import EngineSpec

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                 "--disable-background-networking", "--disable-component-update", "--disable-sync",
                 "--use-fake-ui-for-media-stream", "--use-fake-device-for-media-stream",
                 "--autoplay-policy=no-user-gesture-required"]


def tiny_config() -> AgentConfig:
    """Random tiny target + draft (instant to load, gibberish answers); real ASR and TTS.

    One turn of history: the tiny target's 512-token context holds no more next to the system prompt."""
    return AgentConfig(engine=EngineSpec(target="tiny-random-target", draft="tiny-random-draft", k="3",
                                         dtype="float32", draft_quant="none", draft_vocab=0), history_turns=1)


@functools.cache
def shared_agent() -> VoiceAgent:
    """One agent for every app test in this process (loading ASR and TTS costs seconds); each app warms it up."""
    return VoiceAgent(tiny_config())


def gated_build(gate: threading.Event, error: str | None = None) -> Callable:
    """Model loading (for running_app) that waits for gate, then fails with error or gives the shared agent."""
    def build(progress: Callable[[int], None]) -> VoiceAgent:
        progress(0)
        gate.wait(30)
        if error:
            raise RuntimeError(error)
        progress(1)
        progress(2)
        return shared_agent()
    return build


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class RunningApp:
    def __init__(self, server: AppServer, thread: threading.Thread, uv) -> None:
        self.server = server
        self.thread = thread
        self.uv = uv
        self.url = f"http://127.0.0.1:{server.options.port}"
        self.ws_url = f"ws://127.0.0.1:{server.options.port}/specvoice/ws"


@contextlib.contextmanager
def running_app(build: Callable | None = None, **options) -> Iterator[RunningApp]:
    """`specvoice app` in a thread on a free port; build(progress) -> agent replaces model loading."""
    import uvicorn

    server = AppServer(tiny_config(), ServerOptions(port=free_port(), **options),
                       build=build or (lambda progress: shared_agent()))
    uv = uvicorn.Server(server.uvicorn_config(server.build_app()))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    server.loader.start()
    deadline = time.monotonic() + 30
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the app server did not start")
        time.sleep(0.05)
    try:
        yield RunningApp(server, thread, uv)
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def wait_ready(app: RunningApp, timeout: float = 60) -> None:
    if not app.server.loader.finished.wait(timeout) or app.server.loader.error:
        raise RuntimeError(f"models not ready: {app.server.loader.error}")


def recv_until(ws, want: Callable[[dict], bool], timeout: float = 30) -> tuple[dict, list]:
    """Read a websockets sync client until a JSON message satisfies want; returns it and everything read."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no matching message; saw {[m if isinstance(m, dict) else len(m) for m in seen]}")
        raw = ws.recv(timeout=left)
        msg = json.loads(raw) if isinstance(raw, str) else raw
        seen.append(msg)
        if isinstance(msg, dict):
            if msg.get("type") == "ping":  # keep the clock estimate fed, like the page does
                ws.send(json.dumps({"type": "pong", "ts": msg["ts"], "tc": time.perf_counter() * 1000}))
            elif want(msg):
                return msg, seen


def utterance_wav(path: str | os.PathLike[str], text: str, lead_s: float = 0.5, tail_s: float = 4.0) -> float:
    """Speech padded with silence (Chromium's fake capture loops the file); returns the speech's length in s."""
    from speech import speak

    speech = speak(text, rate=SAMPLE_RATE)
    pad = [np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (lead_s, tail_s)]
    sf.write(os.fspath(path), np.concatenate([pad[0], speech, pad[1]]), SAMPLE_RATE, subtype="PCM_16")
    return len(speech) / SAMPLE_RATE
