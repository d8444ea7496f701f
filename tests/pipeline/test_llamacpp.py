"""The llama.cpp comparator (`bench --llamacpp`) without llama-cpp-python: a missing package says how to install it,
split presets are joined once into the cache and reused, generation is greedy, cold and stops where it should (on a
stand-in Llama), runs in a process of its own, and bench joins its answers per prompt and reports them. One `models`
test runs the real thing where the package is installed."""

from __future__ import annotations

import json
import os
import sys
import types
from pathlib import Path

import pytest

from specdec import models
from specdec.bench import summarize
from specdec.llamacpp import ISOLATION, LlamaCppModel, LlamaCppRun, generate_alone, import_llama_cpp, preset_gguf
from specdec.metrics import DEFINITIONS, SpecStats
from tests.support.cli import specvoice
from tests.support.engine import cpu_only


@pytest.fixture
def no_llama_cpp(monkeypatch):
    """As if llama-cpp-python were not installed: a None entry makes `import llama_cpp` raise ImportError."""
    monkeypatch.setitem(sys.modules, "llama_cpp", None)


@pytest.fixture
def cache(tmp_path, monkeypatch) -> Path:
    monkeypatch.setenv("SPECVOICE_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def fake_part_packages(root: Path, monkeypatch, prefix: str, chunks: list[bytes]) -> tuple[str, ...]:
    """Importable packages shaped like the offline part packages: get_part_path() → a file holding one chunk."""
    names = []
    for i, chunk in enumerate(chunks, 1):
        pkg = root / f"{prefix}{i}"
        pkg.mkdir(parents=True)
        (pkg / "part.bin").write_bytes(chunk)
        (pkg / "__init__.py").write_text(
            "from pathlib import Path\n\ndef get_part_path():\n    return str(Path(__file__).parent / 'part.bin')\n"
        )
        names.append(pkg.name)
    monkeypatch.syspath_prepend(str(root))
    return tuple(names)


def test_missing_package_says_how_to_install(no_llama_cpp):
    for make in (import_llama_cpp, lambda: LlamaCppModel("model.gguf", n_threads=2)):
        with pytest.raises(ValueError, match=r"llama-cpp-python: run scripts/setup\.sh --llama"):
            make()


def test_missing_package_fails_before_joining_the_gguf(no_llama_cpp, monkeypatch):
    monkeypatch.setattr("specdec.llamacpp.gguf_path", lambda preset: pytest.fail("joined a GGUF for nothing"))
    with pytest.raises(ValueError, match="setup.sh --llama"):
        preset_gguf("qwen-1.5b")


@pytest.mark.parametrize("name", ["tiny-random-target", "Qwen/Qwen2.5-Coder-1.5B-Instruct", "/some/local/dir"])
def test_only_presets_with_a_gguf_file(name):
    with pytest.raises(ValueError, match=rf"{name!r} has none \(use qwen-1.5b, qwen-0.5b, smollm2-135m\)"):
        preset_gguf(name)


def test_gguf_path_joins_the_parts_once_into_the_cache(tmp_path, monkeypatch, cache):
    chunks = [b"GGUF" + b"a" * 1000, b"b" * 777, b"c" * 3]
    parts = fake_part_packages(tmp_path / "site", monkeypatch, "fake_gguf_join_part", chunks)
    preset = models.Preset("fake", None, parts, "fake.gguf")
    path = models.gguf_path(preset)
    assert path == cache / "gguf" / "fake.gguf"
    assert path.read_bytes() == b"".join(chunks)
    assert [p.name for p in path.parent.iterdir()] == ["fake.gguf"]  # no .partial left behind
    for name in parts:  # a second call reuses the joined file: it no longer needs the parts
        (tmp_path / "site" / name / "part.bin").unlink()
    assert models.gguf_path(preset) == path and path.read_bytes() == b"".join(chunks)


def test_gguf_path_names_a_missing_part_package(cache):
    preset = models.Preset("fake", None, ("no_such_gguf_part1",), "fake.gguf")
    with pytest.raises(models.ModelLoadError, match="needs the package no-such-gguf-part1"):
        models.gguf_path(preset)
    with pytest.raises(models.ModelLoadError, match="has no GGUF file"):
        models.gguf_path(models.PRESETS["tiny-random-target"])


class _FakeLoaded:
    """What offline_dir saves: a config.json and a safetensors file (no real model is made)."""

    def __init__(self, *args, **kwargs) -> None:
        self.config = types.SimpleNamespace()

    @classmethod
    def from_pretrained(cls, *args, **kwargs):
        return cls()

    def save_pretrained(self, out) -> None:
        Path(out).mkdir(parents=True, exist_ok=True)
        (Path(out) / "config.json").write_text("{}")
        (Path(out) / "model.safetensors").write_bytes(b"")


@pytest.mark.parametrize("joined_before", [False, True])
def test_offline_dir_drops_only_a_gguf_it_joined_itself(tmp_path, monkeypatch, cache, joined_before):
    """offline_dir's own joined copy is a third copy of the weights, deleted after dequantizing; a copy that was
    already there belongs to the llama.cpp comparator, which would otherwise join it again on every run."""
    transformers = pytest.importorskip("transformers")
    monkeypatch.setattr(transformers, "AutoModelForCausalLM", _FakeLoaded)
    monkeypatch.setattr(transformers, "AutoTokenizer", _FakeLoaded)
    parts = fake_part_packages(tmp_path / "site", monkeypatch, f"fake_gguf_offline{int(joined_before)}_part", [b"x"])
    preset = models.Preset("fake", None, parts, "fake.gguf")
    if joined_before:
        models.gguf_path(preset)
    out = models.offline_dir(preset)
    assert (out / "config.json").exists()
    assert (cache / "gguf" / "fake.gguf").exists() == joined_before


class FakeLlama:
    """Stands in for llama_cpp.Llama: yields `script` from generate(), after the prompt, and counts what it did."""

    script: list[int] = []

    def __init__(self, **kwargs) -> None:
        self.kwargs = kwargs
        self.n_tokens = 0
        self.resets = 0
        self.pulled = 0
        self.calls: list[dict] = []

    def reset(self) -> None:
        self.resets += 1
        self.n_tokens = 0

    def generate(self, tokens, **kwargs):
        assert self.n_tokens == 0, "generate() ran on a warm KV cache"
        self.calls.append({"tokens": list(tokens), **kwargs})
        self.n_tokens = len(tokens)
        for tok in self.script:
            self.pulled += 1
            yield tok
            self.n_tokens += 1  # the token is evaluated only once the caller asks for the next one


@pytest.fixture
def fake_llama(monkeypatch):
    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    return LlamaCppModel("model.gguf", n_threads=3, n_ctx=64, n_batch=32, seed=7)


def test_loads_with_our_threads_and_quietly(fake_llama):
    assert fake_llama.llm.kwargs == {
        "model_path": "model.gguf",
        "n_ctx": 64,
        "n_threads": 3,
        "n_threads_batch": 3,
        "n_batch": 32,
        "seed": 7,
        "verbose": False,
    }


def test_generate_is_greedy_cold_and_stops_at_eos(fake_llama, monkeypatch):
    monkeypatch.setattr(FakeLlama, "script", [5, 6, 2, 9, 9])
    run = fake_llama.generate([1, 2, 3], max_new_tokens=10, eos={2, 4})
    assert run.tokens == [5, 6, 2]  # the EOS included, as our engine emits it
    assert fake_llama.llm.pulled == 3  # nothing generated past it
    call = fake_llama.llm.calls[-1]
    assert call["tokens"] == [1, 2, 3] and call["temp"] == 0.0 and call["top_k"] == 1 and call["repeat_penalty"] == 1
    assert run.seconds >= run.decode_seconds >= 0
    again = fake_llama.generate([1, 2, 3, 4], max_new_tokens=10, eos={2})  # would fail on a warm cache
    assert again.tokens == [5, 6, 2] and fake_llama.llm.resets == 2


def test_generate_stops_at_the_budget(fake_llama, monkeypatch):
    monkeypatch.setattr(FakeLlama, "script", [5, 6, 7, 8, 9])
    assert fake_llama.generate([1], max_new_tokens=2, eos=set()).tokens == [5, 6]
    assert fake_llama.llm.pulled == 2


def test_generate_refuses_what_does_not_fit(fake_llama):
    with pytest.raises(ValueError, match="exceed llama.cpp's context of 64"):
        fake_llama.generate(list(range(60)), max_new_tokens=5, eos=set())
    with pytest.raises(ValueError, match="empty prompt"):
        fake_llama.generate([], max_new_tokens=5, eos=set())


# llama_cpp as generate_alone's process imports it (from PYTHONPATH, ahead of an installed one): each answer is that
# process's pid, then the prompt echoed, so a test sees which process answered which prompt. A model file named
# crash.gguf aborts the process.
CHILD_LLAMA_CPP = """
import os


class Llama:
    def __init__(self, model_path, **kwargs):
        if model_path.endswith("crash.gguf"):
            os.abort()
        self.n_tokens = 0

    def reset(self):
        self.n_tokens = 0

    def generate(self, tokens, **kwargs):
        assert self.n_tokens == 0, "generate() ran on a warm KV cache"
        self.n_tokens = len(tokens)
        for tok in [os.getpid(), *tokens]:
            yield tok
            self.n_tokens += 1
"""


@pytest.fixture
def child_llama_cpp(tmp_path, monkeypatch) -> None:
    root = tmp_path / "child_site"
    root.mkdir()
    (root / "llama_cpp.py").write_text(CHILD_LLAMA_CPP)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(root), os.environ.get("PYTHONPATH")])))


