"""Draft trees (specdec/tree.py) and their verdicts: masks and positions by hand, greedy and sampled verdicts on
hand-made targets, each equal to the chain's verdict on a chain, EAGLE-2's expansion on a draft of known
probabilities, and the tree's size from a measured forward-cost curve. Fast: the statistics are in
test_tree_distribution.py."""

from __future__ import annotations

import math

import pytest
import torch

from specdec.cost_grid import ForwardCosts
from specdec.sampling import (
    candidate_distributions,
    greedy_verdict,
    multi_candidate_verdict,
    sampled_verdict,
)
from specdec.scheduler import LoadEstimate, choose_ks
from specdec.tree import (
    ROOT,
    DraftTree,
    build_tree,
    chain_tree,
    draw_tree,
    graft,
    greedy_tree_verdict,
    grow_tree,
    keep_best,
    node_ranks,
    tree_attention_mask,
    tree_feed_mask,
    tree_positions,
)

#      root
#     /    \
#    0      1
#   / \
#  2   3
#  |
#  4
PARENTS = torch.tensor([ROOT, ROOT, 0, 0, 2])
DEPTHS = torch.tensor([1, 1, 2, 2, 3])


def long(values: list) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.long)


def one_hot_logits(argmax: list[int], vocab: int = 10) -> torch.Tensor:
    return torch.nn.functional.one_hot(long(argmax), vocab).float()


def test_mask_and_positions_by_hand():
    expected = [
        [1, 0, 0, 0, 0],
        [0, 1, 0, 0, 0],
        [1, 0, 1, 0, 0],
        [1, 0, 0, 1, 0],
        [1, 0, 1, 0, 1],
    ]
    assert tree_attention_mask(PARENTS).int().tolist() == expected
    # start = len(context) with the root last: the root sits at 9, depth d at 9 + d, siblings side by side.
    assert tree_positions(DEPTHS, 10).tolist() == [10, 10, 11, 11, 12]


def test_feed_mask_adds_the_cache_and_the_root():
    mask = tree_feed_mask(PARENTS, cached=2).int()
    assert mask.shape == (6, 8)  # rows: root, 5 nodes; keys: 2 cached, root, 5 nodes
    assert mask[0].tolist() == [1, 1, 1, 0, 0, 0, 0, 0]  # the root sees the cache and itself, as a chain's row 0
    assert mask[5].tolist() == [1, 1, 1, 1, 0, 1, 0, 1]  # node 4: cache, root, nodes 0, 2 and itself
    assert mask[1:, 3:].tolist() == tree_attention_mask(PARENTS).int().tolist()


@pytest.mark.parametrize("n", [0, 1, 2, 3, 9, 17])
def test_a_chain_mask_is_causal(n):
    """The squaring covers paths as long as the tree: a chain of n is the lower triangle."""
    chain = chain_tree(torch.zeros(n, dtype=torch.long))
    assert torch.equal(tree_attention_mask(chain.parents), torch.ones(n, n, dtype=torch.bool).tril())
    assert chain.depths.tolist() == list(range(1, n + 1))


def test_greedy_verdict_takes_a_branch_that_is_not_the_first_child():
    """Root candidates 5 and 7; the target wants 7 (the second), then 2 (node 1's second child), then 9."""
    tree = DraftTree(long([5, 7, 3, 4, 2]), long([ROOT, ROOT, 0, 1, 1]), long([1, 1, 2, 2, 2]))
    logits = one_hot_logits([7, 3, 2, 0, 0, 9])  # rows: root, nodes 0 … 4
    assert greedy_tree_verdict(tree, logits).tolist() == [2, 9, 1, 4, -1, -1, -1]


def test_greedy_verdict_corrects_at_the_root_when_no_candidate_matches():
    tree = DraftTree(long([5, 7]), long([ROOT, ROOT]), long([1, 1]))
    assert greedy_tree_verdict(tree, one_hot_logits([3, 0, 0])).tolist() == [0, 3, -1, -1]


def test_greedy_verdict_of_an_empty_tree_is_a_plain_step():
    assert greedy_tree_verdict(chain_tree(long([])), one_hot_logits([4])).tolist() == [0, 4]


def test_greedy_verdict_follows_the_first_of_twin_siblings():
    tree = DraftTree(long([5, 5, 1, 2]), long([ROOT, ROOT, 0, 1]), long([1, 1, 2, 2]))
    logits = one_hot_logits([5, 1, 2, 8, 8])
    assert greedy_tree_verdict(tree, logits).tolist() == [2, 8, 0, 2, -1, -1]


