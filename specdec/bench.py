"""`specvoice bench`: target-only, this engine and transformers' assisted generation, interleaved per prompt
in one process, on the same models, dtype and threads. Progress on stderr, JSON out."""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch

from .build import add_engine_arguments, build_engine, spec_from_args
from .engine import GenerationConfig, SpeculativeEngine, collect
from .metrics import DEFINITIONS, LOW_ACCEPTANCE_WARNING, SpecStats, expected_speedup
from .models import load_model


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompts", required=True, help="JSONL, one {\"prompt\": ..., \"category\"?: ...} a line")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    parser.add_argument("--compare", default="hf", choices=["hf", "none"],
                        help="hf: also run transformers' generate() target-only and with assistant_model")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--json", required=True)


def read_prompts(path: str, limit: int = 0) -> list[dict]:
    rows = []
    for n, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{n}: not JSON ({e})") from None
        if not isinstance(row, dict) or not str(row.get("prompt", "")).strip():
            raise ValueError(f"{path}:{n}: needs a non-empty \"prompt\"")
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows[:limit] if limit else rows


def _timed(fn, *args) -> tuple[list[int], float]:
    t0 = time.perf_counter()
    tokens = fn(*args)
    return tokens, time.perf_counter() - t0


def _entry(tokens: list[int], seconds: float) -> dict:
    return {"tokens": len(tokens), "seconds": seconds, "tokens_per_s": len(tokens) / seconds}


def first_divergence(a: list[int], b: list[int]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


@torch.inference_mode()
def explain_divergence(model, prompt: list[int], baseline: list[int], index: int) -> dict:
    """At the first differing token: the target's two best logits there. A gap of at most two rounding steps
    of the model's dtype is a tie that batched and one-by-one kernels may break differently."""
    ids = torch.tensor([prompt + baseline[:index]], device=model.device)
    logits = model(input_ids=ids, logits_to_keep=1).logits[0, -1].float()
    top = logits.topk(2)
    gap = float(top.values[0] - top.values[1])
    top1 = abs(float(top.values[0])) or 1.0
    ulp = 2.0 ** math.floor(math.log2(top1)) * torch.finfo(model.dtype).eps  # spacing of dtype at top1
    near_tie = gap <= 2 * ulp
    return {"index": index, "top2_tokens": top.indices.tolist(), "top2_logit_gap": gap, "dtype_step": ulp,
            "near_tie": near_tie,
            "explanation": (f"near-tie: the target's top two logits differ by {gap:.4g}, at most two {model.dtype} "
                            "rounding steps; batched verification and one-by-one decoding round differently")
            if near_tie else "not a near-tie: investigate"}


def hf_generate(target_model, prompt: list[int], n: int, eos: set[int], assistant=None) -> list[int]:
    """transformers' generate(), greedy; with `assistant`, its assisted generation on its own default K schedule
    (which ran at least as fast here as any fixed num_assistant_tokens we tried)."""
    ids = torch.tensor([prompt], device=target_model.device)
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    out = target_model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                                eos_token_id=sorted(eos), pad_token_id=sorted(eos)[0], **kwargs)
    return out[0, len(prompt):].tolist()


