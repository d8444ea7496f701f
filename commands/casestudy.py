"""`specvoice casestudy`: the latency model applied to the reference story, as a table, plots and JSON.

Defaults are the story calibrated by casestudy.story (efficiency solved from 28 tokens/s, α read from vLLM's 74% draft
acceptance rate, first-chunk tokens solved from the 700 ms pause); every option overrides one input and everything
downstream is recomputed. The page's Case study tab (app/casestudy.py) shows the same model with sliders.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict
from pathlib import Path

from app.casestudy import alpha_figure, concurrency_figure
from casestudy.inputs import DEFAULT_CONCURRENCY, check_scenario, with_inputs
from casestudy.latency_model import (
    DECODE_STAGE,
    Scenario,
    batch_sweep,
    breakeven_concurrency,
    evaluate,
    fits_in_memory,
    memory_needed_gb,
)
from casestudy.story import calibrated_scenario, explain_story
from pipeline.timeline import STAGES
from specdec.metrics import alpha_from_acceptance_rate


def add_arguments(parser: argparse.ArgumentParser) -> None:
    acc = parser.add_mutually_exclusive_group()
    acc.add_argument("--alpha", type=float, help="per-token acceptance probability α (Leviathan et al.)")
    acc.add_argument(
        "--acceptance-rate",
        type=float,
        help="draft acceptance rate as vLLM reports it (accepted ÷ proposed); converted to α at --k",
    )
    parser.add_argument("--k", type=int, help="draft tokens per step, 0 = speculation off (story: 4)")
    parser.add_argument(
        "--c",
        type=float,
        help="draft cost ratio c = draft forward ÷ target forward (default: from the roofline of draft vs target)",
    )
    parser.add_argument("--params-b", type=float, help="target parameters, billions (story: 70.6)")
    parser.add_argument("--draft-params-b", type=float, help="draft parameters, billions (story: 8.03)")
    parser.add_argument("--bytes-per-param", type=float, help="weight bytes per parameter (fp16: 2, int8: 1)")
    parser.add_argument("--gpu-bandwidth-tbs", type=float, help="HBM bandwidth per GPU, TB/s (A100: 2.0)")
    parser.add_argument("--gpu-tflops", type=float, help="dense fp16 TFLOP/s per GPU (A100: 312)")
    parser.add_argument("--gpus", type=int, help="tensor-parallel GPU count (story: 4)")
    parser.add_argument(
        "--efficiency",
        type=float,
        help="fraction of peak reached (default: solved so the story's baseline is 28 tokens/s)",
    )
    parser.add_argument(
        "--first-chunk-tokens", type=float, help="tokens before TTS can speak (default: solved from the story's 700 ms)"
    )
    parser.add_argument("--prompt-tokens", type=int, help="prompt tokens prefilled per turn")
    parser.add_argument("--context-tokens", type=int, help="tokens in each sequence's KV cache")
    parser.add_argument("--end-of-turn-ms", type=float, help="silence hangover before the turn ends")
    parser.add_argument("--asr-ms", type=float, help="ASR time after the end of turn")
    parser.add_argument("--tts-ms", type=float, help="TTS time to its first audio chunk")
    parser.add_argument("--concurrency", type=int, default=1, help="sequences per batch for the headline numbers")
    parser.add_argument(
        "--concurrency-sweep",
        type=int,
        nargs="+",
        default=list(DEFAULT_CONCURRENCY),
        help="concurrencies for the batch table and plot",
    )
    parser.add_argument("--out", type=Path, default=Path("casestudy_out"), help="folder for the PNG plots")
    parser.add_argument("--json", type=Path, help="write the numbers as JSON to this file")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The calibrated story with each given option replacing one input."""
    base = calibrated_scenario()
    k = base.k if args.k is None else args.k
    alpha = args.alpha
    if alpha is None and args.acceptance_rate is not None:
        alpha = alpha_from_acceptance_rate(args.acceptance_rate, k)
    return with_inputs(
        base,
        alpha=alpha,
        k=k,
        c=args.c,
        params_b=args.params_b,
        draft_params_b=args.draft_params_b,
        bytes_per_param=args.bytes_per_param,
        bandwidth_tbs=args.gpu_bandwidth_tbs,
        tflops=args.gpu_tflops,
        gpus=args.gpus,
        efficiency=args.efficiency,
        first_chunk_tokens=args.first_chunk_tokens,
        prompt_tokens=args.prompt_tokens,
        context_tokens=args.context_tokens,
        end_of_turn_ms=args.end_of_turn_ms,
        asr_ms=args.asr_ms,
        tts_ms=args.tts_ms,
        concurrency=args.concurrency,
    )


