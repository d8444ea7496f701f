"""The speculative decoding loop: draft K tokens, verify them in one target forward, stream the result."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from .drafters import Drafter, NGramDrafter, Proposal
from .kpolicy import KPolicy, SpeculationGovernor
from .kv import PrefixCache
from .metrics import SpecStats
from .models import LoadedModel
from .sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs, sample


class PromptError(ValueError):
    pass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    speculate: bool = True
    k_policy: Callable[[], KPolicy] | None = None  # overrides the engine's default K policy for this answer


@dataclass
class StepEvent:
    """One target forward pass and what it emitted."""

    step: int
    tokens: list[int]  # emitted this step: accepted drafts, then the target's own token
    from_draft: list[bool]  # per emitted token: True if it was an accepted draft
    drafted: list[int]
    n_accepted: int
    draft_seconds: float
    verify_seconds: float
    k: int  # drafts proposed this step (0: a plain target step)
    note: str = ""  # why speculation changed state, if it did
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled" on the last event


class EngineSession:
    """KV caches kept across answers of one conversation: each answer then prefills only what is new
    (the caches crop themselves to the common prefix). Not for concurrent use."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.target = PrefixCache(engine.target.model, engine.target.device, engine.target.min_feed)
        self.drafter = engine.drafter_factory() if engine.drafter_factory else None

    @property
    def _draft_cache(self) -> PrefixCache | None:
        return getattr(self.drafter, "cache", None)  # n-gram drafters keep none

    def use_drafter(self, kind: str) -> None:
        """Switch this conversation's drafter: "draft-model" (the engine's) or "ngram"."""
        if kind == "ngram":
            self.drafter = NGramDrafter()
        elif kind == "draft-model":
            if not self.engine.has_draft_model:
                raise ValueError("no draft model loaded: start with --draft MODEL to use it")
            self.drafter = self.engine.drafter_factory()
        else:
            raise ValueError(f"drafter must be 'draft-model' or 'ngram', got {kind!r}")

    def prefill(self, ids: list[int]) -> None:
        """Warm both caches on a prefix that every answer shares (the system prompt)."""
        self.target.extend(ids)
        if self._draft_cache is not None:
            self._draft_cache.extend(ids)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)
        if self._draft_cache is not None:
            self._draft_cache.rollback(length)


