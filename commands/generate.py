"""`specvoice generate`: answer one prompt, streaming text as tokens are accepted."""

from __future__ import annotations

import argparse
import json
import sys
import time

from specdec.build import build_engine
from specdec.engine import GenerationConfig
from specdec.metrics import DEFINITIONS, LOW_ACCEPTANCE_WARNING, SpecStats
from specdec.sampling import SamplingParams
from specdec.tokenizer import IncrementalDecoder, words_start

from .options import add_engine_arguments, spec_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompt", required=True)
    parser.add_argument("--system", default=None, help="optional system message")
    parser.add_argument("--max-new-tokens", type=int, default=128)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--top-p", type=float, default=1.0)
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="sampling seed: the same seed gives the same answer with a fixed --k and --no-auto-off "
        "(AdaptiveK and the governor decide from measured times)",
    )
    parser.add_argument("--json", default=None, help="write tokens, events and metrics here")


def main(args: argparse.Namespace) -> int:
    engine, target = build_engine(spec_from_args(args))
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + [
        {"role": "user", "content": args.prompt}
    ]
    prompt_ids = target.tokenizer.chat_ids(messages) if args.prompt.strip() else []
    config = GenerationConfig(
        args.max_new_tokens,
        SamplingParams(args.temperature, args.top_p),
        args.seed,
        speculate=args.draft != "none",
        question_start=words_start(target.tokenizer, messages[:-1]),
    )
    stats = SpecStats()
    decoder = IncrementalDecoder(target.tokenizer)
    tokens: list[int] = []
    events = []
    t0 = time.perf_counter()
    for ev in engine.stream(prompt_ids, config, stats=stats):
        tokens += ev.tokens
        sys.stdout.write(decoder.push([t for t in ev.tokens if t not in target.tokenizer.eos_token_ids]))
        sys.stdout.flush()
        if ev.note:
            print(f"\n[{ev.note}]", file=sys.stderr)
        events.append(
            {
                "step": ev.step,
                "speculative": ev.speculative,
                "k_chosen": ev.k_chosen,
                "draft_tokens": ev.draft_tokens,
                "accepted": ev.accepted,
                "draft_forwards": ev.draft_forwards,
                "emitted": ev.tokens,
                "draft_s": ev.draft_seconds,
                "verify_s": ev.verify_seconds,
                "note": ev.note,
                "finish_reason": ev.finish_reason,
            }
        )
    seconds = time.perf_counter() - t0
    print()
    result = {
        "prompt": args.prompt,
        "text": decoder.text,
        "tokens": tokens,
        "seconds": seconds,
        "tokens_per_s": len(tokens) / seconds,
        **stats.as_dict(),
        "events": events,
        "definitions": DEFINITIONS,
    }
    summary = f"{len(tokens)} tokens in {seconds:.2f} s = {result['tokens_per_s']:.2f} tok/s"
    if stats.proposed:
        summary += (
            f"; draft_acceptance_rate {stats.draft_acceptance_rate:.0%}, "
            f"tokens_per_target_forward {stats.tokens_per_target_forward:.2f}"
        )
        if stats.draft_acceptance_rate < LOW_ACCEPTANCE_WARNING:
            summary += f" (warning: acceptance below {LOW_ACCEPTANCE_WARNING:.0%}; speculation may not pay)"
    print(summary, file=sys.stderr)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=2)
    return 0
