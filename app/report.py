"""Session export: every turn as CSV and JSON, and one self-contained HTML report with the plots embedded as PNG.

Input is the list of turn dicts the app keeps: TurnResult.to_dict() plus the app's own fields (turn, kind, heard
figures, settings, A/B ids). Nothing here needs the models, so reports can be rebuilt from a saved JSON.
"""

from __future__ import annotations

import base64
import csv
import html
import io
import json
import re
from collections.abc import Sequence
from datetime import datetime, timezone
from pathlib import Path

from matplotlib.figure import Figure
from matplotlib.ticker import MaxNLocator

from app.stats import median_or_none, paired_ratio
from pipeline.timeline import STAGES
from specdec.metrics import DEFINITIONS


def page_colors() -> dict[str, str]:
    """The page's colours (the `--sv-*` custom properties in app/static/app.css, their one home), so the exported
    report's plots match the live ones."""
    css = (Path(__file__).parent / "static" / "app.css").read_text()
    return dict(re.findall(r"--sv-([\w-]+):\s*(#[0-9a-fA-F]{3,6})\b", css))


COLORS = page_colors()
MODE_COLORS = {False: COLORS["spec-off"], True: COLORS["spec-on"]}  # speculation off / on
STAGE_COLORS = tuple(COLORS[f"stage-{i}"] for i in range(len(STAGES)))

CSV_COLUMNS = (
    "turn",
    "kind",
    "ab",
    "ab_repeat",
    "speculation",
    "ttfa_ms",
    "ttfa_heard_ms",
    "heard_delay_ms",
    *STAGES,
    "stall_ms",
    "first_chunk_tokens",
    "tokens",
    "tokens_per_s",
    "draft_acceptance_rate",
    "tokens_per_target_forward",
    "rejected_draft_tokens",
    "wasted_tokens",
    "cancelled",
    "audio_seconds",
    "drafter",
    "k",
    "temperature",
    "heard_method",
    "started_at",
    "transcript",
    "answer",
)


def flatten_turn(turn: dict) -> dict:
    """One CSV row: stages and settings spread into columns, everything else as the turn holds it."""
    row = {c: turn.get(c) for c in CSV_COLUMNS}
    row.update({name: (turn.get("stages") or {}).get(name) for name in STAGES})
    row.update({k: (turn.get("settings") or {}).get(k) for k in ("drafter", "k", "temperature")})
    return row


def turns_csv(turns: Sequence[dict]) -> str:
    out = io.StringIO()
    writer = csv.DictWriter(out, fieldnames=CSV_COLUMNS, extrasaction="ignore", lineterminator="\n")
    writer.writeheader()
    for t in turns:
        writer.writerow({k: "" if v is None else v for k, v in flatten_turn(t).items()})
    return out.getvalue()


def ab_pairs(turns: Sequence[dict]) -> dict[int, list[tuple[dict, dict]]]:
    """A/B id → [(off turn, on turn)] per repeat, complete pairs only."""
    runs: dict[int, dict[int, dict[bool, dict]]] = {}
    for t in turns:
        if t.get("kind") == "ab" and t.get("ab") is not None:
            runs.setdefault(t["ab"], {}).setdefault(t.get("ab_repeat", 0), {})[bool(t["speculation"])] = t
    return {
        ab: [(r[False], r[True]) for _, r in sorted(reps.items()) if False in r and True in r]
        for ab, reps in runs.items()
    }


def summarize(turns: Sequence[dict]) -> dict:
    by_mode = {
        mode: [t for t in turns if bool(t.get("speculation")) == mode and not t.get("cancelled")]
        for mode in (False, True)
    }
    summary: dict = {"turns": len(turns), "kinds": {}}
    for t in turns:
        summary["kinds"][t.get("kind", "?")] = summary["kinds"].get(t.get("kind", "?"), 0) + 1
    for mode, name in ((False, "off"), (True, "on")):
        ts = by_mode[mode]
        summary[name] = {
            "turns": len(ts),
            "ttfa_ms_median": median_or_none([t.get("ttfa_ms") for t in ts]),
            "ttfa_heard_ms_median": median_or_none([t.get("ttfa_heard_ms") for t in ts]),
            "tokens_per_s_median": median_or_none([t.get("tokens_per_s") for t in ts]),
            "draft_acceptance_rate_median": median_or_none([t.get("draft_acceptance_rate") for t in ts]),
        }
    summary["heard_delay_ms_median"] = median_or_none([t.get("heard_delay_ms") for t in turns])
    summary["ab"] = {
        ab: paired_ratio([(off["ttfa_ms"], on["ttfa_ms"]) for off, on in pairs])
        for ab, pairs in ab_pairs(turns).items()
    }
    return summary


def turns_json(turns: Sequence[dict], meta: dict | None = None) -> str:
    return json.dumps(
        {"meta": meta or {}, "definitions": DEFINITIONS, "summary": summarize(turns), "turns": list(turns)},
        indent=2,
        default=str,
    )


# ------------------------------------------------------------------------------------------------ plots


