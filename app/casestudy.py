"""The case study on the page: its tab (build_tab; the page calls it), and the figures that the tab and
`specvoice casestudy` draw, in the page's stage colours.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
from matplotlib.axes import Axes
from matplotlib.figure import Figure

from casestudy.inputs import DEFAULT_CONCURRENCY, check_scenario, with_inputs
from casestudy.latency_model import (
    Evaluation,
    Scenario,
    breakeven_concurrency,
    evaluate,
    fits_in_memory,
    memory_needed_gb,
    recommended_k,
    speedup_at,
)
from casestudy.story import calibrated_scenario
from pipeline.timeline import STAGES

from .report import STAGE_COLORS

K_VALUES = range(1, 9)
ALPHA_GRID = np.linspace(0.30, 0.98, 69)

# ------------------------------------------------------------------------------------------------ figures


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


# ------------------------------------------------------------------------------------------------ the tab


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
