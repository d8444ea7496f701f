"""The record of one speculative step: what the engine emits, what every learner observes, what the wire carries."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass(kw_only=True)
class StepEvent:
    """One target forward pass and what it emitted. Every learner (SpecStats, KPolicy, SpeculationGovernor, the
    scheduler's LoadEstimate, the drafter) observes this one record, and its names are the wire's."""

    step: int
    tokens: list[int]  # emitted this step: accepted drafts, then the target's own token
    from_draft: list[bool]  # per emitted token: True if it was an accepted draft
    speculative: bool = False  # a drafter ran before this forward (it may have proposed nothing)
    k_chosen: int = 0  # metrics.DEFINITIONS["k_chosen"]: drafts asked for (0: a plain target step)
    draft_tokens: list[int] = field(default_factory=list)  # proposed (past the gate; none past the answer's end)
    accepted: int = 0  # of those, accepted
    # a draft tree's accepted nodes' ranks by the drafter's confidence (tree.node_ranks): what a smaller tree would
    # have kept; None for a chain, whose accepted drafts are its first
    accepted_ranks: list[int] | None = None
    draft_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    note: str = ""  # why speculation changed state, if it did
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled" on the last event
    batch_size: int = 1  # sequences that shared this target forward (continuous batching)
    end_of_message_probability: float | None = None  # metrics.DEFINITIONS; first step of a probed answer only
    done_t: float | None = None  # time.perf_counter() when its forward and verdict were done (the compute thread)

    @property
    def drafted(self) -> int:
        """Draft tokens proposed this step."""
        return len(self.draft_tokens)