# A tree spelling 5, 6, 5-7, 5-8, 5-7-9 (PARENTS, DEPTHS above), and chains grafted onto it.
SPELLED = DraftTree(long([5, 6, 7, 8, 9]), PARENTS, DEPTHS)


@pytest.mark.parametrize(
    "chain,parents",
    [
        ([5, 8, 3, 4], [ROOT, 0, 3, 7]),  # shares 5-8 with the tree: 3 hangs under the tree's 8, 4 under 3
        ([4, 8], [ROOT, 5]),  # nothing shared: a new branch from the root
        ([5, 7, 9, 1], [ROOT, 0, 2, 4]),  # the tree's whole deepest path, then one more under its leaf
        ([], []),
    ],
)
def test_graft_hangs_the_chain_under_the_nodes_that_spell_its_prefix(chain, parents):
    grafted = graft(SPELLED, long(chain))
    assert grafted.tokens.tolist() == [5, 6, 7, 8, 9] + chain
    assert grafted.parents.tolist() == PARENTS.tolist() + parents
    assert grafted.depths.tolist() == DEPTHS.tolist() + list(range(1, len(chain) + 1))
    assert all(p < i for i, p in enumerate(grafted.parents.tolist()))  # still in topological order


def test_greedy_verdict_follows_a_grafted_chain_past_the_tree():
    """The target wants 5, 8, 3, 4, then 2: the tree holds 5-8, the graft 3-4 under it; its twins of 5 and 8
    (nodes 5 and 6) are wasted rows and never on the path."""
    grafted = graft(SPELLED, long([5, 8, 3, 4]))
    argmax = {0: 5, 1: 8, 4: 3, 8: 4, 9: 2}  # row (1 + node) → the target's choice; 0 elsewhere
    logits = one_hot_logits([argmax.get(row, 0) for row in range(len(grafted) + 1)])
    assert greedy_tree_verdict(grafted, logits).tolist()[:6] == [4, 2, 0, 3, 7, 8]


def test_a_grafted_twin_is_never_accepted_after_its_rejection():
    """One-hot candidates: when the tree's 5 is rejected, the root's residual has no mass on 5 left, so the graft's 5
    (and the chain under it) can never be accepted; the root then draws from p without 5."""
    grafted = graft(DraftTree(long([5]), long([ROOT]), long([1])), long([5, 1]))
    p = torch.full((len(grafted) + 1, 10), 0.1)
    for seed in range(50):
        verdict = multi_candidate_verdict(p, grafted, torch.Generator().manual_seed(seed)).tolist()
        assert verdict[0] == 0 and verdict[1] != 5 or verdict[2] == 0  # rejected: not 5 again; accepted: node 0


@pytest.mark.parametrize(
    "drafts,argmax",
    [([1, 2, 3], [1, 2, 3, 9]), ([1, 2, 3], [1, 5, 3, 9]), ([1], [4, 8]), ([], [7]), ([4, 4], [4, 4, 4])],
)
def test_greedy_verdict_on_a_chain_is_the_chain_verdict(drafts, argmax):
    tokens, logits = long(drafts), one_hot_logits(argmax)
    tree = greedy_tree_verdict(chain_tree(tokens), logits)
    chain = greedy_verdict(tokens, torch.tensor(len(drafts)), logits)
    assert tree[:2].tolist() == chain.tolist()
    assert tree[2 : 2 + int(chain[0])].tolist() == list(range(int(chain[0])))  # the path: nodes 0 … n − 1


def test_greedy_verdict_on_random_chains_is_the_chain_verdict():
    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        logits = torch.randn(k + 1, 3, generator=g)
        tokens = torch.randint(0, 3, (k,), generator=g)
        chain = greedy_verdict(tokens, torch.tensor(k), logits)
        assert greedy_tree_verdict(chain_tree(tokens), logits)[:2].tolist() == chain.tolist()


@pytest.mark.parametrize("with_q", [True, False], ids=["sampled-drafts", "deterministic-drafts"])
def test_sampled_verdict_on_a_chain_is_the_chain_verdict_draw_for_draw(with_q):
    """Same uniforms, same ratios, same residual, same draw: the same verdict for every seed."""
    g = torch.Generator().manual_seed(1)
    for seed in range(200):
        k = int(torch.randint(0, 5, (1,), generator=g))
        p = torch.softmax(2 * torch.randn(k + 1, 6, generator=g), -1)
        q = torch.softmax(2 * torch.randn(k, 6, generator=g), -1)
        tokens = torch.multinomial(q, 1, generator=g)[:, 0] if k else long([])
        q_or_none = q if with_q else None
        chain = sampled_verdict(tokens, torch.tensor(k), p, q_or_none, torch.Generator().manual_seed(seed))
        tree = multi_candidate_verdict(p, chain_tree(tokens, q_or_none), torch.Generator().manual_seed(seed))
        assert tree[:2].tolist() == chain.tolist()


