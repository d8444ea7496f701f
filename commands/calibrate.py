"""`specvoice calibrate`: measure this machine's forward and drafting costs and acceptance, fit the speedup model
E(α, K) / (cK + v(K + 1)), and set its predictions beside measured speedups for K = 1 … 8. Everything is timed
through what the app runs: the engine's BatchRunner for the target and the engine's own drafter (the default draft
heads, a draft model or n-gram) for the drafts, on --device."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

from specdec.bench import read_prompts, run_engine
from specdec.build import build_engine
from specdec.calibrate import measured_draft_seconds, measured_forward_seconds
from specdec.engine import GenerationConfig
from specdec.kpolicy import FixedK
from specdec.metrics import DEFINITIONS, SpecStats, expected_tokens_per_step
from specdec.session import EngineSession
from specdec.timing import clock

from .options import add_engine_arguments, spec_from_args

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
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards and proposals per point (median)")
    parser.add_argument("--json", default="calibration.json")


def main(args: argparse.Namespace) -> int:
    spec = spec_from_args(args)
    spec.draft_min_prob = 0.0  # Leviathan's model drafts K tokens every step: no confidence gate here
    spec.draft_tree = 1  # and a chain of them: its α is the chance each next draft is accepted
    engine, target = build_engine(spec)
    if engine.drafter_factory is None:
        raise ValueError("calibrate needs a drafter: --draft heads (the default), a draft model or ngram")
    engine.auto_off = False  # measure every K as it is, even where it loses
    device = target.device
    t_start = time.perf_counter()
    verify = {n: measured_forward_seconds(engine.runner, n, repeats=args.repeats) for n in range(1, 17)}
    fit = statistics.linear_regression(list(verify), list(verify.values()))  # least squares: a + b·tokens
    a, b = fit.intercept, fit.slope

    rows = read_prompts(args.prompts, args.limit) if args.prompts else [{"prompt": p} for p in DEFAULT_PROMPTS]
    prompts = [target.tokenizer.chat_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]
    # A drafter in the state a step meets it: a conversation holding the first prompt (heads: with the target's
    # features of it), then one token it has not seen.
    session = EngineSession(engine)
    session.prefill(prompts[0])
    drafter = session.drafter
    assert drafter is not None  # the engine has a drafter factory
    context = prompts[0] + prompts[0][-1:]
    k_values = [int(x) for x in args.k_values.split(",")]
    draft = {k: measured_draft_seconds(drafter, context, k, device, args.repeats) for k in sorted({1, *k_values})}
    c = draft[1][0] / verify[1]
    print(
        f"target forward: {verify[1] * 1000:.1f} ms (1 token) … {verify[16] * 1000:.1f} ms (16); "
        f"{engine.drafter_kind}: {draft[1][0] * 1000:.2f} ms for one draft; c = {c:.3f}",
        file=sys.stderr,
    )

    n = args.max_new_tokens
    run_engine(engine, prompts[0], GenerationConfig(4))  # warm-up

    def tokens_per_s(config: GenerationConfig, stats: SpecStats | None = None) -> float:
        tokens, seconds = 0, 0.0
        for p in prompts:
            t0 = clock(device)
            tokens += len(run_engine(engine, p, config, stats))
            seconds += clock(device) - t0
        return tokens / seconds

    baseline = tokens_per_s(GenerationConfig(n, speculate=False))
    per_k = []
    for k in k_values:
        stats = SpecStats()
        measured = tokens_per_s(GenerationConfig(n, k_policy=lambda k=k: FixedK(k)), stats) / baseline
        draft_s, drafted = draft[k]  # medusa heads propose at most one draft per head (4)
        v = (a + b * (drafted + 1)) / verify[1]
        e = expected_tokens_per_step(stats.alpha, drafted)
        per_k.append(
            {
                "k": k,
                "drafted": drafted,
                "alpha": stats.alpha,
                "draft_acceptance_rate": stats.draft_acceptance_rate,
                "draft_s": draft_s,
                "draft_cost_ratio": draft_s / drafted / verify[1] if drafted else 0.0,
                "verify_cost_ratio": v,
                "predicted_speedup": e / (draft_s / verify[1] + v),
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
        "target_quant": spec.target_quant,
        "draft": spec.draft,
        "drafter_kind": engine.drafter_kind,
        "target_forward_s_by_tokens": verify,
        "verify_fit": {"intercept_s": a, "per_token_s": b},
        "draft_s_by_k": {k: s for k, (s, _) in draft.items()},
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
