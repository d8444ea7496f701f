"""Summary statistics of repeated measurements (bench-voice, the app's A/B runs), with the standard library only,
so that reports built from saved JSON load no models."""

from __future__ import annotations

import random
import statistics
from collections.abc import Callable, Sequence


def bootstrap_ci(
    values: Sequence[float], stat: Callable[[Sequence[float]], float] = statistics.median, n: int = 2000, seed: int = 0
) -> tuple[float, float]:
    """95% percentile-bootstrap interval of stat(values)."""
    rng = random.Random(seed)
    draws = sorted(stat(rng.choices(values, k=len(values))) for _ in range(n))
    return draws[int(0.025 * n)], draws[int(0.975 * n) - 1]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median, quartiles and range of a non-empty sample."""
    q = statistics.quantiles(values, n=4) if len(values) > 1 else [values[0]] * 3
    return {"median": statistics.median(values), "p25": q[0], "p75": q[2], "min": min(values), "max": max(values)}


def median_or_none(values: Sequence[float | None]) -> float | None:
    """Median of the values that are present; None when none are."""
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def paired_ratio(pairs: Sequence[tuple[float, float]]) -> dict:
    """The A/B statistic, metrics.DEFINITIONS["ttfa_ratio_on_off"], of (off, on) pairs of one figure: the median of
    on ÷ off with a 95% bootstrap interval of that median, beside each side's median. A ratio, not a difference, so
    short and long answers weigh alike; a median, so one stalled run does not decide it."""
    if not pairs:
        return {"n": 0, "ratio_on_off_median": None, "ratio_on_off_ci95": None, "median_off": None, "median_on": None}
    ratios = [on / off for off, on in pairs]
    return {
        "n": len(ratios),
        "ratio_on_off_median": statistics.median(ratios),
        # One pair has no spread: its interval is the point itself.
        "ratio_on_off_ci95": list(bootstrap_ci(ratios)),
        "median_off": statistics.median(off for off, _ in pairs),
        "median_on": statistics.median(on for _, on in pairs),
    }
