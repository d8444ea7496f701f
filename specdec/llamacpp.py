"""llama.cpp as the yardstick (`specvoice bench --llamacpp`): the GGUF file our offline presets dequantize, run by
llama-cpp-python on the very prompt tokens our engine gets, greedily, and timed the way bench times our engine.

Alone: llama.cpp runs in a process of its own (`python -m specdec.llamacpp`, JSON in and out, generate_alone), all
prompts in one block while bench's process waits with its OpenMP workers let go, and it has exited before our engine
runs. Run in our process, beside our forwards, the two thread pools took the same cores from each other: on 2
cores llama.cpp measured 5.9 tok/s there and 11.65 alone, our target-only 2.7–4.1 against 10.3 alone (issue 38).

Fairness: bench's run_engine makes a new EngineSession per call, so our engine prefills every prompt from an empty
KV cache (no prefix reuse between prompts, not even the shared chat-template head). llama-cpp-python instead reuses
the longest common prefix of the previous call's tokens, so each generation here resets its state first: both
engines start every prompt cold. The optional package is llama-cpp-python (`scripts/setup.sh --llama`); it is not
installed in CI, so it is imported only when a comparator is made, and bench checks it before its models load.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .models import PRESETS, gguf_path

INSTALL_HINT = "run scripts/setup.sh --llama (it builds llama-cpp-python for this CPU, about 4 minutes)"
# How bench measured llama.cpp (its summary's llamacpp_isolation): see the module docstring.
ISOLATION = "own process, run alone: every prompt before our engine's runs, while our process waits"


def import_llama_cpp() -> Any:
    """The llama_cpp module, or a ValueError saying how to install it (the CLI prints ValueErrors as errors)."""
    try:
        import llama_cpp
    except ImportError as e:
        raise ValueError(f"the llama.cpp comparator needs the optional package llama-cpp-python: {INSTALL_HINT}") from e
    return llama_cpp


def preset_gguf(name: str) -> Path:
    """The preset's own GGUF file, for llama.cpp (joined once into the cache, then reused); its server
    (`python -m llama_cpp.server --model PATH`) serves it too. Checks the package before the file."""
    preset = PRESETS.get(name)
    if preset is None or not (preset.part_packages or preset.single_gguf_package):
        usable = [p.name for p in PRESETS.values() if p.part_packages or p.single_gguf_package]
        raise ValueError(
            f"the llama.cpp comparator runs a preset's GGUF file; {name!r} has none (use {', '.join(usable)})"
        )
    import_llama_cpp()  # fail before joining a gigabyte of parts
    return gguf_path(preset)


@dataclass(frozen=True)
class LlamaCppRun:
    """One greedy generation by llama.cpp."""

    tokens: list[int]  # new tokens, the EOS included when it came (as our engine emits it)
    seconds: float  # prompt processing + decoding: what bench times for our engine's runs
    decode_seconds: float  # from the first new token to the last (prefill and the first token excluded)

    @property
    def tokens_per_s(self) -> float:
        return len(self.tokens) / self.seconds if self.seconds > 0 else 0.0

    @property
    def decode_tokens_per_s(self) -> float | None:
        """Tokens after the first ÷ decode_seconds; None when there was only one token to time."""
        if len(self.tokens) < 2 or self.decode_seconds <= 0:
            return None
        return (len(self.tokens) - 1) / self.decode_seconds


class LlamaCppModel:
    """A GGUF model loaded in llama.cpp for greedy, cold-start generation from token ids."""

    def __init__(
        self, model_path: str | Path, n_threads: int, n_ctx: int = 4096, n_batch: int = 512, seed: int = 0
    ) -> None:
        llama_cpp = import_llama_cpp()
        self.path = Path(model_path)
        self.n_ctx = n_ctx
        # The same thread count for prompt processing as for decoding: torch uses one pool for both.
        self.llm = llama_cpp.Llama(
            model_path=str(self.path),
            n_ctx=n_ctx,
            n_threads=n_threads,
            n_threads_batch=n_threads,
            n_batch=n_batch,
            seed=seed,
            verbose=False,
        )

    def generate(self, prompt: list[int], max_new_tokens: int, eos: Iterable[int]) -> LlamaCppRun:
        """Greedy (temperature 0) continuation of `prompt` (token ids, chat template already applied) until one
        of `eos` or max_new_tokens, from an empty KV cache."""
        if not prompt:
            raise ValueError("empty prompt: nothing to answer")
        if max_new_tokens < 1:
            raise ValueError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if len(prompt) + max_new_tokens > self.n_ctx:
            raise ValueError(
                f"prompt ({len(prompt)} tokens) + {max_new_tokens} new tokens exceed llama.cpp's context "
                f"of {self.n_ctx} (n_ctx)"
            )
        stop = set(eos)
        tokens: list[int] = []
        t0 = time.perf_counter()
        t_first = t0
        # n_tokens = 0 makes generate() skip its prefix match and eval() drop every cached position: a cold start.
        self.llm.reset()
        # top_k 1 alongside temp 0 (greedy) so that no version's sampler chain can draw; no penalties.
        steps = self.llm.generate(
            prompt, top_k=1, top_p=1.0, min_p=0.0, temp=0.0, repeat_penalty=1.0, frequency_penalty=0.0, reset=True
        )
        try:
            for tok in steps:
                if not tokens:
                    t_first = time.perf_counter()
                tokens.append(int(tok))
                if tokens[-1] in stop or len(tokens) >= max_new_tokens:
                    break  # before the generator evaluates this token: our engine never feeds its last token either
        finally:
            steps.close()
        t_end = time.perf_counter()
        return LlamaCppRun(tokens, t_end - t0, t_end - t_first)


def generate_alone(
    model_path: str | Path,
    n_threads: int,
    prompts: list[list[int]],
    max_new_tokens: int,
    eos: Iterable[int],
    warmup: list[int] | None = None,
) -> list[LlamaCppRun]:
    """LlamaCppModel.generate on each of `prompts`, in a new process that loads the model, answers `warmup` first
    (untimed) and has exited on return: llama.cpp has the cores to itself while the caller, blocked here, runs
    nothing. A ValueError there (a prompt too long) is raised here; a crash is a RuntimeError."""
    request = {
        "model_path": str(model_path),
        "n_threads": n_threads,
        "prompts": prompts,
        "max_new_tokens": max_new_tokens,
        "eos": sorted(eos),
        "warmup": warmup,
    }
    # stderr passes through: llama.cpp's own messages and a traceback reach the terminal as they come.
    proc = subprocess.run(
        [sys.executable, "-m", "specdec.llamacpp"], input=json.dumps(request), stdout=subprocess.PIPE, text=True
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"llama.cpp's process exited with status {proc.returncode} (negative: killed by that signal; a build "
            f"with AMX faults in VMs: {INSTALL_HINT}); its error output is above"
        )
    reply = json.loads(proc.stdout)
    if "error" in reply:
        raise ValueError(reply["error"])
    return [LlamaCppRun(**run) for run in reply["runs"]]


def _serve(request: dict[str, Any]) -> dict[str, Any]:
    """generate_alone's other end: the request's prompts answered by one model, in order."""
    model = LlamaCppModel(request["model_path"], request["n_threads"])
    eos = request["eos"]
    if request["warmup"]:
        model.generate(request["warmup"], 8, eos)  # as bench warms our engine up before its timed runs
    runs = [model.generate(prompt, request["max_new_tokens"], eos) for prompt in request["prompts"]]
    return {"runs": [dataclasses.asdict(run) for run in runs]}


def main() -> int:
    """`python -m specdec.llamacpp`: one generate_alone request (JSON) on stdin, its reply (JSON) on stdout."""
    reply_fd = os.dup(1)
    os.dup2(2, 1)  # whatever llama.cpp prints goes to stderr: stdout carries the reply alone
    try:
        reply = _serve(json.load(sys.stdin))
    except ValueError as e:
        reply = {"error": str(e)}
    with os.fdopen(reply_fd, "w") as out:
        json.dump(reply, out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
