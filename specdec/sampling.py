"""Pure sampling and acceptance math. Each function matches one formula and is tested against it."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SamplingParams:
    temperature: float = 0.0  # 0 means greedy
    top_p: float = 1.0

    def __post_init__(self) -> None:
        if self.temperature < 0:
            raise ValueError(f"temperature must be ≥ 0, got {self.temperature}")
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


def one_hot_probs(token: int, like: torch.Tensor) -> torch.Tensor:
    """q for a deterministic drafter (n-gram): all mass on the proposed token."""
    return torch.zeros_like(like).index_fill_(-1, torch.tensor([token], device=like.device), 1.0)


def accept_greedy(draft_tokens: list[int], target_argmax: list[int]) -> tuple[int, int]:
    """Accept drafts while they equal the target's argmax; return (n_accepted, next_token).

    target_argmax has K + 1 entries: the target's choice after each drafted prefix.
    next_token is the target's correction at the first mismatch, or the bonus token if all match.
    """
    n = 0
    while n < len(draft_tokens) and draft_tokens[n] == target_argmax[n]:
        n += 1
    return n, target_argmax[n]


def accept_sampled(
    draft_tokens: list[int],
    p: torch.Tensor,
    q: torch.Tensor | None,
    generator: torch.Generator | None = None,
) -> tuple[int, int]:
    """Speculative rejection sampling (Leviathan et al. 2023, Chen et al. 2023).

    p: target probabilities, shape (K + 1, V); q: draft probabilities, shape (K, V), or None for a
    deterministic drafter (q one-hot on each proposal). Accept draft i with probability
    min(1, p_i(x) / q_i(x)); on the first rejection sample from norm(max(0, p_i − q_i)); if all K are
    accepted, sample a bonus token from p_K. The emitted tokens are distributed exactly as p.
    Returns (n_accepted, next_token).
    """
    for i, tok in enumerate(draft_tokens):
        qi = one_hot_probs(tok, p[i]) if q is None else q[i]
        ratio = p[i, tok] / qi[tok].clamp_min(1e-30)
        u = torch.rand((), generator=generator, device=p.device)
        if u < torch.clamp(ratio, max=1.0):
            continue
        nxt = torch.multinomial(residual_distribution(p[i], qi), 1, generator=generator)
        return i, int(nxt)
    bonus = torch.multinomial(p[len(draft_tokens)], 1, generator=generator)
    return len(draft_tokens), int(bonus)


def sample(probs: torch.Tensor, generator: torch.Generator | None = None) -> int:
    return int(torch.multinomial(probs, 1, generator=generator))
