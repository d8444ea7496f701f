"""scripts/gpu-check.sh in its CPU mode, as CI runs it so that the GPU check cannot rot between GPU runs: every
section is there, its numbers are positive, and the prediction agrees with the costs and constants it came from."""

import json
import os
import subprocess
import sys

import pytest

from tests.support.engine import ROOT

MODELS = {"qwen2.5-0.5b", "qwen2.5-1.5b", "qwen2.5-7b"}
PAIRS = {f"{t} + {d}" for t in ("qwen2.5-1.5b", "qwen2.5-7b") for d in ("qwen2.5-0.5b", "heads")}


@pytest.fixture(scope="module")
def check(tmp_path_factory) -> dict:
    out = tmp_path_factory.mktemp("gpu-check") / "gpu-check.json"
    proc = subprocess.run(
        [str(ROOT / "scripts" / "gpu-check.sh"), "--device", "cpu", "--json", str(out)],
        cwd=ROOT,
        env={**os.environ, "SPECVOICE_PYTHON": sys.executable},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(out.read_text())


def test_every_section_ran(check):
    assert check["ok"] and check["errors"] == {} and check["small"] and check["device"] == "cpu"
    assert check["environment"]["torch"] and check["environment"]["python"]
    tests = check["tests"]
    assert tests["passed"] > 0 and tests["failed"] == tests["errors"] == 0 and not tests["interrupted_at_budget"]
    assert tests["device"] == "cpu"
    assert tests["skipped_because"].get("needs a CUDA GPU (torch sees none)", 0) >= 7  # the GPU tests, and why


def test_a_step_reads_the_device_at_most_twice(check):
    reads = check["host_reads"]
    for drafter in ("draft-model", "heads"):
        for counts in reads[drafter].values():
            assert counts and all(1 <= n <= 2 for n in counts)
    assert 1 <= reads["batched_step_of_3"] <= 2


def test_the_costs_are_positive_and_grow_with_tokens(check):
    models = check["models"]
    assert set(models) == MODELS
    assert models["qwen2.5-7b"]["params"] > models["qwen2.5-1.5b"]["params"] > models["qwen2.5-0.5b"]["params"]
    for row in models.values():
        seconds = row["costs"]["seconds"]
        assert len(seconds) == len(row["costs"]["batches"]) and all(s > 0 for line in seconds for s in line)
        assert all(line == sorted(line) for line in seconds)  # more tokens never cost less
        assert row["prefill"]["seconds"] > 0 and all(s > 0 for s in row["draft_s_by_k"].values())


def test_the_prediction_follows_from_costs_and_acceptance(check):
    prediction = check["prediction"]
    assert prediction["label"].startswith("PREDICTION") and set(prediction["pairs"]) == PAIRS
    for name, pair in prediction["pairs"].items():
        acceptance = prediction["acceptance"]["heads" if name.endswith("heads") else "qwen2.5-0.5b"]
        assert acceptance["source"].startswith("docs/results.md")
        p = acceptance["by_position"]
        assert [r["k"] for r in pair["per_k"]] == list(range(1, len(p) + 1))
        for r in pair["per_k"]:
            assert r["expected_tokens_per_step"] == pytest.approx(1 + sum(p[: r["k"]])) and r["speedup"] > 0
        best = max(pair["per_k"], key=lambda r: r["speedup"])
        assert (pair["best_k"], pair["speedup"]) == (best["k"], best["speedup"])
        assert pair["by_batch"][0] == {"batch": 1, "k": best["k"], "speedup": best["speedup"]}
        assert pair["tokens_per_s_on"] == pytest.approx(pair["tokens_per_s_off"] * pair["speedup"])
        off, on = pair["stages_ms_off"], pair["stages_ms_on"]
        assert pair["ttfa_ms_off"] == pytest.approx(sum(off.values())) and min(off.values()) > 0
        assert pair["ttfa_ms_on"] == pytest.approx(sum(on.values())) and min(on.values()) > 0
        assert off["first_chunk_tokens"] / on["first_chunk_tokens"] == pytest.approx(pair["speedup"])


def test_the_case_study_is_calibrated_to_the_curve(check):
    case = check["casestudy"]
    hw = case["hardware"]
    assert hw["bandwidth_tbs"] > 0 and hw["tflops"] > 0 and hw["efficiency"] > 0 and hw["overhead_ms"] >= 0
    assert set(case["models"]) == MODELS
    for row in case["models"].values():
        assert 0 < row["measured_over_modelled"]["min"] <= row["measured_over_modelled"]["max"]
    assert case["roofline_speedup_7b_with_0.5b_k4"] > 0


def test_the_efficiency_fit_survives_forwards_that_do_not_grow_with_size():
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_predict import fit_efficiency

    efficiency, overhead_s, how = fit_efficiency([1.0, 3.0, 9.0], [2.5, 3.5, 6.5])  # 2 s + bytes ÷ 2
    assert efficiency == pytest.approx(2.0) and overhead_s == pytest.approx(2.0) and how.startswith("fitted")
    # A fresh machine's cold first forward: 64 ms for the smallest model (the run).
    efficiency, overhead_s, how = fit_efficiency([0.001, 0.003, 0.014], [0.064, 0.0019, 0.0067])
    assert efficiency == pytest.approx(0.014 / 0.0067) and overhead_s == 0 and "did not grow" in how


def test_problems_from_a_missing_module_are_counted_apart_from_real_failures(tmp_path):
    sys.path.insert(0, str(ROOT / "scripts"))
    from gpu_sections import junit_counts

    xml = tmp_path / "junit.xml"
    xml.write_text(
        '<testsuites><testsuite tests="4" failures="2" errors="1" skipped="0">'
        '<testcase classname="t.a" name="x"><failure message="ModuleNotFoundError: No module named \'hibari\'"/>'
        "</testcase>"
        '<testcase classname="" name="t.b"><error message="collection failure">'
        "E   ModuleNotFoundError: No module named 'opentelemetry.context'</error></testcase>"
        '<testcase classname="t.c" name="y"><failure message="assert 1 == 2">tokens differ</failure></testcase>'
        '<testcase classname="t.d" name="z"/>'
        "</testsuite></testsuites>"
    )
    counts = junit_counts(xml)
    assert (counts["passed"], counts["failed"], counts["errors"]) == (1, 2, 1)
    assert counts["problems_from_missing_modules"] == {"hibari": 1, "opentelemetry": 1}  # not the real failure
    assert len(counts["problems"]) == 3
