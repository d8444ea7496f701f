"""`specvoice bench-heard`: how long after the server emits an answer's first sample the browser plays it.

Starts the app in this process on a free loopback port, drives headless Chromium through N typed turns and writes
each turn's heard delay and TTFA (server side and heard) with their medians and quartiles. Typed turns start at
submission, so no microphone is needed; the default engine is the tiny random pair, so it runs anywhere (the
heard delay is the audio path's, not the model's). Playwright comes with the test extra only.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import os
import socket
import threading
import time
from collections.abc import Iterator
from dataclasses import asdict, replace

from app.server import AppServer, ServerOptions
from app.stats import spread
from pipeline.agent import AgentConfig
from specdec.build import TINY_ENGINE
from specdec.metrics import DEFINITIONS

from .options import add_agent_arguments, agent_config_from_args, option_defaults, positive_int

CHROMIUM = "/usr/bin/chromium"
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",
    "--use-fake-device-for-media-stream",
    "--autoplay-policy=no-user-gesture-required",
]
GOAL_MS = 150.0  # the heard delay's goal, for the median
METRICS = ("heard_delay_ms", "ttfa_ms", "ttfa_heard_ms")
QUESTIONS = (
    "What is the capital of France?",
    "Name a colour.",
    "How many legs does a spider have?",
    "Why is the sky blue?",
    "Tell me a short joke.",
)
TURN_TIMEOUT_S = 120  # a whole answer from the real models on two CPU cores, with room to spare
NEEDS_PLAYWRIGHT = "needs the test extra: scripts/setup.sh --test"


def tiny_config() -> AgentConfig:
    """Random tiny target + draft (instant to load, gibberish answers); real ASR and TTS.

    One turn of history: the tiny target's 512-token context holds no more next to the system prompt. Batched, as
    every voice command runs the engine (commands/options.py, agent_config_from_args)."""
    return AgentConfig(engine=replace(TINY_ENGINE, batched=True), history_turns=1)  # a copy: callers may change it


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serving(server: AppServer, start_timeout_s: float = 30) -> Iterator[str]:
    """The app's web server on a thread, its models loading in the background as in `specvoice app`; yields its URL."""
    import uvicorn

    uv = uvicorn.Server(server.uvicorn_config(server.build_app()))
    thread = threading.Thread(target=uv.run, name="uvicorn", daemon=True)
    thread.start()
    server.loader.start()
    deadline = time.monotonic() + start_timeout_s
    while not uv.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("the app server did not start")
        time.sleep(0.05)
    try:
        yield f"http://{server.options.host}:{server.options.port}"
    finally:
        uv.should_exit = True
        thread.join(timeout=10)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--turns", type=positive_int, default=5, help="typed turns to measure")
    parser.add_argument("--json", required=True, help="where to write the per-turn figures and their summary")
    parser.add_argument("--chromium", default=CHROMIUM, help="the Chromium executable Playwright drives")
    add_agent_arguments(parser)
    parser.set_defaults(**option_defaults(tiny_config()))


def summarize(turns: list[dict], config: dict) -> dict:
    """The JSON written: per-turn figures, their quartiles, the goal and whether the median met it, definitions."""
    summary = {m: spread([t[m] for t in turns]) for m in METRICS}
    median = summary["heard_delay_ms"]["median"]
    return {
        "turns": turns,
        "summary": summary,
        "goal": {"metric": "heard_delay_ms", "statistic": "median", "max_ms": GOAL_MS, "met": median <= GOAL_MS},
        "methods": sorted({t["method"] for t in turns}),
        "definitions": {m: DEFINITIONS[m] for m in METRICS},
        "config": config,
    }


def typed_turn(page, text: str) -> dict:
    """Type one question and wait until its answer is done and reported heard; the page's view of that turn."""
    before = page.evaluate("specvoice.order.length")
    page.fill("#text-input", text)
    page.press("#text-input", "Enter")
    page.wait_for_function(
        f"specvoice.order.length > {before} && (t => t.data && t.heard)(specvoice.turns[specvoice.current])",
        timeout=TURN_TIMEOUT_S * 1000,
    )
    t = page.evaluate("(t => ({turn: t.turn, data: t.data, heard: t.heard}))(specvoice.turns[specvoice.current])")
    heard = t["heard"]
    return {
        "turn": t["turn"],
        "heard_delay_ms": heard["heard_delay_ms"],
        "ttfa_ms": t["data"]["ttfa_ms"],
        "ttfa_heard_ms": heard["ttfa_heard_ms"],
        "method": heard["heard_method"],
        "clock_rtt_ms": heard["clock_rtt_ms"],
        "detail": heard["heard_detail"],
    }


def main(args: argparse.Namespace) -> int:
    try:
        from playwright.sync_api import sync_playwright
    except ImportError:
        raise RuntimeError(NEEDS_PLAYWRIGHT) from None
    if not os.path.exists(args.chromium):
        raise FileNotFoundError(f"no Chromium at {args.chromium} (Debian: apt-get install chromium; or --chromium)")
    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    logging.getLogger("specvoice.app").setLevel(logging.INFO)  # loading progress: real models take a while
    agent_config = agent_config_from_args(args)
    server = AppServer(agent_config, ServerOptions(port=free_port()))
    turns = []
    with serving(server) as url, sync_playwright() as p:
        server.loader.finished.wait()
        if server.loader.error:
            raise RuntimeError(f"the models did not load: {server.loader.error}")
        browser = p.chromium.launch(executable_path=args.chromium, args=CHROMIUM_ARGS)
        try:
            page = browser.new_page()
            page.goto(url)
            page.wait_for_function("window.specvoice && specvoice.status && specvoice.status.ready", timeout=60_000)
            for i in range(args.turns):
                turn = typed_turn(page, QUESTIONS[i % len(QUESTIONS)])
                turns.append(turn)
                print(
                    f"turn {i + 1}/{args.turns}: heard delay {turn['heard_delay_ms']:.0f} ms, TTFA "
                    f"{turn['ttfa_ms']:.0f} ms, heard {turn['ttfa_heard_ms']:.0f} ms ({turn['method']})"
                )
        finally:
            browser.close()
    config = {
        "turns": args.turns,
        "agent": asdict(agent_config),
        "chromium": args.chromium,
        "chromium_args": CHROMIUM_ARGS,
        "speculation": True,
    }  # the page's default switch position
    result = summarize(turns, config)
    with open(args.json, "w") as f:
        json.dump(result, f, indent=2)
    s, goal = result["summary"]["heard_delay_ms"], result["goal"]
    print(
        f"heard delay median {s['median']:.0f} ms (p25–p75 {s['p25']:.0f}–{s['p75']:.0f} ms) over {args.turns} "
        f"turns; goal ≤ {GOAL_MS:g} ms {'met' if goal['met'] else 'NOT met'}; wrote {args.json}"
    )
    return 0
