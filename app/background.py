"""The app's load control: simulated conversations answering prompts back to back through the batch scheduler, beside
the real ones, so a presenter can show speculation helping one user and hurting many, and the load-aware K keeping
the better (bench-load's synthetic users too). The server runs the most that any open tab asked for, never fewer than
its floor (--background-conversations); what a tab asked for ends when it closes."""

from __future__ import annotations

import dataclasses
import itertools
import logging
import threading
import time
from collections.abc import Callable

from pipeline.llm_provider import EngineProvider, LLMProvider
from specdec.bench import read_prompts
from specdec.engine import GenerationConfig, StepEvent
from specdec.models import asset_path
from specdec.sampling import SamplingParams
from specdec.scheduler import BatchScheduler
from specdec.session import EngineSession

log = logging.getLogger("specvoice.app")
# The simulated conversations ask the shipped training prompts (never a benchmark prompt).
BACKGROUND_PROMPTS = asset_path("prompts", "train_prompts.jsonl")


class BackgroundLoad:
    """Simulated conversations answering prompts back to back through a scheduler."""

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


def simulated_users(llm: LLMProvider) -> BackgroundLoad:
    """The app's background conversations: the training prompts after the system prompt, answered with the
    configured budget and temperature, as a user's are."""
    if not isinstance(llm, EngineProvider) or llm.scheduler is None:
        raise ValueError("background load needs the in-process engine with batching (specvoice app)")
    c, tokenizer = llm.config, llm.engine.target.tokenizer
    system = {"role": "system", "content": c.system_prompt}
    prompts = [
        tokenizer.chat_ids([system, {"role": "user", "content": row["prompt"]}])
        for row in read_prompts(str(BACKGROUND_PROMPTS))
    ]
    config = GenerationConfig(c.max_new_tokens, SamplingParams(c.temperature))
    return BackgroundLoad(llm.scheduler, prompts, config, on_error=_failed)


def _failed(error: Exception) -> None:
    log.warning("a background conversation stopped: %s: %s", type(error).__name__, error)


class LoadControl:
    """The server's background load: the most that any open tab asked for, never under floor. A tab can add load
    for everyone while it is open, never take away what another tab (or the server's option) asked for."""

    def __init__(self, load: BackgroundLoad, floor: int = 0) -> None:
        self.load = load
        self.floor = floor
        self._asked: dict[str, int] = {}  # by the tab's token
        self._lock = threading.Lock()
        load.set(floor)

    @property
    def count(self) -> int:
        return self.load.count

    def set(self, n: int, owner: str) -> None:
        """The tab named owner asks for n conversations, until it asks again or closes."""
        if n < 0:
            raise ValueError(f"background conversations must be ≥ 0, got {n}")
        with self._lock:
            self._asked[owner] = n
            self._apply()

    def release(self, owner: str) -> bool:
        """The tab named owner closed: what it asked for ends. True if the load changed."""
        with self._lock:
            before = self.load.count
            self._asked.pop(owner, None)
            self._apply()
            return self.load.count != before

    def _apply(self) -> None:
        self.load.set(max([self.floor, *self._asked.values()]))
