"""`specvoice bench`: target-only, this engine and transformers' assisted generation, interleaved per prompt in one
process, on the same models, dtype and threads; with --llamacpp, llama.cpp on the target's GGUF first, alone in a
process of its own (specdec/llamacpp.py), its answers joined per prompt. Progress on stderr, JSON out."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

from specdec import compute
from specdec.bench import explain_divergence, first_divergence, hf_generate, read_prompts, run_engine, summarize
from specdec.build import DTYPES, NOT_MODELS, build_engines
from specdec.cost_grid import cached_forward_costs
from specdec.engine import GenerationConfig, SpeculativeEngine
from specdec.llamacpp import ISOLATION, LlamaCppRun, generate_alone, preset_gguf
from specdec.metrics import DEFINITIONS, SpecStats
from specdec.models import load_model
from specdec.scheduler import BatchScheduler
from specdec.timing import timed
from specdec.tokenizer import words_start

from .options import add_engine_arguments, spec_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--prompts", required=True, help='JSONL, one {"prompt": ..., "category"?: ...} a line')
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    parser.add_argument(
        "--compare",
        default="hf",
        choices=["hf", "none"],
        help="hf: also run transformers' generate() target-only and with assistant_model",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument(
        "--batched",
        action="store_true",
        help="every answer, the baseline's too, goes through the batch scheduler the app runs (one at a time here), "
        "K chosen by it from this machine's measured forward costs (--no-load-aware: by the K policy alone)",
    )
    parser.add_argument(
        "--llamacpp",
        action="store_true",
        help="also run llama.cpp (llama-cpp-python, scripts/setup.sh --llama) on the target preset's GGUF, same "
        "prompt tokens and threads, alone in its own process before our runs, and report its tok/s beside ours "
        "(CPU only)",
    )
    parser.add_argument(
        "--drafters",
        default="",
        help="comma-separated --draft values to run side by side on the same target, e.g. qwen-0.5b,heads,ngram, "
        "and heads:FILE for more heads (summary.drafters); the summary's own keys stay --draft's",
    )
    parser.add_argument("--json", required=True)


def _entry(tokens: list[int], seconds: float) -> dict:
    return {"tokens": len(tokens), "seconds": seconds, "tokens_per_s": len(tokens) / seconds}


def speculation_summary(runs: list[dict], total: SpecStats) -> dict:
    """metrics.DEFINITIONS["speculative_step_fraction"] and ["speculation_off"] over one drafter's runs, one a prompt,
    each with its "notes": what catches drafts switched off while acceptance and expected speedup still look good."""
    off = [{"prompt": i, "notes": r["notes"]} for i, r in enumerate(runs) if r["notes"]]
    return {
        "speculative_step_fraction": total.speculative_steps / total.target_forwards if total.target_forwards else 0.0,
        "speculation_off": {"answers": len(off), "of": len(runs), "notes": off},
    }


DRAFTER_SUMMARY_KEYS = (
    "speedup_median",
    "speculative_tokens_per_s_median",
    "greedy_identical_fraction",
    "draft_acceptance_rate",
    "per_position_acceptance",
    "tokens_per_target_forward",
    "draft_cost_ratio",
    "mean_k",
    "per_category",
    "speculative_step_fraction",
    "speculation_off",
)


def drafter_summary(results: list[dict], name: str, total: SpecStats, resident_bytes_added: int) -> dict:
    """summarize()'s figures for one of the side-by-side drafters, and the memory it added."""
    view = [
        {
            **r,
            "speculative": r["drafters"][name],
            "speedup": r["drafters"][name]["tokens_per_s"] / r["baseline"]["tokens_per_s"],
        }
        for r in results
    ]
    full = {**summarize(view, total), **speculation_summary([r["speculative"] for r in view], total)}
    return {**{k: full[k] for k in DRAFTER_SUMMARY_KEYS}, "resident_bytes_added": resident_bytes_added}


