"""`specvoice calibrate`: measure this machine's forward costs and acceptance, fit the speedup model
E(α, K) / (cK + v(K + 1)), and set its predictions beside measured speedups for K = 1 … 8."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from pipeline.options import add_engine_arguments, spec_from_args
from specdec.bench import read_prompts, run_engine
from specdec.build import build_engine
from specdec.calibrate import measured_forward_seconds
from specdec.drafters import DraftModelDrafter
from specdec.engine import GenerationConfig
from specdec.kpolicy import FixedK
from specdec.metrics import DEFINITIONS, SpecStats, expected_tokens_per_step

DEFAULT_PROMPTS = [
    "What is the capital of Australia?",
    "How do I reverse a list in Python?",
    "Give me three quick tips for sleeping better.",
]


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompts", default=None, help="JSONL prompts (default: three built-in ones)")
    parser.add_argument("--limit", type=int, default=3)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument("--k-values", default="1,2,3,4,5,6,7,8")
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per point (median)")
    parser.add_argument("--json", default="calibration.json")


def main(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    spec.draft_min_prob = 0.0  # Leviathan's model drafts K tokens every step: no confidence gate here
    engine, target = build_engine(spec)
    if engine.drafter_factory is None:
        raise ValueError("calibrate needs a drafter: --draft MODEL or --draft ngram")
    if engine.drafter_kind == "heads":  # its cost is not one model forward; bench measures it as draft_cost_ratio
        raise ValueError("calibrate times a draft model's forward; for --draft heads see `specvoice bench`")
    engine.auto_off = False  # measure every K as it is, even where it loses
    device = target.device
    t_start = time.perf_counter()
    verify = {n: measured_forward_seconds(engine.runner, n, repeats=args.repeats) for n in range(1, 17)}
    fit = statistics.linear_regression(list(verify), list(verify.values()))  # least squares: a + b·tokens
    a, b = fit.intercept, fit.slope
    drafter = engine.drafter_factory()
    draft_s = (
        measured_forward_seconds(drafter.cache.runner, 1, repeats=args.repeats)
        if isinstance(drafter, DraftModelDrafter)
        else 0.0
    )
    c = draft_s / verify[1]
    print(
        f"target forward: {verify[1] * 1000:.1f} ms (1 token) … {verify[16] * 1000:.1f} ms (16); "
        f"draft {draft_s * 1000:.1f} ms; c = {c:.3f}",
        file=sys.stderr,
    )

    rows = read_prompts(args.prompts, args.limit) if args.prompts else [{"prompt": p} for p in DEFAULT_PROMPTS]
    prompts = [target.tokenizer.chat_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]
    n = args.max_new_tokens
    run_engine(engine, prompts[0], GenerationConfig(4))  # warm-up

    def tokens_per_s(config: GenerationConfig, stats: SpecStats | None = None) -> float:
        tokens, seconds = 0, 0.0
        for p in prompts:
            t0 = time.perf_counter()
            tokens += len(run_engine(engine, p, config, stats))
            seconds += time.perf_counter() - t0
        return tokens / seconds

    baseline = tokens_per_s(GenerationConfig(n, speculate=False))
    per_k = []
    for k in (int(x) for x in args.k_values.split(",")):
        stats = SpecStats()
        measured = tokens_per_s(GenerationConfig(n, k_policy=lambda k=k: FixedK(k)), stats) / baseline
        v = (a + b * (k + 1)) / verify[1]
        e = expected_tokens_per_step(stats.alpha, k)
        per_k.append(
            {
                "k": k,
                "alpha": stats.alpha,
                "draft_acceptance_rate": stats.draft_acceptance_rate,
                "verify_cost_ratio": v,
                "predicted_speedup": e / (c * k + v),
                "measured_speedup": measured,
            }
        )
        print(
            f"K={k}: α {stats.alpha:.2f}, predicted {per_k[-1]['predicted_speedup']:.2f}×, measured {measured:.2f}×",
            file=sys.stderr,
            flush=True,
        )
    out = {
        "definitions": DEFINITIONS,
        "device": str(device),
        "dtype": spec.dtype,
        "target": spec.target,
        "draft": spec.draft,
        "target_forward_s_by_tokens": verify,
        "verify_fit": {"intercept_s": a, "per_token_s": b},
        "draft_forward_s": draft_s,
        "draft_cost_ratio": c,
        "baseline_tokens_per_s": baseline,
        "per_k": per_k,
        "best_k_predicted": max(per_k, key=lambda r: r["predicted_speedup"])["k"],
        "best_k_measured": max(per_k, key=lambda r: r["measured_speedup"])["k"],
        "seconds": time.perf_counter() - t_start,
    }
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(f"wrote {args.json} ({out['seconds']:.0f} s)", file=sys.stderr)
    return 0
