"""What `specvoice bench` (commands/bench.py) runs and reports: prompts, the engine and transformers' generate() on the
same prompt, where two outputs diverge and why, and the summary of a run."""

from __future__ import annotations

import json
import math
import statistics
from collections import defaultdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .engine import GenerationConfig, SpeculativeEngine, collect
from .metrics import LOW_ACCEPTANCE_WARNING, SpecStats, expected_speedup
from .tokenizer import common_prefix_length

if TYPE_CHECKING:
    from .scheduler import BatchScheduler


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
            raise ValueError(f'{path}:{n}: needs a non-empty "prompt"')
        rows.append(row)
    if not rows:
        raise ValueError(f"{path}: no prompts")
    return rows[:limit] if limit else rows


def first_divergence(a: list[int], b: list[int]) -> int | None:
    """Index of the first token where a and b differ (a shorter one ends there); None when they are equal."""
    n = common_prefix_length(a, b)
    return None if n == len(a) == len(b) else n


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
    return {
        "index": index,
        "top2_tokens": top.indices.tolist(),
        "top2_logit_gap": gap,
        "dtype_step": ulp,
        "near_tie": near_tie,
        "explanation": (
            f"near-tie: the target's top two logits differ by {gap:.4g}, at most two {model.dtype} "
            "rounding steps; batched verification and one-by-one decoding round differently"
        )
        if near_tie
        else "not a near-tie: investigate",
    }


def hf_generate(target_model, prompt: list[int], n: int, eos: set[int], assistant=None) -> list[int]:
    """transformers' generate(), greedy; with `assistant`, its assisted generation on its own default K schedule
    (which ran at least as fast here as any fixed num_assistant_tokens we tried)."""
    ids = torch.tensor([prompt], device=target_model.device)
    kwargs = {"assistant_model": assistant} if assistant is not None else {}
    out = target_model.generate(
        ids,
        attention_mask=torch.ones_like(ids),
        max_new_tokens=n,
        do_sample=False,
        eos_token_id=sorted(eos),
        pad_token_id=sorted(eos)[0],
        **kwargs,
    )
    return out[0, len(prompt) :].tolist()


def run_engine(
    engine: SpeculativeEngine | BatchScheduler,
    prompt: list[int],
    config: GenerationConfig,
    stats: SpecStats | None = None,
    notes: list[str] | None = None,
) -> list[int]:
    """One answer's tokens; notes, if given, gets the steps' notes (why speculation changed state)."""
    tokens, events = collect(engine.stream(prompt, config, stats=stats))
    if notes is not None:
        notes += [e.note for e in events if e.note]
    return tokens


def _median_ratio(results: list[dict], num: str, den: str) -> float | None:
    ratios = [r[num]["tokens_per_s"] / r[den]["tokens_per_s"] for r in results if num in r and den in r]
    return statistics.median(ratios) if ratios else None


def _llamacpp_summary(results: list[dict]) -> dict:
    """bench --llamacpp's figures (metrics.DEFINITIONS); absent from a run without it, so its keys stay as they were."""
    runs = [r["llamacpp"] for r in results if "llamacpp" in r]
    if not runs:
        return {}
    return {
        "llamacpp_tokens_per_s_median": statistics.median(r["tokens_per_s"] for r in runs),
        "speculative_vs_llamacpp": _median_ratio(results, "speculative", "llamacpp"),
        "llamacpp_identical_fraction": sum(r["identical_to_baseline"] for r in runs) / len(runs),
    }


def summarize(results: list[dict], total: SpecStats) -> dict:
    base_s_per_token = sum(r["baseline"]["seconds"] for r in results) / max(
        1, sum(r["baseline"]["tokens"] for r in results)
    )
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
        warnings.append(
            f"draft acceptance {total.draft_acceptance_rate:.0%} is below "
            f"{LOW_ACCEPTANCE_WARNING:.0%}: speculation may not pay on these prompts"
        )
    diverged = [r["speculative"]["first_divergence"] for r in results if r["speculative"]["first_divergence"]]
    if diverged:
        warnings.append(
            f"{len(diverged)} of {len(results)} outputs differ from target-only; see each "
            "prompt's first_divergence for the target's top-2 logit gap at that token"
        )
    base_vs_hf = _median_ratio(results, "baseline", "hf_generate")
    if base_vs_hf is not None and base_vs_hf < 0.95:
        warnings.append(
            f"our target-only baseline runs at {base_vs_hf:.2f}× transformers' generate(): the "
            "speedups above are measured against a slower baseline than exists"
        )
    return {
        "warnings": warnings,
        "speedup_median": speedup,
        "speedup_vs_hf_median": _median_ratio(results, "speculative", "hf_assisted"),
        "baseline_vs_hf_generate_median": base_vs_hf,
        "baseline_tokens_per_s_median": statistics.median(r["baseline"]["tokens_per_s"] for r in results),
        "speculative_tokens_per_s_median": statistics.median(r["speculative"]["tokens_per_s"] for r in results),
        "greedy_identical_fraction": sum(r["speculative"]["identical_to_baseline"] for r in results) / len(results),
        "hf_assisted_identical_fraction": (
            sum(r["hf_assisted"]["identical_to_baseline"] for r in results) / len(results)
        )
        if "hf_assisted" in results[0]
        else None,
        **_llamacpp_summary(results),
        "draft_acceptance_rate": total.draft_acceptance_rate,
        "tokens_per_target_forward": total.tokens_per_target_forward,
        "per_position_acceptance": total.per_position_acceptance,
        "alpha": total.alpha,
        "mean_k": total.mean_k,
        "draft_cost_ratio": c,
        "expected_speedup": expected,
        "bound_attainment": speedup / expected if expected else None,
        "per_category": {
            cat: {
                "speedup_median": statistics.median(r["speedup"] for r in rs),
                "draft_acceptance_rate_mean": statistics.fmean(r["speculative"]["draft_acceptance_rate"] for r in rs),
                "prompts": len(rs),
            }
            for cat, rs in by_cat.items()
        },
    }
