"""Pure sampling and acceptance math. Each function matches one formula and is tested against it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from .tree import DraftTree, accepted_path, earlier_siblings, last_accepted_row, tree_verdict


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.temperature) and self.temperature >= 0):  # NaN would poison every sample
            raise ValueError(f"temperature must be a finite number ≥ 0, got {self.temperature}")
        if not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p}")

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def logits_to_probs(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """softmax(logits / T), then top-p (nucleus) filtering and renormalisation, on the last dim.

    Applied identically to target (p) and draft (q), as rejection sampling requires.
    """
    probs = torch.softmax(logits.float() / params.temperature, dim=-1)
    if params.top_p < 1.0:
        sorted_p, idx = probs.sort(dim=-1, descending=True)
        # Keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in).
        drop = (sorted_p.cumsum(-1) - sorted_p) >= params.top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, idx, sorted_p)
        probs = probs / probs.sum(-1, keepdim=True)
    return probs


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """norm(max(0, p − q)): where to sample after a rejection. Falls back to p if p ≤ q everywhere."""
    r = (p - q).clamp_min(0.0)
    total = r.sum(-1, keepdim=True)
    return torch.where(total > 0, r / total.clamp_min(1e-30), p)


def greedy_verdict(drafts: torch.Tensor, proposed: torch.Tensor, logits: torch.Tensor) -> torch.Tensor:
    """Accept drafts while they equal the target's argmax. drafts (K,), of which the first `proposed` (a 0-d tensor)
    count; logits (K + 1, V): the target's after each drafted prefix. Returns (n_accepted, next_token) as a tensor:
    next is the target's correction at the first mismatch, or its bonus token when every proposed draft matched.
    Stays on the device (no host read)."""
    choice = logits.argmax(-1)
    k = len(drafts)
    match = (drafts == choice[:k]) & (torch.arange(k, device=drafts.device) < proposed)
    n = match.long().cumprod(0).sum()
    return torch.stack([n, choice.index_select(0, n.view(1))[0]])


def sampled_verdict(
    drafts: torch.Tensor,
    proposed: torch.Tensor,
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023), on the device.

    p: target probabilities (K + 1, V); q: draft probabilities (K, V), or None for a deterministic drafter (q one-hot
    on each draft). Draft i (of the first `proposed`) is accepted with probability min(1, p_i(x_i) / q_i(x_i)); at
    the first rejection the next token is drawn from norm(max(0, p_i − q_i)); when every proposed draft is accepted,
    from p at the next position (the bonus). The emitted tokens are distributed exactly as p. All K uniforms and
    the one draw are taken whatever the outcome, so nothing waits for the host. Returns (n_accepted, next_token).
    """
    k = len(drafts)
    positions = torch.arange(k, device=p.device)
    q_of_draft = torch.ones(k, device=p.device) if q is None else q[positions, drafts]
    ratio = (p[positions, drafts] / q_of_draft.clamp_min(1e-30)).clamp(max=1.0)
    u = torch.rand(k, generator=generator, device=p.device)
    accepted = (u < ratio) & (positions < proposed)
    n = accepted.long().cumprod(0).sum()
    at = n.view(1)
    p_n = p.index_select(0, at)[0]
    if k:
        q_rows = torch.zeros_like(p[:k]).scatter_(-1, drafts[:, None], 1.0) if q is None else q
        residual = residual_distribution(p_n, q_rows.index_select(0, at.clamp(max=k - 1))[0])
        p_n = torch.where(n < proposed, residual, p_n)  # rejected at n: the residual; else the bonus from p_n
    return torch.stack([n, torch.multinomial(p_n, 1, generator=generator)[0]])


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> torch.Tensor:
    """One token drawn from probs (V,), as a 0-d tensor on probs' device."""
    return torch.multinomial(probs, 1, generator=generator)[0]