def test_the_next_candidate_is_tried_against_the_residual():
    """Deterministic candidates 0 and 1; the target wants 1 or 2. Candidate 0 is always rejected, the residual is p
    itself (p(0) = 0), candidate 1 is accepted half the time; else the next token comes from the residual without 1:
    always 2. Candidate 1 is a leaf: after it, the bonus from its row (always 3)."""
    tree = DraftTree(long([0, 1]), long([ROOT, ROOT]), long([1, 1]))
    p = torch.tensor([[0.0, 0.5, 0.5, 0.0], [1.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 1.0]])
    g = torch.Generator().manual_seed(0)
    verdicts = [multi_candidate_verdict(p, tree, g).tolist() for _ in range(400)]
    assert set(map(tuple, verdicts)) == {(1, 3, 1, -1), (0, 2, -1, -1)}
    assert 150 < sum(v[0] for v in verdicts) < 250


def test_without_replacement_each_candidate_is_judged_against_q_without_its_elder_siblings():
    q = torch.tensor([0.5, 0.3, 0.2])
    tree = DraftTree(long([0, 1, 2, 1]), long([ROOT, ROOT, ROOT, 0]), long([1, 1, 1, 2]), q.expand(4, 3))
    expected = torch.tensor([[0.5, 0.3, 0.2], [0.0, 0.6, 0.4], [0.0, 0.0, 1.0], [0.5, 0.3, 0.2]])
    assert torch.allclose(candidate_distributions(tree, 3), expected)
    assert torch.equal(candidate_distributions(tree, 3)[0], q)  # a first child's q unchanged, bit for bit


def test_a_padding_child_of_probability_zero_is_never_accepted():
    """q has one token but the width is two: the second child has q = 0. The target wants exactly that token: the
    first child is rejected, the padding child is skipped, and the residual max(0, p − q) gives the token."""
    q = torch.tensor([[1.0, 0.0, 0.0]])
    tree = draw_tree(lambda ids, _: q.expand(len(ids), 3), [2], torch.Generator().manual_seed(0))
    assert tree.tokens[0] == 0 and tree.tokens[1] != 0  # distinct, the real one first
    p = torch.zeros(3, 3)
    p[0, int(tree.tokens[1])] = 1.0
    p[1:, 0] = 1.0
    for seed in range(20):
        verdict = multi_candidate_verdict(p, tree, torch.Generator().manual_seed(seed))
        assert verdict.tolist() == [0, int(tree.tokens[1]), -1, -1]


def test_draw_tree_has_the_shape_asked_for_and_distinct_siblings():
    q = torch.softmax(torch.randn(6, generator=torch.Generator().manual_seed(2)), -1)
    tree = draw_tree(lambda ids, _: q.expand(len(ids), 6), [3, 2, 1], torch.Generator().manual_seed(0))
    assert len(tree) == 3 + 6 + 6
    assert tree.depths.tolist() == [1] * 3 + [2] * 6 + [3] * 6
    assert tree.parents.tolist() == [ROOT] * 3 + [0, 0, 1, 1, 2, 2] + list(range(3, 9))
    for parent in range(ROOT, len(tree)):
        siblings = tree.tokens[tree.parents == parent].tolist()
        assert len(siblings) == len(set(siblings))
    assert tree.q is not None and torch.equal(tree.q, q.expand(15, 6))


