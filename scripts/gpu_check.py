"""One prepared check of the GPU the product is for (issue 22), run by scripts/gpu-check.sh; it writes one JSON file.

On --device (cuda by default), within --budget-s (8 minutes by default), with no network and no real weights:
1. environment: Python, torch, the device, and which of the project's packages this machine lacks;
2. host_reads: the device reads per speculative step on the tiny engine (counted by tests/specdec/test_host_reads.py);
3. models: the forward-cost grid (batch × tokens per sequence) of Qwen2.5-0.5B-, 1.5B- and 7B-shaped models with
   random weights, timed through the engine's BatchRunner as its own cost grid is (cost_grid.measure_forward_costs),
   a voice turn's prefill, and the drafters' proposals as a step meets them (specdec/calibrate.py): the 0.5B as a
   draft model, untrained medusa heads (the shipped kind) on each target;
4. prediction: speedup and TTFA for this device from those costs and the acceptance measured on the CPU with the
   real weights (ACCEPTANCE) — a prediction, not a measurement;
5. casestudy: the case study's roofline (casestudy/latency_model.py) calibrated from the measured curve;
6. tests: the fast suite on the device (SPECVOICE_TEST_DEVICE), with whatever time is left.

--small (the default on the CPU, what CI runs) shrinks the shapes, the grid and the test run to seconds.
Every section that fails is reported under "errors" and the rest still run; the JSON is rewritten after each one.
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import gc
import importlib.metadata
import json
import os
import platform
import re
import shlex
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import xml.etree.ElementTree as ET
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # the project and its tests.support, installed or not

# The fast suite, as the README defines it.
FAST_SUITE = "not models and not browser and not slow"
# --small's test run: the GPU tests (skipped without one) and the host-read tests but the one that trains heads.
SMALL_TESTS = [
    "tests/specdec/test_gpu.py",
    "tests/specdec/test_host_reads.py",
    "--deselect=tests/specdec/test_host_reads.py::test_a_heads_step_reads_the_device_at_most_twice",
]

# Qwen2.5's published shapes (config.json of Qwen/Qwen2.5-{0.5B,1.5B,7B}-Instruct), built with random weights.
SHAPES: dict[str, dict[str, Any]] = {
    "qwen2.5-0.5b": {
        "hidden_size": 896,
        "intermediate_size": 4864,
        "num_hidden_layers": 24,
        "num_attention_heads": 14,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-1.5b": {
        "hidden_size": 1536,
        "intermediate_size": 8960,
        "num_hidden_layers": 28,
        "num_attention_heads": 12,
        "num_key_value_heads": 2,
        "vocab_size": 151936,
        "tie_word_embeddings": True,
    },
    "qwen2.5-7b": {
        "hidden_size": 3584,
        "intermediate_size": 18944,
        "num_hidden_layers": 28,
        "num_attention_heads": 28,
        "num_key_value_heads": 4,
        "vocab_size": 152064,
        "tie_word_embeddings": False,
    },
}
DRAFT_MODEL = "qwen2.5-0.5b"
TARGETS = ("qwen2.5-1.5b", "qwen2.5-7b")
HEADS_VOCAB = 7264  # the shipped heads' draft vocabulary (assets/heads/qwen-1.5b.safetensors)
SMALL_DIVISOR = 8  # --small: widths and vocabularies ÷ 8, two layers; the structure stays, CPU seconds
SMALL_LAYERS = 2


@dataclasses.dataclass(frozen=True)
class Acceptance:
    """P(the first i drafts of a step are all accepted), i = 1 … the most drafts a step takes."""

    by_position: tuple[float, ...]
    source: str

    def expected_tokens(self, k: int) -> float:
        """Tokens per verifying forward with k drafts: the target's own token and each accepted prefix."""
        return 1 + sum(self.by_position[:k])


