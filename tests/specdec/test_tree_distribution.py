"""Sampling over a draft tree keeps the target's distribution: multi_candidate_verdict checked by simulation on a toy
target and draft over six tokens, whose distributions depend on the whole context (seeded tables). Answers are
decoded step by step — draft a tree after the context, verify it, emit its accepted path and the next token — until
two tokens are out, and a χ² test compares the first token and the first two (joint) with the target's exact
probabilities. Each check also runs on deliberately broken verdicts and must fail there ("teeth").

"Batched" here means what a batched engine step does to the math: several answers, each with its own context,
draft and tree, verified one after the other in each step, their draws interleaved through one generator; each
answer must still follow its own target. The seeds are fixed, so every outcome is reproducible."""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable

import pytest
import torch

from specdec import sampling
from specdec.openings import opening_tree
from specdec.sampling import multi_candidate_verdict
from specdec.tree import ROOT, DraftTree, build_tree, draw_tree
from tests.support.stats import chi2_pvalue

pytestmark = pytest.mark.slow

V = 6
N_ANSWERS = 4000
P_FAIL = 1e-3  # a check fails below this p-value


class Toy:
    """A target p and a draft q over V tokens, each a seeded function of the whole context. The target gives its
    least likely token probability 0 (a top-p cut), so a sampler that emits it fails at once; the draft is sharper
    than the target and only loosely like it, so rejections, residuals and the sibling updates all do real work."""

    def __init__(self, seed: int) -> None:
        self.seed = seed
        self.rows: dict[tuple[int, ...], tuple[torch.Tensor, torch.Tensor]] = {}

    def _row(self, context: tuple[int, ...]) -> tuple[torch.Tensor, torch.Tensor]:
        if context not in self.rows:
            code = sum((t + 1) * (V + 1) ** i for i, t in enumerate(context))
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + code)
            logits = 1.3 * torch.randn(V, generator=g)
            p = torch.softmax(logits, -1)
            p[logits.argmin()] = 0.0
            q = torch.softmax(2.0 * (0.6 * logits + 0.8 * torch.randn(V, generator=g)), -1)
            self.rows[context] = (p / p.sum(), q)
        return self.rows[context]

    def p(self, context: tuple[int, ...]) -> torch.Tensor:
        return self._row(context)[0]

    def q(self, context: tuple[int, ...]) -> torch.Tensor:
        return self._row(context)[1]

    def exact_pairs(self) -> dict[tuple[int, int], float]:
        return {
            (a, b): float(self.p(())[a] * self.p((a,))[b])
            for a in range(V)
            for b in range(V)
            if self.p(())[a] * self.p((a,))[b] > 0
        }


def paths(tree: DraftTree) -> list[tuple[int, ...]]:
    """Each node's tokens from the root's first child down to itself."""
    out: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        out.append((*(out[parent] if parent != ROOT else ()), token))
    return out


MakeTree = Callable[[Toy, tuple[int, ...], torch.Generator], DraftTree]


def sampled(widths: tuple[int, ...]) -> MakeTree:
    """A tree of fixed shape whose children are drawn without replacement from the toy's q (draw_tree)."""

    def make(toy: Toy, context: tuple[int, ...], g: torch.Generator) -> DraftTree:
        def draft_probs(ids: torch.Tensor, so_far: DraftTree) -> torch.Tensor:
            known = paths(so_far)
            return torch.stack([toy.q(context + (known[i] if i != ROOT else ())) for i in ids.tolist()])

        return draw_tree(draft_probs, widths, g)

    return make


