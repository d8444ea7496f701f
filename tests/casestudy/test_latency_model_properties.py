"""The latency model away from the figures it is fitted to: limits, monotonicity, functions that must invert each
other, where the roofline turns compute-bound, and the K policy against a brute-force search.

Where that is cheap, a property is written as a function of the formula it checks and is also run against a
deliberately wrong formula, which it must reject: it cannot pass whatever the code does.
"""

from __future__ import annotations

import itertools
import random
from collections.abc import Callable
from dataclasses import replace

import pytest

from casestudy import latency_model as lm
from casestudy.latency_model import (
    DECODE_STAGE,
    MIN_GAIN,
    Scenario,
    breakeven_concurrency,
    compute_seconds,
    evaluate,
    memory_seconds,
    recommended_k,
    ridge_tokens,
    solve_draft_cost_ratio,
)
from casestudy.story import calibrated_scenario
from specdec.metrics import (
    alpha_from_acceptance_rate,
    expected_acceptance_rate,
    expected_speedup,
    expected_tokens_per_step,
)

ALPHAS = [i / 20 for i in range(1, 20)]  # 0.05 … 0.95
KS = range(1, 9)
CS = [0.0, 0.02, 0.1, 0.3, 0.7]
Speedup = Callable[..., float]  # (alpha, k, c, v=1.0) -> speedup


@pytest.fixture(scope="module")
def scenario() -> Scenario:
    return calibrated_scenario()


def geometric_tokens(alpha: float, k: int) -> float:
    """E as the sum it comes from: the target's token plus draft i accepted with probability α^i."""
    return sum(alpha**i for i in range(k + 1))


# ---- deliberately wrong formulas: each property below must reject at least one


