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
    accept_greedy,
    accept_sampled,
    logits_to_probs,
    residual_distribution,
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
    "drafts,argmax,expected",
    [([1, 2, 3], [1, 2, 3, 9], (3, 9)), ([1, 2, 3], [1, 5, 3, 9], (1, 5)), ([1], [4, 8], (0, 4)), ([], [7], (0, 7))],
)
def test_accept_greedy(drafts, argmax, expected):
    assert accept_greedy(drafts, argmax) == expected


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
        n_acc, nxt = accept_sampled([draft], p_rows, q, g)
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
    assert accept_sampled([1], p, q, torch.Generator().manual_seed(0)) == (1, 2)


def test_expected_speedup_formulas():
    assert expected_tokens_per_step(0.0, 4) == 1.0
    assert expected_tokens_per_step(1.0, 4) == 5.0
    assert math.isclose(expected_tokens_per_step(0.5, 2), 1 + 0.5 + 0.25)
    assert math.isclose(expected_speedup(0.85, 4, 0.5, 1.15), ((1 - 0.85**5) / 0.15) / (4 * 0.5 + 1.15), rel_tol=1e-3)
    # The case study: a 74% draft acceptance rate at K = 4 is α ≈ 0.88 (see latency-anchors.md).
    alpha = alpha_from_acceptance_rate(0.74, 4)
    assert 0.87 < alpha < 0.89
    assert math.isclose(expected_acceptance_rate(alpha, 4), 0.74, abs_tol=1e-6)


def test_spec_stats_definitions():
    s = SpecStats()
    s.record(5, 0.2, speculative=True, k_drafted=4, n_accepted=4, draft_s=0.1, draft_forwards=4)
    s.record(2, 0.2, speculative=True, k_drafted=4, n_accepted=1, draft_s=0.1, draft_forwards=4)
    s.record(1, 0.3)  # a plain target step: counts as a target forward, not as a speculative one
    s.record(1, 0.2, speculative=True, draft_s=0.02, draft_forwards=1)  # the gate stopped before the first draft
    assert s.draft_acceptance_rate == 5 / 8
    assert s.tokens_per_target_forward == 9 / 4
    assert (s.target_forwards, s.speculative_steps, s.draft_forwards) == (4, 3, 9)
    assert s.mean_k == 8 / 3
    assert s.alpha == 5 / 6  # 5 accepted, 1 rejection
    assert s.per_position_acceptance == [1.0, 0.5, 0.5, 0.5]
    assert math.isclose(s.draft_cost_ratio, (0.22 / 9) / (0.6 / 3))


def test_spec_stats_merge_adds_every_counter():
    a, b, both = SpecStats(), SpecStats(), SpecStats()
    steps = [
        (a, (5, 0.2), dict(speculative=True, k_drafted=4, n_accepted=4, draft_s=0.1, draft_forwards=4)),
        (b, (2, 0.1), dict(speculative=True, k_drafted=6, n_accepted=1, draft_s=0.3, draft_forwards=6)),
        (b, (1, 0.3), {}),
    ]
    for stats, args, kw in steps:
        stats.record(*args, **kw)
        both.record(*args, **kw)
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
