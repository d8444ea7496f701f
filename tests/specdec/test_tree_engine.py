"""Draft trees through the runner and the engine: a node's logits are those of its path decoded alone, the cache
keeps the accepted path as if it alone was fed, an eagle node drafts as its path alone would, and greedy answers with
a heads tree (medusa's or eagle's) equal target-only ones, alone and batched. (The sampled verdict's distribution:
test_distribution.py and test_tree_distribution.py.)"""

from __future__ import annotations

import copy
import itertools
from dataclasses import replace

import pytest
import torch

from specdec import heads_drafter as heads_drafter_module
from specdec.cost_grid import ForwardCosts
from specdec.engine import GenerationConfig, collect
from specdec.heads_drafter import HeadsDrafter
from specdec.heads_file import load_heads
from specdec.kv import Feed
from specdec.quant import quantize_linears
from specdec.runner import BatchRunner
from specdec.sampling import SamplingParams
from specdec.scheduler import BatchScheduler
from specdec.tree import DraftTree, grow_tree, node_ranks
from tests.specdec.test_scheduler import run_together
from tests.support.engine import cpu_only, eagle_path_alone, heads_engine, target_only, tiny_prompts

# root → a, b; a → c, d; b → e; c → f
PARENTS = [-1, -1, 0, 0, 1, 2]
DEPTHS = [1, 1, 2, 2, 2, 3]


def hand_tree(target, seed: int = 0) -> DraftTree:
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(10, target.model.config.vocab_size, (len(PARENTS),), generator=g)
    as_long = {"dtype": torch.long, "device": target.device}
    return DraftTree(tokens.to(target.device), torch.tensor(PARENTS, **as_long), torch.tensor(DEPTHS, **as_long))


def path_to(node: int) -> list[int]:
    path = [node]
    while PARENTS[path[-1]] >= 0:
        path.append(PARENTS[path[-1]])
    return path[::-1]


@pytest.fixture(scope="module")
def w8a8_model(tiny_engine):
    """The tiny target in w8a8: row-wise int8 layers, so with exact_rows a row's values never depend on the others."""
    model = copy.deepcopy(tiny_engine.target.model)
    quantize_linears(model, "w8a8")
    return model


def exact_runner(model) -> BatchRunner:
    return BatchRunner(model, torch.device("cpu"), exact_rows=True)


@cpu_only
def test_a_node_s_logits_are_its_path_decoded_alone_bit_for_bit(tiny_engine, w8a8_model):
    """The quantized target's contract, kept for trees: every row as its path decoded alone."""
    runner = exact_runner(w8a8_model)
    ctx = tiny_prompts(tiny_engine.target, 1, seed=3)[0]
    tree = hand_tree(tiny_engine.target)
    cache = runner.new_cache()
    cache.extend(ctx[:-1])  # as in a step: the root (the last verified token) is fed with the drafts
    logits = runner.extend([Feed(cache, ctx, 1 + len(tree), tree.tokens, tree)])[0]
    tokens = tree.tokens.tolist()
    assert torch.equal(logits[0], runner.new_cache().extend(ctx)[0])
    for node in range(len(tree)):
        assert torch.equal(logits[1 + node], runner.new_cache().extend(ctx + [tokens[j] for j in path_to(node)])[0])


def test_a_node_s_logits_are_its_path_s_with_fused_attention(tiny_engine):
    target = tiny_engine.target
    runner = BatchRunner(target.model, target.device)
    ctx = tiny_prompts(target, 1, seed=3)[0]
    tree = hand_tree(target)
    logits = runner.extend([Feed(runner.new_cache(), ctx, 1 + len(tree), tree.tokens, tree)])[0]
    tokens = tree.tokens.tolist()
    for node in range(len(tree)):
        expected = runner.new_cache().extend(ctx + [tokens[j] for j in path_to(node)])[0]
        torch.testing.assert_close(logits[1 + node], expected, rtol=1e-4, atol=1e-4)


