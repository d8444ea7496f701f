"""The console script end to end on the tiny random models: generate and bench write what they promise."""

import json
import math
import subprocess
import sys

from tests.support.cli import specvoice
from tests.support.speech import needs_espeak


def test_generate_writes_tokens_and_metrics(tiny_engine, tmp_path):
    out = tmp_path / "gen.json"
    specvoice("generate", *tiny_engine.cli_args, "--prompt", "hello", "--max-new-tokens", "24", "--json", str(out))
    data = json.loads(out.read_text())
    assert len(data["tokens"]) == 24
    assert data["proposed"] > 0 and 0 <= data["draft_acceptance_rate"] <= 1
    assert data["definitions"]["draft_acceptance_rate"].startswith("accepted draft tokens")
    assert sum(len(e["emitted"]) for e in data["events"]) == 24


def test_generate_rejects_bad_input_clearly(tiny_engine):
    # In a fresh interpreter: what a user's terminal shows, a clear line and no traceback.
    proc = specvoice("generate", *tiny_engine.cli_args, "--prompt", "   ", check=False, subprocess_run=True)
    assert proc.returncode == 2 and "empty prompt" in proc.stderr and "Traceback" not in proc.stderr
    proc = specvoice("generate", "--target", "nope", "--draft", "none", "--prompt", "hi", check=False)
    assert proc.returncode == 2 and "unknown model 'nope'" in proc.stderr


