"""The app's load control: simulated conversations batched with a real answer, and the load a tab asked for ending
when that tab closes, over the floor the server was started with."""

from __future__ import annotations

import threading

import pytest

from app.background import BackgroundLoad
from app.server import AppServer, ServerOptions
from pipeline.agent import AgentConfig, VoiceAgent
from specdec.engine import GenerationConfig, collect
from specdec.scheduler import BatchScheduler
from tests.support.engine import draft_factory, make_engine, target_only, tiny_prompts
from tests.support.fakes import FakeTTS


class SilentASR:
    def transcribe(self, audio):
        return ""

    def warmup(self):
        pass


def wait_until(condition, what: str) -> None:
    for _ in range(200):
        if condition():
            return
        threading.Event().wait(0.05)
    raise AssertionError(what)


def wait_idle(scheduler: BatchScheduler) -> None:
    wait_until(lambda: scheduler.active == 0, "background conversations kept running")  # they stop at a step


def test_background_load_runs_and_stops(tiny_engine):
    target, draft = tiny_engine.models
    scheduler = BatchScheduler(make_engine(target, draft_factory(draft), "3"))
    errors: list[Exception] = []
    seen: list[int] = []
    load = BackgroundLoad(
        scheduler,
        tiny_prompts(target, 2, seed=17),
        GenerationConfig(8),
        on_event=lambda i, ev, t: seen.append(i),
        on_error=errors.append,
    )
    load.set(2)
    prompt = tiny_prompts(target, 1, seed=18)[0]
    tokens, events = collect(scheduler.stream(prompt, GenerationConfig(30)))
    assert tokens == target_only(target, prompt, 30)
    assert max(ev.batch_size for ev in events) == 3
    load.set(0)
    wait_idle(scheduler)
    assert load.count == 0 and not errors and set(seen) == {0, 1}
    with pytest.raises(ValueError):
        load.set(-1)


def test_the_load_a_tab_asked_for_ends_with_it_and_the_servers_floor_stays(tiny_engine):
    config = AgentConfig(engine=tiny_engine.spec_with(batched=True, load_aware=False), max_new_tokens=8)
    server = AppServer(
        config,
        ServerOptions(background_conversations=1),
        build=lambda progress: VoiceAgent(config, transcriber=SilentASR(), tts=FakeTTS()),
    )
    with pytest.raises(ValueError, match="still loading"):
        server.set_background(2, "tab-a")
    server.loader.start()
    assert server.loader.finished.wait(60) and server.loader.ready, server.loader.error
    try:
        # the floor starts with the models (the tabs are told once loading has finished)
        wait_until(lambda: server.status()["background"] == 1, "--background-conversations did not start")
        server.set_background(3, "tab-a")
        server.set_background(2, "tab-b")  # no tab takes away the load another asked for
        assert server.status()["background"] == 3
        server.set_background(0, "tab-a")
        assert server.status()["background"] == 2
        server.release_background("tab-b")  # tab b closed: its load ends, the floor stays
        assert server.status()["background"] == 1
        server.release_background("tab-a")
        assert server.status()["background"] == 1
        with pytest.raises(ValueError, match="0..16"):
            server.set_background(17, "tab-a")
    finally:
        if server.background is not None:
            server.background.load.set(0)
            wait_idle(server.background.load.scheduler)
