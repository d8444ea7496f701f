"""Draft trees: several candidate continuations verified in one target forward (SpecInfer's token tree, EAGLE-2's
dynamic tree). A chain of K drafts verifies one guess per position; a tree verifies several, so a step still gains
when the draft's first choice is wrong and its second is right, at the price of more rows in the forward.

Layout, the same everywhere: N nodes in topological order, depth by depth, a node's children contiguous and in the
order they were proposed (for a sampled tree, the order they were drawn), so a parent's index is always below its
children's. The verifying forward feeds the root (the last verified token: fed, not yet cached) at row 0 and node i
at row 1 + i; node i attends to the cache, the root, its ancestors and itself (tree_feed_mask), at the position it
would have in a chain (tree_positions), so its logits are those of its path decoded alone. A verdict then keeps the
longest accepted root-to-node path (greedy_tree_verdict here; sampling.multi_candidate_verdict when sampling).

Everything here stays on the tensors' device: no host read, shapes known from the tree's size alone.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from .attention import causal_mask

ROOT = -1  # the parent index of the root's children: the root is the last verified token, not a node

# expand(node_ids (F,)) -> (tokens (F, k), log-probs (F, k)): a node's k candidate children under the draft, best
# first. Node ids are numbered as the tree grows: the children of row r of a call get ids n + r·k + j, n the nodes
# made before the call, so a drafter can map ids to its own per-node state (a head's hidden state, a path).
Expand = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]


@dataclass(frozen=True)
class DraftTree:
    """N drafted nodes in topological order (see the module's docstring).

    q[i] is the draft distribution at node i's parent, the one node i's token was drawn from (siblings share it):
    given for a tree whose children were sampled (draw_tree, sampling without replacement), None for a tree whose
    children are a function of the context (build_tree's top-k, an n-gram lookup): verification then treats each
    candidate as a one-hot draft. None is lossless for any candidates, sampled ones too (trying fixed candidates
    one-hot by one-hot samples p exactly, whatever chose them); the sampled q only raises the acceptance, from p(c)
    to min(1, p(c) / q(c)), and then the tree must be drawn as draw_tree does. scores[i]: the draft's log-probability
    of the path root → i, what build_tree ranks nodes by (None where nothing ranks them)."""

    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long: the parent's index, ROOT for the root's children
    depths: torch.Tensor  # (N,) long: 1 for the root's children
    q: torch.Tensor | None = None  # (N, V)
    scores: torch.Tensor | None = None  # (N,)

    def __len__(self) -> int:
        return len(self.tokens)


def chain_tree(tokens: torch.Tensor, q: torch.Tensor | None = None) -> DraftTree:
    """K chained drafts (tokens (K,), q (K, V) or None) as a tree: node i's parent is node i − 1."""
    k = torch.arange(len(tokens), device=tokens.device)
    return DraftTree(tokens.long(), k - 1, k + 1, q)


def tree_attention_mask(parents: torch.Tensor) -> torch.Tensor:
    """(N, N) bool: node i may attend to node j iff j is i or one of i's ancestors. Starts from "self or parent" and
    squares the reachability ⌈log₂ N⌉ times (each squaring doubles the path length covered), so the number of steps
    depends on N only: no walk up the tree, no host read."""
    n = len(parents)
    index = torch.arange(n, device=parents.device)
    reach = (index[:, None] == index[None, :]) | (parents[:, None] == index[None, :])
    for _ in range(max(0, n - 1).bit_length()):
        paths = reach.float()
        reach = reach | (paths @ paths > 0)
    return reach


def tree_positions(depths: torch.Tensor, start: int) -> torch.Tensor:
    """The position of each node: start + depth − 1, where start = len(context), the context ending with the root
    (the last verified token, at position start − 1). Node i sits where it would sit in a chain along its path, so
    its rotary angles, and with them its logits, are those of that path decoded alone; siblings share a position."""
    return depths + (start - 1)


def tree_feed_mask(parents: torch.Tensor, cached: int, before: int = 1, after: int = 0) -> torch.Tensor:
    """(R, cached + R) bool, R = before + N + after, the verifying forward's attention mask for one sequence: rows
    [`before` fed rows ending with the root, node 0 … N − 1, `after` padding rows] against keys [the `cached`
    positions before them, the same rows]. The rows before and after the nodes are causal (a chain's rows; the
    padding's outputs go unread); node i sees the cache, the rows before, its ancestors and itself
    (tree_attention_mask)."""
    n = len(parents)
    rows = before + n + after
    mask = causal_mask(rows, cached + rows, parents.device)
    mask[before : before + n, cached + before : cached + before + n] = tree_attention_mask(parents)
    return mask


def earlier_siblings(parents: torch.Tensor) -> torch.Tensor:
    """(N, N) bool: j is a sibling of i proposed before it (same parent, lower index)."""
    index = torch.arange(len(parents), device=parents.device)
    return (parents[:, None] == parents[None, :]) & (index[None, :] < index[:, None])


def accepted_path(chosen: torch.Tensor, parents: torch.Tensor) -> torch.Tensor:
    """(N,) bool, the accepted path: the nodes whose every ancestor, and themselves, were the child their parent
    chose. chosen[i]: node i is the one child its parent's row accepted (at most one per parent)."""
    return ~(tree_attention_mask(parents) & ~chosen[None, :]).any(-1)


def last_accepted_row(on_path: torch.Tensor) -> torch.Tensor:
    """(1,) the logit row of the deepest accepted node: 1 + its index, 0 (the root's row) when none was accepted.
    On the topological order the path's deepest node has its highest index."""
    rows = on_path.long() * torch.arange(1, len(on_path) + 1, device=on_path.device)
    return torch.cat([rows.new_zeros(1), rows]).max().view(1)


def tree_verdict(on_path: torch.Tensor, depths: torch.Tensor, next_token: torch.Tensor) -> torch.Tensor:
    """(2 + N,) long, the verdict as one tensor (what the engine reads back once per step): n accepted, the next
    token, then the accepted nodes' indices root-first, padded with −1. The path holds one node per depth 1 … n, so
    a node's depth is its place on the path."""
    n = len(on_path)
    slots = torch.where(on_path, depths - 1, torch.full_like(depths, n))  # off-path nodes land in a dropped slot
    path = torch.full((n + 1,), -1, dtype=torch.long, device=on_path.device)
    path.scatter_(0, slots, torch.arange(n, device=on_path.device))
    return torch.cat([on_path.long().sum().view(1), next_token.view(1).long(), path[:n]])


def greedy_tree_verdict(tree: DraftTree, logits: torch.Tensor) -> torch.Tensor:
    """Greedy verification of a tree. logits (N + 1, V): row 0 the target's after the root, row 1 + i after node i.
    A node is accepted when its token is the target's argmax at its parent's row (the first such sibling, should a
    drafter propose a token twice) and its parent is accepted; the longest such path wins, and the next token is
    the argmax at its last node's row (the correction, or the bonus after a leaf). On a chain this is
    sampling.greedy_verdict with every draft proposed. Returns tree_verdict's (2 + N,) tensor."""
    choice = logits.argmax(-1)
    match = tree.tokens == choice[tree.parents + 1]
    first = match & ~(earlier_siblings(tree.parents) & match[None, :]).any(-1)
    on_path = accepted_path(first, tree.parents)
    return tree_verdict(on_path, tree.depths, choice.index_select(0, last_accepted_row(on_path))[0])


def grow_tree(expand: Expand, top_k: int, max_depth: int, device: torch.device | None = None) -> DraftTree:
    """EAGLE-2's expansion (Li et al. 2024): the root gets expand's candidates; at each further depth the top_k nodes
    of the newest depth by path log-probability (the draft's confidence in the whole path, which tracks how often
    the target accepts it) are expanded, each by expand's candidates. Ties go to the node made first. Returns every
    node made, numbered as made (Expand's numbering: depth by depth, so topological), with its score."""
    frontier = torch.full((1,), ROOT, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, device=device)
    tokens, parents, depths, scores = [], [], [], []
    made = 0
    for depth in range(1, max_depth + 1):
        children, logp = expand(frontier)
        k = children.shape[1]
        level_scores = (frontier_scores[:, None] + logp.float().clamp_max(0.0)).flatten()  # ≤ the parent's: kept
        tokens.append(children.flatten().long())
        parents.append(frontier.repeat_interleave(k))
        depths.append(torch.full_like(level_scores, depth, dtype=torch.long))
        scores.append(level_scores)
        level = torch.arange(made, made + len(level_scores), device=level_scores.device)
        made += len(level_scores)
        best = torch.sort(-level_scores, stable=True).indices[:top_k]
        frontier, frontier_scores = level[best], level_scores[best]
    if not tokens:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(empty, empty, empty, None, torch.zeros(0, device=device))
    return DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), None, torch.cat(scores))


