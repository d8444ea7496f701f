"""`specvoice bench-layerskip`: self-speculation (the target with layers skipped drafting for itself), measured.

On the held-out answers of `specvoice train-heads` (the target's own greedy answers to training prompts, never a
benchmark prompt): layers are ranked by the agreement left when each is skipped alone (on one half), then the
n least needed are skipped together and scored on the other half. α is that agreement (the chance a draft token is
accepted, teacher-forced), c the measured cost of a skipped forward against the whole target's, and the expected
speedup E(α, K) / (cK + 1) tells whether such a drafter can pay on this machine. JSON out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from specdec.build import DTYPES, EngineSpec, quantize_target
from specdec.heads_data import load_shards
from specdec.heads_train import split
from specdec.layerskip import agreement, draft_cost_ratio, rank_layers
from specdec.metrics import expected_speedup
from specdec.models import cache_dir, load_model
from specdec.quant import TARGET_QUANTS


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineSpec()
    parser.add_argument("--target", default=d.target)
    parser.add_argument("--target-quant", default=d.target_quant, choices=list(TARGET_QUANTS))
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    parser.add_argument("--work", default="", help="train-heads' work folder (default: its default for the target)")
    parser.add_argument("--limit", type=int, default=40, help="held-out answers to use (half rank, half score)")
    parser.add_argument("--skip-counts", default="4,7,10,14", help="layers skipped together")
    parser.add_argument("--k-values", default="1,2,3,4")
    parser.add_argument("--json", required=True)


def main(args: argparse.Namespace) -> int:
    work = Path(args.work) if args.work else cache_dir() / "heads" / f"{args.target}-{args.target_quant}"
    seqs = load_shards(work)
    if not seqs:
        raise FileNotFoundError(f"no answers in {work}/data: run `specvoice train-heads` first (it records them)")
    _, held_out = split(seqs, 0.1, 0)
    held_out = held_out[: args.limit]
    rank_set, score_set = held_out[::2], held_out[1::2]
    target = load_model(args.target, DTYPES[args.dtype])
    quantize_target(target, args.target_quant)
    model = target.model
    ceiling = agreement(model, score_set, set())
    print(f"whole target: agreement {ceiling:.1%} (the ceiling: its batched answers vs one at a time)", file=sys.stderr)
    ranking = rank_layers(model, rank_set)
    print("layers, least needed first: " + ", ".join(f"{i} ({a:.0%})" for i, a in ranking), file=sys.stderr)
    ks = [int(k) for k in args.k_values.split(",")]
    runs = []
    for n in (int(x) for x in args.skip_counts.split(",")):
        skip = {i for i, _ in ranking[:n]}
        alpha = agreement(model, score_set, skip)
        c = draft_cost_ratio(model, skip, target.device)
        speedups = {k: expected_speedup(alpha, k, c) for k in ks}
        runs.append({"skipped": sorted(skip), "alpha": alpha, "draft_cost_ratio": c, "expected_speedup": speedups})
        print(
            f"skip {n:2d}: α {alpha:.1%}, c {c:.2f}, expected speedup "
            + ", ".join(f"K={k} {s:.2f}×" for k, s in speedups.items()),
            file=sys.stderr,
        )
    best = max((s for r in runs for s in r["expected_speedup"].values()), default=1.0)
    out = {
        "target": args.target,
        "target_quant": args.target_quant,
        "held_out_answers": {"rank": len(rank_set), "score": len(score_set)},
        "whole_target_agreement": ceiling,
        "layer_ranking": [{"layer": i, "agreement_skipped_alone": a} for i, a in ranking],
        "runs": runs,
        "best_expected_speedup": best,
        "pays": best > 1.0,
    }
    Path(args.json).write_text(json.dumps(out, indent=2) + "\n")
    return 0