@cpu_only
@pytest.mark.parametrize("node", [5, 4, 1])
def test_the_cache_keeps_the_accepted_path_as_if_fed_alone(tiny_engine, w8a8_model, node):
    runner = exact_runner(w8a8_model)
    ctx = tiny_prompts(tiny_engine.target, 1, seed=5)[0]
    tree = hand_tree(tiny_engine.target, seed=1)
    cache = runner.new_cache()
    cache.keep_hidden = True
    runner.extend([Feed(cache, ctx, 1 + len(tree), tree.tokens, tree)])
    path = path_to(node)
    accepted = ctx + [tree.tokens.tolist()[j] for j in path]
    cache.keep_path(len(ctx), path)
    cache.settle(accepted)
    alone = runner.new_cache()
    alone.keep_hidden = True
    alone.extend(accepted)
    assert cache.hidden is not None and alone.hidden is not None
    kept = len(accepted) - cache.hidden_start  # the rows past the path: settle dropped their tokens
    assert torch.equal(cache.hidden[:kept], alone.hidden[cache.hidden_start : len(accepted)])
    for layer in range(runner.n_layers):
        assert torch.equal(cache.keys[layer][:, : len(accepted)], alone.keys[layer][:, : len(accepted)])
        assert torch.equal(cache.values[layer][:, : len(accepted)], alone.values[layer][:, : len(accepted)])
    more = accepted + [7]
    assert torch.equal(cache.extend(more), runner.new_cache().extend(more))


def accepted_nodes(tree: DraftTree, tokens: list[int]) -> list[int]:
    """The nodes on the path that spells `tokens` from the root (the first sibling with each token)."""
    parents, values, nodes, parent = tree.parents.tolist(), tree.tokens.tolist(), [], -1
    for token in tokens:
        parent = next(i for i, (p, t) in enumerate(zip(parents, values)) if p == parent and t == token)
        nodes.append(parent)
    return nodes


def sibling_groups_differ(tree: DraftTree) -> bool:
    """Whether two nodes at one depth got different candidates: beyond the first depth, plain medusa gives every
    node block d's same top tokens (the best-ranked kept, so each group is a prefix of its depth's longest)."""
    groups: dict[int, list[int]] = {}
    for parent, token in zip(tree.parents.tolist(), tree.tokens.tolist()):
        groups.setdefault(parent, []).append(token)
    depth = {i: d for i, d in enumerate(tree.depths.tolist())}
    by_depth: dict[int, list[list[int]]] = {}
    for parent, tokens in groups.items():
        if parent >= 0:
            by_depth.setdefault(depth[parent], []).append(tokens)
    return any(g[: len(h)] != h for gs in by_depth.values() for g in gs for h in gs if len(h) <= len(g))


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-draft"], indirect=True)
def test_a_reads_draft_tree_gives_each_node_children_of_its_own(tiny_engine, tiny_heads):
    """With reads_draft a node's children are block d's top tokens after that node's own token: two nodes at one
    depth get different candidates. Plain medusa gives every node the same."""
    path, val = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    drafter = HeadsDrafter(heads, tree_width=3)
    s = val[0]
    drafter.add_features(s.tokens[:-1], 0, s.features)
    trees = [
        drafter.propose(s.tokens[: last + 1], 12, SamplingParams(), None).tree
        for last in range(s.answer_start, len(s.tokens))
    ]
    assert all(t is not None and len(t) == 12 for t in trees)
    assert any(sibling_groups_differ(t) for t in trees if t is not None) == heads.cfg.reads_draft