def speedup_sign_flipped(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    return expected_tokens_per_step(alpha, k) / (v - c * k)


def speedup_without_bonus_token(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    return sum(alpha**i for i in range(1, k + 1)) / (c * k + v)


def solve_draft_cost_sign_flipped(speedup: float, alpha: float, k: int, v: float = 1.0) -> float:
    return (expected_tokens_per_step(alpha, k) / speedup + v) / k


def rate_per_token_slot(alpha: float, k: int) -> float:
    return expected_tokens_per_step(alpha, k) / (k + 1)


def min_roofline(model, hw, tokens: int = 1, batch: int = 1, context_tokens: int = 0) -> float:
    return min(memory_seconds(model, hw, batch, context_tokens), compute_seconds(model, hw, tokens))


# ---- the closed forms (specdec.metrics) the model is built on


def limit_violations(speedup: Speedup) -> list[str]:
    bad = []
    for k, c in itertools.product(KS, CS):
        cost = c * k + 1
        if speedup(0.0, k, c) != pytest.approx(1 / cost):  # nothing accepted: one token a step, drafts still paid
            bad.append(f"α=0 K={k} c={c}: {speedup(0.0, k, c)}")
        for alpha in (1.0, 1 - 1e-9):  # everything accepted: K + 1 tokens a step, approached continuously
            if speedup(alpha, k, c) != pytest.approx((k + 1) / cost, rel=1e-6):
                bad.append(f"α={alpha} K={k} c={c}: {speedup(alpha, k, c)}")
        if c == 0:  # a free draft: the speedup is the tokens per step
            bad += [f"c=0 α={a} K={k}" for a in ALPHAS if speedup(a, k, 0.0) != pytest.approx(geometric_tokens(a, k))]
    return bad


def monotonicity_violations(speedup: Speedup) -> list[str]:
    bad = []
    for k, c in itertools.product(KS, CS):
        values = [speedup(a, k, c) for a in ALPHAS]
        if any(x >= y for x, y in zip(values, values[1:])):
            bad.append(f"not rising with α at K={k} c={c}")
    for k, a in itertools.product(KS, ALPHAS):
        values = [speedup(a, k, c) for c in CS]
        if any(x <= y for x, y in zip(values, values[1:])):
            bad.append(f"not falling with c at K={k} α={a}")
    return bad


def test_speedup_limits() -> None:
    assert not limit_violations(expected_speedup)
    assert limit_violations(speedup_sign_flipped) and limit_violations(speedup_without_bonus_token)


def test_speedup_rises_with_acceptance_and_falls_with_draft_cost() -> None:
    assert not monotonicity_violations(expected_speedup)
    assert monotonicity_violations(speedup_sign_flipped)


def test_tokens_per_step_grow_with_k_towards_one_over_one_minus_alpha() -> None:
    for a in ALPHAS:
        values = [expected_tokens_per_step(a, k) for k in range(0, 9)]
        assert values[0] == 1 and all(x < y < 1 / (1 - a) for x, y in zip(values, values[1:]))
        assert expected_tokens_per_step(a, 1000) == pytest.approx(1 / (1 - a))


def draft_cost_inversion_errors(solve: Callable[..., float]) -> list[float]:
    """|solve(S(c)) − c| at random points far from the story's."""
    rng = random.Random(7)
    errors = []
    for _ in range(500):
        alpha, k, c, v = rng.uniform(0.01, 0.99), rng.randint(1, 10), rng.uniform(0, 1), rng.uniform(1, 2)
        errors.append(abs(solve(expected_speedup(alpha, k, c, v), alpha, k, v) - c))
    return errors


def test_solve_draft_cost_ratio_inverts_the_speedup_anywhere() -> None:
    assert max(draft_cost_inversion_errors(solve_draft_cost_ratio)) < 1e-9
    assert max(draft_cost_inversion_errors(solve_draft_cost_sign_flipped)) > 0.1


def alpha_inversion_errors(inverse: Callable[[float, int], float]) -> list[float]:
    """Both ways over a grid: α → rate → α, and rate → α → rate."""
    errors = []
    for k in KS:
        for x in [0.001, *ALPHAS, 0.999]:
            errors.append(abs(inverse(expected_acceptance_rate(x, k), k) - x))
            errors.append(abs(expected_acceptance_rate(inverse(x, k), k) - x))
    return errors


def test_alpha_from_acceptance_rate_inverts_the_rate_over_a_grid() -> None:
    assert max(alpha_inversion_errors(alpha_from_acceptance_rate)) < 1e-9
    # Reading vLLM's acceptance rate as α, the story's own confusion, is caught (it holds only at K = 1).
    assert max(alpha_inversion_errors(lambda rate, k: rate)) > 0.1


def rate_above_alpha(rate: Callable[[float, int], float]) -> list[str]:
    """The acceptance rate averages α^i over the K positions, so it never exceeds α, and equals it at K = 1."""
    bad = [f"α={a} K={k}" for a, k in itertools.product([0.0, *ALPHAS, 1.0], KS) if rate(a, k) > a + 1e-12]
    return bad + [f"α={a} K=1" for a in ALPHAS if rate(a, 1) != pytest.approx(a)]


def test_acceptance_rate_never_exceeds_alpha() -> None:
    assert not rate_above_alpha(expected_acceptance_rate)
    assert rate_above_alpha(rate_per_token_slot)


# ---- the model (casestudy.latency_model) at inputs it was not fitted to


def model_limit_violations(s: Scenario) -> list[str]:
    """The closed forms' limits through the whole model, with a given draft cost c = 0.1 (and c = 0)."""
    s = replace(s, c=0.1)
    bad = []
    for k in KS:
        none = evaluate(replace(s, alpha=0.0, k=k))
        if none.tokens_per_step != 1 or none.speedup != pytest.approx(1 / (0.1 * k + none.v)) or none.speedup >= 1:
            bad.append(f"α=0 K={k}: speedup {none.speedup}")
        every = evaluate(replace(s, alpha=1.0, k=k))
        if every.tokens_per_step != k + 1 or every.speedup != pytest.approx((k + 1) / (0.1 * k + every.v)):
            bad.append(f"α=1 K={k}: speedup {every.speedup}")
        free = evaluate(replace(s, alpha=0.8, k=k, c=0.0))
        if free.speedup != pytest.approx(geometric_tokens(0.8, k) / free.v):
            bad.append(f"c=0 K={k}: speedup {free.speedup}")
        if s.concurrency == 1 and free.v != 1:  # memory-bound: verifying K + 1 tokens costs one plain forward
            bad.append(f"K={k}: v={free.v} at batch 1")
    if recommended_k(s.concurrency, 0.0, 0.1, scenario=s):  # nothing accepted: never worth drafting
        bad.append("drafts with α = 0")
    return bad


@pytest.mark.parametrize("concurrency", [1, 64, 512])
def test_model_limits(scenario: Scenario, concurrency: int, monkeypatch) -> None:
    s = replace(scenario, concurrency=concurrency)
    assert not model_limit_violations(s)
    monkeypatch.setattr(lm, "expected_speedup", speedup_sign_flipped)
    assert model_limit_violations(s)


@pytest.mark.parametrize("concurrency", [1, 64, 512])
def test_model_speedup_rises_with_alpha_and_falls_with_c(scenario: Scenario, concurrency: int, monkeypatch) -> None:
    def model(alpha: float, k: int, c: float, v: float = 1.0) -> float:
        return evaluate(replace(scenario, alpha=alpha, k=k, c=c, concurrency=concurrency)).speedup

    assert not monotonicity_violations(model)
    roofline = [evaluate(replace(scenario, alpha=a, concurrency=concurrency)).speedup for a in ALPHAS]
    assert all(x < y for x, y in zip(roofline, roofline[1:]))
    monkeypatch.setattr(lm, "expected_speedup", speedup_sign_flipped)
    assert monotonicity_violations(model)


def test_ttfa_falls_as_tokens_per_s_rise(scenario: Scenario) -> None:
    evs = [evaluate(replace(scenario, hw=replace(scenario.hw, bandwidth_tbs=bw))) for bw in (0.5, 1, 2, 3.35, 8, 16)]
    for rate, ttfa, stages in [
        ("baseline_tokens_per_s", "baseline_ttfa_ms", "baseline_stages"),
        ("speculative_tokens_per_s", "speculative_ttfa_ms", "speculative_stages"),
    ]:
        ordered = sorted(evs, key=lambda e: getattr(e, rate))
        rates, ttfas = [getattr(e, rate) for e in ordered], [getattr(e, ttfa) for e in ordered]
        assert all(x < y for x, y in zip(rates, rates[1:])) and all(x > y for x, y in zip(ttfas, ttfas[1:]))
        for e in evs:  # the decode share is the first chunk's tokens at that rate
            assert getattr(e, stages)[DECODE_STAGE] == pytest.approx(
                scenario.stages.first_chunk_tokens * 1e3 / getattr(e, rate)
            )


def verify_cost_violations(s: Scenario) -> list[str]:
    """v = verify forward ÷ plain forward with no KV reads: 1 while the B·(K+1) verify tokens are under the ridge,
    rising with the batch, and K + 1 once even the plain B-token forward is compute-bound."""
    s = replace(s, context_tokens=0)
    ridge = ridge_tokens(s.target, s.hw)
    bad = []
    for k in (1, 4, 8):
        vs = {b: evaluate(replace(s, k=k, concurrency=b)).v for b in range(1, int(2 * ridge))}
        bad += [f"K={k} B={b}: v={v}" for b, v in vs.items() if b * (k + 1) < ridge and v != pytest.approx(1)]
        bad += [f"K={k} B={b}: v={v}" for b, v in vs.items() if b > ridge and v != pytest.approx(k + 1)]
        values = list(vs.values())
        if any(x > y + 1e-12 for x, y in zip(values, values[1:])):
            bad.append(f"K={k}: v falls with the batch")
    return bad


def test_verification_turns_compute_bound_at_the_ridge(scenario: Scenario, monkeypatch) -> None:
    assert not verify_cost_violations(scenario)
    monkeypatch.setattr(lm, "modelled_forward_seconds", min_roofline)  # the two roofs swapped
    assert verify_cost_violations(scenario)


def first_compute_bound_batch(s: Scenario, k: int) -> int | None:
    return next((b for b in range(1, 1 << 14) if evaluate(replace(s, k=k, concurrency=b)).v > 1 + 1e-9), None)


def test_the_crossover_batch_falls_with_k_and_rises_with_kv_reads(scenario: Scenario, monkeypatch) -> None:
    ridge = ridge_tokens(scenario.target, scenario.hw)
    no_kv = replace(scenario, context_tokens=0)
    crossings = [first_compute_bound_batch(no_kv, k) for k in KS]
    assert crossings == [int(ridge // (k + 1)) + 1 for k in KS]  # B·(K+1) just past the ridge
    assert all(x >= y for x, y in zip(crossings, crossings[1:]))
    for k in KS:  # each sequence's KV cache adds bytes per forward: memory-bound up to larger batches
        longer = [first_compute_bound_batch(replace(scenario, context_tokens=n), k) for n in (0, 1024, 4096)]
        assert longer == sorted(longer) and longer[0] < longer[-1]
    monkeypatch.setattr(lm, "modelled_forward_seconds", min_roofline)
    assert [first_compute_bound_batch(no_kv, k) for k in KS] != crossings


def test_breakeven_moves_the_right_way_with_hardware_and_k(scenario: Scenario) -> None:
    def breakeven(**hw) -> int | None:
        return breakeven_concurrency(replace(scenario, hw=replace(scenario.hw, **hw)))

    # More FLOP/s move the ridge out, more bandwidth moves it in.
    assert breakeven(tflops=156) < breakeven(tflops=312) < breakeven(tflops=624)
    assert breakeven(bandwidth_tbs=1) > breakeven(bandwidth_tbs=2) > breakeven(bandwidth_tbs=4)
    by_k = [breakeven_concurrency(replace(scenario, k=k)) for k in KS]
    assert by_k == sorted(by_k, reverse=True) and by_k[0] > by_k[-1]  # deeper drafts pay more FLOPs per step


def brute_force_disagreements(recommend: Callable[..., int], s: Scenario) -> list[tuple]:
    """The policy against every K from 1 to k_max, evaluated one by one, over a grid it was not fitted to."""
    bad = []
    for b, alpha, c, k_max, min_gain in itertools.product(
        [1, 8, 64, 256, 1024], [0.3, 0.6, 0.8, 0.95], [None, 0.02, 0.1, 0.4], [3, 8], [1.0, MIN_GAIN, 1.5]
    ):
        point = replace(s, alpha=alpha, c=c, concurrency=b)
        gains = {k: evaluate(replace(point, k=k)).speedup for k in range(1, k_max + 1)}
        best = max(gains, key=gains.get)
        expected = best if gains[best] >= min_gain else 0
        got = recommend(b, alpha, c, scenario=s, k_max=k_max, min_gain=min_gain)
        if got != expected:
            bad.append((b, alpha, c, k_max, min_gain, got, expected))
    return bad


def test_recommended_k_is_the_best_k_of_a_grid_search(scenario: Scenario) -> None:
    assert not brute_force_disagreements(recommended_k, scenario)
    assert brute_force_disagreements(
        lambda b, a, c, *, k_max, **kw: recommended_k(b, a, c, k_max=k_max - 1, **kw), scenario
    )  # one K short of the range
    assert brute_force_disagreements(
        lambda *args, min_gain, **kw: recommended_k(*args, min_gain=1.0, **kw), scenario
    )  # ignores the minimum gain