# Measured on this project's CPU with the real weights; the 7B target is assumed to accept as the 1.5B does.
ALPHA_DRAFT_MODEL = 0.80
ACCEPTANCE = {
    "heads": Acceptance(
        (0.35, 0.08, 0.03, 0.03),
        "docs/results.md, 'The default configuration' (18:04–18:07): acceptance by position of the shipped medusa "
        "heads on the w8a8 qwen-1.5b target, 20 voice prompts, gate 0; 4 heads, so at most 4 drafts",
    ),
    DRAFT_MODEL: Acceptance(
        tuple(ALPHA_DRAFT_MODEL**i for i in range(1, 9)),
        "docs/results.md, 'Calibration: specvoice calibrate': α ≈ 0.80–0.82 per token for the 0.5B draft on the "
        "bf16 qwen-1.5b target, no gate; each draft accepted independently, so P(first i) = α^i, K ≤ 8",
    ),
}
PAIRS = [(t, d) for t in reversed(TARGETS) for d in (DRAFT_MODEL, "heads")]  # the 7B with the 0.5B first


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(prog="scripts/gpu-check.sh", description=__doc__.split("\n")[0])
    parser.add_argument("--device", default="cuda", help="cuda (default), cuda:N or cpu")
    out = os.environ.get("OUT")
    parser.add_argument(
        "--json",
        type=Path,
        default=Path(out) / "gpu-check.json" if out else Path("gpu-check.json"),
        help="where the JSON goes (default: $OUT/gpu-check.json where $OUT is set, else ./gpu-check.json)",
    )
    parser.add_argument(
        "--small",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="shapes ÷ 8 with two layers, a 3 × 4 grid and a handful of tests (default: on for the CPU only)",
    )
    parser.add_argument("--budget-s", type=float, default=480, help="the whole check's seconds (8 minutes)")
    args = parser.parse_args(argv)
    if args.small is None:
        args.small = args.device == "cpu"
    return args


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    t_start = time.perf_counter()
    report: dict[str, Any] = {
        "check": "scripts/gpu-check.sh (issue 22)",
        "started_utc": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": args.device,
        "small": args.small,
        "errors": {},
    }

    def save() -> None:
        report["seconds"] = time.perf_counter() - t_start
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))

    def section(name: str, run: Callable[[], Any]) -> None:
        print(f"gpu-check: {name} …", file=sys.stderr, flush=True)
        t0 = time.perf_counter()
        try:
            report[name] = run()
        except Exception as e:  # report it and go on: one missing package must not hide the other results
            traceback.print_exc()
            report["errors"][name] = f"{type(e).__name__}: {e}"
        report.setdefault("section_seconds", {})[name] = time.perf_counter() - t0  # where the budget went
        save()

    # Filled as it is read, so that what was found survives a missing torch or device.
    section("environment", lambda: environment(args.device, report.setdefault("environment", {})))
    if "environment" in report["errors"]:  # no torch or no such device: nothing else can run
        report["ok"] = False
        save()
        return 1
    section("host_reads", lambda: host_reads(args.device))
    # Filled model by model: a model that fails (out of memory, say) leaves the ones before it for the prediction.
    section("models", lambda: model_costs(args.device, args.small, report.setdefault("models", {})))
    if report["models"]:
        section("prediction", lambda: prediction(report["models"]))
        section("casestudy", lambda: casestudy_calibration(args.device, args.small, report["models"]))
    left = args.budget_s - (time.perf_counter() - t_start) - 10  # 10 s to write up
    section("tests", lambda: run_tests(args.device, args.small, left))
    tests = report.get("tests", {})
    report["ok"] = (
        not report["errors"]
        and tests.get("failed") == 0
        and tests.get("errors") == 0
        and not tests.get("interrupted_at_budget")
    )
    save()
    print(f"gpu-check: wrote {args.json} in {report['seconds']:.0f} s; ok: {report['ok']}", file=sys.stderr)
    return 0 if report["ok"] else 1


# ---------------------------------------------------------------------------------------------- environment


def declared_packages() -> list[str]:
    """The project's runtime and test requirements, by distribution name (pyproject.toml)."""
    try:
        import tomllib
    except ModuleNotFoundError:  # Python 3.10: the check runs without this list
        return []
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = project["dependencies"] + project["optional-dependencies"]["test"]
    return [re.split(r"[\s<>=!~\[;(]", r.strip(), maxsplit=1)[0] for r in reqs]