@pytest.mark.parametrize("tiny_heads", ["eagle", "eagle3"], indirect=True)
def test_an_eagle_node_s_children_are_its_path_drafted_alone(tiny_engine, tiny_heads, monkeypatch):
    """Each node of an eagle tree scores as the chain drafting of its path would (the layer on its cache over the
    true slots, then one slot per token of the path): its log-probability is the path's, token by token, under the
    layer's predictions there, and it is among the top tree_width there. Every node grown to depth 4 is checked
    (the tiny heads' best nodes stay shallow), and the layer's attention and MLP are given weights, so a node that
    attended to the wrong slots would score otherwise."""
    monkeypatch.setattr(
        heads_drafter_module, "build_tree", lambda expand, top_k, _, __, dev: grow_tree(expand, top_k, 4, dev)
    )
    path, val = tiny_heads
    target = tiny_engine.cpu_target
    heads = load_heads(path, target.model, target.name)
    layer = heads.eagle
    assert layer is not None
    torch.manual_seed(0)
    with torch.no_grad():
        for linear in (layer.o, layer.down):
            linear.weight.add_(torch.randn_like(linear.weight) * 0.5)
    drafter = HeadsDrafter(heads, tree_width=3)
    s = val[0]
    drafter.add_features(s.tokens[:-1], 0, s.features)
    checked = 0
    for last in (s.answer_start, len(s.tokens) - 2):
        tree = drafter.propose(s.tokens[: last + 1], 4, SamplingParams(), None).tree
        assert (
            tree is not None
            and tree.scores is not None
            and tree.depths.tolist() == [1] * 3 + [2] * 9 + [3] * 9 + [4] * 9
        )
        for node in range(len(tree)):
            chain = [node]
            while int(tree.parents[chain[-1]]) >= 0:
                chain.append(int(tree.parents[chain[-1]]))
            tokens = [int(tree.tokens[i]) for i in reversed(chain)]
            score = 0.0
            with torch.inference_mode():
                for pred, token in zip(eagle_path_alone(heads, s, last, tokens[:-1]), tokens, strict=True):
                    logp = heads.lm(pred).float().log_softmax(-1)
                    local = int((heads.vocab_ids == token).nonzero())
                    assert local in logp.topk(3).indices.tolist()
                    score += float(logp[local])
            assert float(tree.scores[node]) == pytest.approx(score, abs=1e-4)
            checked += 1
    assert checked == 60


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-draft", "medusa-deep", "eagle", "eagle3"], indirect=True)
def test_greedy_output_with_a_heads_tree_is_target_only(tiny_engine, tiny_heads, monkeypatch):
    trees: list[DraftTree] = []
    name = "_eagle_tree" if "eagle" in tiny_heads[0].name else "_medusa_tree"
    made = getattr(HeadsDrafter, name)
    monkeypatch.setattr(HeadsDrafter, name, lambda self, *a: trees.append(made(self, *a)) or trees[-1])
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3)
    target = engine.target
    steps = []
    for ids in tiny_prompts(target, 6, seed=1):
        spec, events = collect(engine.stream(ids, GenerationConfig(32)))
        assert spec == target_only(target, ids, 32)
        steps += [ev for ev in events if ev.drafted]
    assert len(steps) == len(trees)  # every drafting step verified a tree
    assert any(len(set(t.parents.tolist())) < len(t) for t in trees)  # with siblings: a tree, not a chain
    paths = [accepted_nodes(t, ev.tokens[: ev.accepted]) for t, ev in zip(trees, steps)]
    assert any(paths)  # drafts were accepted
    # and some path went through a candidate that is not its parent's first: what a chain could not have accepted
    assert any(any(t.parents[i] == t.parents[i - 1] for i in path if i) for t, path in zip(trees, paths))


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)
def test_a_step_tells_the_ranks_of_the_accepted_nodes(tiny_engine, tiny_heads, monkeypatch):
    """What the load-aware K learns a tree by. The tiny heads' scores are re-ranked (later siblings first; a depth
    before the next) so that ranks differ from the nodes' order: the verdict does not read scores."""
    trees: list[DraftTree] = []
    made = HeadsDrafter._medusa_tree

    def reranked(self, *a):
        tree = made(self, *a)
        trees.append(replace(tree, scores=torch.arange(len(tree)) - 100.0 * tree.depths))
        return trees[-1]

    monkeypatch.setattr(HeadsDrafter, "_medusa_tree", reranked)
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3)
    steps = []
    for ids in tiny_prompts(engine.target, 4, seed=2):
        steps += [ev for ev in collect(engine.stream(ids, GenerationConfig(24)))[1] if ev.drafted]
    ranks = [
        [node_ranks(t).tolist()[i] for i in accepted_nodes(t, ev.tokens[: ev.accepted])] for t, ev in zip(trees, steps)
    ]
    assert [ev.accepted_ranks for ev in steps] == ranks
    assert any(r and r != list(range(len(r))) for r in ranks)  # some told a rank that is not the node's index


