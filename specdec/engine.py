"""The speculative decoding loop: draft K tokens, verify them in one target forward, stream the result."""

from __future__ import annotations

import itertools
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
from .runner import BatchRunner, SequenceCache
from .sampling import SamplingParams, accept_greedy, accept_sampled, logits_to_probs, sample

TargetCache = PrefixCache | SequenceCache  # a session's target KV: alone, or in a BatchRunner


class PromptError(ValueError):
    pass


@dataclass
class GenerationConfig:
    max_new_tokens: int = 128
    sampling: SamplingParams = field(default_factory=SamplingParams)
    seed: int = 0
    speculate: bool = True
    k_policy: Callable[[], KPolicy] | None = None  # overrides the engine's default K policy for this answer
    load_aware: bool = True  # in a load-aware BatchScheduler: K capped by load (else the K policy's K, load or not)


@dataclass(kw_only=True)
class StepEvent:
    """One target forward pass and what it emitted."""

    step: int
    tokens: list[int]  # emitted this step: accepted drafts, then the target's own token
    from_draft: list[bool]  # per emitted token: True if it was an accepted draft
    speculative: bool = False  # a drafter ran before this forward (it may have proposed nothing)
    k_planned: int = 0  # drafts asked for (0: a plain target step)
    drafted: list[int] = field(default_factory=list)  # drafts proposed
    n_accepted: int = 0  # of those, accepted (counted up to the answer's end)
    draft_forwards: int = 0
    draft_seconds: float = 0.0
    verify_seconds: float = 0.0
    note: str = ""  # why speculation changed state, if it did
    finish_reason: str | None = None  # "eos", "length", "context", "cancelled" on the last event
    batch_size: int = 1  # sequences that shared this target forward (continuous batching)

    @property
    def k_drafted(self) -> int:
        return len(self.drafted)


DRAFTER_KINDS = ("draft-model", "heads", "ngram")  # what a conversation may switch to (the engine's own or n-gram)


class EngineSession:
    """KV caches kept across answers of one conversation: each answer then prefills only what is new
    (the caches crop themselves to the common prefix). Not for concurrent use."""

    def __init__(self, engine: SpeculativeEngine) -> None:
        self.engine = engine
        self.target = engine.new_target_cache()
        self.drafter: Drafter | None = None
        self._set_drafter(engine.drafter_factory() if engine.drafter_factory else None)

    def _set_drafter(self, drafter: Drafter | None) -> None:
        reads_hidden = drafter is not None and drafter.reads_target_hidden
        if reads_hidden and not self.target.keep_hidden:
            self.target.reset()  # its features start with the next forward, so that forward must see everything
        self.target.keep_hidden = reads_hidden
        self.drafter = drafter

    def use_drafter(self, kind: str) -> None:
        """Switch this conversation's drafter: the engine's own ("draft-model" or "heads") or "ngram"."""
        if kind not in DRAFTER_KINDS:
            raise ValueError(f"drafter must be one of {', '.join(DRAFTER_KINDS)}, got {kind!r}")
        if kind == "ngram":
            self._set_drafter(NGramDrafter())
            return
        factory = self.engine.drafter_factory
        if self.engine.drafter_kind != kind or factory is None:  # the engine's own kind implies its factory
            hint = {"draft-model": "draft model loaded: start with --draft MODEL to use it"}
            hint["heads"] = "draft heads loaded: start with --draft heads to use them"
            raise ValueError(f"no {hint[kind]}")
        self._set_drafter(factory())

    def observer(self) -> Drafter | None:
        """The drafter to hand the target's hidden states to, if it reads them."""
        return self.drafter if self.target.keep_hidden else None

    def prefill(self, ids: list[int]) -> None:
        """Warm both caches on a prefix that every answer shares (the system prompt)."""
        self.target.extend(ids)
        if self.drafter is not None:
            self.drafter.prefill(ids)
        observer = self.observer()
        if observer is not None:
            observe_target(observer, self.target)

    def rollback(self, length: int) -> None:
        self.target.rollback(length)
        if self.drafter is not None:
            self.drafter.rollback(length)


@dataclass
class Draft:
    """What a step drafted, before the target forward that verifies it."""

    k_planned: int
    note: str
    proposal: Proposal | None
    seconds: float

    @property
    def tokens(self) -> list[int]:
        return self.proposal.tokens if self.proposal else []


@dataclass
class Answer:
    """What one answer carries from step to step."""

    ctx: list[int]
    budget: int  # tokens this answer may still add, context room included
    length_limited: bool  # the budget is max_new_tokens (else the context ran out first)
    drafter: Drafter | None
    policy: KPolicy
    governor: SpeculationGovernor = field(default_factory=SpeculationGovernor)
    produced: int = 0
    observer: Drafter | None = None  # reads the target's hidden states after every forward, drafting or not