def test_bench_side_by_side_json(tiny_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"category": "a", "prompt": "hello"}\n{"category": "b", "prompt": "count: 1 2 3"}\n')
    out = tmp_path / "bench.json"
    specvoice(
        "bench",
        *tiny_engine.cli_args,
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "16",
        "--compare",
        "hf",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    assert len(data["prompts"]) == 2
    for p in data["prompts"]:
        for path in ("baseline", "speculative", "hf_assisted"):
            assert p[path]["tokens"] > 0 and p[path]["tokens_per_s"] > 0
        assert p["speculative"]["identical_to_baseline"] and p["speculative"]["first_divergence"] is None
        assert p["hf_assisted"]["identical_to_baseline"]
    s = data["summary"]
    assert s["greedy_identical_fraction"] == 1.0
    for key in (
        "speedup_median",
        "speedup_vs_hf_median",
        "draft_acceptance_rate",
        "expected_speedup",
        "bound_attainment",
    ):
        assert isinstance(s[key], float)
    assert set(s["per_category"]) == {"a", "b"}


def test_bench_batched_runs_the_app_s_scheduler_with_its_forward_costs(tiny_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "count: 1 2 3"}\n')
    out = tmp_path / "bench.json"
    args = ("--prompts", str(prompts), "--max-new-tokens", "16", "--compare", "none", "--batched", "--json", str(out))
    specvoice("bench", *tiny_engine.cli_args, *args)
    s = json.loads(out.read_text())["summary"]
    assert s["config"]["batched"] and s["greedy_identical_fraction"] == 1.0
    assert s["forward_costs"]["batches"][0] == 1 and len(s["forward_costs"]["seconds"]) == len(
        s["forward_costs"]["batches"]
    )
    specvoice("bench", *tiny_engine.cli_args, *args, "--no-load-aware")  # the K policy's K: no costs read
    assert "forward_costs" not in json.loads(out.read_text())["summary"]


def test_calibrate_fits_and_compares_every_k(tiny_engine, tmp_path):
    out = tmp_path / "cal.json"
    specvoice(
        "calibrate",
        *tiny_engine.cli_args,
        "--k-values",
        "1,3",
        "--repeats",
        "1",
        "--max-new-tokens",
        "8",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    assert list(data["target_forward_s_by_tokens"]) == [str(n) for n in range(1, 17)]
    # The fit's sign is the machine's noise (a loaded fresh run fitted −0.8 ms): what ran, not how fast
    assert all(math.isfinite(data["verify_fit"][key]) for key in ("intercept_s", "per_token_s"))
    assert data["draft_cost_ratio"] > 0
    assert data["drafter_kind"] == "draft-model" and data["device"] == tiny_engine.spec.device
    assert [row["k"] for row in data["per_k"]] == [row["drafted"] for row in data["per_k"]] == [1, 3]
    for row in data["per_k"]:
        assert math.isfinite(row["predicted_speedup"]) and row["measured_speedup"] > 0
        assert row["draft_s"] == data["draft_s_by_k"][str(row["k"])] > 0


def test_bench_rejects_bad_prompt_file(tiny_engine, tmp_path):
    bad = tmp_path / "bad.jsonl"
    bad.write_text("not json\n")
    proc = specvoice(
        "bench", *tiny_engine.cli_args, "--prompts", str(bad), "--json", str(tmp_path / "x.json"), check=False
    )
    assert proc.returncode == 2 and "not JSON" in proc.stderr


def test_every_subcommand_has_help():
    out = specvoice("--help").stdout
    for name in (
        "generate",
        "bench",
        "bench-target",
        "bench-asr",
        "calibrate",
        "say",
        "bench-voice",
        "app",
        "casestudy",
        "bench-load",
        "bench-users",
    ):
        assert name in out


def test_bench_load_sweeps_modes_side_by_side(tiny_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "count: 1 2 3"}\n{"prompt": "tell me a story"}\n')
    out = tmp_path / "load.json"
    specvoice(
        "bench-load",
        *tiny_engine.cli_args,
        "--prompts",
        str(prompts),
        "--concurrency",
        "2,1",
        "--seconds",
        "0.3",
        "--rounds",
        "2",
        "--max-new-tokens",
        "12",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    runs = data["runs"]
    assert [(r["concurrency"], r["mode"]) for r in runs] == [
        (n, mode) for n in (1, 2) for mode in ("off", "k4", "load_aware")
    ]
    for r in runs:
        assert r["aggregate_tokens_per_s"] > 0 and len(r["aggregate_tokens_per_s_by_round"]) == 2
        assert r["per_sequence_tokens_per_s"] <= r["aggregate_tokens_per_s"]
        assert (r["mean_k_chosen"] == 0) == (r["mode"] == "off") or r["mode"] == "load_aware"
    rate = {(r["concurrency"], r["mode"]): r["aggregate_tokens_per_s"] for r in runs}
    losing = [n for n in (1, 2) if rate[n, "k4"] < rate[n, "off"]]
    assert data["crossover_concurrency"] == (losing[0] if losing else None)
    assert set(data["predicted"]) >= {"case_study_crossover_concurrency", "measured_costs_speedup_k4"}
    assert len(data["forward_costs"]["seconds"]) == len(data["forward_costs"]["batches"])
    assert (tmp_path / "load.png").stat().st_size > 1000
    assert "aggregate_tokens_per_s" in data["definitions"]
    bad = specvoice("bench-load", *tiny_engine.cli_args, "--concurrency", "0", "--json", str(out), check=False)
    assert bad.returncode == 2 and "--concurrency" in bad.stderr


def test_bench_target_compares_formats_in_one_run(tiny_engine, tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "hello"}\n{"prompt": "count: 1 2 3"}\n')
    out = tmp_path / "target.json"
    specvoice(
        "bench-target",
        "--target",
        tiny_engine.spec.target,
        "--quants",
        "none,w8a8,int4",
        "--prompts",
        str(prompts),
        "--max-new-tokens",
        "12",
        "--repeats",
        "1",
        "--json",
        str(out),
    )
    data = json.loads(out.read_text())
    runs = {r["target_quant"]: r for r in data["runs"]}
    assert list(runs) == ["none", "w8a8", "int4"] and data["reference"] == "none"
    assert runs["none"]["identical_answers"] == 2  # the reference against itself
    for run in runs.values():
        counts = {"1", "2", "5", "9", "16", "32"}
        assert set(run["forward_ms"]) == counts and run["target_only_tokens_per_s_median"] > 0
        assert set(run["forward_ms_by_attention"]) == {"row", "fused"} and run["verify_cost_ratio"]["1"] == 1.0
        assert 0 < run["top1_agreement"] <= 1 and run["mean_logprob"] < 0
    assert runs["w8a8"]["weight_bytes"] < runs["none"]["weight_bytes"]
    assert "top1_agreement" in data["definitions"]


@needs_espeak
def test_bench_asr_reports_word_error_rate(tmp_path):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text('{"prompt": "What is the capital of France?"}\n')
    out = tmp_path / "asr.json"
    args = ["--voices", "espeak en-us", "--asr", "tiny.en", "--beams", "5", "--windows", "10", "--threads", "1"]
    specvoice("bench-asr", "--prompts", str(prompts), *args, "--json", str(out))
    data = json.loads(out.read_text())
    (row,) = data["summary"]
    assert row["clips"] == 1 and 0 <= row["wer"] <= 1
    assert "wer" in " ".join(data["definitions"]).lower()


def test_every_job_runs_numpy_s_blas_on_one_thread():
    """OpenBLAS's helper thread spins on a core after each call (specdec/compute.py): the console script stops it."""
    code = (
        "import json\n"
        "from threadpoolctl import threadpool_info\n"
        "from commands import cli\n"
        "cli.main(['vllm-serve', '--draft', 'ngram'])\n"
        "print(json.dumps([i['num_threads'] for i in threadpool_info() if i['user_api'] == 'blas']))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120).stdout
    blas_threads = json.loads(out.splitlines()[-1])
    assert blas_threads and set(blas_threads) == {1}  # numpy's OpenBLAS at least