def _png(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    return base64.b64encode(buf.getvalue()).decode("ascii")


def ttfa_figure(turns: Sequence[dict]) -> Figure:
    """TTFA per turn, speculation off and on in two colours; heard TTFA as hollow markers."""
    fig = Figure(figsize=(8, 3.4), layout="constrained")
    ax = fig.subplots()
    for mode, label in ((False, "speculation off"), (True, "speculation on")):
        pts = [(t["turn"], t["ttfa_ms"]) for t in turns if bool(t.get("speculation")) == mode and t.get("ttfa_ms")]
        if pts:
            ax.plot(*zip(*pts), "o", color=MODE_COLORS[mode], label=f"{label} (server)")
        heard = [
            (t["turn"], t["ttfa_heard_ms"])
            for t in turns
            if bool(t.get("speculation")) == mode and t.get("ttfa_heard_ms") is not None
        ]
        if heard:
            ax.plot(*zip(*heard), "o", mfc="none", color=MODE_COLORS[mode], label=f"{label} (heard)")
    ax.set(xlabel="turn", ylabel="TTFA, ms", title="Time to first audio per turn")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        ax.legend(fontsize=8)
    return fig


def stages_figure(turns: Sequence[dict]) -> Figure:
    """Each turn's TTFA split into its pipeline stages (they add up to the TTFA)."""
    fig = Figure(figsize=(8, 3.4), layout="constrained")
    ax = fig.subplots()
    shown = [t for t in turns if t.get("stages")]
    labels = [f"{t['turn']}{'+' if t.get('speculation') else '−'}" for t in shown]
    bottoms = [0.0] * len(shown)
    for name, color in zip(STAGES, STAGE_COLORS):
        vals = [t["stages"].get(name, 0.0) for t in shown]
        ax.bar(labels, vals, bottom=bottoms, color=color, label=name)
        bottoms = [b + v for b, v in zip(bottoms, vals)]
    ax.set(xlabel="turn (+ speculation on, − off)", ylabel="ms", title="TTFA by stage")
    ax.tick_params(axis="x", labelsize=7)
    ax.legend(fontsize=7, ncol=3)
    return fig


def heard_figure(turns: Sequence[dict]) -> Figure:
    fig = Figure(figsize=(8, 2.8), layout="constrained")
    ax = fig.subplots()
    pts = [(t["turn"], t["heard_delay_ms"]) for t in turns if t.get("heard_delay_ms") is not None]
    if pts:
        ax.plot(*zip(*pts), "o-", color=COLORS["heard"])
    ax.axhline(150, color="gray", ls=":", label="goal: 150 ms median")
    ax.set(xlabel="turn", ylabel="ms", title="Heard delay: emitted by the server → heard in the browser")
    ax.xaxis.set_major_locator(MaxNLocator(integer=True))
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    return fig


def ab_figure(pairs: Sequence[tuple[dict, dict]]) -> Figure:
    fig = Figure(figsize=(5, 3.2), layout="constrained")
    ax = fig.subplots()
    for off, on in pairs:
        ax.plot([0, 1], [off["ttfa_ms"], on["ttfa_ms"]], "-", color=COLORS["axis"], lw=1)
        ax.plot([0], [off["ttfa_ms"]], "o", color=MODE_COLORS[False])
        ax.plot([1], [on["ttfa_ms"]], "o", color=MODE_COLORS[True])
    ax.set_xticks([0, 1], ["speculation off", "speculation on"])
    ax.set(ylabel="TTFA, ms", title="Paired runs of the same utterance")
    ax.set_ylim(bottom=0)
    ax.grid(alpha=0.3)
    return fig


# ------------------------------------------------------------------------------------------------ HTML


def _clip(text: str | None, limit: int = 160) -> str:
    """Table cells stay readable; the full text is in the CSV and JSON."""
    text = text or ""
    return html.escape(text if len(text) <= limit else text[:limit] + "…")


def _fmt(v, digits: int = 0, pct: bool = False) -> str:
    if v is None or v == "":
        return "–"
    if isinstance(v, bool):
        return "on" if v else "off"
    if isinstance(v, (int, float)):
        return f"{v:.0%}" if pct else f"{v:.{digits}f}"
    return html.escape(str(v))


def _img(fig: Figure, alt: str) -> str:
    return f'<img alt="{html.escape(alt)}" src="data:image/png;base64,{_png(fig)}">'


def _data_link(text: str, mime: str, name: str) -> str:
    b64 = base64.b64encode(text.encode("utf-8")).decode("ascii")
    return f'<a download="{name}" href="data:{mime};base64,{b64}">{name}</a>'


_CSS = """body{font-family:system-ui,sans-serif;max-width:1000px;margin:2em auto;padding:0 1em;color:#222}
table{border-collapse:collapse;font-size:13px;margin:.5em 0}td,th{border:1px solid #ddd;padding:3px 6px;
text-align:right;vertical-align:top}td.text{text-align:left;min-width:180px;max-width:320px;
overflow-wrap:anywhere}
img{max-width:100%}dt{font-weight:600}dd{margin:0 0 .4em 1em}"""


def render_html(turns: Sequence[dict], meta: dict | None = None) -> str:
    """The whole session as one HTML file: summary, A/B results, plots (PNG inside), every turn, the data."""
    meta = meta or {}
    summary = summarize(turns)
    generated = datetime.now(timezone.utc).strftime("%Y-%m-%d %H:%M UTC")
    about = " · ".join(
        f"{html.escape(str(k))}: {_fmt(v, 1) if isinstance(v, float) else html.escape(str(v))}" for k, v in meta.items()
    )
    parts = [
        f"<!doctype html><html><head><meta charset='utf-8'><title>specvoice session report</title>"
        f"<style>{_CSS}</style></head><body><h1>specvoice session report</h1><p>Generated {generated}. {about}</p>",
        _summary_html(summary),
        *(_ab_html(ab, pairs, summary["ab"][ab]) for ab, pairs in ab_pairs(turns).items()),
    ]
    if turns:
        parts.append(
            "<h2>Plots</h2>"
            + _img(ttfa_figure(turns), "TTFA per turn")
            + _img(stages_figure(turns), "TTFA by stage")
            + _img(heard_figure(turns), "heard delay")
        )
    parts.append(_turns_html(turns))
    parts.append(
        "<h2>Definitions</h2><dl>"
        + "".join(f"<dt>{html.escape(k)}</dt><dd>{html.escape(v)}</dd>" for k, v in DEFINITIONS.items())
        + "</dl>"
    )
    parts.append(
        "<h2>Data</h2><p>"
        + _data_link(turns_csv(turns), "text/csv", "turns.csv")
        + " · "
        + _data_link(turns_json(turns, meta), "application/json", "turns.json")
        + "</p></body></html>"
    )
    return "".join(parts)


def _summary_html(summary: dict) -> str:
    rows = "".join(
        f"<tr><th>{name}</th><td>{s['turns']}</td><td>{_fmt(s['ttfa_ms_median'])}</td>"
        f"<td>{_fmt(s['ttfa_heard_ms_median'])}</td><td>{_fmt(s['tokens_per_s_median'], 1)}</td>"
        f"<td>{_fmt(s['draft_acceptance_rate_median'], pct=True)}</td></tr>"
        for name, s in (("speculation off", summary["off"]), ("speculation on", summary["on"]))
    )
    return (
        "<h2>Summary</h2><table><tr><th></th><th>turns</th><th>TTFA median, ms</th>"
        "<th>TTFA (heard) median, ms</th><th>tokens/s median</th><th>draft acceptance median</th></tr>"
        f"{rows}</table><p>Heard delay median: {_fmt(summary['heard_delay_ms_median'])} ms "
        "(goal ≤ 150 ms).</p>"
    )


def _ab_html(ab: int, pairs: list[tuple[dict, dict]], s: dict) -> str:
    ci = s["ratio_on_off_ci95"]
    return (
        f"<h2>A/B run {ab}: “{html.escape(pairs[0][0].get('transcript', ''))}”</h2>"
        f"<p>{s['n']} pairs; TTFA on ÷ off: <b>{_fmt(s['ratio_on_off_median'], 2)}</b> "
        f"(median; 95% bootstrap CI {_fmt(ci[0], 2)} to {_fmt(ci[1], 2)}); median off "
        f"{_fmt(s['median_off'])} ms, on {_fmt(s['median_on'])} ms. "
        f"{html.escape(DEFINITIONS['ttfa_ratio_on_off'])}</p>{_img(ab_figure(pairs), f'A/B run {ab}')}"
    )


def _turns_html(turns: Sequence[dict]) -> str:
    head = (
        "<tr><th>turn</th><th>kind</th><th>speculation</th><th>TTFA</th><th>TTFA heard</th><th>heard delay</th>"
        + "".join(f"<th>{s}</th>" for s in STAGES)
        + "<th>tok/s</th><th>acceptance</th><th>accepted/step</th><th>you</th><th>agent</th></tr>"
    )
    body = "".join(
        f"<tr><td>{t.get('turn')}</td><td>{_fmt(t.get('kind'))}</td><td>{_fmt(bool(t.get('speculation')))}</td>"
        f"<td>{_fmt(t.get('ttfa_ms'))}</td><td>{_fmt(t.get('ttfa_heard_ms'))}</td><td>{_fmt(t.get('heard_delay_ms'))}"
        "</td>"
        + "".join(f"<td>{_fmt((t.get('stages') or {}).get(s))}</td>" for s in STAGES)
        + f"<td>{_fmt(t.get('tokens_per_s'), 1)}</td><td>{_fmt(t.get('draft_acceptance_rate'), pct=True)}</td>"
        f"<td>{_fmt(t.get('tokens_per_target_forward'), 2)}</td><td class='text'>{_clip(t.get('transcript'))}</td>"
        f"<td class='text'>{_clip(t.get('answer'))}</td></tr>"
        for t in turns
    )
    return (
        f"<h2>Turns</h2><p>All times in ms; texts cut at 160 characters (whole in the data below).</p>"
        f"<table>{head}{body}</table>"
    )
