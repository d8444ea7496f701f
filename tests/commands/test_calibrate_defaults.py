"""`specvoice calibrate` with no engine options: the default target and drafter (its shipped draft heads), the
configuration the app runs, calibrated through the engine's runner (issue 22)."""

import json
import math

import pytest

from commands import cli


@pytest.mark.models
def test_calibrate_runs_with_the_defaults(real_models, tmp_path):
    out = tmp_path / "cal.json"
    argv = ["calibrate", "--k-values", "1,4", "--repeats", "1", "--max-new-tokens", "8", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert (data["target"], data["drafter_kind"], data["device"]) == ("qwen-1.5b", "heads", "cpu")
    assert [row["drafted"] for row in data["per_k"]] == [1, 4]
    for row in data["per_k"]:
        assert row["draft_s"] > 0 and math.isfinite(row["predicted_speedup"]) and row["measured_speedup"] > 0
    assert data["draft_cost_ratio"] > 0  # how small it is is the machine's to say (docs/results.md), not a test's
