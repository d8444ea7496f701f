"""The roofline latency model and the story it explains (the casestudy command: tests/commands/test_casestudy.py)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from casestudy.latency_model import (
    DECODE_STAGE,
    Scenario,
    VoiceStages,
    breakeven_concurrency,
    evaluate,
    fits_in_memory,
    modelled_forward_seconds,
    recommended_k,
    ridge_tokens,
    solve_draft_cost_ratio,
    speedup_at,
)
from casestudy.story import STORY, calibrated_scenario, explain_story
from specdec.metrics import expected_acceptance_rate, expected_speedup

CONCURRENCY = [1, 2, 4, 8, 16, 32, 48, 64, 96, 128, 192, 256, 384, 512]


@pytest.fixture(scope="module")
def story():
    return explain_story()


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return calibrated_scenario()


def test_story_speed_is_reproduced_within_the_rounding_of_its_inputs(story) -> None:
    assert 0.2 < story.efficiency <= 1.0  # a plausible share of peak bandwidth, not a fudge factor
    assert story.baseline_tokens_per_s == pytest.approx(STORY.baseline_tokens_per_s)
    lo, hi = story.speculative_tokens_per_s_band
    assert lo <= story.speculative_tokens_per_s <= hi
    assert hi - lo < 0.06 * story.speculative_tokens_per_s  # the tolerance is tight, not a free pass
    assert lo - STORY.tokens_per_s_rounding <= STORY.speculative_tokens_per_s <= hi + STORY.tokens_per_s_rounding
    assert story.rate_reading_consistent and not story.alpha_reading_consistent


def test_story_acceptance_is_vllms_rate_not_alpha(story) -> None:
    assert expected_acceptance_rate(story.alpha, STORY.k) == pytest.approx(STORY.acceptance, abs=1e-6)
    assert story.alpha > 0.85
    assert story.acceptance_rate_if_alpha == pytest.approx(expected_acceptance_rate(STORY.acceptance, STORY.k))
    assert story.acceptance_rate_if_alpha < 0.55
    assert story.speculative_tokens_per_s_if_alpha < STORY.speculative_tokens_per_s - 10


def test_required_draft_cost_matches_the_draft_models_bytes(story) -> None:
    assert story.c_required == pytest.approx(story.c_roofline, rel=0.05)
    assert story.c_required_if_alpha < story.c_roofline / 3
    speedup = STORY.speculative_tokens_per_s / STORY.baseline_tokens_per_s
    assert expected_speedup(story.alpha, STORY.k, story.c_required, story.v) == pytest.approx(speedup)


def test_solve_draft_cost_ratio_inverts_the_speedup() -> None:
    for alpha, k, c, v in [(0.6, 2, 0.3, 1.0), (0.9, 6, 0.05, 1.2), (0.75, 4, 0.0, 1.0)]:
        assert solve_draft_cost_ratio(expected_speedup(alpha, k, c, v), alpha, k, v) == pytest.approx(c, abs=1e-12)


def test_story_ttfa_budget_adds_up_and_bounds_what_decoding_can_do(story) -> None:
    assert story.baseline_ttfa_ms == pytest.approx(STORY.baseline_ttfa_ms)
    assert sum(story.baseline_stages.values()) == pytest.approx(story.baseline_ttfa_ms)
    assert story.ttfa_floor_ms == pytest.approx(story.baseline_ttfa_ms - story.baseline_stages[DECODE_STAGE])
    assert story.ttfa_floor_ms < story.speculative_ttfa_ms < story.baseline_ttfa_ms
    assert story.first_chunk_tokens > 0
    # Speculation speeds only the decode stage (and adds the draft's prefill).
    spec, base = story.speculative_stages, story.baseline_stages
    assert spec[DECODE_STAGE] == pytest.approx(base[DECODE_STAGE] / (story.speculative_tokens_per_s / 28.0))
    assert spec["llm_first_token"] > base["llm_first_token"]
    assert story.decode_only_speculative_ttfa_ms == pytest.approx(
        STORY.baseline_ttfa_ms * story.baseline_tokens_per_s / story.speculative_tokens_per_s
    )


def test_story_ttfa_below_the_decode_only_floor_is_flagged(story) -> None:
    lo, hi = story.decode_only_ttfa_band
    assert lo <= story.decode_only_speculative_ttfa_ms <= hi
    assert STORY.speculative_ttfa_ms + STORY.ms_rounding < lo
    assert not story.story_ttfa_reachable
    assert story.acceptance_rate_for_story_ttfa > STORY.acceptance
    # A claim the model can reach is accepted as such.
    assert explain_story(replace(STORY, speculative_ttfa_ms=round(hi))).story_ttfa_reachable


def test_slower_other_stages_leave_fewer_tokens_before_the_first_chunk() -> None:
    tokens = [
        calibrated_scenario(replace(STORY, stages=VoiceStages(asr_ms=a))).stages.first_chunk_tokens
        for a in (0, 100, 200)
    ]
    assert tokens[0] > tokens[1] > tokens[2]


def test_roofline_scales_with_bandwidth_gpus_and_size(scenario: Scenario) -> None:
    base = evaluate(scenario).baseline_tokens_per_s
    faster = evaluate(replace(scenario, hw=replace(scenario.hw, bandwidth_tbs=4.0))).baseline_tokens_per_s
    more = evaluate(replace(scenario, hw=replace(scenario.hw, n_gpus=8))).baseline_tokens_per_s
    bigger = evaluate(replace(scenario, target=replace(scenario.target, params_b=140.0))).baseline_tokens_per_s
    assert faster == pytest.approx(2 * base) and more == pytest.approx(2 * base)
    assert bigger < base / 1.9


def test_forward_is_flat_below_the_ridge_and_linear_above(scenario: Scenario) -> None:
    t, hw = scenario.target, scenario.hw
    ridge = ridge_tokens(t, hw)
    assert modelled_forward_seconds(t, hw, 1) == pytest.approx(modelled_forward_seconds(t, hw, int(ridge * 0.9)))
    past_ridge = modelled_forward_seconds(t, hw, int(ridge * 8))
    assert past_ridge == pytest.approx(2 * modelled_forward_seconds(t, hw, int(ridge * 4)))


@pytest.mark.parametrize("k", [1, 4, 8])
def test_more_acceptance_means_faster_decoding_and_earlier_audio(scenario: Scenario, k: int) -> None:
    evs = [evaluate(replace(scenario, alpha=a, k=k)) for a in (0.4, 0.6, 0.8, 0.95)]
    rates = [e.speculative_tokens_per_s for e in evs]
    ttfas = [e.speculative_ttfa_ms for e in evs]
    assert rates == sorted(rates) and len(set(rates)) == 4
    assert ttfas == sorted(ttfas, reverse=True)


def test_k_zero_is_the_target_alone(scenario: Scenario) -> None:
    ev = evaluate(replace(scenario, k=0))
    assert ev.speculative_tokens_per_s == ev.baseline_tokens_per_s
    assert ev.speculative_ttfa_ms == ev.baseline_ttfa_ms


def test_speedup_falls_with_concurrency_and_breaks_even(scenario: Scenario) -> None:
    # Past the GPUs' memory the draft's KV reads and the target's FLOPs trade places; only batches that fit count.
    fitting = [b for b in CONCURRENCY if fits_in_memory(scenario, b)]
    assert 128 < fitting[-1] < CONCURRENCY[-1]
    speedups = [speedup_at(scenario, b) for b in fitting]
    assert all(a >= b - 1e-9 for a, b in zip(speedups, speedups[1:]))
    assert speedups[0] > 2 and speedups[-1] < 1
    b = breakeven_concurrency(scenario)
    assert speedup_at(scenario, b) <= 1 < speedup_at(scenario, b - 1)


def test_policy_speculates_deeper_when_idle_and_stops_under_load(scenario: Scenario) -> None:
    ks = [recommended_k(b, scenario.alpha, None, scenario=scenario) for b in CONCURRENCY]
    assert ks == sorted(ks, reverse=True)
    assert ks[0] >= STORY.k and ks[-1] == 0
    for b, k in zip(CONCURRENCY, ks):
        if k:  # whatever it picks beats the target alone, and is the best K there
            assert speedup_at(scenario, b, k) >= max(speedup_at(scenario, b, kk) for kk in range(1, 9)) - 1e-12
            assert speedup_at(scenario, b, k) > 1


def test_policy_follows_acceptance_and_draft_cost(scenario: Scenario) -> None:
    ks = [recommended_k(1, a, 0.1, scenario=scenario) for a in (0.5, 0.7, 0.9, 0.97)]
    assert ks == sorted(ks) and ks[-1] > ks[0]
    assert recommended_k(1, 0.3, 0.6, scenario=scenario) == 0  # a poor, expensive draft is never worth it
