"""A conversation's caches kept between its answers (EngineSession), and how a drafter learns what the target's
cache was fed outside a step (catch_up)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from . import compute
from .drafters import Drafter, NGramDrafter
from .events import StepEvent
from .kv import SequenceCache
from .models import LoadedModel
from .runner import BatchRunner

DRAFTER_KINDS = ("draft-model", "heads", "ngram")  # what a conversation may switch to (the engine's own or n-gram)


class SessionEngine(Protocol):
    """What a session reads of its engine (SpeculativeEngine has it): the target's cache maker and the drafters."""

    target: LoadedModel
    runner: BatchRunner
    drafter_factory: Callable[[], Drafter] | None
    drafter_kind: str | None


class EngineSession:
    """The KV caches kept across answers of one conversation: each answer then prefills only what is new (the
    caches crop themselves to the common prefix). Not for concurrent use."""

    def __init__(self, engine: SessionEngine) -> None:
        self.engine = engine
        self.target = engine.runner.new_cache()
        self.drafter: Drafter | None = None
        self._set_drafter(engine.drafter_factory() if engine.drafter_factory else None)

    def _set_drafter(self, drafter: Drafter | None) -> None:
        reads_hidden = drafter is not None and drafter.reads_target_hidden
        if reads_hidden and not self.target.keep_hidden:
            self.target.reset()  # its features start with the next forward, so that forward must see everything
        self.target.keep_hidden = reads_hidden
        self.target.keep_layers = drafter.target_layers if drafter is not None and reads_hidden else ()
        self.drafter = drafter

    def use_drafter(self, kind: str) -> None:
        """Switch this conversation's drafter: the engine's own ("draft-model" or "heads") or "ngram"."""
        if kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
        if kind == "ngram":
            self._set_drafter(NGramDrafter(self.engine.target.device))
            return
        factory = self.engine.drafter_factory
        if self.engine.drafter_kind != kind or factory is None:  # the engine's own kind implies its factory
            hint = {"draft-model": "draft model loaded: start with --draft MODEL to use it"}
            hint["heads"] = "draft heads loaded: start with --draft heads to use them"
            raise ValueError(f"no {hint[kind]}")
        self._set_drafter(factory())

    def prefill(self, ids: list[int]) -> None:
        """Warm both caches on a prefix that every answer shares (the system prompt)."""
        self.target.extend(ids)
        if self.drafter is not None:
            catch_up(self.drafter, ids, self.target)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)
        if self.drafter is not None:
            self.drafter.rollback(length)


def catch_up(drafter: Drafter, ids: list[int], target: SequenceCache) -> None:
    """The drafter learns ids, just fed to the target's cache outside a step (a draft model prefills, heads read);
    on the compute thread."""

    def learn() -> None:
        drafter.prefill(ids)
        if target.keep_hidden:
            drafter.observe(StepEvent(step=0, tokens=[], from_draft=[]), target)

    compute.run(learn)
