"""Continuous batching: the active answers' steps share one target forward. Answers join and leave between steps,
each keeps its own KV cache, drafter and sampling generator, and the drafts per answer are chosen from the load
and, once drafted, from how sure each drafter is of them. A long prompt joins in chunks (chunked prefill), fed in
the forwards of the others' steps.

Why the load matters: while a forward is memory-bound, B sequences × (K + 1) tokens cost about what B tokens do,
so drafts are nearly free; past the ridge every token fed costs compute, and a rejected draft is pure load.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

import torch

from . import compute
from .cost_grid import ForwardCosts
from .drafters import Proposal
from .engine import Answer, GenerationConfig, SpeculativeEngine, StepEvent
from .metrics import SpecStats
from .session import EngineSession, catch_up

# What an answer's estimate keeps per step of what it learned of a draft the step did not verify (LoadEstimate):
# drafts accepted 41 % of the time then run in ~93 % of an answer's steps on this AMD EPYC's grid, and drafts never
# accepted in ~40 %, each costing ~5 % of a step (tests/specdec/test_scheduler.py simulates both).
FORGET = 0.95


@dataclass
class LoadEstimate:
    """What the load-aware choice knows of one answer, per draft i (a chain's i-th draft, a tree's node of rank i
    by the drafter's confidence, tree.node_ranks), as moving averages: proposed[i], the chance the drafter proposes
    draft i when asked for more than i drafts, and accepted[i], the chance draft i is proposed and accepted. A
    confidence gate stops drafters short (the shipped heads propose under one draft per step when asked for four),
    so these, not a geometric α, say what asking for K drafts brings: 1 + Σ_{i<K} accepted[i] tokens for
    Σ_{i<K} proposed[i] verified rows, and K · draft_s seconds of drafting. A tree of K nodes is the best K of a
    larger one (tree.keep_best), so what its node of rank i brings is learned from every step verifying it. The
    scheduler reads it to decide whether an answer drafts at all, and which of its drafts to verify where its
    drafter gives no confidence (Proposal.confidence).

    A draft i not verified in a step (K ≤ i, a plain step) is not measured by it: with forget < 1, what was learned
    of it ages back toward `prior`, the estimate before anything was measured (an answer's: FORGET per step).
    Without that, K = 0 after a few rejections was never measured again and held to the answer's end, as did a tree
    cut to one node (bench --batched: 57 % of forwards plain where drafts were accepted 41 % of the time)."""

    accepted: list[float]
    proposed: list[float]
    draft_s: float  # seconds of drafting per draft verified
    decay: float = 0.7
    forget: float = 1.0  # what is kept per step of what was learned of a draft not verified (1: all)
    prior: list[float] = field(default_factory=list)  # accepted[i] before any measurement; [] : the values given

    def __post_init__(self) -> None:
        self.prior = list(self.prior or self.accepted)

    @classmethod
    def geometric(cls, alpha: float, draft_s: float = 0.0, positions: int = 16, decay: float = 0.7) -> LoadEstimate:
        """A drafter that always proposes and whose drafts are each accepted with probability α (Leviathan et al.)."""
        return cls([alpha ** (i + 1) for i in range(positions)], [1.0] * positions, draft_s, decay)

    def copy(self, decay: float, forget: float = 1.0) -> LoadEstimate:
        return LoadEstimate(list(self.accepted), list(self.proposed), self.draft_s, decay, forget, self.prior)

    def tokens(self, k: int) -> float:
        return 1.0 + sum(self.accepted[:k])

    def rows(self, k: int) -> float:
        return sum(self.proposed[:k])

    def observe(self, event: StepEvent, draft_time: bool = True) -> None:
        """draft_time False: the step's draft time is not a draft's cost (a draft model's first step in an answer
        also prefills the prompt)."""
        verified = min(event.k_chosen, len(self.accepted)) if event.speculative else 0
        keep = self.decay
        accepted = set(range(event.accepted) if event.accepted_ranks is None else event.accepted_ranks)
        for i in range(verified):
            self.proposed[i] = keep * self.proposed[i] + (1 - keep) * (i < event.drafted)
            self.accepted[i] = keep * self.accepted[i] + (1 - keep) * (i in accepted)
        # unmeasured: back toward the prior's shape hung from the last draft measured (never above it), and
        # proposing all asked
        scale = min(1.0, self.accepted[verified - 1] / max(self.prior[verified - 1], 1e-9)) if verified else 1.0
        for i in range(verified, len(self.accepted)):
            shape = scale * self.prior[i]
            self.proposed[i] = self.forget * self.proposed[i] + (1 - self.forget)
            self.accepted[i] = min(shape, self.forget * self.accepted[i] + (1 - self.forget) * shape)
        if not verified:
            return
        if draft_time:
            self.draft_s = keep * self.draft_s + (1 - keep) * event.draft_seconds / event.k_chosen


@dataclass
class Calibration:
    """How often the target accepts drafts against how sure their drafter was (Proposal.confidence): accepted
    drafts ÷ the confidence summed over the drafts verified, both as moving sums. The shipped heads' path
    probabilities rank their nodes well but run high: on the 20 voice prompts (AMD EPYC, K = 6), nodes of 0.9–1.0
    were accepted 84 % of the time, of 0.2–0.3 15 %, and 0.8 of their summed confidence (docs/results.md)."""

    accepted: float = 0.8  # the sums start at that ratio, worth one step's drafts
    expected: float = 1.0
    decay: float = 0.9

    @property
    def ratio(self) -> float:
        return self.accepted / max(self.expected, 1e-9)

    def observe(self, expected: float, accepted: int) -> None:
        self.accepted = self.decay * self.accepted + accepted
        self.expected = self.decay * self.expected + expected

    def copy(self, decay: float) -> Calibration:
        return Calibration(self.accepted, self.expected, decay)


# A draft must raise the expected rate by this share to be asked for (n drafts added at once: (1 + MIN_GAIN)ⁿ).
# The cost grid's marginal cost of a row is uncertain by about 2× between runs (8 sequences × 2 tokens cost 26, 35
# and 68 ms more than × 1 in three grids), and K = 4 measured 9–19% below speculation off from 8 sequences on while
# gains of a few % were predicted.
MIN_GAIN = 0.03


def choose_ks(
    fed: list[int],
    wanted: list[int],
    estimates: list[LoadEstimate],
    cost: ForwardCosts,
    prefilling: Sequence[int] = (),
) -> list[int]:
    """Drafts per answer for one batched step. fed: tokens each answer feeds without drafts (1, or its prompt);
    wanted: the most each may draft; prefilling: tokens of the prompts read in chunks in the same forward, load
    that emits nothing. Greedily adds the drafts that raise the batch's expected tokens per second most per draft,
    Σ tokens_i(K_i) ÷ (forward(B, Σ fed_i + rows_i(K_i)) + Σ K_i · draft_s_i), until none raises it: at light
    load drafts ride a memory-bound forward nearly free, past the ridge they cost more than they bring. One answer
    may gain several at once: a tree's node of rank i may bring more than the one before it (a sibling the target
    takes more often than the draft's first choice)."""
    ks = [0] * len(fed)
    wanted = [min(w, len(e.accepted)) for w, e in zip(wanted, estimates)]
    batch, base = len(fed) + len(prefilling), sum(fed) + sum(prefilling)

    def rate(ks: list[int]) -> float:
        tokens = sum(e.tokens(k) for e, k in zip(estimates, ks))
        rows = base + sum(e.rows(k) for e, k in zip(estimates, ks))
        return tokens / (cost(batch, rows) + sum(k * e.draft_s for e, k in zip(estimates, ks)))

    best = rate(ks)
    while True:
        tries = []
        for i in range(len(ks)):
            for k in range(ks[i] + 1, wanted[i] + 1):
                added, r = k - ks[i], rate(ks[:i] + [k] + ks[i + 1 :])
                if r > best * (1 + MIN_GAIN) ** added:  # each draft must earn its share
                    tries.append(((r - best) / added, -k, r, i))  # on a tie, the fewer drafts
        if not tries:
            return ks
        _, k, best, i = max(tries)
        ks[i] = -k


@dataclass
class _Running:
    answer: Answer
    estimate: LoadEstimate
    events: queue.Queue = field(default_factory=queue.Queue)  # StepEvents, or the exception that ended the answer
    drafted: bool = False  # a drafter has run for this answer
    abandoned: bool = False  # its reader stopped reading: leave at the next step
    note: str = ""  # why speculation stopped during its chunked prefill, told with its first event
    calibration: Calibration = field(default_factory=Calibration)
    confidence: list[float] | None = None  # this step's drafts' (Proposal.confidence), read when they were cut


# An answer's first steps make its first spoken chunk, and drafters guess an answer's opening words worse than the rest
# (the shipped heads: acceptance 0 on the first chunk's tokens, 0.5 later, docs/results.md): their acceptance is
# learned apart, so a drafter that misses openings costs the first chunk no verification.
OPENING_STEPS = 4

# Prompt tokens a joining answer feeds per step (chunked prefill): the answers already running wait for a forward
# of at most this many tokens more, not for a whole long prompt's.
PREFILL_CHUNK = 256


class BatchScheduler:
    """Runs every answer streamed through it on the compute thread (specdec/compute.py), one batched target forward
    per step; its loop is a compute job that serves the other jobs between steps, and ends when no answer is left.

    costs: measured forward costs; given, K per answer is chosen by load (choose_ks, capped by the answer's own K
    policy), else each answer drafts what its K policy says. prefill_chunk: a prompt longer than this is read this
    many tokens per step, in the forwards of the others' steps, so one long prompt cannot stall every answer.
    Greedy answers equal those of SpeculativeEngine.stream alone; with sampling, each answer draws from its own
    seeded generator, so its draws do not depend on others.
    """

    ALPHA_PRIOR = 0.5  # acceptance assumed for an answer before anything was measured

    def __init__(
        self, engine: SpeculativeEngine, costs: ForwardCosts | None = None, prefill_chunk: int = PREFILL_CHUNK
    ) -> None:
        if prefill_chunk < 1:
            raise ValueError(f"prefill chunk must be ≥ 1 token, got {prefill_chunk}")
        self.engine = engine
        self.costs = costs
        self.prefill_chunk = prefill_chunk
        self._running: list[_Running] = []
        self._joining: list[_Running] = []
        self._lock = threading.Lock()  # guards _joining and _looping
        self._looping = False  # the loop is queued or running on the compute thread
        # What answers' steps brought so far: one estimate for their opening steps, one for the steps after.
        self._opening_prior = LoadEstimate.geometric(self.ALPHA_PRIOR, decay=0.95)
        self._prior = LoadEstimate.geometric(self.ALPHA_PRIOR, decay=0.95)
        self._calibration = Calibration(decay=0.98)  # every answer's; each starts from it

    def stream(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        cancel: threading.Event | None = None,
        stats: SpecStats | None = None,
        session: EngineSession | None = None,
    ) -> Iterator[StepEvent]:
        """SpeculativeEngine.stream's contract; the steps run on the compute thread, batched with the others'."""
        answer = self.engine.new_answer(prompt_ids, config, session, cancel, stats)  # a bad prompt fails here
        estimate = self._opening_prior.copy(decay=0.7, forget=FORGET)
        return self._read(_Running(answer, estimate, calibration=self._calibration.copy(decay=0.9)))

    def _read(self, run: _Running) -> Iterator[StepEvent]:
        with self._lock:
            self._joining.append(run)
            if not self._looping:
                self._looping = True
                compute.submit(self._loop)
        try:
            while True:
                event = run.events.get()
                if isinstance(event, BaseException):
                    raise event
                yield event
                if event.finish_reason:
                    return
        finally:
            run.abandoned = True  # a reader that stops early (a closed client) frees its place in the batch

    @property
    def active(self) -> int:
        with self._lock:
            return len(self._running) + len(self._joining)

    def _loop(self) -> None:
        while True:
            with self._lock:
                if not self._running and not self._joining:
                    self._looping = False  # idle: the compute thread serves other jobs; the next answer loops again
                    return
                self._running += self._joining
                self._joining = []
            try:
                compute.serve_pending()
                self._step()
            except Exception as e:  # a bug must end the answers it hit, never the thread every answer waits on
                for run in self._running:
                    run.events.put(e)
                self._running = []

    def _step(self) -> None:
        runs = [r for r in self._running if not r.abandoned]  # a closed reader leaves without a forward
        self._running = runs
        if not runs:
            return
        chunks = [(r, end) for r in runs if (end := self._chunk_end(r.answer)) is not None]
        chunked = {id(r) for r, _ in chunks}
        stepping = [r for r in runs if id(r) not in chunked]
        prefilling = [self.prefill_chunk] * len(chunks)
        caps, cut = None, None
        if self.costs:
            caps = self._load_aware_ks(stepping, prefilling)

            def cut(proposals: list[Proposal | None]) -> list[int | None]:
                return self._verified_ks(stepping, proposals, prefilling)

        try:
            events = self.engine.step([r.answer for r in stepping], caps, [(r.answer, end) for r, end in chunks], cut)
        except Exception as e:  # every answer in this forward fails with it; their caches were reset
            for r in runs:
                r.events.put(e)
            self._running = []
            return
        for r, end in chunks:
            self._catch_up(r, end)
        finished = set()
        for r, event in zip(stepping, events):
            event.note, r.note = event.note or r.note, ""
            draft_time = r.drafted  # not the answer's first drafting step
            r.drafted = r.drafted or event.speculative
            r.estimate.observe(event, draft_time)
            if r.confidence is not None and event.speculative:
                expected = sum(r.confidence[: event.k_chosen])
                for calibration in (r.calibration, self._calibration):
                    calibration.observe(expected, event.accepted)
                r.confidence = None
            opening = r.answer.steps <= OPENING_STEPS
            if r.answer.drafter is not None:  # an answer that cannot draft tells nothing of drafts
                (self._opening_prior if opening else self._prior).observe(event, draft_time)
            if r.answer.steps == OPENING_STEPS:  # past its opening, an answer starts from what later steps brought
                r.estimate = self._prior.copy(decay=0.7, forget=FORGET)
            r.events.put(event)
            if event.finish_reason:
                finished.add(id(r))
        self._running = [r for r in runs if id(r) not in finished]  # in the order they joined

    def _chunk_end(self, answer: Answer) -> int | None:
        """Where this step's chunk of the answer's prompt ends; None once the rest fits one step (its own)."""
        cached = answer.cache.common_prefix(answer.ctx)
        if answer.cancelled or len(answer.ctx) - cached <= self.prefill_chunk:
            return None
        return cached + self.prefill_chunk

    @staticmethod
    def _catch_up(run: _Running, end: int) -> None:
        """After a chunk, the answer's drafters learn its context up to end; a failing one is dropped, as in a
        step, and the answer goes on with the target alone."""
        answer = run.answer
        for drafter in {id(d): d for d in (answer.observer, answer.drafter) if d}.values():
            try:
                catch_up(drafter, answer.ctx[:end], answer.cache)
            except Exception as e:
                run.note = f"drafter failed ({type(e).__name__}: {e}); continuing target-only"
                answer.drafter = answer.observer = None

    def _load_aware_ks(self, runs: list[_Running], prefilling: list[int]) -> list[int | None]:
        """Drafts to ask of each answer that asked for load-aware K: all its K policy wants where choose_ks, by what
        its drafts brought by rank, says drafting pays, else none (which of them to verify is chosen once drafted,
        _verified_ks). None for the others, whose drafts count as load, as do the prompts read in chunks
        (prefilling: their tokens)."""
        assert self.costs is not None
        answers = [r.answer for r in runs]
        aware = [a.load_aware for a in answers]
        wanted = [self.engine.wanted_k(a) for a in answers]
        fed = [b if a else b + w for a, b, w in zip(aware, self._fed(runs), wanted)]
        estimates = [r.estimate for r in runs]
        ks = choose_ks(fed, [w if a else 0 for a, w in zip(aware, wanted)], estimates, self.costs, prefilling)
        return [(w if k else 0) if a else None for a, k, w in zip(aware, ks, wanted)]

    def _verified_ks(
        self, runs: list[_Running], proposals: list[Proposal | None], prefilling: list[int]
    ) -> list[int | None]:
        """Once every answer has drafted: how many of each load-aware answer's drafts to verify (Proposal.best), by
        choose_ks with each draft's chance this step, its confidence × the answer's Calibration (a drafter without
        confidence: by rank, from the answer's LoadEstimate), the drafting already paid. An average by rank
        verified one draft a step where the heads, asked for their best 3–6 every step, brought 1.94 tokens a
        forward against 1.57 (docs/results.md): how sure the heads are varies step by step. The confidences are
        read from the device here, once a step."""
        assert self.costs is not None
        aware = [r.answer.load_aware and p is not None and p.cuttable for r, p in zip(runs, proposals)]
        drafted = [0 if p is None else len(p.tokens) for p in proposals]
        sure = [p.confidence for p in proposals if p is not None and p.confidence is not None]
        values = iter(torch.cat(sure).tolist() if sure else [])  # one read for the batch
        estimates = []
        for r, p, n in zip(runs, proposals, drafted):
            r.confidence = None
            if p is not None and p.confidence is not None:
                r.confidence = [next(values) for _ in range(len(p.confidence))]
            if r.confidence is None:
                estimates.append(replace(r.estimate, draft_s=0.0))
            else:
                ratio = r.calibration.ratio
                estimates.append(LoadEstimate([min(1.0, ratio * c) for c in r.confidence], [1.0] * n, 0.0))
        fed = [b if a else b + n for a, b, n in zip(aware, self._fed(runs), drafted)]
        ks = choose_ks(fed, [n if a else 0 for a, n in zip(aware, drafted)], estimates, self.costs, prefilling)
        return [k if a else None for a, k in zip(aware, ks)]

    @staticmethod
    def _fed(runs: list[_Running]) -> list[int]:
        """Tokens each answer feeds without drafts: 1, or what its cache lacks (a prompt)."""
        return [max(1, len(r.answer.ctx) - r.answer.cache.common_prefix(r.answer.ctx)) for r in runs]