# Forwards of 1 s whatever they feed (only read, never slept): drafting time cannot decide the load-aware choice
FLAT_COSTS = ForwardCosts([1, 4], [1, 5], [[1.0, 1.0], [1.0, 1.0]])


@pytest.mark.parametrize("tiny_heads", ["medusa", "medusa-draft", "eagle"], indirect=True)
@pytest.mark.parametrize("costs", [None, FLAT_COSTS], ids=["own-k", "load-aware"])
def test_heads_trees_in_a_batch_equal_each_answer_alone(tiny_engine, tiny_heads, costs):
    """load-aware: the grid sizes each answer's tree from what its nodes brought by rank (scheduler.choose_ks)."""
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3)
    target = engine.target
    prompts = tiny_prompts(target, 3, seed=9)
    results = run_together(BatchScheduler(engine, costs), prompts, [GenerationConfig(24)] * 3)
    assert [tokens for tokens, _ in results] == [target_only(target, p, 24) for p in prompts]
    events = [ev for _, evs in results for ev in evs]
    assert max(ev.batch_size for ev in events) > 1
    assert any(ev.accepted for ev in events)
    if costs is not None:  # trees the grid cut short of the K asked for, and some plain steps
        assert any(0 < ev.k_chosen < 4 for ev in events) and any(ev.k_chosen == 0 for ev in events)


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)
def test_a_grafted_lookup_is_verified_with_the_tree_alone_and_batched(tiny_engine, tiny_heads, monkeypatch):
    """The lookup made an oracle that knows the target-only answers, with a wrong first token every other call: its
    chains are accepted through the graft, under the heads' own nodes where they agree (a path from a heads node
    into grafted ones) and as a new branch where they do not; a wrong chain is rejected; answers stay target-only's,
    one at a time and batched."""
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3, lookup=4)
    target = engine.target
    prompts = tiny_prompts(target, 6, seed=3)
    expected = [target_only(target, p, 24) for p in prompts]
    calls = itertools.count()

    def oracle(context: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
        i = next(i for i, p in enumerate(prompts) if context[: len(p)] == p)
        chain = expected[i][len(context) - len(prompts[i]) :][:k]
        return chain if not chain or next(calls) % 2 else [(chain[0] + 1) % target.model.config.vocab_size] + chain[1:]

    trees: list[tuple[int, DraftTree]] = []
    with_lookup = HeadsDrafter._with_lookup

    def recorded(self, tree, context, k):
        trees.append((len(tree), with_lookup(self, tree, context, k)))
        return trees[-1][1]

    monkeypatch.setattr(heads_drafter_module, "ngram_lookup", oracle)
    monkeypatch.setattr(HeadsDrafter, "_with_lookup", recorded)
    steps = []
    for ids, answer in zip(prompts, expected):
        spec, events = collect(engine.stream(ids, GenerationConfig(24)))
        assert spec == answer
        steps += [ev for ev in events if ev.drafted]
    assert len(steps) == len(trees)
    paths = [(heads, accepted_nodes(t, ev.tokens[: ev.accepted])) for (heads, t), ev in zip(trees, steps)]
    assert any(path and path[-1] >= heads for heads, path in paths)  # grafted nodes accepted
    assert any(path and path[0] < heads <= path[-1] for heads, path in paths)  # from a heads node into the graft
    assert any(path and path[0] >= heads for heads, path in paths)  # a grafted branch of its own
    assert any(not ev.accepted for ev in steps)  # and wrong chains were rejected
    results = run_together(BatchScheduler(engine), prompts[:3], [GenerationConfig(24)] * 3)
    assert [tokens for tokens, _ in results] == expected[:3]
    assert max(ev.accepted for _, events in results for ev in events) == 4
