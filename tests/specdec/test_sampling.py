"""The acceptance and sampling math, checked against the formulas and by simulation."""

import math

import pytest
import torch

from specdec.drafters import ngram_lookup
from specdec.metrics import (
    SpecStats,
    alpha_from_acceptance_rate,
    expected_acceptance_rate,
    expected_speedup,
    expected_tokens_per_step,
)
from specdec.sampling import (
    SamplingParams,
    greedy_verdict,
    logits_to_probs,
    residual_distribution,
    sampled_verdict,
)


def test_logits_to_probs_is_tempered_softmax():
    logits = torch.tensor([2.0, 1.0, 0.0, -1.0])
    p = logits_to_probs(logits, SamplingParams(temperature=0.5))
    e = [math.exp(x / 0.5) for x in logits.tolist()]
    assert torch.allclose(p, torch.tensor([x / sum(e) for x in e]), atol=1e-6)


def test_top_p_keeps_smallest_prefix_reaching_mass():
    p0 = torch.tensor([0.5, 0.3, 0.15, 0.05])
    p = logits_to_probs(p0.log(), SamplingParams(temperature=1.0, top_p=0.8))
    # 0.5 + 0.3 reaches 0.8: the rest is cut and the kept mass renormalised.
    assert torch.allclose(p, torch.tensor([0.5 / 0.8, 0.3 / 0.8, 0.0, 0.0]), atol=1e-6)
    p = logits_to_probs(p0.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert p[2] > 0 and p[3] == 0


def test_bad_sampling_params_are_refused():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="top_p"):
        SamplingParams(temperature=1, top_p=0)


def test_residual_is_normalised_positive_part():
    p = torch.tensor([0.5, 0.3, 0.2])
    q = torch.tensor([0.2, 0.5, 0.3])
    assert torch.allclose(residual_distribution(p, q), torch.tensor([1.0, 0.0, 0.0]))
    assert torch.allclose(residual_distribution(p, p), p)  # p == q: nothing to correct, fall back to p


@pytest.mark.parametrize(
    "drafts,proposed,argmax,expected",
    [
        ([1, 2, 3], 3, [1, 2, 3, 9], [3, 9]),
        ([1, 2, 3], 3, [1, 5, 3, 9], [1, 5]),
        ([1], 1, [4, 8], [0, 4]),
        ([], 0, [7], [0, 7]),
        ([1, 2, 3], 1, [1, 2, 3, 9], [1, 2]),  # the gate let one count: the target's token after it, not a bonus
    ],
)
def test_greedy_verdict(drafts, proposed, argmax, expected):
    logits = torch.nn.functional.one_hot(torch.tensor(argmax), 10).float()
    verdict = greedy_verdict(torch.tensor(drafts, dtype=torch.long), torch.tensor(proposed), logits)
    assert verdict.tolist() == expected


def _simulate(p_rows, q_rows, deterministic, n=40000, seed=0):
    """Empirical distribution of the first emitted token of a speculative step with K=1."""
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(p_rows.shape[-1])
    for _ in range(n):
        if deterministic:
            draft, q = 0, None
        else:
            draft = int(torch.multinomial(q_rows[0], 1, generator=g))
            q = q_rows
        n_acc, nxt = sampled_verdict(torch.tensor([draft]), torch.tensor(1), p_rows, q, g).tolist()
        counts[draft if n_acc == 1 else nxt] += 1
    return counts / n


def _chi_square_ok(freq, p, n):
    # Pearson chi-square against the exact target distribution; threshold ≈ 99.9th percentile for df ≤ 5.
    mask = p > 0
    if float(freq[~mask].sum()) > 0:
        return False  # emitted a token the target gives zero probability
    stat = float((((freq - p) ** 2) / p)[mask].sum() * n)
    return stat < 20.5


def test_rejection_sampling_keeps_target_distribution():
    p = torch.tensor([[0.1, 0.4, 0.2, 0.3, 0.0], [0.2, 0.2, 0.2, 0.2, 0.2]])
    q = torch.tensor([[0.5, 0.1, 0.1, 0.1, 0.2]])
    freq = _simulate(p, q, deterministic=False)
    assert _chi_square_ok(freq, p[0], 40000)


def test_rejection_sampling_with_deterministic_drafter_keeps_target_distribution():
    p = torch.tensor([[0.25, 0.05, 0.3, 0.4], [0.25, 0.25, 0.25, 0.25]])
    freq = _simulate(p, None, deterministic=True, seed=1)
    assert _chi_square_ok(freq, p[0], 40000)