def keep_best(tree: DraftTree, max_nodes: int) -> DraftTree:
    """The max_nodes nodes of highest score (EAGLE-2's rerank), renumbered in their topological order. A node's
    score is its parent's plus a log-probability ≤ 0, and the parent comes first in the stable sort on a tie, so a
    kept node's ancestors are always kept: the result is a tree (tests check it, no host read here)."""
    assert tree.scores is not None, "keep_best ranks nodes by their scores"
    n = len(tree)
    if max_nodes >= n:
        return tree
    kept = torch.sort(-tree.scores, stable=True).indices[:max_nodes].sort().values
    renumber = torch.full((n,), ROOT, dtype=torch.long, device=tree.tokens.device)
    renumber[kept] = torch.arange(len(kept), device=kept.device)
    parents = tree.parents[kept]
    parents = torch.where(parents >= 0, renumber[parents.clamp_min(0)], parents)
    q = None if tree.q is None else tree.q[kept]
    return DraftTree(tree.tokens[kept], parents, tree.depths[kept], q, tree.scores[kept])


def build_tree(
    expand: Expand, top_k: int, max_depth: int, max_nodes: int, device: torch.device | None = None
) -> DraftTree:
    """EAGLE-2's dynamic draft tree: grow_tree, then keep_best. The shape follows the draft's confidence: a sure
    draft grows a deep narrow tree, an unsure one a wide shallow one, within max_nodes rows and max_depth.

    The children are the draft's top-k, not samples, and nodes are ranked by their own draft probabilities: both
    depend on the context alone, so the tree is verified as deterministic drafts (q = None), greedy or sampled —
    as EAGLE does. Sampled children ranked this way could not be verified with their q: keeping a sample for being
    probable changes the distribution it was drawn from, which min(1, p / q) needs (draw_tree's trees keep all)."""
    return keep_best(grow_tree(expand, top_k, max_depth, device), max_nodes)


