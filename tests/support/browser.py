"""Test helpers for the app: the tiny-engine agent (loaded once per test process) and an in-process app server.

from tests.support.browser import running_app, shared_agent, gated_build, CHROMIUM
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import os
import threading
from collections.abc import Callable, Iterator

import numpy as np
import soundfile as sf

from app.protocol import WS_PATH
from app.server import AppServer, ServerOptions

# Re-exported for the tests: `specvoice bench-heard` launches Chromium and serves the app the same way.
from commands.bench_heard import CHROMIUM as CHROMIUM
from commands.bench_heard import CHROMIUM_ARGS as CHROMIUM_ARGS
from commands.bench_heard import free_port as free_port
from commands.bench_heard import serving, tiny_config
from commands.voice_client import recv_until as recv_until  # the WebSocket client's reader, shared with bench-users
from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.audio import SAMPLE_RATE


@functools.cache
def shared_agent() -> VoiceAgent:
    """One agent for every app test in this process (loading ASR and TTS costs seconds); each app warms it up."""
    return VoiceAgent(app_tiny_config())


def app_tiny_config() -> AgentConfig:
    """tiny_config (batched, as `specvoice app` runs it). The tiny draft is as large as the tiny target, so a measured
    load-aware K (or the governor) rightly drafts nothing; these tests exercise the plumbing of a drafting answer, so
    every step drafts its K."""
    config = tiny_config()
    config.engine = dataclasses.replace(config.engine, load_aware=False, auto_off=False)
    return config


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


class RunningApp:
    def __init__(self, server: AppServer, url: str) -> None:
        self.server = server
        self.url = url
        self.ws_url = url.replace("http://", "ws://", 1) + WS_PATH


@contextlib.contextmanager
def running_app(build: Callable | None = None, **options) -> Iterator[RunningApp]:
    """`specvoice app` in a thread on a free port; build(progress) -> agent replaces model loading."""
    server = AppServer(
        app_tiny_config(), ServerOptions(port=free_port(), **options), build=build or (lambda progress: shared_agent())
    )
    with serving(server) as url:
        yield RunningApp(server, url)


def wait_ready(app: RunningApp, timeout: float = 60) -> None:
    if not app.server.loader.finished.wait(timeout) or app.server.loader.error:
        raise RuntimeError(f"models not ready: {app.server.loader.error}")


def utterance_wav(path: str | os.PathLike[str], text: str, lead_s: float = 0.5, tail_s: float = 4.0) -> float:
    """Speech padded with silence (Chromium's fake capture loops the file); returns the speech's length in s."""
    from tests.support.speech import speak

    speech = speak(text, rate=SAMPLE_RATE)
    pad = [np.zeros(int(s * SAMPLE_RATE), np.float32) for s in (lead_s, tail_s)]
    sf.write(os.fspath(path), np.concatenate([pad[0], speech, pad[1]]), SAMPLE_RATE, subtype="PCM_16")
    return len(speech) / SAMPLE_RATE
