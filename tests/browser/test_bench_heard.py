"""`specvoice bench-heard`: its options and JSON summary (fast), and one short run in headless Chromium (browser)."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import pytest

from commands import bench_heard, cli
from commands.options import agent_config_from_args
from specdec.metrics import DEFINITIONS
from tests.support.engine import ROOT


def parse(*argv: str):
    return cli.build_parser().parse_args(["bench-heard", *argv])


def fake_turn(delay: float, method: str = "getOutputTimestamp") -> dict:
    return {
        "turn": 1,
        "heard_delay_ms": delay,
        "ttfa_ms": 300.0,
        "ttfa_heard_ms": 300.0 + delay,
        "method": method,
        "clock_rtt_ms": 1.0,
        "detail": {},
    }


def test_defaults_are_the_tiny_engine_and_options_override_them() -> None:
    args = parse("--json", "h.json")
    assert args.turns == 5 and args.chromium == bench_heard.CHROMIUM
    assert agent_config_from_args(args) == bench_heard.tiny_config()
    args = parse("--turns", "3", "--json", "h.json", "--target", "qwen-1.5b", "--draft", "ngram", "--k", "adaptive")
    engine = agent_config_from_args(args).engine
    assert args.turns == 3 and (engine.target, engine.draft, engine.k) == ("qwen-1.5b", "ngram", "adaptive")


@pytest.mark.parametrize("argv", [["--turns", "0", "--json", "h.json"], ["--turns", "2"]])
def test_rejects_no_turns_and_a_missing_json_path(argv: list[str]) -> None:
    with pytest.raises(SystemExit):
        parse(*argv)


def test_summary_has_quartiles_goal_and_definitions() -> None:
    turns = [fake_turn(d) for d in (40.0, 10.0, 30.0, 20.0, 50.0)]
    result = bench_heard.summarize(turns, {"turns": 5})
    heard = result["summary"]["heard_delay_ms"]
    assert (heard["p25"], heard["median"], heard["p75"], heard["min"], heard["max"]) == (15, 30, 45, 10, 50)
    assert result["summary"]["ttfa_heard_ms"]["median"] == 330 and result["summary"]["ttfa_ms"]["median"] == 300
    assert result["goal"] == {"metric": "heard_delay_ms", "statistic": "median", "max_ms": 150.0, "met": True}
    assert result["definitions"] == {m: DEFINITIONS[m] for m in bench_heard.METRICS}
    assert result["turns"] == turns and result["config"] == {"turns": 5} and result["methods"] == ["getOutputTimestamp"]
    json.dumps(result, allow_nan=False)  # plain JSON: numpy scalars or NaN would fail here
    # The goal is judged on the median: one slow turn does not fail it, a slow middle does.
    slow = [fake_turn(d, "currentTime+outputLatency") for d in (100, 151, 900)]
    assert bench_heard.summarize(turns[:2] + [fake_turn(900)], {})["goal"]["met"]
    assert not bench_heard.summarize(slow, {})["goal"]["met"]
    assert bench_heard.summarize(slow + turns[:1], {})["methods"] == ["currentTime+outputLatency", "getOutputTimestamp"]


def test_without_playwright_it_says_what_to_install(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setitem(sys.modules, "playwright.sync_api", None)  # makes the import fail
    assert cli.main(["bench-heard", "--turns", "1", "--json", str(tmp_path / "h.json")]) == 2
    assert "needs the test extra: scripts/setup.sh --test" in capsys.readouterr().err
    assert not (tmp_path / "h.json").exists()


@pytest.mark.browser
@pytest.mark.models  # real ASR and TTS
@pytest.mark.skipif(not os.path.exists(bench_heard.CHROMIUM), reason="Debian chromium is not installed")
def test_two_turns_in_chromium_write_the_figures(tmp_path) -> None:
    pytest.importorskip("playwright.sync_api")
    out = tmp_path / "heard.json"
    proc = subprocess.run(
        [sys.executable, "-m", "commands.cli", "bench-heard", "--turns", "2", "--json", str(out)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stdout + proc.stderr
    result = json.loads(out.read_text())
    assert set(result) == {"turns", "summary", "goal", "methods", "definitions", "config"}
    assert len(result["turns"]) == 2 and result["config"]["turns"] == 2
    assert result["config"]["agent"]["engine"]["target"] == "tiny-random-target"
    for turn in result["turns"]:
        assert math.isfinite(turn["heard_delay_ms"]) and turn["heard_delay_ms"] >= 0
        assert turn["ttfa_heard_ms"] >= turn["ttfa_ms"] > 0 and turn["method"] in result["methods"]
    for metric in bench_heard.METRICS:
        s = result["summary"][metric]
        assert s["p25"] <= s["median"] <= s["p75"] and s["min"] <= s["median"] <= s["max"]
    assert isinstance(result["goal"]["met"], bool) and set(result["definitions"]) == set(bench_heard.METRICS)
    assert "heard delay median" in proc.stdout