def test_generate_alone_answers_every_prompt_in_one_process_of_its_own(child_llama_cpp):
    prompts = [[1, 2, 3], [4, 5, 6, 7], [8]]
    runs = generate_alone("model.gguf", 2, prompts, max_new_tokens=4, eos={2}, warmup=[9, 9])
    pids = {run.tokens[0] for run in runs}
    assert len(pids) == 1 and os.getpid() not in pids  # one other process answered them all
    assert [run.tokens[1:] for run in runs] == [[1, 2], [4, 5, 6], [8]]  # in order; EOS and budget kept
    assert all(run.seconds >= run.decode_seconds >= 0 for run in runs)
    again = generate_alone("model.gguf", 2, prompts[:1], max_new_tokens=4, eos={2})
    assert again[0].tokens[0] not in pids  # a new process for each call


def test_generate_alone_raises_what_went_wrong_there(child_llama_cpp):
    with pytest.raises(ValueError, match="exceed llama.cpp's context of 4096"):
        generate_alone("model.gguf", 2, [list(range(4096))], max_new_tokens=4, eos=set())
    with pytest.raises(RuntimeError, match="llama.cpp's process exited with status -6"):
        generate_alone("crash.gguf", 2, [[1]], max_new_tokens=4, eos=set())


def test_rates():
    run = LlamaCppRun([1, 2, 3, 4, 5], seconds=2.0, decode_seconds=1.0)
    assert run.tokens_per_s == 2.5 and run.decode_tokens_per_s == 4.0
    assert LlamaCppRun([1], seconds=0.5, decode_seconds=0.0).decode_tokens_per_s is None


