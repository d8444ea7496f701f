"""Model loading for the app: on a background thread, so the page is up at once and says how far loading got."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from pipeline.agent import AgentConfig, VoiceAgent, make_transcriber
from pipeline.tts import make_tts
from specdec.build import fixed_k
from specdec.openings import openings_file
from specdec.quant_cache import early_packing

from . import page
from .heap import process_memory_mb

log = logging.getLogger("specvoice.app")


class ModelLoader:
    """Loads the agent on a background thread so the page is up (and says how far loading got) at once, then warms
    every stage: the app is ready only when its first turn is as fast as later ones."""

    LOAD_STEPS = ("speech recognition", "text to speech", "language models")
    STEPS = LOAD_STEPS + tuple(f"warm-up: {step}" for step in VoiceAgent.WARMUP_STEPS)

    def __init__(
        self,
        config: AgentConfig,
        on_change: Callable[[dict], None] = lambda status: None,
        build: Callable[[Callable[[int], None]], VoiceAgent] | None = None,
    ) -> None:
        self.config = config
        self.on_change = on_change
        self._build = build or self._build_agent
        self.agent: VoiceAgent | None = None
        self.error: str | None = None
        self.finished = threading.Event()  # loading is over: ready, or failed
        self.step = -1
        self.step_s: list[tuple[str, float]] = []  # the steps done and their seconds
        self.t0 = self._step_t0 = time.perf_counter()
        self.load_s: float | None = None

    def prepack(self) -> None:
        """Start packing the target's cached int8 layers now (specdec.quant_cache.early_packing): C++ work that holds
        no GIL, so it runs beside the page's build on the other core. The load takes the layers when it gets there."""
        if not self.config.llm_url:
            engine = self.config.engine
            early_packing.start(engine.target, engine.target_quant, engine.dtype)

    def start(self) -> None:
        self.t0 = self._step_t0 = time.perf_counter()
        threading.Thread(target=self._run, name="model-loader", daemon=True).start()

    def _end_step(self) -> None:
        now = time.perf_counter()
        if self.step >= 0:
            self.step_s.append((self.STEPS[self.step], now - self._step_t0))
        self._step_t0 = now

    def _advance(self, step: int) -> None:
        self._end_step()
        self.step = step
        log.info("loading %s (%.1f s elapsed)", self.stage(), self._step_t0 - self.t0)
        self.on_change(self.status())

    def _build_agent(self, progress: Callable[[int], None]) -> VoiceAgent:
        progress(0)
        transcriber = make_transcriber(self.config)
        progress(1)
        tts = make_tts(self.config.tts, self.config.engine.device)
        progress(2)
        return VoiceAgent(self.config, transcriber=transcriber, tts=tts)

    def _run(self) -> None:
        try:
            agent = self._build(self._advance)
            agent.warmup(lambda step: self._advance(len(self.LOAD_STEPS) + step))
            self.agent = agent
        except Exception as e:  # shown on the page; the server stays up to say so
            log.exception("loading the models failed")
            self.error = f"{type(e).__name__}: {e}"
        self._end_step()
        self.load_s = time.perf_counter() - self.t0
        if self.agent is not None:
            log.info("models loaded and warmed up in %.1f s: ready", self.load_s)
        self.finished.set()
        self.on_change(self.status())

    @property
    def ready(self) -> bool:
        return self.agent is not None

    @property
    def loading(self) -> bool:
        return not self.finished.is_set()

    def failed_message(self) -> str:
        return f"The models failed to load ({self.error}); nothing can be answered. Restart the app."

    def stage(self) -> str:
        if self.step < 0:
            return "starting"
        return f"step {self.step + 1}/{len(self.STEPS)}: {self.STEPS[self.step]}"

    def status(self) -> dict:
        status = {
            "type": "status",
            "ready": self.ready,
            "error": self.error,
            "stage": self.stage(),
            "step": self.step,
            "steps": len(self.STEPS),
            "step_s": list(self.step_s),
            "elapsed_s": time.perf_counter() - self.t0,
            "load_s": self.load_s,
            "memory": process_memory_mb(),  # the server process's, resident and peak (docs/results.md: the breakdown)
        }
        if self.agent is not None:
            llm = self.agent.llm
            status.update(
                batched=self.config.engine.batched,
                drafters=llm.engine.switchable_drafters() if llm.engine else [],
                k=self.config.engine.k,
                temperature=self.config.temperature,
                engine=self.describe(),
                forward_costs=self.forward_costs(),
                end_of_turn=self.agent.turn_end_status,  # says when Smart Turn fell back to the words rule
            )
        return status

    def forward_costs(self) -> dict | None:
        """The forward-cost grid measured at warm-up, for the page's verify-cost curve and predicted speedup: the
        batch-1 forward in ms by tokens fed (n = 1 + K for every K an answer may draft, interpolated between the
        measured sizes as the load-aware K reads them), and the whole grid. None without one (a remote LLM, or the
        load-aware K off)."""
        scheduler = self.agent.llm.scheduler if self.agent else None
        if scheduler is None or scheduler.costs is None:
            return None
        e = self.config.engine
        k_most = max(*page.K_CHOICES, e.k_max, fixed_k(e.k) or 0)
        return {
            "batch1_ms": [1000 * scheduler.costs(1, n) for n in range(1, k_most + 2)],
            "grid": scheduler.costs.as_dict(),
        }

    def describe(self) -> dict:
        """The configuration in words, for the page. Its defaults are the measured fastest (docs/results.md)."""
        c, e = self.config, self.config.engine
        target = f"{e.target} {e.dtype if e.target_quant == 'none' else e.target_quant}"
        draft = e.draft if e.draft in ("none", "ngram") else f"{e.draft} {e.draft_quant}"
        window = f"{c.asr_window_s:g} s window" if c.asr_window_s else "30 s window"
        return {
            "llm": c.llm_url or f"{target} + {draft} ({e.device})",
            "asr": f"{c.asr_model}, beam {c.asr_beam_size}, {window}",
            "tts": c.tts,
            "k": e.k,
            "preemptive": c.preemptive,
            "prefill_while_speaking": c.prefill_while_speaking,
            "opening_echo": (echo := not c.llm_url and e.opening_echo and e.draft == "heads"),
            "opening_guesses": echo and openings_file(e.opening_table, e.target) is not None,
            "first_chunk_words": c.first_chunk_words,
        }