def run_engine(engine: SpeculativeEngine, prompt: list[int], config: GenerationConfig,
               stats: SpecStats | None = None) -> list[int]:
    return collect(engine.stream(prompt, config, stats=stats))[0]


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = read_prompts(args.prompts, args.limit)
    spec = spec_from_args(args)
    engine, target = build_engine(spec)
    assistant = None
    if args.compare == "hf" and spec.draft not in ("none", "ngram"):
        assistant = load_model(spec.draft, target.dtype, spec.device).model  # unmodified copy for transformers
    eos = target.tokenizer.eos_token_ids
    n = args.max_new_tokens
    base_cfg = GenerationConfig(n, speculate=False)
    spec_cfg = GenerationConfig(n, speculate=True)

    warm = target.tokenizer.chat_ids([{"role": "user", "content": "Say hi."}])
    run_engine(engine, warm, GenerationConfig(4, speculate=False))
    run_engine(engine, warm, GenerationConfig(8))
    if assistant is not None:
        hf_generate(target.model, warm, 4, eos, assistant)

    total = SpecStats()
    results = []
    for i, row in enumerate(rows):
        prompt = target.tokenizer.chat_ids([{"role": "user", "content": row["prompt"]}])
        base, base_s = _timed(run_engine, engine, prompt, base_cfg)
        stats = SpecStats()
        spec_tokens, spec_s = _timed(run_engine, engine, prompt, spec_cfg, stats)
        total.merge(stats)
        div = first_divergence(base, spec_tokens)
        entry = {
            "category": row.get("category", ""), "prompt": row["prompt"], "prompt_tokens": len(prompt),
            "baseline": _entry(base, base_s),
            "speculative": {**_entry(spec_tokens, spec_s), **stats.as_dict(), "identical_to_baseline": div is None,
                            "first_divergence": None if div is None else
                            explain_divergence(target.model, prompt, base, div)},
        }
        if args.compare == "hf":
            hf_plain, hf_plain_s = _timed(hf_generate, target.model, prompt, n, eos)
            entry["hf_generate"] = {**_entry(hf_plain, hf_plain_s), "identical_to_baseline": hf_plain == base}
            if assistant is not None:
                hf_tokens, hf_s = _timed(hf_generate, target.model, prompt, n, eos, assistant)
                entry["hf_assisted"] = {**_entry(hf_tokens, hf_s), "identical_to_baseline": hf_tokens == base}
        entry["speedup"] = entry["speculative"]["tokens_per_s"] / entry["baseline"]["tokens_per_s"]
        results.append(entry)
        print(f"[{i + 1}/{len(rows)}] {entry['category']:10s} base {entry['baseline']['tokens_per_s']:.2f} tok/s, "
              f"spec {entry['speculative']['tokens_per_s']:.2f} tok/s ({entry['speedup']:.2f}×, "
              f"acc {stats.draft_acceptance_rate:.0%}, identical={div is None})"
              + (f", hf_assisted {entry['hf_assisted']['tokens_per_s']:.2f}" if "hf_assisted" in entry else ""),
              file=sys.stderr, flush=True)

    summary = summarize(results, total)
    drafter = engine.drafter_factory() if engine.drafter_factory else None
    summary["config"] = {**vars(spec), "max_new_tokens": n, "threads": torch.get_num_threads(),
                         "target_min_feed": target.min_feed, "draft_min_prob": getattr(drafter, "min_prob", None)}
    out = {"definitions": DEFINITIONS, "summary": summary, "prompts": results}
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_category"}, indent=2), file=sys.stderr)
    return 0


def _median_ratio(results: list[dict], num: str, den: str) -> float | None:
    ratios = [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in results if num in r and den in r]
    return statistics.median(ratios) if ratios else None


def summarize(results: list[dict], total: SpecStats) -> dict:
    base_s_per_token = sum(r["baseline"]["seconds"] for r in results) / max(1, sum(r["baseline"]["tokens"]
                                                                                  for r in results))
    # c against the target-only path's seconds per token, as Leviathan et al. define it.
    c = (total.draft_seconds / total.draft_forwards) / base_s_per_token if total.draft_forwards else 0.0
    k = round(total.mean_k)
    expected = expected_speedup(total.alpha, k, c) if k else 1.0
    speedup = statistics.median(r["speedup"] for r in results)
    by_cat: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by_cat[r["category"]].append(r)
    warnings = []
    if total.draft_acceptance_rate < LOW_ACCEPTANCE_WARNING:
        warnings.append(f"draft acceptance {total.draft_acceptance_rate:.0%} is below "
                        f"{LOW_ACCEPTANCE_WARNING:.0%}: speculation may not pay on these prompts")
    diverged = [r["speculative"]["first_divergence"] for r in results if r["speculative"]["first_divergence"]]
    if diverged:
        warnings.append(f"{len(diverged)} of {len(results)} outputs differ from target-only; see each "
                        "prompt's first_divergence for the target's top-2 logit gap at that token")
    base_vs_hf = _median_ratio(results, "baseline", "hf_generate")
    if base_vs_hf is not None and base_vs_hf < 0.95:
        warnings.append(f"our target-only baseline runs at {base_vs_hf:.2f}× transformers' generate(): the "
                        "speedups above are measured against a slower baseline than exists")
    return {
        "warnings": warnings,
        "speedup_median": speedup,
        "speedup_vs_hf_median": _median_ratio(results, "speculative", "hf_assisted"),
        "baseline_vs_hf_generate_median": base_vs_hf,
        "baseline_tokens_per_s_median": statistics.median(r["baseline"]["tokens_per_s"] for r in results),
        "speculative_tokens_per_s_median": statistics.median(r["speculative"]["tokens_per_s"] for r in results),
        "greedy_identical_fraction": sum(r["speculative"]["identical_to_baseline"] for r in results) / len(results),
        "hf_assisted_identical_fraction": (sum(r["hf_assisted"]["identical_to_baseline"] for r in results)
                                           / len(results)) if "hf_assisted" in results[0] else None,
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "tokens_per_target_forward": total.tokens_per_target_forward,
        "per_position_acceptance": total.per_position_acceptance,
        "alpha": total.alpha,
        "mean_k": total.mean_k,
        "draft_cost_ratio": c,
        "expected_speedup": expected,
        "bound_attainment": speedup / expected if expected else None,
        "per_category": {cat: {"speedup_median": statistics.median(r["speedup"] for r in rs),
                               "draft_acceptance_rate_mean": statistics.fmean(
                                   r["speculative"]["draft_acceptance_rate"] for r in rs),
                               "prompts": len(rs)} for cat, rs in by_cat.items()},
    }