def test_a_wrong_acceptance_rule_is_detected():
    """The check above has teeth: always accepting the draft gives q, not p, and fails it."""
    p = torch.tensor([0.1, 0.4, 0.2, 0.3, 0.0])
    q = torch.tensor([0.5, 0.1, 0.1, 0.1, 0.0])
    q = q / q.sum()
    g = torch.Generator().manual_seed(0)
    draws = torch.multinomial(q, 40000, replacement=True, generator=g)
    freq = torch.bincount(draws, minlength=5).float() / 40000
    assert not _chi_square_ok(freq, p, 40000)


def test_bonus_token_sampled_from_last_target_row_when_all_accepted():
    p = torch.tensor([[0.0, 1.0, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0]])
    assert sampled_verdict(torch.tensor([1]), torch.tensor(1), p, q, torch.Generator().manual_seed(0)).tolist() == [
        1,
        2,
    ]


def test_after_the_gate_the_next_token_comes_from_the_target_not_the_residual():
    """Two drafts, the gate counts one: the second is never judged, so the token after the first comes from p[1]
    (half 0, half 1), not from the residual of p[1] against q[1] (always 1)."""
    p = torch.tensor([[0.0, 1.0, 0.0], [0.5, 0.5, 0.0], [0.0, 0.0, 1.0]])
    q = torch.tensor([[0.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    g = torch.Generator().manual_seed(0)
    verdicts = [sampled_verdict(torch.tensor([1, 0]), torch.tensor(1), p, q, g).tolist() for _ in range(400)]
    assert all(n == 1 for n, _ in verdicts)
    assert 150 < sum(nxt == 0 for _, nxt in verdicts) < 250


def test_expected_speedup_formulas():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert math.isclose(expected_tokens_per_step(0.5, 2), 1 + 0.5 + 0.25)
    assert math.isclose(expected_speedup(0.85, 4, 0.5, 1.15), ((1 - 0.85**5) / 0.15) / (4 * 0.5 + 1.15), rel_tol=1e-3)
    # The case study: a 74% draft acceptance rate at K = 4 is α ≈ 0.88 (see latency-anchors.md).
    alpha = alpha_from_acceptance_rate(0.74, 4)
    assert 0.87 < alpha < 0.89
    assert math.isclose(expected_acceptance_rate(alpha, 4), 0.74, abs_tol=1e-6)


def test_spec_stats_definitions(step_event):
    s = SpecStats()
    s.observe(step_event(accepted=4, drafted=4, forwards=4, draft_s=0.1, verify_s=0.2))
    s.observe(step_event(accepted=1, drafted=4, forwards=4, draft_s=0.1, verify_s=0.2))
    s.observe(step_event(verify_s=0.3, speculative=False))  # a plain step: a target forward, not a speculative one
    s.observe(step_event(forwards=1, draft_s=0.02, verify_s=0.2))  # the gate stopped before the first draft
    assert s.draft_acceptance_rate == 5 / 8
    assert s.tokens_per_target_forward == 9 / 4
    assert (s.target_forwards, s.speculative_steps, s.draft_forwards) == (4, 3, 9)
    assert s.mean_k == 8 / 3
    assert s.alpha == 5 / 6  # 5 accepted, 1 rejection
    assert s.per_position_acceptance == [1.0, 0.5, 0.5, 0.5]
    assert math.isclose(s.draft_cost_ratio, (0.22 / 9) / (0.6 / 3))


def test_spec_stats_merge_adds_every_counter(step_event):
    a, b, both = SpecStats(), SpecStats(), SpecStats()
    steps = [
        (a, step_event(accepted=4, drafted=4, forwards=4, draft_s=0.1, verify_s=0.2)),
        (b, step_event(accepted=1, drafted=6, forwards=6, draft_s=0.3, verify_s=0.1)),
        (b, step_event(verify_s=0.3, speculative=False)),
    ]
    for stats, event in steps:
        stats.observe(event)
        both.observe(event)
    a.merge(b)
    assert a == both


@pytest.mark.parametrize(
    "context,k,expected",
    [
        ([1, 2, 3, 4, 1, 2], 2, [3, 4]),  # suffix [1, 2] seen before, followed by 3, 4
        ([5, 6, 7, 5, 6, 8, 5, 6], 3, [8, 5, 6]),  # the most recent match wins
        ([1, 2, 3], 2, []),  # nothing repeats
        ([9, 9], 3, [9]),
    ],
)
def test_ngram_lookup(context, k, expected):
    assert ngram_lookup(context, k) == expected