def report(s: Scenario, concurrencies: list[int]) -> dict:
    ev = evaluate(s)
    story = explain_story()
    implied = story.as_dict()
    implied.pop("story")
    return {
        "baseline_tokens_per_s": ev.baseline_tokens_per_s,
        "speculative_tokens_per_s": ev.speculative_tokens_per_s,
        "speedup": ev.speedup,
        "baseline_ttfa_ms": ev.baseline_ttfa_ms,
        "speculative_ttfa_ms": ev.speculative_ttfa_ms,
        "ttfa_floor_ms": ev.ttfa_floor_ms,
        "stages": {"baseline": ev.baseline_stages, "speculative": ev.speculative_stages},
        "inputs": {
            "alpha": s.alpha,
            "k": s.k,
            "c": ev.c,
            "c_given": s.c is not None,
            "v": ev.v,
            "tokens_per_step": ev.tokens_per_step,
            "concurrency": s.concurrency,
            "target": asdict(s.target),
            "draft": asdict(s.draft),
            "hardware": asdict(s.hw),
            "stages": asdict(s.stages),
            "context_tokens": s.context_tokens,
            "memory_needed_gb": memory_needed_gb(s),
            "fits_in_memory": fits_in_memory(s),
        },
        "implied": implied,  # about the reference story itself, whatever the overrides
        "batch": batch_sweep(s, concurrencies),
        "breakeven_concurrency": breakeven_concurrency(s),
    }


def format_report(rep: dict) -> str:
    inp = rep["inputs"]
    lines = [
        f"Inputs: α = {inp['alpha']:.3f}, K = {inp['k']}, c = {inp['c']:.3f}"
        f"{'' if inp['c_given'] else ' (roofline)'}, v = {inp['v']:.3f}, E = {inp['tokens_per_step']:.2f}, "
        f"{inp['target']['params_b']:g}B target on {inp['hardware']['n_gpus']}× {inp['hardware']['bandwidth_tbs']:g} "
        f"TB/s at {inp['hardware']['efficiency']:.0%} efficiency, concurrency {inp['concurrency']}",
        "",
        f"{'stage (ms)':<22}{'target alone':>14}{'speculative':>14}",
    ]
    for name in STAGES:
        lines.append(f"{name:<22}{rep['stages']['baseline'][name]:>14.1f}{rep['stages']['speculative'][name]:>14.1f}")
    lines += [
        f"{'TTFA':<22}{rep['baseline_ttfa_ms']:>14.1f}{rep['speculative_ttfa_ms']:>14.1f}",
        f"{'tokens/s':<22}{rep['baseline_tokens_per_s']:>14.1f}{rep['speculative_tokens_per_s']:>14.1f}"
        f"   ({rep['speedup']:.2f}×)",
        f"floor (every stage but {DECODE_STAGE}): {rep['ttfa_floor_ms']:.0f} ms",
        "",
        f"{'concurrency':>11}{'target tok/s':>14}{'spec tok/s':>12}{'speedup':>9}{'best K':>8}",
    ]
    for r in rep["batch"]:
        fits = "" if r["fits_in_memory"] else "  (KV caches exceed GPU memory)"
        lines.append(
            f"{r['concurrency']:>11}{r['baseline_tokens_per_s']:>14.1f}{r['speculative_tokens_per_s']:>12.1f}"
            f"{r['speedup']:>8.2f}×{r['recommended_k']:>8}{fits}"
        )
    lines += [
        f"speculation at K = {inp['k']} stops paying at concurrency {rep['breakeven_concurrency']}",
        "",
        "What the story's figures imply:",
    ]
    lines += [f"- {sentence}" for sentence in rep["implied"]["sentences"]]
    return "\n".join(lines)


def main(args: argparse.Namespace) -> int:
    s = scenario_from_args(args)
    problem = check_scenario(s)
    if problem:
        print(f"specvoice casestudy: {problem}", file=sys.stderr)
        return 2
    concurrencies = sorted(set(args.concurrency_sweep))
    rep = report(s, concurrencies)
    print(format_report(rep))
    if not args.no_plots:
        args.out.mkdir(parents=True, exist_ok=True)
        for name, fig in (
            ("speed_vs_alpha.png", alpha_figure(s)),
            ("speedup_vs_concurrency.png", concurrency_figure(s, concurrencies)),
        ):
            fig.savefig(args.out / name, dpi=110)
            print(f"wrote {args.out / name}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(rep, indent=2))
        print(f"wrote {args.json}")
    return 0