def graft(tree: DraftTree, chain: torch.Tensor) -> DraftTree:
    """The tree with one more guess from the root, chain (m,) (another drafter's: the context's own n-gram
    continuation), as m more nodes after the tree's. Node N + j spells chain[: j + 1]; its parent is the tree's node
    that spells chain[: j] where the tree has one, else node N + j − 1, so the chain goes on under the tree's own
    nodes as far as they agree. A grafted node that repeats a tree node (same parent, same token) is a wasted row,
    never a wrong one: the greedy verdict takes the first sibling with a token, and a one-hot candidate is never
    accepted after its twin's rejection. Found on the device: shapes depend on N and m alone, no host read.
    Deterministic trees only (q None): a grafted candidate has no q to be verified against."""
    assert tree.q is None, "graft adds deterministic candidates: a sampled tree's q would not cover them"
    n, m = len(tree), len(chain)
    if m == 0:
        return tree
    left = -2  # `at` once the chain has left the tree: no node's parent
    at = torch.tensor(ROOT, device=tree.tokens.device)  # the tree's node spelling chain[: j], or `left`
    parents = []
    for j in range(m):
        parents.append(torch.where(at == left, n + j - 1, at))
        hit = (tree.tokens == chain[j]) & (tree.parents == at)
        at = torch.where(hit.any(), hit.long().argmax(), left)
    depths = torch.arange(1, m + 1, device=tree.tokens.device)
    scores = None  # grafted nodes rank after the tree's, in chain order (node_ranks)
    if tree.scores is not None:
        scores = torch.cat([tree.scores, torch.full((m,), -torch.inf, device=tree.scores.device)])
    return DraftTree(
        torch.cat([tree.tokens, chain.long()]),
        torch.cat([tree.parents, torch.stack(parents)]),
        torch.cat([tree.depths, depths]),
        None,
        scores,
    )


