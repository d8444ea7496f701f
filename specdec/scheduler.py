"""Continuous batching: the active answers' steps share one target forward. Answers join and leave between steps,
each keeps its own KV cache, drafter and sampling generator, and the drafts per answer are chosen from the load.

Why the load matters: while a forward is memory-bound, B sequences × (K + 1) tokens cost about what B tokens do,
so drafts are nearly free; past the ridge every token fed costs compute, and a rejected draft is pure load.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from .cost_grid import ForwardCosts
from .engine import Answer, EngineSession, GenerationConfig, SpeculativeEngine, StepEvent
from .metrics import SpecStats


@dataclass
class LoadEstimate:
    """What the load-aware choice knows of one answer, per draft position i, as moving averages: proposed[i], the
    chance the drafter proposes position i when asked for more than i drafts, and accepted[i], the chance position i
    is proposed and accepted. A confidence gate stops drafters short (the shipped heads propose under one draft
    per step when asked for four), so these, not a geometric α, say what asking for K drafts brings:
    1 + Σ_{i<K} accepted[i] tokens for Σ_{i<K} proposed[i] verified rows, and K · draft_s seconds of drafting."""

    accepted: list[float]
    proposed: list[float]
    draft_s: float  # seconds per draft asked for
    decay: float = 0.7

    @classmethod
    def geometric(cls, alpha: float, draft_s: float = 0.0, positions: int = 16, decay: float = 0.7) -> LoadEstimate:
        """A drafter that always proposes and whose drafts are each accepted with probability α (Leviathan et al.)."""
        return cls([alpha ** (i + 1) for i in range(positions)], [1.0] * positions, draft_s, decay)

    def copy(self, decay: float) -> LoadEstimate:
        return LoadEstimate(list(self.accepted), list(self.proposed), self.draft_s, decay)

    def tokens(self, k: int) -> float:
        return 1.0 + sum(self.accepted[:k])

    def rows(self, k: int) -> float:
        return sum(self.proposed[:k])

    def observe(self, event: StepEvent, draft_time: bool = True) -> None:
        """draft_time False: the step's draft time is not a draft's cost (a draft model's first step in an answer
        also prefills the prompt)."""
        if not event.speculative or not event.k_chosen:
            return
        keep = self.decay
        for i in range(min(event.k_chosen, len(self.accepted))):
            self.proposed[i] = keep * self.proposed[i] + (1 - keep) * (i < event.drafted)
            self.accepted[i] = keep * self.accepted[i] + (1 - keep) * (i < event.accepted)
        if draft_time:
            self.draft_s = keep * self.draft_s + (1 - keep) * event.draft_seconds / event.k_chosen


# A draft must raise the expected rate by this share to be asked for. The cost grid's marginal cost of a row is
# uncertain by about 2× between runs (8 sequences × 2 tokens cost 26, 35 and 68 ms more than × 1 in three grids),
# and K = 4 measured 9–19% below speculation off from 8 sequences on while gains of a few % were predicted.
MIN_GAIN = 0.03


def choose_ks(fed: list[int], wanted: list[int], estimates: list[LoadEstimate], cost: ForwardCosts) -> list[int]:
    """Drafts per answer for one batched step. fed: tokens each answer feeds without drafts (1, or its prompt);
    wanted: the most each may draft. Greedily adds the draft that raises the batch's expected tokens per second
    most, Σ tokens_i(K_i) ÷ (forward(B, Σ fed_i + rows_i(K_i)) + Σ K_i · draft_s_i), until no draft raises it: at
    light load drafts ride a memory-bound forward nearly free, past the ridge they cost more than they bring."""
    ks = [0] * len(fed)
    wanted = [min(w, len(e.accepted)) for w, e in zip(wanted, estimates)]

    def rate(ks: list[int]) -> float:
        tokens = sum(e.tokens(k) for e, k in zip(estimates, ks))
        rows = sum(fed) + sum(e.rows(k) for e, k in zip(estimates, ks))
        return tokens / (cost(len(fed), rows) + sum(k * e.draft_s for e, k in zip(estimates, ks)))

    best = rate(ks)
    while True:
        tries = []
        for i in range(len(ks)):
            if ks[i] < wanted[i]:
                ks[i] += 1
                tries.append((rate(ks), i))
                ks[i] -= 1
        if not tries or max(tries)[0] <= best * (1 + MIN_GAIN):
            return ks
        best, i = max(tries)
        ks[i] += 1


@dataclass
class _Running:
    answer: Answer
    estimate: LoadEstimate
    events: queue.Queue = field(default_factory=queue.Queue)  # StepEvents, or the exception that ended the answer
    drafted: bool = False  # a drafter has run for this answer
    abandoned: bool = False  # its reader stopped reading: leave at the next step


class BatchScheduler:
    """Runs every answer streamed through it on one thread, one batched target forward per step.

    costs: measured forward costs; given, K per answer is chosen by load (choose_ks, capped by the answer's own K
    policy), else each answer drafts what its K policy says. Greedy answers equal those of SpeculativeEngine.stream
    alone; with sampling, each answer draws from its own seeded generator, so its draws do not depend on others.
    """

    ALPHA_PRIOR = 0.5  # acceptance assumed for an answer before anything was measured

    def __init__(self, engine: SpeculativeEngine, costs: ForwardCosts | None = None) -> None:
        self.engine = engine
        self.costs = costs
        self._running: list[_Running] = []
        self._joining: list[_Running] = []
        self._lock = threading.Lock()  # guards _joining and _thread
        self._thread: threading.Thread | None = None
        self._prior = LoadEstimate.geometric(self.ALPHA_PRIOR, decay=0.95)

    def stream(
        self,
        prompt_ids: list[int],
        config: GenerationConfig,
        cancel: threading.Event | None = None,
        stats: SpecStats | None = None,
        session: EngineSession | None = None,
    ) -> Iterator[StepEvent]:
        """SpeculativeEngine.stream's contract; the steps run on the scheduler's thread, batched with the others."""
        answer = self.engine.new_answer(prompt_ids, config, session, cancel, stats)  # a bad prompt fails here
        return self._read(_Running(answer, self._prior.copy(decay=0.7)))

    def _read(self, run: _Running) -> Iterator[StepEvent]:
        with self._lock:
            self._joining.append(run)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="batch-scheduler", daemon=True)
                self._thread.start()
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
                    self._thread = None  # idle: the next answer starts a new one (no thread left per scheduler)
                    return
                self._running += self._joining
                self._joining = []
            try:
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
        answers = [r.answer for r in runs]
        caps = self._load_aware_ks(runs) if self.costs else None
        try:
            events = self.engine.step(answers, caps)
        except Exception as e:  # every answer in this forward fails with it; their caches were reset
            for r in runs:
                r.events.put(e)
            self._running = []
            return
        staying = []
        for r, event in zip(runs, events):
            draft_time = r.drafted  # not the answer's first drafting step
            r.drafted = r.drafted or event.speculative
            r.estimate.observe(event, draft_time)
            self._prior.observe(event, draft_time)
            r.events.put(event)
            if not event.finish_reason:
                staying.append(r)
        self._running = staying

    def _load_aware_ks(self, runs: list[_Running]) -> list[int | None]:
        """K caps for the answers that asked for load-aware K; None for the others, whose drafts count as load."""
        assert self.costs is not None
        answers = [r.answer for r in runs]
        aware = [a.load_aware for a in answers]
        base = [max(1, len(a.ctx) - a.cache.common_prefix(a.ctx)) for a in answers]
        wanted = [self.engine.wanted_k(a) for a in answers]
        fed = [b if a else b + w for a, b, w in zip(aware, base, wanted)]
        estimates = [r.estimate for r in runs]
        ks = choose_ks(fed, [w if a else 0 for a, w in zip(aware, wanted)], estimates, self.costs)
        return [k if a else None for a, k in zip(aware, ks)]


class BackgroundLoad:
    """Simulated conversations answering prompts back to back through a scheduler: the app's load control, so a
    presenter can show speculation helping one user and hurting many, and the load-aware K keeping the better."""

    def __init__(
        self,
        scheduler: BatchScheduler,
        prompts: list[list[int]],
        config: GenerationConfig,
        on_event: Callable[[int, StepEvent, float], None] | None = None,
        on_error: Callable[[Exception], None] | None = None,
    ) -> None:
        """config: every answer's (its seed varies by turn); on_event(conversation, event, time) sees every step."""
        if not prompts:
            raise ValueError("background load needs at least one prompt")
        self.scheduler = scheduler
        self.prompts = prompts
        self.config = config
        self.on_event = on_event
        self.on_error = on_error
        self._stops: list[threading.Event] = []
        self._threads: list[threading.Thread] = []

    @property
    def count(self) -> int:
        return len(self._stops)

    def set(self, n: int) -> None:
        """Run n background conversations: start the missing ones, stop the extra ones at their next step."""
        if n < 0:
            raise ValueError(f"background conversations must be ≥ 0, got {n}")
        while len(self._stops) < n:
            stop = threading.Event()
            index = len(self._stops)
            thread = threading.Thread(target=self._converse, args=(index, stop), daemon=True, name=f"load-{index}")
            self._stops.append(stop)
            self._threads.append(thread)
            thread.start()
        while len(self._stops) > n:
            self._stops.pop().set()
            self._threads.pop()

    def _converse(self, index: int, stop: threading.Event) -> None:
        session = EngineSession(self.scheduler.engine)
        for turn in itertools.count():
            prompt = self.prompts[(index + turn) % len(self.prompts)]
            try:
                config = dataclasses.replace(self.config, seed=turn)
                for event in self.scheduler.stream(prompt, config, stop, session=session):
                    if self.on_event is not None:
                        self.on_event(index, event, time.perf_counter())
            except Exception as e:  # a background conversation must never take the app down
                if self.on_error is not None:
                    self.on_error(e)
                return
            if stop.is_set():
                return
