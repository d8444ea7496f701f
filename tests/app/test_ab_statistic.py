"""The one A/B statistic, metrics.DEFINITIONS["ttfa_ratio_on_off"], that bench-voice and the app's A/B runs report."""

import statistics

import pytest

from app.stats import bootstrap_ci, paired_ratio


def test_median_ratio_on_off_with_a_bootstrap_interval_of_the_median():
    pairs = [(1000.0, 800.0), (1200.0, 1100.0), (900.0, 950.0), (1500.0, 1000.0), (1100.0, 700.0)]
    s = paired_ratio(pairs)
    ratios = [on / off for off, on in pairs]
    assert s["n"] == 5 and s["ratio_on_off_median"] == statistics.median(ratios)
    assert s["ratio_on_off_ci95"] == list(bootstrap_ci(ratios, statistics.median))
    assert s["ratio_on_off_ci95"][0] <= s["ratio_on_off_median"] <= s["ratio_on_off_ci95"][1]
    assert (s["median_off"], s["median_on"]) == (1100.0, 950.0)
    # A ratio: a pair that is slower in both modes alike weighs the same.
    scaled = paired_ratio([(off * 3, on * 3) if i == 0 else (off, on) for i, (off, on) in enumerate(pairs)])
    assert scaled["ratio_on_off_median"] == s["ratio_on_off_median"]


def test_one_pair_and_no_pair():
    assert paired_ratio([(1000.0, 500.0)])["ratio_on_off_ci95"] == [0.5, 0.5]  # no spread: the point itself
    assert paired_ratio([]) == {
        "n": 0,
        "ratio_on_off_median": None,
        "ratio_on_off_ci95": None,
        "median_off": None,
        "median_on": None,
    }


def test_the_statistic_is_the_one_defined_by_hand():
    """DEFINITIONS["ttfa_ratio_on_off"]: the median over pairs of TTFA on ÷ TTFA off, with a bootstrap 95% interval
    of that median. Worked by hand: ratios 0.8, 0.9167, 1.0556, 0.6667, 0.6364, sorted 0.6364 0.6667 [0.8] 0.9167
    1.0556, so 0.8; not their mean (0.8150), not median on ÷ median off (950 / 1100 = 0.8636), not off ÷ on (1.25)."""
    s = paired_ratio([(1000.0, 800.0), (1200.0, 1100.0), (900.0, 950.0), (1500.0, 1000.0), (1100.0, 700.0)])
    assert s["ratio_on_off_median"] == pytest.approx(0.8)
    # The median of a resample of five is one of the five ratios (a mean's would fall between them), so each end of
    # the interval is one of them, the lower at most 0.8 and the upper at least.
    low, high = s["ratio_on_off_ci95"]
    ratios = (800 / 1000, 1100 / 1200, 950 / 900, 1000 / 1500, 700 / 1100)
    assert low in ratios and high in ratios and low < 0.8 < high