def installed(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def environment(device: str, env: dict[str, Any]) -> dict[str, Any]:
    """Into `env`: Python, the project's packages as installed here (None: missing), torch and the device."""
    packages = {name: installed(name) for name in declared_packages()}
    env.update(
        python=platform.python_version(),
        executable=sys.executable,
        packages=packages,
        missing=sorted(name for name, version in packages.items() if version is None),
    )
    import torch

    from specdec.cost_grid import cpu_name

    env.update(
        torch=torch.__version__,
        torch_cuda=torch.version.cuda,
        cuda_available=torch.cuda.is_available(),
        cpu=cpu_name(),
        cores=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
    )
    dev = torch.device(device)
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {device}, but torch {torch.__version__} sees no CUDA device")
        props = torch.cuda.get_device_properties(dev)
        env.update(
            device_name=props.name,
            capability=f"{props.major}.{props.minor}",
            memory_gib=props.total_memory / 2**30,
            multiprocessors=props.multi_processor_count,
        )
    return env


# ---------------------------------------------------------------------------------------------- host reads


def host_reads(device: str) -> dict[str, Any]:
    """Device reads per speculative step (K = 4) on the tiny engine with this device's defaults, for the draft model
    and for (untrained) heads, one answer at a time, and one batched step of three answers."""
    from specdec.build import TINY_ENGINE, build_engines
    from specdec.engine import GenerationConfig
    from specdec.sampling import SamplingParams
    from tests.support.engine import tiny_prompts, untrained_heads
    from tests.support.host_reads import counting_host_reads, reads_per_step

    with tempfile.TemporaryDirectory() as tmp:
        spec = dataclasses.replace(TINY_ENGINE, device=device, k="4")
        engines, target, _ = build_engines(spec, [spec.draft])
        heads = untrained_heads(target, Path(tmp) / "medusa.safetensors")
        heads_engines, _, _ = build_engines(dataclasses.replace(spec, heads=str(heads)), ["heads"])
    prompt = tiny_prompts(target, 1)[0]
    out: dict[str, Any] = {"k": 4}
    for engine in [*engines.values(), *heads_engines.values()]:
        engine.auto_off = False
        out[str(engine.drafter_kind)] = {
            name: reads_per_step(engine, prompt, params)
            for name, params in (("greedy", SamplingParams()), ("sampled", SamplingParams(temperature=0.8)))
        }
    engine = engines[spec.draft]
    answers = [engine.new_answer(p, GenerationConfig(64)) for p in tiny_prompts(target, 3, seed=4)]
    engine.step(answers)  # the prefills
    with counting_host_reads() as counter:
        engine.step(answers)
    out["batched_step_of_3"] = counter["reads"]
    return out


# ---------------------------------------------------------------------------------------------- forward costs


def shaped_model(name: str, device: Any, dtype: Any, small: bool) -> Any:
    """A Qwen2.5-shaped model with random weights, made on the device (no host copy of a 7B)."""
    import torch
    from transformers import AutoModelForCausalLM, Qwen2Config

    shape = dict(SHAPES[name])
    if small:
        heads = shape["num_attention_heads"]
        head_dim = max(2, shape["hidden_size"] // heads // SMALL_DIVISOR) // 2 * 2  # RoPE rotates pairs
        shape.update(
            hidden_size=heads * head_dim,
            intermediate_size=shape["intermediate_size"] // SMALL_DIVISOR,
            vocab_size=shape["vocab_size"] // SMALL_DIVISOR,
            num_hidden_layers=SMALL_LAYERS,
        )
    torch.manual_seed(0)
    with torch.device(device):
        model = AutoModelForCausalLM.from_config(Qwen2Config(**shape), dtype=dtype)
    return model.to(device).eval()


def model_costs(device_name: str, small: bool, out: dict[str, Any]) -> dict[str, Any]:
    """Into `out`, per model: its shape, the forward-cost grid, a voice turn's prefill, and its drafter's proposal
    costs (the 0.5B's as a draft model, each target's heads')."""
    import torch

    from casestudy.latency_model import VoiceStages
    from specdec.build import k_policy_factory
    from specdec.calibrate import measured_draft_seconds
    from specdec.cost_grid import COST_CONTEXT, measure_forward_costs
    from specdec.drafters import DraftModelDrafter
    from specdec.engine import SpeculativeEngine
    from specdec.heads_drafter import HeadsDrafter
    from specdec.heads_model import DraftHeads
    from specdec.heads_train import heads_config
    from specdec.models import LoadedModel
    from specdec.runner import BatchRunner, fastest_min_feed
    from specdec.timing import median_seconds
    from specdec.tokenizer import ByteTokenizer

    device = torch.device(device_name)
    # bf16 as the app runs these on a GPU; float32 on the CPU, whose bf16 matmuls only some CPUs have fast
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    batches, tokens = ((1, 4, 16), (1, 2, 5, 16)) if small else ((1, 2, 4, 8, 16), (1, 2, 3, 4, 5, 8, 12, 16))
    trials, repeats = (1, 3) if small else (3, 5)
    prompt_tokens = VoiceStages().prompt_tokens
    context = [1000 + i for i in range(COST_CONTEXT)]  # any ids do: cost does not depend on them
    for name in (DRAFT_MODEL, *TARGETS):
        t0 = time.perf_counter()
        model = shaped_model(name, device, dtype, small)
        build_s = time.perf_counter() - t0
        cfg = model.config
        runner = BatchRunner(model, device)
        runner.min_feed = fastest_min_feed(runner)  # as build_engine sets it (1 on a GPU)
        # measure_forward_costs takes an engine: this model as its target, the byte tokenizer's ids for text
        target = LoadedModel(name, model, ByteTokenizer(), device, dtype)
        engine = SpeculativeEngine(target, runner, None, k_policy_factory("1"))
        costs = measure_forward_costs(engine, batches, tokens, trials)
        cache = runner.new_cache()
        prompt = [2000 + i for i in range(prompt_tokens)]

        def prefill(cache: Any = cache, prompt: list[int] = prompt) -> None:
            cache.extend(prompt)
            cache.rollback(0)

        row: dict[str, Any] = {
            "shape": {k: getattr(cfg, k) for k in SHAPES[name]},
            "params": sum(p.numel() for p in model.parameters()),
            "dtype": str(dtype).removeprefix("torch."),
            "build_s": build_s,
            "min_feed": runner.min_feed,
            "context_tokens": COST_CONTEXT,
            "costs": costs.as_dict(),
            "prefill": {"tokens": prompt_tokens, "seconds": median_seconds(prefill, device, repeats)},
        }
        kind = DRAFT_MODEL if name == DRAFT_MODEL else "heads"  # the 0.5B drafts; a target gets heads
        if kind == DRAFT_MODEL:
            drafter: Any = DraftModelDrafter(runner, min_prob=0.0)
        else:
            heads_vocab = HEADS_VOCAB // SMALL_DIVISOR if small else HEADS_VOCAB
            heads = DraftHeads(heads_config("medusa", cfg, name), torch.arange(heads_vocab))
            heads.attach(model.get_input_embeddings(), model.get_output_embeddings().weight)
            drafter = HeadsDrafter(heads.to(device), min_prob=0.0)  # float32, as load_heads gives them
            features = torch.randn(len(context), cfg.hidden_size, device=device)
            drafter.add_features(context, 0, features)
        step = context + [3000]  # one token the drafter has not seen, as at every step
        row["drafter"] = "draft-model" if kind == DRAFT_MODEL else "medusa heads (untrained)"
        row["draft_s_by_k"] = {
            k: measured_draft_seconds(drafter, step, k, device, repeats)[0]
            for k in range(1, len(ACCEPTANCE[kind].by_position) + 1)
        }
        out[name] = row
        print(
            f"  {name}: {row['params'] / 1e9:.2f} B params, one token {costs(1, 1) * 1e3:.2f} ms, 16 × 16 "
            f"{costs(16, 256) * 1e3:.1f} ms, prefill {row['prefill']['seconds'] * 1e3:.1f} ms",
            file=sys.stderr,
            flush=True,
        )
        del model, runner, engine, target, cache, drafter
        gc.collect()
        if device.type == "cuda":
            torch.cuda.empty_cache()
    return out


# ---------------------------------------------------------------------------------------------- prediction


def forward_costs(row: dict[str, Any]) -> Any:
    from specdec.cost_grid import ForwardCosts

    return ForwardCosts.from_dict(row["costs"])


def prediction(models: dict[str, Any]) -> dict[str, Any]:
    """Speedup and TTFA per target and drafter, from the measured costs and the CPU-measured acceptance."""
    from casestudy.latency_model import VoiceStages, stage_ms

    stages = VoiceStages()
    pairs = {}
    for target, drafter in [(t, d) for t, d in PAIRS if t in models and d in (*models, "heads")]:
        cost = forward_costs(models[target])
        source = models[drafter] if drafter == DRAFT_MODEL else models[target]
        draft_s = {int(k): s for k, s in source["draft_s_by_k"].items()}
        acceptance = ACCEPTANCE[drafter]

        def speedup(batch: int, k: int, cost: Any = cost, draft_s: dict = draft_s, acc: Acceptance = acceptance):
            """Tokens per second with k drafts ÷ without, every sequence of the batch drafting for itself."""
            step = cost(batch, batch * (k + 1)) + batch * draft_s[k]
            return acc.expected_tokens(k) * cost(batch, batch) / step

        per_k = [
            {"k": k, "expected_tokens_per_step": acceptance.expected_tokens(k), "speedup": speedup(1, k)}
            for k in sorted(draft_s)
        ]
        best = max(per_k, key=lambda r: r["speedup"])
        rate_off = 1 / cost(1, 1)
        # The draft model reads the prompt too before it drafts; heads draft from the target's own features.
        prefill_off = models[target]["prefill"]["seconds"]
        prefill_on = prefill_off + (models[drafter]["prefill"]["seconds"] if drafter == DRAFT_MODEL else 0.0)

        off = stage_ms(stages, prefill_off, rate_off)
        on = stage_ms(stages, prefill_on, rate_off * best["speedup"])
        pairs[f"{target} + {drafter}"] = {
            "best_k": best["k"],
            "speedup": best["speedup"],
            "tokens_per_s_off": rate_off,
            "tokens_per_s_on": rate_off * best["speedup"],
            "per_k": per_k,
            "by_batch": [
                {"batch": b, **max(({"k": k, "speedup": speedup(b, k)} for k in draft_s), key=lambda r: r["speedup"])}
                for b in models[target]["costs"]["batches"]
            ],
            "ttfa_ms_off": sum(off.values()),
            "ttfa_ms_on": sum(on.values()),
            "stages_ms_off": off,
            "stages_ms_on": on,
        }
    return {
        "label": "PREDICTION for this device, not a measurement: the forward and drafting costs measured here on "
        "random-weight models of the real shapes, with the acceptance measured on the CPU with the real weights",
        "acceptance": {name: dataclasses.asdict(a) for name, a in ACCEPTANCE.items()},
        "assumptions": {
            "acceptance": "the 7B target accepts as the 1.5B did; acceptance does not depend on the device",
            "stages": f"casestudy.latency_model.VoiceStages (a GPU-served voice agent): {dataclasses.asdict(stages)}",
            "draft_cost": "each sequence of a batch drafts on its own, one after another, as the engine does",
        },
        "pairs": pairs,
    }


# ---------------------------------------------------------------------------------------------- case study


def casestudy_calibration(device_name: str, small: bool, models: dict[str, Any]) -> dict[str, Any]:
    """The case study's roofline for this device: its roofs measured (a copy, a square matmul), one efficiency and one
    per-forward overhead fitted to the three models' one-token forwards, its modelled grid beside the measured one,
    and its speedup for the 7B with the 0.5B at K = 4 (the measured curve's is prediction.pairs[…].per_k)."""
    import torch

    from casestudy.latency_model import (
        Hardware,
        ModelSpec,
        Scenario,
        evaluate,
        memory_seconds,
        modelled_forward_seconds,
    )
    from specdec.cost_grid import COST_CONTEXT, cpu_name
    from specdec.timing import median_seconds

    device = torch.device(device_name)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    x = torch.empty(1 << (23 if small else 28), dtype=dtype, device=device)  # 32 MiB of float32, 512 MiB of bf16
    y = torch.empty_like(x)
    copied = 2 * x.nbytes  # read once, written once
    copy_s = median_seconds(lambda: y.copy_(x), device, 5)
    n = 512 if small else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    matmul_s = median_seconds(lambda: a @ a, device, 5)
    name = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    peak = Hardware(name, bandwidth_tbs=copied / copy_s / 1e12, tflops=2 * n**3 / matmul_s / 1e12)
    specs = {}
    for model, row in models.items():
        s = row["shape"]
        size = torch.finfo(getattr(torch, row["dtype"])).bits / 8
        specs[model] = ModelSpec(
            model,
            params_b=row["params"] / 1e9,
            n_layers=s["num_hidden_layers"],
            n_kv_heads=s["num_key_value_heads"],
            head_dim=s["hidden_size"] // s["num_attention_heads"],
            bytes_per_param=size,
            kv_bytes_per_value=size,
        )
    # t = overhead + bytes ÷ (bandwidth · efficiency): a line through the models' one-token forwards
    at_peak = [memory_seconds(specs[m], peak, 1, COST_CONTEXT) for m in models]
    measured = [forward_costs(models[m])(1, 1) for m in models]
    fit = statistics.linear_regression(at_peak, measured)
    if fit.slope <= 0:
        raise ValueError(f"one-token forwards {measured} do not grow with the bytes they read: no efficiency to fit")
    hw = dataclasses.replace(peak, efficiency=1 / fit.slope, overhead_ms=max(fit.intercept, 0.0) * 1e3)
    per_model = {}
    for model, row in models.items():
        costs = row["costs"]
        ratios = [
            costs["measured_seconds"][i][j] / modelled_forward_seconds(specs[model], hw, b * p, b, COST_CONTEXT)
            for i, b in enumerate(costs["batches"])
            for j, p in enumerate(costs["per_sequence"])
        ]
        per_model[model] = {
            "params_b": specs[model].params_b,
            "one_token_ms_measured": forward_costs(row)(1, 1) * 1e3,
            "one_token_ms_modelled": modelled_forward_seconds(specs[model], hw, 1, 1, COST_CONTEXT) * 1e3,
            "measured_over_modelled": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        }
    alpha = ACCEPTANCE[DRAFT_MODEL].by_position[0]
    scenario = Scenario(
        alpha=alpha, k=4, target=specs["qwen2.5-7b"], draft=specs[DRAFT_MODEL], hw=hw, context_tokens=COST_CONTEXT
    )
    return {
        "hardware": dataclasses.asdict(hw),
        "how": f"bandwidth_tbs and tflops measured here in {str(dtype).removeprefix('torch.')} (a copy, a square "
        f"matmul); efficiency and overhead_ms fitted to the {len(measured)} models' one-token forwards",
        "models": per_model,
        "roofline_speedup_7b_with_0.5b_k4": evaluate(scenario).speedup,
    }


# ---------------------------------------------------------------------------------------------- tests


def run_tests(device: str, small: bool, budget_s: float) -> dict[str, Any]:
    """The fast suite with the tiny engine on `device` (SPECVOICE_TEST_DEVICE); interrupted once the budget is spent,
    with SIGINT, on which pytest still writes its report."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    # not this check's own CI test (it runs the check in its CPU mode)
    cmd += ["-m", FAST_SUITE, "--ignore=tests/commands/test_gpu_check.py", *(SMALL_TESTS if small else [])]
    env = {**os.environ, "SPECVOICE_TEST_DEVICE": device}
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory() as tmp:
        xml = Path(tmp) / "junit.xml"
        proc = subprocess.Popen(
            [*cmd, f"--junitxml={xml}"], cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
        )
        try:
            output, _ = proc.communicate(timeout=max(budget_s, 30))
            interrupted = False
        except subprocess.TimeoutExpired:
            proc.send_signal(signal.SIGINT)
            interrupted = True
            try:
                output, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                output, _ = proc.communicate()
        counts = junit_counts(xml) if xml.exists() else {}
    print(output[-4000:], file=sys.stderr)
    return {
        "command": shlex.join(cmd),
        "device": device,
        "returncode": proc.returncode,
        "seconds": time.perf_counter() - t0,
        "interrupted_at_budget": interrupted,
        "budget_s": budget_s,
        **counts,
        "output_tail": output[-3000:],
    }


def junit_counts(path: Path) -> dict[str, Any]:
    """passed / failed / errors / skipped from pytest's JUnit XML, and what failed, with pytest's one-line reason."""
    root = ET.parse(path).getroot()
    suite = root if root.tag == "testsuite" else root.find("testsuite")
    assert suite is not None, f"{path} holds no testsuite"
    n = {k: int(suite.get(k, 0)) for k in ("tests", "failures", "errors", "skipped")}
    problems = [
        f"{case.get('classname')}::{case.get('name')} ({kind}): {(found.get('message') or '')[:300]}"
        for case in suite.iter("testcase")
        for kind in ("failure", "error")
        if (found := case.find(kind)) is not None
    ]
    return {
        "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
        "failed": n["failures"],
        "errors": n["errors"],
        "skipped": n["skipped"],
        "problems": problems[:50],
    }


if __name__ == "__main__":
    sys.exit(main())
