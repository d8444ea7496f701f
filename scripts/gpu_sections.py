"""The GPU check's measuring sections (scripts/gpu_check.py runs them): the environment, the host reads, the
forward and drafting costs of the Qwen2.5-shaped models, and the fast suite on the device; with the shapes and the
CPU-measured acceptance they use."""

from __future__ import annotations

import dataclasses
import gc
import importlib.metadata
import os
import platform
import re
import shlex
import signal
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from collections import Counter
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
HEADS_VOCAB = 8192  # the shipped heads' draft vocabulary (assets/heads/qwen-1.5b.safetensors)
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
        if device.type == "cuda" and name == TARGETS[-1]:  # the largest: what CUDA graphs save of its overhead
            try:
                row["compiled"] = compiled_forward_seconds(model, device, context, repeats)
            except Exception as e:  # a compile that fails on this machine must not lose the eager figures
                row["compiled"] = {"error": f"{type(e).__name__}: {e}"[:500]}
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


def compiled_forward_seconds(model: Any, device: Any, context: list[int], repeats: int) -> dict[str, Any]:
    """Seconds of a one-token and a five-token (K = 4 verify) forward through the runner's --compile: each layer's
    dense halves in torch.compile, reduce-overhead (CUDA graphs) on a GPU, attention and caches eager. Beside the
    eager grid, it shows how much of a step's time is the host's dispatch; and how far its logits are from eager's."""
    import torch

    from specdec.kv import Feed
    from specdec.runner import BatchRunner
    from specdec.timing import median_seconds

    runner = BatchRunner(model, device, compile=True)
    cache = runner.new_cache()
    cache.extend(context)
    eager = BatchRunner(model, device).new_cache()
    eager.extend(context)
    seconds: dict[str, Any] = {}
    for rows in (1, 5):
        ids = context + [3000 + i for i in range(rows)]

        def forward(ids: list[int] = ids, rows: int = rows) -> torch.Tensor:
            logits = runner.extend([Feed(cache, ids, rows)])[0]
            cache.rollback(len(context))
            return logits

        t0 = time.perf_counter()
        compiled = forward()  # the compile, for this many rows
        seconds[f"first_call_{rows}_tokens_s"] = time.perf_counter() - t0
        seconds[f"{rows}_tokens_s"] = median_seconds(forward, device, repeats, warmup=3)
        expected = eager.extend(ids, rows)
        eager.rollback(len(context))
        seconds[f"{rows}_tokens_max_logit_difference"] = float((compiled.float() - expected.float()).abs().max())
        seconds[f"{rows}_tokens_same_argmax"] = bool(torch.equal(compiled.argmax(-1), expected.argmax(-1)))
    return seconds


# ---------------------------------------------------------------------------------------------- tests


def run_tests(device: str, small: bool, budget_s: float) -> dict[str, Any]:
    """The fast suite with the tiny engine on `device` (SPECVOICE_TEST_DEVICE); interrupted once the budget is spent,
    with SIGINT, on which pytest still writes its report."""
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "--continue-on-collection-errors"]
    # not this check's own CI test (it runs the check in its CPU mode)
    cmd += ["-m", FAST_SUITE, "--ignore=tests/commands/test_gpu_check.py", *(SMALL_TESTS if small else [])]
    # nor the project's checks of this machine's install (a GPU machine's image lacks the voice packages)
    cmd += ["--ignore=tests/project"]
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
    failed = [
        (f"{case.get('classname')}::{case.get('name')} ({kind})", found.get("message") or "", found.text or "")
        for case in suite.iter("testcase")
        for kind in ("failure", "error")
        if (found := case.find(kind)) is not None
    ]
    problems = [f"{name}: {message[:300]}" for name, message, _ in failed]
    # what could not run here because a module is missing (listed by the environment section), apart from real failures
    # (a collection error's message says only "collection failure": its traceback names the module)
    missing = Counter(
        m.group(1).split(".")[0]
        for _, message, text in failed
        if (m := re.search(r"No module named '([\w.]+)'", message + text))
    )
    skips = [case.find("skipped") for case in suite.iter("testcase")]
    skipped = Counter((found.get("message") or "")[:200] for found in skips if found is not None)
    return {
        "passed": n["tests"] - n["failures"] - n["errors"] - n["skipped"],
        "failed": n["failures"],
        "errors": n["errors"],
        "skipped": n["skipped"],
        "problems": problems[:50],
        "problems_from_missing_modules": dict(missing),
        "skipped_because": dict(skipped.most_common(20)),  # e.g. whether Coqui's GPU test found its package
    }
