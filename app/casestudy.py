"""`specvoice casestudy`: the latency model applied to the reference story, as a table, plots, JSON and a Gradio tab.

Defaults are the story calibrated by casestudy.latency_model (efficiency solved from 28 tokens/s, α read from
vLLM's 74% draft acceptance rate, first-chunk tokens solved from the 700 ms pause); every option overrides
one input and everything downstream is recomputed.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, replace
from pathlib import Path

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from casestudy.latency_model import (
    DECODE_STAGE,
    Evaluation,
    Scenario,
    batch_sweep,
    breakeven_concurrency,
    calibrated_scenario,
    evaluate,
    explain_story,
    fits_in_memory,
    memory_needed_gb,
    recommended_k,
    speedup_at,
)
from pipeline.timeline import STAGES
from specdec.metrics import alpha_from_acceptance_rate

from .report import STAGE_COLORS

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)
K_VALUES = range(1, 9)
ALPHA_GRID = np.linspace(0.30, 0.98, 69)


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


def _pick(value, default):
    return default if value is None else value


def with_inputs(
    base: Scenario,
    *,
    alpha: float | None = None,
    k: int | None = None,
    c: float | None = None,
    params_b: float | None = None,
    draft_params_b: float | None = None,
    bytes_per_param: float | None = None,
    bandwidth_tbs: float | None = None,
    tflops: float | None = None,
    gpus: int | None = None,
    efficiency: float | None = None,
    first_chunk_tokens: float | None = None,
    prompt_tokens: int | None = None,
    context_tokens: int | None = None,
    end_of_turn_ms: float | None = None,
    asr_ms: float | None = None,
    tts_ms: float | None = None,
    concurrency: int | None = None,
) -> Scenario:
    """`base` with each given input replaced (None keeps it); the CLI and the tab both go through here."""
    target = replace(
        base.target,
        params_b=_pick(params_b, base.target.params_b),
        bytes_per_param=_pick(bytes_per_param, base.target.bytes_per_param),
    )
    draft = replace(
        base.draft, params_b=_pick(draft_params_b, base.draft.params_b), bytes_per_param=target.bytes_per_param
    )
    hw = replace(
        base.hw,
        bandwidth_tbs=_pick(bandwidth_tbs, base.hw.bandwidth_tbs),
        tflops=_pick(tflops, base.hw.tflops),
        n_gpus=_pick(gpus, base.hw.n_gpus),
        efficiency=_pick(efficiency, base.hw.efficiency),
    )
    st = base.stages
    stages = replace(
        st,
        first_chunk_tokens=_pick(first_chunk_tokens, st.first_chunk_tokens),
        prompt_tokens=_pick(prompt_tokens, st.prompt_tokens),
        end_of_turn_ms=_pick(end_of_turn_ms, st.end_of_turn_ms),
        asr_ms=_pick(asr_ms, st.asr_ms),
        tts_first_chunk_ms=_pick(tts_ms, st.tts_first_chunk_ms),
    )
    return replace(
        base,
        alpha=_pick(alpha, base.alpha),
        k=_pick(k, base.k),
        c=_pick(c, base.c),
        target=target,
        draft=draft,
        hw=hw,
        stages=stages,
        context_tokens=_pick(context_tokens, base.context_tokens),
        concurrency=_pick(concurrency, base.concurrency),
    )


def scenario_from_args(args: argparse.Namespace) -> Scenario:
    """The calibrated story with each given option replacing one input."""
    base = calibrated_scenario()
    k = _pick(args.k, base.k)
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


def check_scenario(s: Scenario) -> str | None:
    """A reason the inputs make no sense, or None."""
    problems = [
        (not 0 < s.alpha <= 1, f"α must be in (0, 1], got {s.alpha}"),
        (s.k < 0, f"K must be ≥ 0, got {s.k}"),
        (s.c is not None and s.c < 0, f"c must be ≥ 0, got {s.c}"),
        (
            min(s.target.params_b, s.draft.params_b, s.hw.bandwidth_tbs, s.hw.tflops, s.hw.efficiency) <= 0,
            "model sizes, bandwidth, TFLOP/s and efficiency must be positive",
        ),
        (s.hw.n_gpus < 1 or s.concurrency < 1, "GPU count and concurrency must be ≥ 1"),
        (s.stages.first_chunk_tokens < 0 or s.stages.prompt_tokens < 1, "token counts must be positive"),
    ]
    return next((msg for bad, msg in problems if bad), None)


# ------------------------------------------------------------------------------------------------ plots


def _k_colors(n: int = len(K_VALUES)) -> list:
    from matplotlib import colormaps

    return [colormaps["viridis"](i / max(n - 1, 1)) for i in range(n)]


def draw_alpha_sweep(ax_rate: Axes, ax_ttfa: Axes, s: Scenario) -> None:
    """Tokens/s and TTFA against α for K = 1..8, the target alone dashed, the scenario marked."""
    base = evaluate(replace(s, k=0))
    for k, color in zip(K_VALUES, _k_colors()):
        evs = [evaluate(replace(s, alpha=float(a), k=k)) for a in ALPHA_GRID]
        ax_rate.plot(ALPHA_GRID, [e.speculative_tokens_per_s for e in evs], color=color, label=f"K={k}")
        ax_ttfa.plot(ALPHA_GRID, [e.speculative_ttfa_ms for e in evs], color=color, label=f"K={k}")
    ax_rate.axhline(base.baseline_tokens_per_s, color="k", ls="--", label="target alone")
    ax_ttfa.axhline(base.baseline_ttfa_ms, color="k", ls="--", label="target alone")
    ax_ttfa.axhline(base.ttfa_floor_ms, color="gray", ls=":", label="non-decode floor")
    now = evaluate(s)
    ax_rate.plot([s.alpha], [now.speculative_tokens_per_s], "r*", ms=12, label=f"this (K={s.k})")
    ax_ttfa.plot([s.alpha], [now.speculative_ttfa_ms], "r*", ms=12, label=f"this (K={s.k})")
    ax_rate.set(
        xlabel="per-token acceptance α",
        ylabel="tokens/s per sequence",
        title=f"Decode rate, concurrency {s.concurrency}",
    )
    ax_ttfa.set(
        xlabel="per-token acceptance α",
        ylabel="time to first audio, ms",
        title=f"TTFA, first chunk = {s.stages.first_chunk_tokens:.1f} tokens",
    )
    for ax, where in ((ax_rate, "upper left"), (ax_ttfa, "lower left")):
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7, ncol=2, loc=where)


def draw_concurrency(ax: Axes, s: Scenario, concurrencies: list[int]) -> None:
    """Speedup against concurrency for K = 1..8 (the scenario's K bold), with the break-even line."""
    for k, color in zip(K_VALUES, _k_colors()):
        speedups = [speedup_at(s, b, k) for b in concurrencies]
        ax.plot(concurrencies, speedups, color=color, lw=3 if k == s.k else 1.2, marker="o", ms=3, label=f"K={k}")
    ax.axhline(1.0, color="k", ls="--", label="no gain")
    ax.axvline(s.concurrency, color="r", ls=":", label="this concurrency")
    ax.set_xscale("log", base=2)
    ax.set_xticks(concurrencies, [str(b) for b in concurrencies])
    ax.set(
        xlabel="concurrent sequences (batch size)",
        ylabel="speedup vs target alone",
        title="Where speculation stops paying",
    )
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7, ncol=2)