def candidate_distributions(tree: DraftTree, vocab: int) -> torch.Tensor:
    """(N, V): the distribution each node's token was drawn from, given its earlier siblings. Children drawn without
    replacement from q (draw_tree): child k came from q with siblings 1 … k − 1 removed and the rest renormalised.
    A tree without q (deterministic candidates): the one-hot on each node's token. A first child's row is q itself,
    bit for bit (nothing removed, nothing renormalised), so a chain's acceptance ratios are sampled_verdict's."""
    one_hot = torch.zeros(len(tree), vocab, device=tree.tokens.device).scatter_(-1, tree.tokens[:, None], 1.0)
    if tree.q is None:
        return one_hot
    removed = (earlier_siblings(tree.parents).float() @ one_hot) > 0
    kept = tree.q.masked_fill(removed, 0.0)
    renormalised = kept / kept.sum(-1, keepdim=True).clamp_min(1e-30)
    return torch.where(removed.any(-1, keepdim=True), renormalised, tree.q)


def multi_candidate_verdict(p: torch.Tensor, tree: DraftTree, generator: torch.Generator | None = None) -> torch.Tensor:
    """Rejection sampling over a draft tree (SpecInfer's multi-step speculative sampling, Miao et al. 2024; EAGLE's
    recursive residual; for children drawn without replacement, Jeon et al. 2024's recursive rejection sampling).

    p (N + 1, V): the target's probabilities, row 0 after the root, row 1 + i after node i. At a node with target
    distribution r, its children c_1 … c_m are tried in order: c_k is accepted with probability
    min(1, r(c_k) / q_k(c_k)), q_k the distribution c_k was drawn from given c_1 … c_{k−1} (candidate_distributions);
    on a rejection r ← norm(max(0, r − q_k)) and the next child is tried. An accepted child becomes the node, with its
    own row of p; when every child is rejected, or the node is a leaf, the next token is drawn from r. Each try is
    one single-draft rejection step (sampled_verdict's), which emits exactly r; the next try's candidate is a fresh
    draw from q_{k+1} whatever happened before, so by induction the node emits exactly its p row, and the path, token
    by token, the target's distribution.

    Every node's try is computed, reached or not (each row's outcome depends on that row alone), and the path is
    then read off the tree: N uniforms and one draw whatever happens, no host read. A candidate q_k gives no mass
    (draw_tree's padding where q had fewer tokens than the width) is never accepted and changes nothing. On a chain
    this is sampled_verdict with every draft proposed, draw for draw. Returns tree_verdict's (2 + N,) tensor."""
    n, device = len(tree), p.device
    drawn_from = candidate_distributions(tree, p.shape[-1])
    nodes = torch.arange(n, device=device)
    q_of_token = drawn_from[nodes, tree.tokens] if tree.q is not None else torch.ones(n, device=device)
    u = torch.rand(n, generator=generator, device=device)
    residual = p.clone()  # each row's current target: its p, then its residual after each rejected child
    done = torch.zeros(n + 1, dtype=torch.bool, device=device)  # a row whose child was accepted tries no more
    chosen = torch.zeros(n, dtype=torch.bool, device=device)
    for i in range(n):
        row = tree.parents[i : i + 1] + 1
        r = residual.index_select(0, row)[0]
        ratio = (r[tree.tokens[i]] / q_of_token[i].clamp_min(1e-30)).clamp(max=1.0)
        tried = ~done[row][0] & (q_of_token[i] > 0)
        accept = tried & (u[i] < ratio)
        chosen[i] = accept
        done[row] = done[row] | accept
        rejected = (tried & ~accept).view(1, 1)
        residual.index_copy_(0, row, torch.where(rejected, residual_distribution(r, drawn_from[i]), r).view(1, -1))
    on_path = accepted_path(chosen, tree.parents)
    last = residual.index_select(0, last_accepted_row(on_path))[0]
    return tree_verdict(on_path, tree.depths, torch.multinomial(last, 1, generator=generator)[0])