class SpeculativeEngine:
    """Streams tokens from `target`, speculating with drafters made by `drafter_factory`."""

    def __init__(self, target: LoadedModel, drafter_factory: Callable[[], Drafter] | None,
                 k_policy_factory: Callable[[], KPolicy], max_speculative_sequences: int = 4,
                 auto_off: bool = True) -> None:
        self.target = target
        self.drafter_factory = drafter_factory
        self.k_policy_factory = k_policy_factory
        self.max_speculative_sequences = max_speculative_sequences
        self.auto_off = auto_off  # let the governor switch speculation off when it measures it slower
        self._active = 0
        self._lock = threading.Lock()

    @property
    def has_draft_model(self) -> bool:
        return self.drafter_factory is not None and self.drafter_factory is not NGramDrafter

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int = 1) -> None:
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if not prompt_ids:
            raise PromptError("empty prompt: nothing to answer")
        limit = self.target.max_context - 1
        if len(prompt_ids) > limit:
            raise PromptError(f"prompt is {len(prompt_ids)} tokens; the target's context holds {limit} plus one "
                              "generated token. Shorten the prompt or the conversation history.")

    def stream(self, prompt_ids: list[int], config: GenerationConfig, cancel: threading.Event | None = None,
               stats: SpecStats | None = None, session: EngineSession | None = None) -> Iterator[StepEvent]:
        self.check_prompt(prompt_ids, config.max_new_tokens)
        stats = stats if stats is not None else SpecStats()
        session = session or EngineSession(self)
        with self._lock:
            self._active += 1
        try:
            yield from self._loop(list(prompt_ids), config, cancel, stats, session)
        finally:
            with self._lock:
                self._active -= 1

    def _loop(self, ctx: list[int], config: GenerationConfig, cancel: threading.Event | None,
              stats: SpecStats, session: EngineSession) -> Iterator[StepEvent]:
        target = session.target
        drafter = session.drafter if config.speculate else None
        policy = (config.k_policy or self.k_policy_factory)()
        governor = SpeculationGovernor()
        gen = torch.Generator(device=self.target.device).manual_seed(config.seed)
        params = config.sampling
        budget = min(config.max_new_tokens, self.target.max_context - len(ctx))
        eos = self.target.tokenizer.eos_token_ids
        produced = 0
        step = 0
        while True:
            if cancel is not None and cancel.is_set():  # checked before spending a forward pass
                yield StepEvent(step + 1, [], [], [], 0, 0.0, 0.0, 0, "", "cancelled")
                return
            note = ""
            busy = self._active > self.max_speculative_sequences
            if busy and drafter is not None:
                note = f"speculation paused: {self._active} sequences > limit {self.max_speculative_sequences}"
            k = 0 if (drafter is None or busy) else min(policy.next_k(stats), budget - produced - 1)
            if drafter is not None and governor.off_reason and self.auto_off:
                note, drafter = governor.off_reason, None
                k = 0
            elif self.auto_off and governor.wants_probe:
                k = 0  # one plain step measures what target-only costs, for the governor's comparison
            t0 = time.perf_counter()
            proposal = Proposal([], None, 0)
            if k > 0:
                try:
                    proposal = drafter.propose(ctx, k, params, gen)
                except Exception as e:  # a failing drafter must not cost the answer: go on with the target
                    note, drafter, k = f"drafter failed ({type(e).__name__}: {e}); continuing target-only", None, 0
            t1 = time.perf_counter()
            n_acc, nxt = self._verify(target, ctx, proposal, params, gen)
            t2 = time.perf_counter()
            emitted = proposal.tokens[:n_acc] + [nxt]
            from_draft = [True] * n_acc + [False]
            k = len(proposal.tokens)
            if k:
                stats.record(k, n_acc, len(emitted), t1 - t0, proposal.forwards, t2 - t1)
                policy.observe(n_acc, k, t1 - t0, t2 - t1)
                drafter.observe(ctx + emitted, n_acc)
            governor.observe(k, len(emitted), t1 - t0, t2 - t1)
            # Trim at EOS and at the token budget; the target cache is rolled back on the next extend.
            finish = None
            for i, tok in enumerate(emitted):
                if tok in eos:
                    emitted, from_draft, finish = emitted[:i + 1], from_draft[:i + 1], "eos"
                    break
            room = budget - produced
            if len(emitted) >= room and finish is None:
                finish = "length" if budget == config.max_new_tokens else "context"
            emitted, from_draft = emitted[:room], from_draft[:room]
            ctx += emitted
            produced += len(emitted)
            step += 1
            yield StepEvent(step, emitted, from_draft, proposal.tokens, n_acc, t1 - t0, t2 - t1, k, note, finish)
            if finish:
                return

    @staticmethod
    def _verify(target: PrefixCache, ctx: list[int], proposal: Proposal, params: SamplingParams,
                gen: torch.Generator) -> tuple[int, int]:
        """One target forward over ctx + drafts; returns (accepted drafts, the target's next token)."""
        drafts = proposal.tokens
        logits = target.extend(ctx + drafts, n_logits=len(drafts) + 1)[-(len(drafts) + 1):]
        if params.greedy:
            n_acc, nxt = accept_greedy(drafts, logits.argmax(-1).tolist())
        elif drafts:
            n_acc, nxt = accept_sampled(drafts, logits_to_probs(logits, params), proposal.probs, gen)
        else:
            n_acc, nxt = 0, sample(logits_to_probs(logits[-1], params), gen)
        # The cache keeps ctx and the accepted drafts; rejected drafts are dropped now.
        target.rollback(len(ctx) + n_acc)
        return n_acc, nxt


def collect(events: Iterator[StepEvent]) -> tuple[list[int], list[StepEvent]]:
    """Drain a stream: all emitted tokens, and the events."""
    tokens: list[int] = []
    seen = []
    for ev in events:
        tokens += ev.tokens
        seen.append(ev)
    return tokens, seen
