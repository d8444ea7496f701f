"""The one A/B statistic, metrics.DEFINITIONS["ttfa_ratio_on_off"], that bench-voice and the app's A/B runs report."""

import statistics

from app.stats import bootstrap_ci, paired_ratio
from specdec.metrics import DEFINITIONS


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


def test_the_definition_says_what_is_computed():
    text = DEFINITIONS["ttfa_ratio_on_off"]
    assert all(word in text for word in ("median", "on ÷ TTFA off", "bootstrap", "95%"))
