"""vLLM's speculative decoding counters, read from its Prometheus /metrics page (the text format, parsed by
prometheus_client), and one reply's difference of them folded into ReplyStats.spec as the in-process engine would
have recorded it.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field

from prometheus_client.parser import text_string_to_metric_families

from specdec.metrics import SpecStats, alpha_from_acceptance_rate

SPEC_PREFIX = "vllm:spec_decode_"
# Counter names without vLLM's prefix and without the `_total` the Prometheus exposition may add.
SPEC_COUNTERS = ("num_drafts", "num_draft_tokens", "num_accepted_tokens", "num_accepted_tokens_per_pos")


def parse_prometheus(text: str) -> Iterator[tuple[str, dict[str, str], float]]:
    """Samples of the Prometheus text exposition format: (name, labels, value); timestamps dropped.
    ValueError on text that is not in that format."""
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            yield sample.name, sample.labels, float(sample.value)


@dataclass
class SpecCounters:
    """vLLM's speculative decoding counters at one moment (or the difference between two)."""

    drafts: float = 0.0
    draft_tokens: float = 0.0
    accepted: float = 0.0
    accepted_per_pos: dict[int, float] = field(default_factory=dict)

    def __sub__(self, before: SpecCounters) -> SpecCounters:
        positions = self.accepted_per_pos.keys() | before.accepted_per_pos.keys()
        return SpecCounters(
            self.drafts - before.drafts,
            self.draft_tokens - before.draft_tokens,
            self.accepted - before.accepted,
            {p: self.accepted_per_pos.get(p, 0.0) - before.accepted_per_pos.get(p, 0.0) for p in positions},
        )

    @property
    def k(self) -> int:
        """Draft length: the positions vLLM reports, else the mean draft tokens per draft."""
        if self.accepted_per_pos:
            return max(self.accepted_per_pos) + 1
        return round(self.draft_tokens / self.drafts) if self.drafts else 0

    @property
    def emitted(self) -> float:
        return self.drafts + self.accepted  # each draft step emits its accepted tokens plus the target's own


def spec_counters(text: str, model: str | None = None) -> SpecCounters | None:
    """The speculative decoding counters in a /metrics page, summed over engines; None when there are none.

    Samples labelled with another model_name are left out when some carry `model`'s (a server may host several).
    """
    samples = []
    try:
        for name, labels, value in parse_prometheus(text):
            if not name.startswith(SPEC_PREFIX):
                continue
            short = name[len(SPEC_PREFIX) :].removesuffix("_total")
            if short in SPEC_COUNTERS:
                samples.append((short, labels, value))
    except ValueError:  # not a Prometheus page (a proxy's error page, say): no counters to read
        return None
    if not samples:
        return None
    if model and any(labels.get("model_name") == model for _, labels, _ in samples):
        samples = [s for s in samples if s[1].get("model_name", model) == model]
    out = SpecCounters()
    for short, labels, value in samples:
        if short == "num_accepted_tokens_per_pos":
            pos = int(labels.get("position", 0))
            out.accepted_per_pos[pos] = out.accepted_per_pos.get(pos, 0.0) + value
        elif short == "num_drafts":
            out.drafts += value
        elif short == "num_draft_tokens":
            out.draft_tokens += value
        else:
            out.accepted += value
    return out


def add_spec_delta(spec: SpecStats, d: SpecCounters) -> None:
    """Fold one reply's counter difference into SpecStats, as the in-process engine would have recorded it."""
    drafts, proposed, accepted = round(d.drafts), round(d.draft_tokens), round(d.accepted)
    if drafts <= 0:
        return
    k = d.k
    per_pos = [round(d.accepted_per_pos.get(i, 0.0)) for i in range(k)]
    if d.accepted_per_pos and proposed == k * drafts:
        # A draft whose last position was accepted had no rejection; every other draft stopped at one.
        rejections = drafts - per_pos[-1]
    else:  # no per-position counters: estimate from the rate under independent acceptance
        alpha = alpha_from_acceptance_rate(accepted / proposed if proposed else 0.0, k)
        rejections = round(accepted * (1 - alpha) / alpha) if alpha > 0 else drafts
    # The server's counters, as the in-process engine would have recorded them (a draft is a speculative step).
    spec.merge(
        SpecStats(
            target_forwards=drafts,
            speculative_steps=drafts,
            proposed=proposed,
            accepted=accepted,
            emitted=drafts + accepted,
            rejections=rejections,
            per_position_proposed=[drafts] * k,  # vLLM's per-position rate divides by the drafts
            per_position_accepted=per_pos,
        )
    )
