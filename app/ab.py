"""A/B on the page: one utterance answered with speculation off and on, alternated, and the paired TTFA ratio."""

from __future__ import annotations

import threading
from collections.abc import Callable

from pipeline.paired import paired_runs

from .stats import paired_ratio

AB_RUN_KEYS = "turn transcript ttfa_ms stages tokens_per_s draft_acceptance_rate answer audio_seconds cancelled".split()
# run(repeat, speculation): one answer's record; None once cancel stopped it
Run = Callable[[int, bool], dict | None]


def run_ab(run: Run, put: Callable[[dict], None], head: dict, repeats: int, cancel: threading.Event) -> None:
    """repeats pairs of runs, each pair sent to the page as it ends, then the summary. head: {"ab": id, ...}."""
    put({"type": "ab_start", **head, "repeats": repeats})
    pairs: list[dict] = []
    for pair in paired_runs(run, range(repeats), cancel):
        assert pair.off is not None and pair.on is not None  # a run is None only once cancelled
        pairs.append({"repeat": pair.item, "off": _ab_run(pair.off), "on": _ab_run(pair.on)})
        put({"type": "ab_progress", "ab": head["ab"], "done": len(pairs), "repeats": repeats})
    summary = paired_ratio([(p["off"]["ttfa_ms"], p["on"]["ttfa_ms"]) for p in pairs])
    put({"type": "ab_result", **head, "pairs": pairs, "summary": summary})


def _ab_run(turn: dict) -> dict:
    return {k: turn.get(k) for k in AB_RUN_KEYS}