def draw_stages(ax: Axes, ev: Evaluation) -> None:
    """The TTFA budget as stacked bars, target alone vs speculative."""
    bottoms = [0.0, 0.0]
    for name, color in zip(STAGES, STAGE_COLORS):
        vals = [ev.baseline_stages[name], ev.speculative_stages[name]]
        ax.bar(["target alone", f"speculative K={ev.scenario.k}"], vals, bottom=bottoms, color=color, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    for x, total in enumerate(bottoms):
        ax.text(x, total, f"{total:.0f} ms", ha="center", va="bottom")
    ax.set_ylim(0, max(bottoms) * 1.3)  # headroom for the totals and the legend
    ax.set(ylabel="ms", title="Time to first audio, stage by stage")
    ax.legend(fontsize=7, ncol=3, loc="upper center")


def alpha_figure(s: Scenario) -> Figure:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    draw_alpha_sweep(*fig.subplots(1, 2), s)
    return fig


def concurrency_figure(s: Scenario, concurrencies: list[int]) -> Figure:
    fig = Figure(figsize=(6.5, 4.2), layout="constrained")
    draw_concurrency(fig.subplots(), s, concurrencies)
    return fig


def tab_figure(s: Scenario) -> Figure:
    fig = Figure(figsize=(11, 4.2), layout="constrained")
    ax_stages, ax_conc = fig.subplots(1, 2)
    draw_stages(ax_stages, evaluate(s))
    draw_concurrency(ax_conc, s, list(DEFAULT_CONCURRENCY))
    return fig


# ---------------------------------------------------------------------------------------------- numbers


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


# ------------------------------------------------------------------------------------------------ Gradio


def tab_outputs(
    alpha: float,
    k: int,
    c: float,
    params_b: float,
    bandwidth_tbs: float,
    gpus: int,
    first_chunk_tokens: float,
    concurrency: int,
) -> tuple[str, Figure]:
    """What the Case study tab shows for one position of its sliders."""
    s = with_inputs(
        calibrated_scenario(),
        alpha=float(alpha),
        k=int(k),
        c=float(c),
        params_b=float(params_b),
        bandwidth_tbs=float(bandwidth_tbs),
        gpus=int(gpus),
        first_chunk_tokens=float(first_chunk_tokens),
        concurrency=int(concurrency),
    )
    problem = check_scenario(s)
    if problem:
        return f"**{problem}**", Figure()
    ev = evaluate(s)
    rows = "\n".join(
        f"| {name} | {ev.baseline_stages[name]:.0f} | {ev.speculative_stages[name]:.0f} |" for name in STAGES
    )
    memory = (
        ""
        if fits_in_memory(s)
        else (
            f"\n\n⚠ {memory_needed_gb(s):.0f} GB needed: the KV caches do not fit in "
            f"{s.hw.n_gpus}× {s.hw.memory_gb:g} GB."
        )
    )
    text = (
        f"**{ev.baseline_tokens_per_s:.1f} → {ev.speculative_tokens_per_s:.1f} tokens/s** ({ev.speedup:.2f}×) · "
        f"**TTFA {ev.baseline_ttfa_ms:.0f} → {ev.speculative_ttfa_ms:.0f} ms** · floor {ev.ttfa_floor_ms:.0f} ms\n\n"
        f"E = {ev.tokens_per_step:.2f} tokens per target step, step cost cK + v = {ev.c * s.k + ev.v:.2f} target "
        f"forwards (v = {ev.v:.2f} at concurrency {s.concurrency}). Best K here: "
        f"**{recommended_k(s.concurrency, s.alpha, s.c, scenario=s)}**; K = {s.k} stops paying at concurrency "
        f"{breakeven_concurrency(s)}.\n\n| stage (ms) | target alone | speculative |\n|---|---:|---:|\n{rows}{memory}"
    )
    return text, tab_figure(s)


def build_tab():
    """The "Case study" tab; call inside a `gr.Blocks()` context. Returns the tab."""
    import gradio as gr

    base = calibrated_scenario()
    ev = evaluate(base)
    with gr.Tab("Case study") as tab:
        gr.Markdown(
            "A roofline model of the reference story (Llama-3-70B on 4× A100, Llama-3-8B draft). "
            "Efficiency is solved so the target alone runs at 28 tokens/s; move a slider to see what "
            "changes. α is the per-token acceptance; vLLM's 74% draft acceptance rate is α ≈ "
            f"{base.alpha:.2f} at K = 4."
        )
        with gr.Row():
            with gr.Column(scale=1):
                sliders = [
                    gr.Slider(0.30, 0.99, round(base.alpha, 3), step=0.01, label="α (per-token acceptance)"),
                    gr.Slider(0, 8, base.k, step=1, label="K (draft tokens per step, 0 = off)"),
                    gr.Slider(0.0, 1.0, round(ev.c, 3), step=0.005, label="c (draft ÷ target forward cost)"),
                    gr.Slider(1, 405, base.target.params_b, step=0.1, label="target size (B params)"),
                    gr.Slider(0.5, 8.0, base.hw.bandwidth_tbs, step=0.1, label="GPU bandwidth (TB/s)"),
                    gr.Slider(1, 8, base.hw.n_gpus, step=1, label="GPUs (tensor parallel)"),
                    gr.Slider(
                        1,
                        64,
                        round(base.stages.first_chunk_tokens, 1),
                        step=0.1,
                        label="first-chunk tokens (before TTS speaks)",
                    ),
                    gr.Slider(1, 512, base.concurrency, step=1, label="concurrency (sequences per batch)"),
                ]
            with gr.Column(scale=2):
                text, fig = tab_outputs(*(sl.value for sl in sliders))
                numbers = gr.Markdown(text)
                plot = gr.Plot(fig, label="TTFA budget and speedup vs concurrency")
        for sl in sliders:
            sl.change(tab_outputs, inputs=sliders, outputs=[numbers, plot])
    return tab
