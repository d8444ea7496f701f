"""`specvoice` console script: one entry point, one subcommand per job."""

from __future__ import annotations

import argparse
import importlib
import sys

from specdec import compute

# subcommand -> (module with add_arguments(parser) and main(args) -> int, help)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "generate": ("commands.generate", "answer one prompt with (or without) speculation"),
    "bench": ("commands.bench", "target-only vs speculative vs transformers assisted, side by side"),
    "bench-target": ("commands.bench_target", "the target's weight formats: forward cost, memory, speed, drift"),
    "calibrate": ("commands.calibrate", "measure forward costs and acceptance, fit the latency model"),
    "say": ("commands.say", "one voice turn from a WAV recording"),
    "bench-voice": ("commands.bench_voice", "paired speculation off/on TTFA over many recordings"),
    "bench-turn": ("commands.bench_turn", "does each turn end where its speaker ended it (pauses, finished questions)"),
    "bench-asr": ("commands.bench_asr", "ASR word error rate and latency over synthetic voices, per model and option"),
    "bench-load": ("commands.bench_load", "N concurrent conversations, batched: speculation off, K = 4 and load-aware"),
    "bench-layerskip": ("commands.bench_layerskip", "self-speculation: the target with layers skipped as its drafter"),
    "corpus": ("commands.corpus", "the draft heads' training corpus, written and answered by the target (resumable)"),
    "train-heads": ("commands.train_heads", "train draft heads for a target on its own answers (resumable)"),
    "app": ("commands.app", "start the browser app"),
    "bench-users": ("commands.bench_users", "N voice clients at once: answered, busy, lost and mixed turns, TTFA"),
    "bench-heard": ("commands.bench_heard", "heard delay in headless Chromium over typed turns (needs the test extra)"),
    "bench-server": ("commands.bench_server", "server memory over N sessions, status under a flood, malformed input"),
    "casestudy": ("commands.casestudy", "reproduce and explain the 700 ms → 240 ms case study"),
    "vllm-serve": ("commands.vllm_serve", "print the `vllm serve` line that serves what the engine options name"),
}


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="specvoice", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    for name, (module, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text)
        p.set_defaults(_module=module)
        importlib.import_module(module).add_arguments(p)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    compute.numpy_blas_on_one_thread()
    try:
        return int(importlib.import_module(args._module).main(args) or 0)
    except KeyboardInterrupt:
        return 130
    except (ValueError, RuntimeError, FileNotFoundError) as e:
        # Bad input and unusable models end in one clear line, not a traceback.
        print(f"specvoice {args.command}: error: {e}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
