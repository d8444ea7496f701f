"""The speculative step, for one answer or a batch: plan K → draft → (a load-aware scheduler keeps the drafts worth
their rows) → one verifying forward → accept → roll back → observe. `SpeculativeEngine.step` is the whole algorithm;
`stream` loops it for one answer, and the BatchScheduler for many. Acceptance runs on the device and the step's
results are read back once."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from . import compute
from .drafters import Drafter, Proposal
from .events import StepEvent
from .kpolicy import KPolicy, SpeculationGovernor
from .kv import Feed, SequenceCache
from .metrics import SpecStats
from .models import LoadedModel
from .runner import BatchRunner
from .sampling import SamplingParams, greedy_verdict, logits_to_probs, multi_candidate_verdict, sampled_verdict
from .session import DRAFTER_KINDS, EngineSession
from .timing import clock
from .tree import DraftTree, greedy_tree_verdict, node_ranks


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
    question_start: int = 0  # where the prompt's last message (the question) begins: an answer's opening echoes it
    end_probe: EndProbe | None = None  # read P(end of message) where the user's words end, in the first forward


@dataclass(frozen=True)
class EndProbe:
    """Where the user's words end in the prompt (`words_end`: the position after their last token) and the tokens
    that would end the message there: the answer's first step reads metrics.DEFINITIONS["end_of_message_probability"]
    from that row of its own forward, so the end-of-turn decision gets the target's view at no extra forward."""

    words_end: int
    end_ids: tuple[int, ...]


Chunks = Sequence[tuple["Answer", int]]  # prompts read in chunks (chunked prefill): (answer, its context's end)
# each answer's proposal, in the step's order (None: no drafts, or cancelled) -> how many of each to verify (None:
# all): a load-aware choice made once every answer has drafted, from what each drafter is sure of this step
Cut = Callable[[list[Proposal | None]], list[int | None]]


@dataclass
class Answer:
    """One answer in progress: everything a step needs of it, and what learns from its steps."""

    ctx: list[int]
    budget: int  # tokens this answer may still add, context room included
    length_limited: bool  # the budget is max_new_tokens (else the context ran out first)
    session: EngineSession
    params: SamplingParams
    gen: torch.Generator  # its own, so a batched answer draws what it would draw alone
    policy: KPolicy
    stats: SpecStats = field(default_factory=SpecStats)
    cancel: threading.Event | None = None
    drafter: Drafter | None = None  # None: target-only (speculation off, switched off, or the drafter failed)
    observer: Drafter | None = None  # reads the target's hidden states after every forward, drafting or not
    governor: SpeculationGovernor = field(default_factory=SpeculationGovernor)
    load_aware: bool = True
    end_probe: EndProbe | None = None  # read once, in the first forward
    produced: int = 0
    steps: int = 0

    @property
    def cache(self) -> SequenceCache:
        return self.session.target

    @property
    def cancelled(self) -> bool:
        return self.cancel is not None and self.cancel.is_set()


@dataclass
class _Draft:
    k_chosen: int
    note: str
    proposal: Proposal | None
    seconds: float