def answer_source(engine: SpeculativeEngine, load_aware: bool) -> BatchScheduler:
    """The engine behind a batch scheduler, as the app runs it: with load_aware, K per step from the measured
    forward costs (measured once per machine and model, then read from the cache)."""
    return BatchScheduler(engine, cached_forward_costs(engine)[0] if load_aware else None)


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    rows = read_prompts(args.prompts, args.limit)
    spec = spec_from_args(args)
    gguf = None
    if args.llamacpp:  # before our models load: a missing package or a non-preset target fails in seconds
        if spec.device != "cpu":
            raise ValueError(f"--llamacpp compares CPU runs (llama.cpp is built for CPUs); got --device {spec.device}")
        gguf = preset_gguf(spec.target)
    drafters = list(dict.fromkeys([spec.draft, *filter(None, args.drafters.split(","))]))
    engines, target, added_bytes = build_engines(spec, drafters)
    engine = engines[spec.draft]
    spec.batched = args.batched
    if args.batched:  # each engine's answers through its own scheduler: the app's path, the baseline included
        engines = {name: answer_source(e, spec.load_aware) for name, e in engines.items()}
    assistant = None
    if args.compare == "hf" and spec.draft not in NOT_MODELS:
        assistant = load_model(spec.draft, DTYPES[spec.dtype], spec.device).model  # unmodified, for transformers
    eos = target.tokenizer.eos_token_ids
    n = args.max_new_tokens
    base_cfg = GenerationConfig(n, speculate=False)
    # every prompt is one user message: its words begin at the same token, where an answer's opening echoes them
    spec_cfg = GenerationConfig(n, speculate=True, question_start=words_start(target.tokenizer, []))

    warm = target.tokenizer.chat_ids([{"role": "user", "content": "Say hi."}])
    prompts = [target.tokenizer.chat_ids([{"role": "user", "content": row["prompt"]}]) for row in rows]
    llama_runs: list[LlamaCppRun] = []
    if gguf is not None:
        # Alone, before any of our timed work: measured beside our forwards, each took the cores from the other.
        # Our process waits meanwhile, the OpenMP workers of this thread (it loaded models) and of the compute thread
        # let go.
        compute.release_workers()
        compute.run(compute.release_workers)
        print(f"llama.cpp: {len(prompts)} prompts in its own process, alone …", file=sys.stderr, flush=True)
        llama_runs = generate_alone(gguf, torch.get_num_threads(), prompts, n, eos, warmup=warm)
    run_engine(engines[spec.draft], warm, GenerationConfig(4, speculate=False))
    for e in engines.values():
        run_engine(e, warm, GenerationConfig(8))
    if assistant is not None:
        hf_generate(target.model, warm, 4, eos, assistant)

    totals = {name: SpecStats() for name in drafters}
    results = []
    for i, (row, prompt) in enumerate(zip(rows, prompts)):
        base, base_s = timed(run_engine, engines[spec.draft], prompt, base_cfg)
        runs = {}
        for name, e in engines.items():  # each drafter right after the same baseline, interleaved per prompt
            stats = SpecStats()
            notes: list[str] = []  # why speculation changed state in this answer
            spec_tokens, spec_s = timed(run_engine, e, prompt, spec_cfg, stats, notes)
            totals[name].merge(stats)
            div = first_divergence(base, spec_tokens)
            runs[name] = {
                **_entry(spec_tokens, spec_s),
                **stats.as_dict(),
                "notes": notes,
                "identical_to_baseline": div is None,
                "first_divergence": None if div is None else explain_divergence(target.model, prompt, base, div),
            }
        entry = {
            "category": row.get("category", ""),
            "prompt": row["prompt"],
            "prompt_tokens": len(prompt),
            "baseline": _entry(base, base_s),
            "speculative": runs[spec.draft],
        }
        if len(drafters) > 1:
            entry["drafters"] = runs
        if args.compare == "hf":
            hf_plain, hf_plain_s = timed(hf_generate, target.model, prompt, n, eos)
            entry["hf_generate"] = {**_entry(hf_plain, hf_plain_s), "identical_to_baseline": hf_plain == base}
            if assistant is not None:
                hf_tokens, hf_s = timed(hf_generate, target.model, prompt, n, eos, assistant)
                entry["hf_assisted"] = {**_entry(hf_tokens, hf_s), "identical_to_baseline": hf_tokens == base}
        if llama_runs:
            run = llama_runs[i]
            entry["llamacpp"] = {
                **_entry(run.tokens, run.seconds),
                "decode_tokens_per_s": run.decode_tokens_per_s,
                "identical_to_baseline": run.tokens == base,
                "first_divergence": first_divergence(base, run.tokens),  # a token index only: other weights
            }
        entry["speedup"] = entry["speculative"]["tokens_per_s"] / entry["baseline"]["tokens_per_s"]
        results.append(entry)
        base_rate = entry["baseline"]["tokens_per_s"]
        print(
            f"[{i + 1}/{len(rows)}] {entry['category']:10s} base {base_rate:.2f} tok/s, "
            + ", ".join(
                f"{name} {r['tokens_per_s']:.2f} tok/s ({r['tokens_per_s'] / base_rate:.2f}×, "
                f"acc {r['draft_acceptance_rate']:.0%}, {r['speculative_steps']}/{r['target_forwards']} forwards "
                f"speculative, identical={r['identical_to_baseline']})"
                for name, r in runs.items()
            )
            + (f", hf_assisted {entry['hf_assisted']['tokens_per_s']:.2f}" if "hf_assisted" in entry else "")
            + (f", llama.cpp {entry['llamacpp']['tokens_per_s']:.2f}" if "llamacpp" in entry else ""),
            file=sys.stderr,
            flush=True,
        )

    summary = summarize(results, totals[spec.draft])
    summary.update(speculation_summary([r["speculative"] for r in results], totals[spec.draft]))
    off = summary["speculation_off"]
    if off["answers"]:
        summary["warnings"].append(
            f"speculation stopped in {off['answers']} of {off['of']} answers (only "
            f"{summary['speculative_step_fraction']:.0%} of target forwards were speculative steps): see "
            "summary.speculation_off for why"
        )
    summary["drafter_resident_bytes_added"] = added_bytes[spec.draft]
    if llama_runs:
        summary["llamacpp_isolation"] = ISOLATION
    if len(drafters) > 1:
        summary["drafters"] = {
            name: drafter_summary(results, name, totals[name], added_bytes[name]) for name in drafters
        }
    drafter = engine.drafter_factory() if engine.drafter_factory else None
    summary["config"] = {
        **vars(spec),
        "max_new_tokens": n,
        "threads": torch.get_num_threads(),
        "target_min_feed": engine.runner.min_feed,
        "draft_min_prob": getattr(drafter, "min_prob", None),
    }
    costs = getattr(engines[spec.draft], "costs", None)
    if costs is not None:  # what the scheduler chose K from
        summary["forward_costs"] = costs.as_dict()
    out = {"definitions": DEFINITIONS, "summary": summary, "prompts": results}
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps({k: v for k, v in summary.items() if k != "per_category"}, indent=2), file=sys.stderr)
    return 0