def observe_target(drafter: Drafter, target: TargetCache) -> None:
    """Hand the drafter the target's hidden states of the positions its last forward fed and kept."""
    assert target.hidden is not None, "keep_hidden was off for that forward"
    kept = len(target.tokens) - target.hidden_start
    drafter.observe(list(target.tokens), target.hidden_start, target.hidden[:kept])


class SpeculativeEngine:
    """Streams tokens from `target`, speculating with drafters made by `drafter_factory`.

    Reproducibility: sampling draws come from one generator seeded by GenerationConfig.seed, in step order. The same
    seed gives the same answer whenever the K schedule is the same: a fixed K with auto_off False, and no
    pause by batch size and no load-aware K. AdaptiveK picks K from measured draft and verify times, the governor
    switches speculation off by measured time, and the pause and the load-aware K depend on load; each changes which
    positions are drafts, so with them a seed can give another answer, drawn from the same target distribution.
    Greedy answers never depend on it.
    """

    def __init__(
        self,
        target: LoadedModel,
        drafter_factory: Callable[[], Drafter] | None,
        k_policy_factory: Callable[[], KPolicy],
        disable_by_batch_size: int | None = None,
        auto_off: bool = True,
        batched: bool = False,
    ) -> None:
        self.target = target
        self.drafter_factory = drafter_factory
        self.drafter_kind = drafter_factory().kind if drafter_factory else None
        self.k_policy_factory = k_policy_factory
        # vLLM's --speculative-disable-by-batch-size: no drafts in a step while more sequences than this are running
        self.disable_by_batch_size = disable_by_batch_size
        self.auto_off = auto_off  # let the governor switch speculation off when it measures it slower
        # batched: sessions keep their target KV in a BatchRunner, so a BatchScheduler can batch their steps
        self.runner = BatchRunner(target.model, target.device) if batched else None
        self._active = 0
        self._lock = threading.Lock()

    def new_target_cache(self) -> TargetCache:
        if self.runner is not None:
            return self.runner.new_cache()
        return PrefixCache(self.target.model, self.target.device, self.target.min_feed)

    def new_answer(self, prompt_ids: list[int], config: GenerationConfig, session: EngineSession) -> Answer:
        self.check_prompt(prompt_ids, config.max_new_tokens)
        room = self.target.max_context - len(prompt_ids)
        return Answer(
            list(prompt_ids),
            min(config.max_new_tokens, room),
            config.max_new_tokens <= room,
            session.drafter if config.speculate else None,
            (config.k_policy or self.k_policy_factory)(),
            observer=session.observer(),
        )

    def check_prompt(self, prompt_ids: list[int], max_new_tokens: int = 1) -> None:
        if max_new_tokens < 1:
            raise PromptError(f"max_new_tokens must be ≥ 1, got {max_new_tokens}")
        if not prompt_ids:
            raise PromptError("empty prompt: nothing to answer")
        limit = self.target.max_context - 1
        if len(prompt_ids) > limit:
            raise PromptError(
                f"prompt is {len(prompt_ids)} tokens; the target's context holds {limit} plus one "
                "generated token. Shorten the prompt or the conversation history."
            )

    def stream(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        cancel: threading.Event | None = None,
        stats: SpecStats | None = None,
        session: EngineSession | None = None,
    ) -> Iterator[StepEvent]:
        session = session or EngineSession(self)
        answer = self.new_answer(prompt_ids, config, session)
        gen = torch.Generator(device=self.target.device).manual_seed(config.seed)
        stats = stats if stats is not None else SpecStats()
        with self._lock:
            self._active += 1
        try:
            for n in itertools.count(1):
                if cancel is not None and cancel.is_set():  # checked before spending a forward pass
                    yield StepEvent(step=n, tokens=[], from_draft=[], finish_reason="cancelled")
                    return
                draft = self.draft(answer, config.sampling, gen, self._active)
                t0 = time.perf_counter()
                logits = session.target.extend(answer.ctx + draft.tokens, n_logits=len(draft.tokens) + 1)
                event = self.conclude(n, answer, session.target, draft, logits, config.sampling, gen, stats, t0)
                yield event
                if event.finish_reason:
                    return
        finally:
            with self._lock:
                self._active -= 1

    def _plan_k(self, answer: Answer, running: int, k_cap: int | None) -> tuple[int, str]:
        """Drafts to ask for this step (0: a plain target step), and why speculation changed state, if it did.
        running: sequences decoding now; k_cap: a load-aware scheduler's choice, which then replaces the governor
        (its times are the batch's, not this answer's)."""
        if answer.drafter is None:
            return 0, ""
        if k_cap is None and self.auto_off and answer.governor.off_reason:
            answer.drafter = None
            return 0, answer.governor.off_reason
        limit = self.disable_by_batch_size
        if limit is not None and running > limit:
            return 0, f"speculation paused: {running} sequences > --speculative-disable-by-batch-size {limit}"
        if k_cap is None and self.auto_off and answer.governor.wants_probe:
            return 0, ""  # one plain step measures what target-only costs, for the governor's comparison
        k = self.wanted_k(answer)
        return (k if k_cap is None else min(k, k_cap)), ""

    @staticmethod
    def wanted_k(answer: Answer) -> int:
        """The most drafts the answer's own K policy asks for now (0 without a drafter)."""
        if answer.drafter is None:
            return 0
        return max(0, min(answer.policy.next_k(), answer.budget - answer.produced - 1))

    def draft(
        self, answer: Answer, params: SamplingParams, gen: torch.Generator, running: int, k_cap: int | None = None
    ) -> Draft:
        """The first half of a step: plan K and let the drafter propose (the target forward comes next)."""
        k_planned, note = self._plan_k(answer, running, k_cap)
        t0 = time.perf_counter()
        proposal = None
        drafter = answer.drafter
        if k_planned > 0 and drafter is not None:  # _plan_k plans drafts only for an answer with a drafter
            try:
                proposal = drafter.propose(answer.ctx, k_planned, params, gen)
            except Exception as e:  # a failing drafter must not cost the answer: go on with the target
                note, answer.drafter = f"drafter failed ({type(e).__name__}: {e}); continuing target-only", None
        return Draft(k_planned, note, proposal, time.perf_counter() - t0)

    def conclude(
        self,
        n: int,
        answer: Answer,
        target: TargetCache,
        draft: Draft,
        logits: torch.Tensor,
        params: SamplingParams,
        gen: torch.Generator,
        stats: SpecStats,
        forward_start: float,
        batch_size: int = 1,
    ) -> StepEvent:
        """The second half, once the target forward over ctx + drafts gave `logits`: accept → roll back → observe."""
        drafts, proposal, note = draft.tokens, draft.proposal, draft.note
        n_acc, nxt = accept(logits[-(len(drafts) + 1) :], proposal, params, gen)
        target.rollback(len(answer.ctx) + n_acc)  # the cache keeps ctx and the accepted drafts
        if answer.observer is not None:
            try:
                observe_target(answer.observer, target)
            except Exception as e:  # as for a failing propose: the answer goes on with the target alone
                note = f"drafter failed ({type(e).__name__}: {e}); continuing target-only"
                answer.drafter = answer.observer = None
        verify_s = time.perf_counter() - forward_start
        emitted, finish = self._trim(drafts[:n_acc] + [nxt], answer)
        # Count only what the answer keeps: drafts past EOS (or the budget) were never needed.
        n_acc_kept = min(n_acc, len(emitted))
        k_counted = len(drafts) if len(emitted) > n_acc else len(emitted)
        speculative = proposal is not None
        forwards = proposal.forwards if proposal else 0
        stats.record(
            len(emitted),
            verify_s,
            speculative=speculative,
            k_drafted=k_counted,
            n_accepted=n_acc_kept,
            draft_s=draft.seconds,
            draft_forwards=forwards,
        )
        answer.governor.observe(speculative, len(emitted), draft.seconds, verify_s)
        if speculative:
            answer.policy.observe(n_acc_kept, k_counted, forwards, draft.seconds, verify_s)
        answer.ctx += emitted
        answer.produced += len(emitted)
        return StepEvent(
            step=n,
            tokens=emitted,
            from_draft=[i < n_acc for i in range(len(emitted))],
            speculative=speculative,
            k_planned=draft.k_planned,
            drafted=drafts,
            n_accepted=n_acc_kept,
            draft_forwards=forwards,
            draft_seconds=draft.seconds,
            verify_seconds=verify_s,
            note=note,
            finish_reason=finish,
            batch_size=batch_size,
        )

    def _trim(self, emitted: list[int], answer: Answer) -> tuple[list[int], str | None]:
        """Cut at EOS and at the token budget; the target cache drops the rest on its next extend."""
        eos = self.target.tokenizer.eos_token_ids
        room = answer.budget - answer.produced
        for i, tok in enumerate(emitted[:room]):
            if tok in eos:
                return emitted[: i + 1], "eos"
        if len(emitted) >= room:
            return emitted[:room], "length" if answer.length_limited else "context"
        return emitted, None


def accept(
    logits: torch.Tensor, proposal: Proposal | None, params: SamplingParams, gen: torch.Generator
) -> tuple[int, int]:
    """The target's verdict on the drafts from its logits at the last position before them and at each draft
    (len(drafts) + 1 rows): accepted drafts, and the target's own next token."""
    drafts = proposal.tokens if proposal else []
    if params.greedy:
        return accept_greedy(drafts, logits.argmax(-1).tolist())
    if proposal is not None and drafts:
        return accept_sampled(drafts, logits_to_probs(logits, params), proposal.probs, gen)
    return 0, sample(logits_to_probs(logits[-1], params), gen)


def collect(events: Iterator[StepEvent]) -> tuple[list[int], list[StepEvent]]:
    """Drain a stream: all emitted tokens, and the events."""
    tokens: list[int] = []
    seen = []
    for ev in events:
        tokens += ev.tokens
        seen.append(ev)
    return tokens, seen