class TableDraft:
    """A draft of known probabilities: table[path] = [(token, prob), …] best first; a path not in the table gets
    `default` probabilities by rank, on tokens 0, 1, …. Tracks node ids by Expand's numbering."""

    def __init__(self, table: dict[tuple[int, ...], list[tuple[int, float]]], top_k: int, default=(0.7, 0.15)):
        self.table, self.top_k, self.default = table, top_k, default
        self.paths: list[tuple[int, ...]] = []
        self.calls: list[list[int]] = []

    def __call__(self, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        self.calls.append(ids.tolist())
        tokens, logps = [], []
        for node in ids.tolist():
            path = () if node == ROOT else self.paths[node]
            row = self.table.get(path, list(enumerate(self.default)))[: self.top_k]
            tokens.append([t for t, _ in row])
            logps.append([math.log(p) for _, p in row])
            self.paths += [(*path, t) for t, _ in row]
        return long(tokens), torch.tensor(logps)


A, B = 1, 2  # the tokens of the hand-made draft below
HAND = {
    (): [(A, 0.6), (B, 0.3)],
    (A,): [(A, 0.7), (B, 0.2)],
    (B,): [(A, 0.5), (B, 0.4)],
    (A, A): [(A, 0.9), (B, 0.05)],
    (B, A): [(A, 0.6), (B, 0.3)],
    (A, B): [(A, 0.5), (B, 0.5)],  # never expanded: 0.12 is not among depth 2's top 2
    (B, B): [(A, 0.5), (B, 0.5)],
}


def paths_of(tree: DraftTree) -> list[tuple[int, ...]]:
    paths: list[tuple[int, ...]] = []
    for token, parent in zip(tree.tokens.tolist(), tree.parents.tolist()):
        paths.append((*(paths[parent] if parent != ROOT else ()), token))
    return paths


def assert_is_a_tree(tree: DraftTree) -> None:
    """Topological, every parent kept, depths one more than the parent's."""
    for i, (parent, depth) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist())):
        assert ROOT <= parent < i
        assert depth == (1 if parent == ROOT else tree.depths[parent] + 1)


def test_build_tree_expands_the_surest_paths_and_keeps_the_best_nodes():
    """Path probabilities: A .6, B .3; AA .42, BA .15, AB .12, BB .12 (AA and BA expanded); AAA .378, AAB .021,
    BAA .09, BAB .045. The best five: A, AA, AAA, B, BA."""
    draft = TableDraft(HAND, top_k=2)
    tree = build_tree(draft, top_k=2, max_depth=3, max_nodes=5)
    assert draft.calls == [[ROOT], [0, 1], [2, 4]]  # depth 2's top two: AA (node 2), BA (node 4)
    assert paths_of(tree) == [(A,), (B,), (A, A), (B, A), (A, A, A)]
    assert tree.parents.tolist() == [ROOT, ROOT, 0, 1, 2]
    assert tree.depths.tolist() == [1, 1, 2, 2, 3]
    assert tree.q is None and tree.scores is not None
    assert torch.allclose(tree.scores.exp(), torch.tensor([0.6, 0.3, 0.42, 0.15, 0.378]))


@pytest.mark.parametrize("max_nodes", [0, 1, 3, 6, 9, 14, 100])
@pytest.mark.parametrize("top_k,max_depth", [(1, 4), (2, 3), (3, 4)])
def test_build_tree_keeps_ancestors_and_respects_the_bounds(top_k, max_depth, max_nodes):
    draft = TableDraft({}, top_k, default=(0.5, 0.3, 0.2))
    grown = grow_tree(TableDraft({}, top_k, default=(0.5, 0.3, 0.2)), top_k, max_depth)
    tree = build_tree(draft, top_k, max_depth, max_nodes)
    assert len(tree) == min(max_nodes, len(grown))
    assert len(grown) == top_k + (max_depth - 1) * top_k * top_k
    assert all(d <= max_depth for d in tree.depths.tolist())
    assert_is_a_tree(tree)
    assert tree.scores is not None and grown.scores is not None
    if len(tree):  # the kept nodes are the best: none left out scores above the worst kept
        assert sorted(tree.scores.tolist(), reverse=True) == sorted(grown.scores.tolist(), reverse=True)[: len(tree)]


def test_node_ranks_by_hand():
    """The build_tree example above: A .6, B .3, AA .42, BA .15, AAA .378, in topological order."""
    tree = build_tree(TableDraft(HAND, top_k=2), top_k=2, max_depth=3, max_nodes=5)
    assert node_ranks(tree).tolist() == [0, 3, 1, 4, 2]
    assert node_ranks(DraftTree(long([5, 6]), long([ROOT, ROOT]), long([1, 1]))).tolist() == [0, 1]  # no scores
    grafted = graft(tree, long([9, 9]))  # a lookup's nodes rank after the heads', in chain order
    assert node_ranks(grafted).tolist() == [0, 3, 1, 4, 2, 5, 6]


