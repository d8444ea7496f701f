"""How many tokens to draft per step, and when speculation should stop altogether."""

from __future__ import annotations

import math
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
    """Switches speculation off, with the reason, once it is measured to be slower than target-only, beyond doubt.

    A speculative step gains g = tokens emitted − (draft + verify seconds) × r over target-only, r its rate (1 ÷ the
    median plain one-token step): the tokens it emitted beyond those plain steps would have emitted in its time.
    Speculation is slower when the mean gain is below zero. One step's gain varies widely (1 to K + 1 tokens; a step
    whose drafts the confidence gate dropped spends its K draft forwards on one token), and so does the machine's
    speed between moments (another process, OpenMP workers sleeping or spinning), so a few steps prove little. Judged
    by six speculative steps against one plain step, for good, the bf16 target with the 0.5B draft lost its speedup
    (issue 38: 1.14× where 1.6× was measured; drafts off after 8 of 24 forwards, acceptance 0.83). So the governor
    switches off only when the mean gain over the last `window` speculative steps is below zero by `z` standard
    errors, r the median of at least `min_plain` plain steps.

    Plain steps are asked for (`wants_probe`): the first once `min_steps` speculative steps were seen, the next ones,
    `probe_gap` steps apart, only while speculation is not yet shown faster (the gain above zero by a standard
    error). A probe costs no tokens (a plain step still emits one), only the gain of the step it replaces. The price
    of the doubt: a drafter that only costs time runs a few more steps (off after about 15 forwards instead of 9).
    """

    def __init__(
        self, window: int = 16, min_steps: int = 6, min_plain: int = 3, probe_gap: int = 2, z: float = 2.0
    ) -> None:
        self.spec: deque[tuple[int, float]] = deque(maxlen=window)  # (tokens emitted, draft + verify seconds)
        self.plain: deque[float] = deque(maxlen=8)  # seconds of a plain one-token step
        self.min_steps, self.min_plain, self.probe_gap, self.z = min_steps, min_plain, probe_gap, z
        self.seen = 0
        self.last_plain = 0  # the step (counted in `seen`) of the last plain step
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
            self.last_plain = self.seen
        self._decide()

    def gain(self) -> tuple[float, float] | None:
        """The mean gain per speculative step over target-only, in tokens, and its standard error; None before
        min_steps speculative steps and a plain step were seen."""
        if len(self.spec) < max(self.min_steps, 2) or not self.plain:
            return None
        rate = self._plain_rate()
        gains = [tokens - seconds * rate for tokens, seconds in self.spec]
        return statistics.fmean(gains), statistics.stdev(gains) / math.sqrt(len(gains))

    def _plain_rate(self) -> float:
        return 1.0 / max(statistics.median(self.plain), 1e-9)  # a clock too coarse to see a step: no division by 0

    def _slower(self, gain: tuple[float, float] | None) -> bool:
        return gain is not None and gain[0] + self.z * gain[1] < 0

    @property
    def wants_probe(self) -> bool:
        """A plain step now would help decide: none measured yet once min_steps speculative steps were; or fewer than
        min_plain, probe_gap steps after the last, while speculation is not yet shown faster (a slow first plain
        step must not hide a slower drafter)."""
        if self.off_reason or len(self.spec) < self.min_steps:
            return False
        if not self.plain:
            return True
        if len(self.plain) >= self.min_plain or self.seen - self.last_plain < self.probe_gap:
            return False
        gain = self.gain()
        return gain is not None and gain[0] - gain[1] <= 0  # not above zero by a standard error

    def _decide(self) -> None:
        if self.off_reason or len(self.plain) < self.min_plain:
            return
        gain = self.gain()
        if not self._slower(gain):
            return
        spec_rate = sum(t for t, _ in self.spec) / max(sum(s for _, s in self.spec), 1e-9)
        self.off_reason = (
            f"speculation switched off: measured {spec_rate:.1f} tok/s with drafts vs {self._plain_rate():.1f} tok/s "
            f"target-only over the last {len(self.spec)} speculative and {len(self.plain)} plain steps"
        )
