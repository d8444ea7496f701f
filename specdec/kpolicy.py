"""How many tokens to draft per step, and when speculation should stop altogether."""

from __future__ import annotations

import statistics
from collections import deque
from typing import TYPE_CHECKING, Protocol

from .metrics import expected_speedup

if TYPE_CHECKING:
    from .events import StepEvent


class KPolicy(Protocol):
    def next_k(self) -> int: ...

    def observe(self, event: StepEvent) -> None:
        """Told after every target forward (event.speculative: the drafter ran; it may have proposed nothing)."""


class FixedK:
    def __init__(self, k: int) -> None:
        if k < 1:
            raise ValueError(f"K must be ≥ 1, got {k}")
        self.k = k

    def next_k(self) -> int:
        return self.k

    def observe(self, event: StepEvent) -> None:
        pass


class AdaptiveK:
    """Pick the K in [k_min, k_max] with the best expected speedup E(α, K) / (cK + 1), where α and the
    draft cost ratio c are exponential moving averages of what the last steps measured."""

    def __init__(self, k_min: int = 3, k_max: int = 6, k_start: int = 4, decay: float = 0.8) -> None:
        if not 1 <= k_min <= k_max:
            raise ValueError(f"need 1 ≤ k_min ≤ k_max, got {k_min}, {k_max}")
        self.k_min, self.k_max = k_min, k_max
        self.k = min(max(k_start, k_min), k_max)
        self.decay = decay
        self.alpha: float | None = None
        self.c: float | None = None

    def _ema(self, old: float | None, new: float) -> float:
        return new if old is None else self.decay * old + (1 - self.decay) * new

    def observe(self, event: StepEvent) -> None:
        if not event.speculative:
            return
        n, k = event.accepted, event.drafted
        if k:  # one step is a truncated geometric sample: n accepted, then one rejection unless n == k
            self.alpha = self._ema(self.alpha, n / (n + (n < k)))
        if event.verify_seconds > 0:  # per draft forward (a gated step may run more forwards than it proposed)
            self.c = self._ema(self.c, (event.draft_seconds / max(event.draft_forwards, 1)) / event.verify_seconds)
        if self.alpha is None:
            return
        alpha = min(self.alpha, 0.999)
        c = self.c or 0.0
        self.k = max(range(self.k_min, self.k_max + 1), key=lambda kk: expected_speedup(alpha, kk, c))

    def next_k(self) -> int:
        return self.k


class SpeculationGovernor:
    """Switches speculation off, with the reason, when it is measured to be slower than target-only.

    Speculative rate: tokens emitted ÷ (draft + verify seconds) over recent steps. Target-only rate: 1 ÷ the
    median plain one-token step; when none was seen, the governor asks for one (`wants_probe`), so the
    comparison is against a measured target-only step, which costs no tokens: a plain step still emits one.
    """

    def __init__(self, window: int = 8, min_steps: int = 6) -> None:
        self.spec: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens emitted, draft + verify seconds)
        self.plain: deque[float] = deque(maxlen=window)  # seconds of a plain one-token step
        self.min_steps = min_steps
        self.seen = 0
        self.off_reason = ""

    def observe(self, event: StepEvent) -> None:
        """One target forward; event.speculative: a drafter ran before it (whatever it proposed)."""
        self.seen += 1
        if self.seen == 1:
            return  # the first step carries the prompt's prefill
        if event.speculative:
            self.spec.append((len(event.tokens), event.draft_seconds + event.verify_seconds))
        else:
            self.plain.append(event.verify_seconds)
        self._decide()

    @property
    def wants_probe(self) -> bool:
        """Enough speculative steps to judge, but no plain step measured yet."""
        return not self.plain and len(self.spec) >= self.min_steps and not self.off_reason

    def _decide(self) -> None:
        if len(self.spec) < self.min_steps or not self.plain or self.off_reason:
            return
        spec_rate = sum(e for e, _ in self.spec) / sum(s for _, s in self.spec)
        plain_rate = 1.0 / statistics.median(self.plain)
        if spec_rate < plain_rate:
            self.off_reason = (
                f"speculation switched off: measured {spec_rate:.1f} tok/s with drafts vs "
                f"{plain_rate:.1f} tok/s target-only"
            )
