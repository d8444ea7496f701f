"""`specvoice casestudy`: its table, plots and JSON, its options, and its refusal of inputs that make no sense."""

from __future__ import annotations

import argparse
import json

import pytest

from casestudy.story import explain_story
from commands import casestudy


def _args(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    casestudy.add_arguments(parser)
    return parser.parse_args(list(argv))


def test_casestudy_writes_table_plots_and_json(tmp_path, capsys) -> None:
    out, js = tmp_path / "plots", tmp_path / "r.json"
    assert casestudy.main(_args("--out", str(out), "--json", str(js), "--concurrency-sweep", "1", "64", "512")) == 0
    rep = json.loads(js.read_text())
    for key in (
        "baseline_tokens_per_s",
        "speculative_tokens_per_s",
        "baseline_ttfa_ms",
        "speculative_ttfa_ms",
        "stages",
        "implied",
        "batch",
    ):
        assert key in rep
    assert set(rep["stages"]) == {"baseline", "speculative"}
    assert rep["implied"]["sentences"] and rep["implied"]["c_required"] > 0
    assert [r["concurrency"] for r in rep["batch"]] == [1, 64, 512]
    assert rep["batch"][0]["speedup"] > 1 > rep["batch"][-1]["speedup"]
    assert rep["speculative_tokens_per_s"] == pytest.approx(explain_story().speculative_tokens_per_s)
    for name in ("speed_vs_alpha.png", "speedup_vs_concurrency.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr().out
    assert "TTFA" in printed and "What the story's figures imply" in printed


def test_casestudy_overrides_change_the_numbers(tmp_path) -> None:
    def numbers(*argv: str) -> dict:
        js = tmp_path / "r.json"
        assert casestudy.main(_args("--no-plots", "--json", str(js), *argv)) == 0
        return json.loads(js.read_text())

    base = numbers()
    low = numbers("--acceptance-rate", "0.5")
    assert low["speculative_tokens_per_s"] < base["speculative_tokens_per_s"]
    assert numbers("--alpha", str(base["inputs"]["alpha"]))["speculative_tokens_per_s"] == pytest.approx(
        base["speculative_tokens_per_s"]
    )
    fast = numbers("--gpu-bandwidth-tbs", "4", "--gpus", "8")
    assert fast["baseline_tokens_per_s"] == pytest.approx(4 * base["baseline_tokens_per_s"])
    more = numbers("--first-chunk-tokens", "20")
    assert more["baseline_ttfa_ms"] > base["baseline_ttfa_ms"]
    busy = numbers("--concurrency", "512")
    assert busy["speculative_tokens_per_s"] < busy["baseline_tokens_per_s"]


def test_casestudy_rejects_bad_inputs(capsys) -> None:
    assert casestudy.main(_args("--no-plots", "--alpha", "1.5")) == 2
    assert "α" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        _args("--alpha", "0.8", "--acceptance-rate", "0.7")