def _result(spec_tps: float, llama_tps: float | None, identical: bool = True) -> dict:
    entry = {
        "category": "c",
        "baseline": {"tokens": 10, "seconds": 1.0, "tokens_per_s": 10.0},
        "speculative": {
            "tokens_per_s": spec_tps,
            "identical_to_baseline": True,
            "first_divergence": None,
            "draft_acceptance_rate": 0.5,
        },
        "speedup": spec_tps / 10.0,
    }
    if llama_tps is not None:
        entry["llamacpp"] = {"tokens_per_s": llama_tps, "identical_to_baseline": identical}
    return entry


def test_summary_reports_llamacpp_beside_ours():
    summary = summarize([_result(20.0, 10.0), _result(30.0, 20.0, identical=False)], SpecStats())
    assert summary["llamacpp_tokens_per_s_median"] == 15.0
    assert summary["speculative_vs_llamacpp"] == 1.75  # median of 2.0 and 1.5
    assert summary["llamacpp_identical_fraction"] == 0.5
    without = summarize([_result(20.0, None)], SpecStats())
    assert not [k for k in without if "llamacpp" in k]  # a run without --llamacpp keeps its keys as they were
    for name in ("llamacpp_tokens_per_s_median", "speculative_vs_llamacpp", "llamacpp_identical_fraction"):
        assert name in DEFINITIONS
    assert "decode_tokens_per_s" in DEFINITIONS