@pytest.mark.parametrize("top_k,max_depth", [(1, 4), (2, 3), (3, 4)])
def test_the_nodes_of_rank_below_n_are_the_tree_keep_best_keeps_of_n(top_k, max_depth):
    """What the load-aware K learns a tree's nodes by: a step that verified the best N nodes tells what the best
    n < N would have brought, because those are its nodes of rank < n."""
    draft = TableDraft({}, top_k, default=(0.5, 0.3, 0.2))
    grown = grow_tree(draft, top_k, max_depth)
    tree = keep_best(grown, 7)
    ranks, paths = node_ranks(tree).tolist(), paths_of(tree)
    for n in range(len(tree) + 1):
        assert {p for p, r in zip(paths, ranks) if r < n} == set(paths_of(keep_best(grown, n)))
    for i, parent in enumerate(tree.parents.tolist()):  # along a path the ranks rise
        assert parent == ROOT or ranks[parent] < ranks[i]


def test_a_certain_child_ties_its_parent_and_the_parent_stays():
    """A draft sure of its next token (log-prob 0) gives the child its parent's score: the parent must rank first."""
    draft = TableDraft({(0,): [(3, 1.0)]}, top_k=1, default=(0.5,))
    tree = build_tree(draft, top_k=1, max_depth=3, max_nodes=2)
    assert paths_of(tree) == [(0,), (0, 3)]
    assert_is_a_tree(keep_best(grow_tree(TableDraft({}, 1, default=(1.0,)), 1, 6), 3))


# The tree's size from the measured forward costs (docs/results.md): the w8a8 1.5B target's verifying forward on the
# AMX VM (oneDNN: 108.7 / 114.4 / 121.6 / 129.8 ms for 1 / 2 / 5 / 9 rows, nearly flat) and on the Intel VM without
# AMX (137 / 160 / 201 ms for 1 / 2 / 5: each row 10–17% of a forward).
FLAT = ForwardCosts([1], [1, 2, 5, 9], [[0.1087, 0.1144, 0.1216, 0.1298]])
STEEP = ForwardCosts([1], [1, 2, 5], [[0.137, 0.160, 0.201]])


def sized(costs: ForwardCosts, values: list[float]) -> int:
    """The nodes the load-aware K verifies at one sequence (scheduler.choose_ks), each node's chance to be accepted
    known (values, by rank), drafting free."""
    ranked = sorted(values, reverse=True)
    return choose_ks([1], [len(values)], [LoadEstimate(ranked, [1.0] * len(values), 0.0)], costs)[0]


def test_the_grid_sizes_a_tree_by_hand():
    """A free row takes every node that earns its share (MIN_GAIN); a row costing a whole forward takes none."""
    assert sized(ForwardCosts([1], [1, 4], [[1.0, 1.0]]), [0.5, 0.2, 0.0]) == 2
    assert sized(ForwardCosts([1], [1, 3], [[1.0, 3.0]]), [0.5, 0.2]) == 0
    assert sized(ForwardCosts([1], [1, 4], [[1.0, 1.0]]), []) == 0


def test_a_flat_cost_curve_grows_a_tree_and_a_steep_one_a_chain_or_nothing():
    """The shipped heads' acceptance: 49% at position 1, 22% at position 2 (docs/results.md), and the second-best
    first token right 11% of the time. On AMX all three nodes pay (a tree: two at depth 1); without AMX only the
    chain of the two surest does; a draft right 10% of the time gets no node at all there."""
    heads = [0.49, 0.111, 0.22]  # depth 1's best, depth 1's second, depth 2 under the best
    assert sized(FLAT, heads) == 3
    assert sized(STEEP, heads) == 2  # 0.49 and 0.22: the chain
    assert sized(STEEP, [0.1, 0.05, 0.03]) == 0
    assert sized(FLAT, [0.1, 0.05, 0.03]) == 1  # the others bring under MIN_GAIN each


def test_a_tree_sized_from_the_costs_is_wide_where_rows_are_cheap_and_a_chain_where_they_are_not():
    """EAGLE-2's path probabilities as each node's chance to be accepted (a calibrated draft): 0.7 for its first
    choice, 0.15 for its second, at every depth."""
    grown = grow_tree(TableDraft({}, top_k=2), top_k=2, max_depth=5)
    assert grown.scores is not None
    values = grown.scores.exp().tolist()
    wide = keep_best(grown, sized(FLAT, values))
    chain = keep_best(grown, sized(STEEP, values))
    assert_is_a_tree(wide)
    assert_is_a_tree(chain)
    assert len(wide) > len(chain) > 0
    assert len(set(wide.depths.tolist())) < len(wide)  # siblings: a tree
    assert chain.depths.tolist() == list(range(1, len(chain) + 1))  # one node per depth: a chain
    assert paths_of(chain)[-1] == (0,) * len(chain)  # the draft's first choice all along