class SpeculativeEngine:
    """Streams tokens from `target`, speculating with drafters made by `drafter_factory`.

    Reproducibility: sampling draws come from the answer's generator seeded by GenerationConfig.seed, in step order.
    The same seed gives the same answer whenever the K schedule is the same: a fixed K with auto_off False, and no
    pause by batch size and no load-aware K. AdaptiveK picks K from measured draft and verify times, the governor
    switches speculation off by measured time, and the pause and the load-aware K depend on load; each changes which
    positions are drafts, so with them a seed can give another answer, drawn from the same target distribution.
    Greedy answers never depend on it.
    """

    def __init__(
        self,
        target: LoadedModel,
        runner: BatchRunner,
        drafter_factory: Callable[[], Drafter] | None,
        k_policy_factory: Callable[[], KPolicy],
        disable_by_batch_size: int | None = None,
        auto_off: bool = True,
    ) -> None:
        self.target = target
        self.runner = runner  # the target's forward, one sequence or many
        self.drafter_factory = drafter_factory
        self.drafter_kind = drafter_factory().kind if drafter_factory else None
        self.k_policy_factory = k_policy_factory
        # vLLM's --speculative-disable-by-batch-size: no drafts in a step while more sequences than this are running
        self.disable_by_batch_size = disable_by_batch_size
        self.auto_off = auto_off  # let the governor switch speculation off when it measures it slower

    def switchable_drafters(self) -> list[str]:
        """The DRAFTER_KINDS a conversation may switch to (EngineSession.use_drafter): the engine's own, and n-gram."""
        own = [self.drafter_kind] if self.drafter_kind in DRAFTER_KINDS else []
        return [k for k in DRAFTER_KINDS if k in own or k == "ngram"]

    def new_answer(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        session: EngineSession | None = None,
        cancel: threading.Event | None = None,
        stats: SpecStats | None = None,
    ) -> Answer:
        self.check_prompt(prompt_ids, config.max_new_tokens)
        session = session or EngineSession(self)
        room = self.target.max_context - len(prompt_ids)
        drafter, probe = session.drafter, config.end_probe
        if drafter is not None and config.speculate:
            drafter.start(len(prompt_ids), config.question_start)
        return Answer(
            list(prompt_ids),
            min(config.max_new_tokens, room),
            config.max_new_tokens <= room,
            session,
            config.sampling,
            torch.Generator(device=self.target.device).manual_seed(config.seed),
            (config.k_policy or self.k_policy_factory)(),
            stats if stats is not None else SpecStats(),
            cancel,
            drafter if config.speculate else None,
            drafter if session.target.keep_hidden else None,
            load_aware=config.load_aware,
            end_probe=probe if probe and 0 < probe.words_end <= len(prompt_ids) else None,
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
        """One answer, step by step."""
        answer = self.new_answer(prompt_ids, config, session, cancel, stats)
        while True:
            (event,) = self.step([answer])
            yield event
            if event.finish_reason:
                return

    def step(
        self,
        answers: list[Answer],
        k_caps: list[int | None] | None = None,
        chunks: Chunks = (),
        cut: Cut | None = None,
    ) -> list[StepEvent]:
        """One step of every answer, all verified in one target forward. k_caps: a load-aware scheduler's K per
        answer (None: the answer's own K policy and governor decide). chunks: (answer, end), a prompt read in chunks:
        the forward feeds its context up to end, and it emits nothing. cut: given the answers' proposals, how
        many of each to verify (Proposal.best; None: all), once every answer has drafted. A cancelled answer gets its
        last event without a forward; a failing forward raises (every answer in it fails; their caches were reset).
        Runs on the compute thread (specdec/compute.py)."""
        return compute.run(lambda: self._step(answers, k_caps, chunks, cut))

    def _step(
        self, answers: list[Answer], k_caps: list[int | None] | None, chunks: Chunks, cut: Cut | None
    ) -> list[StepEvent]:
        caps = k_caps or [None] * len(answers)
        events: list[StepEvent | None] = [None] * len(answers)
        live = []
        for i, (answer, cap) in enumerate(zip(answers, caps)):
            answer.steps += 1
            if answer.cancelled:  # checked before spending a forward on it
                events[i] = StepEvent(step=answer.steps, tokens=[], from_draft=[], finish_reason="cancelled")
            else:
                live.append((i, answer, cap))
        if live or chunks:
            self._verify(live, events, chunks, cut)
        done_t = time.perf_counter()
        for event in events:
            assert event is not None
            event.done_t = done_t
        return events  # type: ignore[return-value]

    def _verify(
        self,
        live: list[tuple[int, Answer, int | None]],
        events: list[StepEvent | None],
        chunks: Chunks,
        cut: Cut | None,
    ) -> None:
        """Draft for every live answer, keep what `cut` says, verify all (and feed the chunks) in one forward, read
        once, conclude each."""
        drafts = [self._draft(answer, len(live), cap) for _, answer, cap in live]
        if cut is not None:
            proposals: list[Proposal | None] = [None] * len(events)  # a cancelled answer drafted nothing
            for (i, _, _), d in zip(live, drafts):
                proposals[i] = d.proposal
            keep = cut(proposals)
            drafts = [self._kept(d, keep[i]) for (i, _, _), d in zip(live, drafts)]
        probes = [self._probe_rows(a) for _, a, _ in live]
        feeds = [
            Feed(a.cache, a.ctx, (probe or 0) + self._n_rows(d), self._draft_tokens(d), self._draft_tree(d))
            for (_, a, _), d, probe in zip(live, drafts, probes)
        ]
        feeds += [Feed(a.cache, a.ctx[:end]) for a, end in chunks]  # their one logit row goes unread
        t0 = clock(self.target.device)
        logits = self.runner.extend(feeds)
        ends = [None if p is None else self._end_probability(lg, a) for lg, (_, a, _), p in zip(logits, live, probes)]
        verdicts = [self._verdict(lg[p or 0 :], a, d) for lg, (_, a, _), d, p in zip(logits, live, drafts, probes)]
        values = torch.cat(verdicts).tolist() if verdicts else []  # the step's one read from the device
        verify_s = clock(self.target.device) - t0
        at = 0
        for (i, answer, _), draft, verdict, end in zip(live, drafts, verdicts, ends):
            n_acc, nxt, proposed, *drafted = values[at : at + len(verdict)]
            at += len(verdict)
            ranks = None
            if draft.proposal is not None and draft.proposal.tree is not None:  # the path, every node's token, rank
                path, nodes, node_rank = drafted[:proposed], drafted[proposed : 2 * proposed], drafted[2 * proposed :]
                answer.cache.keep_path(len(answer.ctx), path[:n_acc])
                drafted = [nodes[j] for j in path[:n_acc]] + [t for j, t in enumerate(nodes) if j not in path[:n_acc]]
                ranks = [node_rank[j] for j in path[:n_acc]]
            event = self._conclude(answer, draft, n_acc, nxt, drafted[:proposed], ranks, verify_s, len(feeds))
            if end is not None:
                event.end_of_message_probability, answer.end_probe = float(end), None
            events[i] = event

    @staticmethod
    def _kept(draft: _Draft, n: int | None) -> _Draft:
        """The draft with its n best drafts (None: all of them)."""
        if n is None or draft.proposal is None:
            return draft
        return replace(draft, k_chosen=min(draft.k_chosen, n), proposal=draft.proposal.best(n))

    @staticmethod
    def _probe_rows(answer: Answer) -> int | None:
        """Rows fed before the verified ones so that the first row is the end probe's (the cache re-feeds them if
        held): 0 when the words end the context, None without a probe."""
        if answer.end_probe is None:
            return None
        return len(answer.ctx) - answer.end_probe.words_end

    @staticmethod
    def _end_probability(logits: torch.Tensor, answer: Answer) -> torch.Tensor:
        assert answer.end_probe is not None
        probs = torch.softmax(logits[0].float(), dim=-1)
        ids = torch.tensor(answer.end_probe.end_ids, device=logits.device)
        return probs.index_select(0, ids).sum()

    @staticmethod
    def _n_rows(draft: _Draft) -> int:
        return 1 + (len(draft.proposal.tokens) if draft.proposal else 0)

    @staticmethod
    def _draft_tokens(draft: _Draft) -> torch.Tensor | None:
        return draft.proposal.tokens if draft.proposal and len(draft.proposal.tokens) else None

    @staticmethod
    def _draft_tree(draft: _Draft) -> DraftTree | None:
        return draft.proposal.tree if draft.proposal else None

    def _verdict(self, logits: torch.Tensor, answer: Answer, draft: _Draft) -> torch.Tensor:
        """(n_accepted, next token, drafts that count, the drafts …) on the device; for a tree (n_accepted, next
        token, N, the accepted path's node indices padded with −1 to N, the N nodes' tokens, their ranks)."""
        p = draft.proposal or Proposal.of([], logits.device)
        if p.tree is not None:
            if answer.params.greedy:
                verdict = greedy_tree_verdict(p.tree, logits)
            else:
                verdict = multi_candidate_verdict(logits_to_probs(logits, answer.params), p.tree, answer.gen)
            return torch.cat([verdict[:2], p.proposed.view(1), verdict[2:], p.tokens, node_ranks(p.tree)])
        if answer.params.greedy:
            verdict = greedy_verdict(p.tokens, p.proposed, logits)
        else:
            probs = logits_to_probs(logits, answer.params)
            verdict = sampled_verdict(p.tokens, p.proposed, probs, p.probs, answer.gen)
        return torch.cat([verdict, p.proposed.view(1), p.tokens])

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

    def _draft(self, answer: Answer, running: int, k_cap: int | None) -> _Draft:
        k_chosen, note = self._plan_k(answer, running, k_cap)
        t0 = clock(self.target.device)
        proposal = None
        drafter = answer.drafter
        if k_chosen > 0 and drafter is not None:  # _plan_k plans drafts only for an answer with a drafter
            try:
                proposal = drafter.propose(answer.ctx, k_chosen, answer.params, answer.gen)
            except Exception as e:  # a failing drafter must not cost the answer: go on with the target
                note, answer.drafter = f"drafter failed ({type(e).__name__}: {e}); continuing target-only", None
        return _Draft(k_chosen, note, proposal, clock(self.target.device) - t0)

    def _conclude(
        self,
        answer: Answer,
        draft: _Draft,
        n_acc: int,
        nxt: int,
        drafts: list[int],
        ranks: list[int] | None,
        verify_s: float,
        batch_size: int,
    ) -> StepEvent:
        """Roll back → trim at EOS and the budget → let every learner observe the same event."""
        answer.cache.settle(answer.ctx + drafts[:n_acc])  # the cache keeps ctx and the accepted drafts
        emitted, finish = self._trim(drafts[:n_acc] + [nxt], answer)
        # Count only what the answer keeps: drafts past EOS (or the budget) were never needed.
        counted = drafts if len(emitted) > n_acc else drafts[: len(emitted)]
        proposal = draft.proposal
        event = StepEvent(
            step=answer.steps,
            tokens=emitted,
            from_draft=[i < n_acc for i in range(len(emitted))],
            speculative=proposal is not None,
            k_chosen=draft.k_chosen,
            draft_tokens=counted,
            accepted=min(n_acc, len(emitted)),
            accepted_ranks=None if ranks is None else ranks[: len(emitted)],
            draft_forwards=proposal.forwards if proposal else 0,
            draft_seconds=draft.seconds,
            verify_seconds=verify_s,
            note=draft.note,
            finish_reason=finish,
            batch_size=batch_size,
        )
        for drafter in {id(d): d for d in (answer.observer, answer.drafter if proposal else None) if d}.values():
            try:
                drafter.observe(event, answer.cache)
            except Exception as e:  # as for a failing propose: the answer goes on with the target alone
                event.note = f"drafter failed ({type(e).__name__}: {e}); continuing target-only"
                answer.drafter = answer.observer = None
        answer.stats.observe(event)
        answer.governor.observe(event)
        answer.policy.observe(event)
        answer.ctx += emitted
        answer.produced += len(emitted)
        return event

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


def collect(events: Iterator[StepEvent]) -> tuple[list[int], list[StepEvent]]:
    """Drain a stream: all emitted tokens, and the events."""
    tokens: list[int] = []
    seen = []
    for ev in events:
        tokens += ev.tokens
        seen.append(ev)
    return tokens, seen
