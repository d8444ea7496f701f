"""Pure sampling and acceptance math. Each function matches one formula and is tested against it."""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


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