def test_bench_help_shows_the_flag():
    proc = specvoice("bench", "--help", check=False)
    assert proc.returncode == 0 and "--llamacpp" in proc.stdout


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--target", "tiny-random-target"], "'tiny-random-target' has none"),
        (["--device", "cuda"], "--llamacpp compares CPU runs"),
    ],
)
def test_bench_llamacpp_refuses_clearly_before_loading(tmp_path, args, message):
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    proc = specvoice(
        "bench",
        *args,
        "--draft",
        "none",
        "--prompts",
        str(prompts),
        "--json",
        str(tmp_path / "o.json"),
        "--llamacpp",
        check=False,
    )
    assert proc.returncode == 2 and message in proc.stderr and "Traceback" not in proc.stderr


def test_bench_llamacpp_without_the_package_fails_before_loading(no_llama_cpp, tmp_path, monkeypatch):
    monkeypatch.setattr("commands.bench.build_engines", lambda *a: pytest.fail("loaded our models for nothing"))
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "hi"}) + "\n")
    args = ["--target", "qwen-1.5b", "--draft", "none", "--prompts", str(prompts), "--json", str(tmp_path / "o.json")]
    proc = specvoice("bench", *args, "--llamacpp", check=False)
    assert proc.returncode == 2 and "llama-cpp-python: run scripts/setup.sh --llama" in proc.stderr


@cpu_only
def test_bench_runs_llamacpp_alone_and_joins_per_prompt(tiny_engine, tmp_path, monkeypatch, child_llama_cpp):
    monkeypatch.setattr("commands.bench.preset_gguf", lambda name: tmp_path / "model.gguf")  # the tiny target has none
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"prompt": p}) + "\n" for p in ("hi", "count: 1 2 3", "a b")))
    out = tmp_path / "bench.json"
    args = ["--prompts", str(prompts), "--max-new-tokens", "64", "--compare", "none", "--json", str(out)]
    specvoice("bench", *tiny_engine.cli_args, *args, "--llamacpp")
    data = json.loads(out.read_text())
    for p in data["prompts"]:
        llama = p["llamacpp"]
        assert set(llama) == {
            "tokens",
            "seconds",
            "tokens_per_s",
            "decode_tokens_per_s",
            "identical_to_baseline",
            "first_divergence",
        }
        assert llama["tokens"] == 1 + p["prompt_tokens"]  # its process's pid, then this prompt echoed: joined right
        assert llama["identical_to_baseline"] is False and llama["first_divergence"] == 0
    summary = data["summary"]
    assert summary["llamacpp_isolation"] == ISOLATION
    assert summary["llamacpp_identical_fraction"] == 0.0 and summary["llamacpp_tokens_per_s_median"] > 0


@pytest.mark.models
def test_real_llamacpp_greedy_on_the_draft_preset(real_models):
    pytest.importorskip("llama_cpp")
    from transformers import AutoTokenizer

    from specdec.tokenizer import HFTokenizer

    tok = HFTokenizer(AutoTokenizer.from_pretrained(str(models.offline_dir(models.PRESETS["qwen-0.5b"]))))
    llama = LlamaCppModel(preset_gguf("qwen-0.5b"), n_threads=2, n_ctx=256)
    prompt = tok.chat_ids([{"role": "user", "content": "What is the capital of France?"}])
    first = llama.generate(prompt, 4, tok.eos_token_ids)
    assert 1 <= len(first.tokens) <= 4 and first.tokens_per_s > 0
    assert "Paris" in tok.decode(llama.generate(prompt, 12, tok.eos_token_ids).tokens)
    assert llama.generate(prompt, 4, tok.eos_token_ids).tokens == first.tokens  # cold each time: the same answer
    alone = generate_alone(preset_gguf("qwen-0.5b"), 2, [prompt], 4, tok.eos_token_ids, warmup=prompt)
    assert alone[0].tokens == first.tokens  # the same model in a process of its own