def node_ranks(tree: DraftTree) -> torch.Tensor:
    """(N,) long: each node's rank by score, 0 the best (keep_best's stable order), so the best n nodes, the tree
    keep_best would have kept of n, are those of rank < n, and a path's ranks rise from the root. Without scores,
    the node's index. What the load-aware K learns a tree's nodes by (scheduler.LoadEstimate)."""
    index = torch.arange(len(tree), device=tree.tokens.device)
    if tree.scores is None:
        return index
    return torch.empty_like(index).scatter_(0, torch.sort(-tree.scores, stable=True).indices, index)


# draft_probs(node_ids (F,), the tree drawn so far) -> q (F, V): the draft distribution after each node (ROOT: after
# the root). The tree so far gives the tokens on each node's path, which the drafter did not choose itself.
DraftProbs = Callable[[torch.Tensor, DraftTree], torch.Tensor]


def draw_tree(
    draft_probs: DraftProbs,
    widths: Sequence[int],
    generator: torch.Generator | None = None,
    device: torch.device | None = None,
) -> DraftTree:
    """A sampled tree of fixed shape (SpecInfer's expansion): every node at depth d − 1 (the root at 0) gets
    widths[d − 1] children drawn without replacement from its draft distribution, in the order drawn, which is the
    order multi_candidate_verdict tries them. Without replacement, siblings are distinct: a repeated sibling would
    cost a verified row and could never be accepted (after its twin's rejection the residual has no mass on it).

    Drawn by Gumbel-top-k (Kool et al. 2019): the w largest of log q + Gumbel noise are w sequential draws without
    replacement, in draw order, in one call. Where q has fewer than w tokens, the last children are tokens of
    probability 0 (log q = −inf sorts them last): multi_candidate_verdict never accepts them and they change
    nothing. The shape is fixed before any draw: a shape chosen from the draws would change the distribution
    each child was drawn from (see build_tree). Node ids as in Expand (children of row r: n + r·w + j)."""
    frontier = torch.full((1,), ROOT, dtype=torch.long, device=device)
    frontier_scores = torch.zeros(1, device=device)
    tokens: list[torch.Tensor] = []
    parents: list[torch.Tensor] = []
    depths: list[torch.Tensor] = []
    qs: list[torch.Tensor] = []
    scores: list[torch.Tensor] = []
    made = 0
    for depth, width in enumerate(widths, start=1):
        so_far = DraftTree(joined(tokens, frontier), joined(parents, frontier), joined(depths, frontier))
        q = draft_probs(frontier, so_far)
        uniform = torch.rand(q.shape, generator=generator, device=q.device).clamp_min(1e-20)
        children = (q.log() - (-uniform.log()).log()).topk(width, -1).indices
        logq = q.gather(-1, children).log()
        tokens.append(children.flatten())
        parents.append(frontier.repeat_interleave(width))
        depths.append(torch.full_like(parents[-1], depth))
        qs.append(q.repeat_interleave(width, 0))
        scores.append((frontier_scores[:, None] + logq).flatten())
        frontier = torch.arange(made, made + len(tokens[-1]), device=q.device)
        frontier_scores = scores[-1]
        made += len(tokens[-1])
    if not tokens:
        empty = torch.zeros(0, dtype=torch.long, device=device)
        return DraftTree(empty, empty, empty, None, torch.zeros(0, device=device))
    return DraftTree(torch.cat(tokens), torch.cat(parents), torch.cat(depths), torch.cat(qs), torch.cat(scores))


def joined(parts: list[torch.Tensor], like: torch.Tensor) -> torch.Tensor:
    """The parts concatenated; an empty tensor like `like` when there are none."""
    return torch.cat(parts) if parts else like[:0]