def top_k(toy: Toy, context: tuple[int, ...], g: torch.Generator) -> DraftTree:
    """EAGLE-2's dynamic tree on the toy's q: its top two at each node, the three surest frontier nodes expanded,
    the best six nodes kept. Deterministic candidates: verified with q = None."""
    made: list[tuple[int, ...]] = []

    def expand(ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rows = [toy.q(context + (made[i] if i != ROOT else ())) for i in ids.tolist()]
        best = [row.topk(2) for row in rows]
        for i, b in zip(ids.tolist(), best):
            made.extend((*(made[i] if i != ROOT else ()), t) for t in b.indices.tolist())
        return torch.stack([b.indices for b in best]), torch.stack([b.values.log() for b in best])

    return build_tree(expand, top_k=3, max_depth=3, max_nodes=6)


def opening(toy: Toy, context: tuple[int, ...], g: torch.Generator) -> DraftTree:
    """An opening's guesses (specdec/openings.py): the toy q's top three, each continued by q's two likeliest next
    tokens in a row, as opening_tree ranks them, five nodes kept. Deterministic candidates: verified with q = None."""
    chains = []
    for guess, share in zip(*toy.q(context).topk(3)):
        chain = [int(guess)]
        for _ in range(2):
            chain.append(int(toy.q(context + tuple(chain)).argmax()))
        chains.append((chain, float(share)))
    return opening_tree(chains, 5, torch.device("cpu"))


def without_q(make: MakeTree) -> MakeTree:
    """Sampled children verified as deterministic candidates (q = None): still lossless, since trying fixed
    candidates one-hot by one-hot is exact sampling from p whatever chose them; only the acceptance is lower."""
    return lambda toy, context, g: dataclasses.replace(make(toy, context, g), q=None)


def step(toy: Toy, context: tuple[int, ...], make: MakeTree, g: torch.Generator) -> list[int]:
    """One speculative step: the tree after the context, its target rows, the verdict; the tokens it emits."""
    tree = make(toy, context, g)
    p = torch.stack([toy.p(context)] + [toy.p(context + path) for path in paths(tree)])
    n, nxt, *path = multi_candidate_verdict(p, tree, g).tolist()
    return [int(tree.tokens[i]) for i in path[:n]] + [nxt]


def first_pairs(toys: list[Toy], makes: list[MakeTree], n: int, seed: int) -> list[Counter]:
    """The first two tokens of n answers per toy, the toys' answers stepped together (one tree each per step),
    all through one generator."""
    g = torch.Generator().manual_seed(seed)
    pairs: list[Counter] = [Counter() for _ in toys]
    for _ in range(n):
        out: list[list[int]] = [[] for _ in toys]
        while any(len(tokens) < 2 for tokens in out):
            for toy, make, tokens in zip(toys, makes, out):
                if len(tokens) < 2:
                    tokens += step(toy, tuple(tokens), make, g)
        for counter, tokens in zip(pairs, out):
            counter[tokens[0], tokens[1]] += 1
    return pairs


def pvalues(toy: Toy, pairs: Counter) -> tuple[float, float]:
    """(first token, first two tokens jointly)."""
    firsts: Counter = Counter()
    for (a, _), count in pairs.items():
        firsts[a] += count
    exact_first = {a: float(p) for a, p in enumerate(toy.p(())) if p > 0}
    return chi2_pvalue(firsts, exact_first), chi2_pvalue(pairs, toy.exact_pairs())


KINDS: dict[str, MakeTree] = {
    "sampled-3-2-1": sampled((3, 2, 1)),  # 15 nodes, three deep
    "sampled-wide-5": sampled((5,)),  # five of the six tokens at the root: the without-replacement updates matter
    "top-k": top_k,
    "opening": opening,
    "sampled-as-deterministic": without_q(sampled((3, 2, 1))),
}


@pytest.mark.parametrize("kind", list(KINDS))
def test_a_tree_keeps_the_target_distribution(kind):
    toy = Toy(1)
    (pairs,) = first_pairs([toy], [KINDS[kind]], N_ANSWERS, seed=0)
    assert min(pvalues(toy, pairs)) > P_FAIL


def test_batched_trees_keep_each_target_distribution():
    toys = [Toy(2), Toy(3), Toy(4)]
    counts = first_pairs(toys, [sampled((3, 2, 1)), top_k, sampled((5,))], N_ANSWERS, seed=1)
    assert all(min(pvalues(toy, pairs)) > P_FAIL for toy, pairs in zip(toys, counts))


# Teeth: the same checks on deliberately broken verdicts must fail.


def residual_is_p(p, q):
    return p


def q_not_updated(real):
    """Children drawn without replacement judged as if drawn with replacement (q never loses a sibling)."""
    return lambda tree, vocab: real(tree, vocab) if tree.q is None else tree.q


def row_before(real):
    """The next token drawn from the row before the last accepted node's (the chain's bonus-from-row-K − 1 bug)."""
    return lambda on_path: (real(on_path) - 1).clamp_min(0)


BROKEN = ["residual_is_p", "q_not_updated", "next_from_the_row_before"]


def break_verdict(broken: str, monkeypatch) -> None:
    if broken == "residual_is_p":
        monkeypatch.setattr(sampling, "residual_distribution", residual_is_p)
    elif broken == "q_not_updated":
        monkeypatch.setattr(sampling, "candidate_distributions", q_not_updated(sampling.candidate_distributions))
    else:
        monkeypatch.setattr(sampling, "last_accepted_row", row_before(sampling.last_accepted_row))


@pytest.mark.parametrize("broken", BROKEN)
def test_the_check_catches_a_broken_tree_verdict(monkeypatch, broken):
    toy = Toy(1)
    break_verdict(broken, monkeypatch)
    (pairs,) = first_pairs([toy], [KINDS["sampled-3-2-1"]], N_ANSWERS, seed=0)
    assert pvalues(toy, pairs)[1] < P_FAIL


@pytest.mark.parametrize("kind", ["top-k", "opening"])
def test_the_check_catches_a_broken_residual_on_a_deterministic_tree(monkeypatch, kind):
    toy = Toy(1)
    monkeypatch.setattr(sampling, "residual_distribution", residual_is_p)
    (pairs,) = first_pairs([toy], [KINDS[kind]], N_ANSWERS, seed=0)
    assert pvalues(toy, pairs)[1] < P_FAIL


@pytest.mark.parametrize("broken", BROKEN)
def test_the_batched_check_catches_a_broken_tree_verdict(monkeypatch, broken):
    toys = [Toy(2), Toy(3), Toy(4)]
    break_verdict(broken, monkeypatch)
    makes = [sampled(widths) for widths in [(3, 2, 1), (5,), (2, 2)]]
    counts = first_pairs(toys, makes, N_ANSWERS, seed=1)
    assert min(pvalues(toy, pairs)[1] for toy, pairs in zip(toys, counts)) < P_FAIL
