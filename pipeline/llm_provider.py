"""Where each conversation's LLM stage comes from, built from the configuration: the in-process speculative engine
(every conversation with its own KV caches, all batched through one scheduler), or one stage shared by all (an
OpenAI-compatible server, or a test's fake). The provider warms its stages up before anyone waits."""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass

from specdec.build import EngineSpec, build_engine
from specdec.cost_grid import cached_forward_costs
from specdec.engine import SpeculativeEngine
from specdec.fields import option
from specdec.sampling import SamplingParams
from specdec.scheduler import PREFILL_CHUNK, BatchScheduler
from specdec.session import EngineSession
from specdec.tokenizer import shared_prefix_ids

from .llm import SYSTEM_PROMPT, EngineLLM, LLMStage, ReplyStats

# A prefill and a few steps (speculative ones with speculation on) pay every first-call cost; the rest of a reply
# pays none, and took ~1 s of every start.
WARMUP_STEPS_PER_MODE = 4
LLM_WARMUP_STEPS = ("forward costs for the load-aware K", "LLM, speculation off", "LLM, speculation on")


@dataclass
class LLMConfig:
    """The LLM stage's configuration, each field but the system prompt a command-line option (specdec/fields.py)."""

    engine: EngineSpec = option(factory=EngineSpec)
    max_new_tokens: int = option(80)
    # A batch step re-reads at most this much of one conversation. Capped by the model's context less max_new_tokens.
    prompt_tokens: int = option(
        2048,
        flag="--max-prompt-tokens",
        at_least=1,
        help="the whole prompt (system, history, the user's turn) in tokens; the oldest exchanges go first",
    )
    prefill_chunk: int = option(
        PREFILL_CHUNK,
        at_least=1,
        help="a long prompt is read this many tokens per batched step, so one user cannot stall the others",
    )
    system_prompt: str = SYSTEM_PROMPT
    temperature: float = option(0.0)
    seed: int = option(
        0,
        help="sampling seed: the same seed gives the same answer with a fixed --k and --no-auto-off "
        "(AdaptiveK and the governor decide from measured times)",
    )
    llm_url: str | None = option(
        None, help="use an OpenAI-compatible server (e.g. vLLM) as the LLM stage instead of the engine"
    )
    llm_url_no_spec: str | None = option(None, help="a target-only server for speculation-off turns")


class LLMProvider:
    """Gives each conversation its LLM stage. engine and scheduler: the in-process engine's (every answer's steps run
    on the scheduler's loop, on the compute thread), else None."""

    engine: SpeculativeEngine | None = None
    scheduler: BatchScheduler | None = None

    def __init__(self, system_prompt: str) -> None:
        self.system_prompt = system_prompt

    def for_conversation(self) -> LLMStage:
        raise NotImplementedError

    def warmup(self, progress: Callable[[int], None] = lambda step: None) -> None:
        """Pay the first-call costs (kernels for both LLM modes, the forward costs the load-aware K reads) before
        anyone waits; progress(i) as LLM_WARMUP_STEPS[i] starts."""
        progress(0)
        self._measure_forward_costs()
        llm = self.for_conversation()
        hi = [{"role": "system", "content": self.system_prompt}, {"role": "user", "content": "Say hi."}]
        for step, speculation in enumerate((False, True), start=1):
            progress(step)
            enough = threading.Event()
            for n, _ in enumerate(llm.stream_reply(hi, speculation, ReplyStats(), enough), start=1):
                if n == WARMUP_STEPS_PER_MODE:
                    enough.set()

    def _measure_forward_costs(self) -> None:
        pass


class SharedProvider(LLMProvider):
    """One stage for every conversation: a remote server keeps no per-conversation state here."""

    def __init__(self, llm: LLMStage, system_prompt: str = SYSTEM_PROMPT) -> None:
        super().__init__(system_prompt)
        self.llm = llm

    def for_conversation(self) -> LLMStage:
        return self.llm


class EngineProvider(LLMProvider):
    """The in-process engine: each conversation keeps its KV caches between turns, the system prompt prefilled once.
    Every answer's steps run on the scheduler's loop (the compute thread), so its reader speaks while the target
    steps on; the conversations' steps share its forwards, with K chosen by load once warm-up has measured the
    forward costs (config.engine.batched and load_aware)."""

    def __init__(self, config: LLMConfig) -> None:
        super().__init__(config.system_prompt)
        self.config = config
        self.engine, _ = build_engine(config.engine)
        self.scheduler = BatchScheduler(self.engine, prefill_chunk=config.prefill_chunk)
        self.shared_prefix = shared_prefix_ids(self.engine.target.tokenizer, config.system_prompt)

    def for_conversation(self) -> EngineLLM:
        session = EngineSession(self.engine)
        session.prefill(self.shared_prefix)  # the system prompt is paid once per conversation, not per turn
        c = self.config
        sampling = SamplingParams(c.temperature)
        return EngineLLM(self.engine, c.max_new_tokens, sampling, c.seed, session, self.scheduler, c.prompt_tokens)

    def _measure_forward_costs(self) -> None:
        if self.scheduler is not None and self.config.engine.batched and self.config.engine.load_aware:
            # the ridge, measured here once per machine, model and format (~30 s), then read from the cache
            self.scheduler.costs, _ = cached_forward_costs(self.engine)


def provider_from_config(config: LLMConfig) -> LLMProvider:
    """The remote server's stage when config.llm_url is set, else the in-process engine's."""
    if not config.llm_url:
        return EngineProvider(config)
    from .remote_llm import OpenAICompatibleLLM

    remote = OpenAICompatibleLLM(
        config.llm_url,
        base_url_no_spec=config.llm_url_no_spec,
        max_tokens=config.max_new_tokens,
        temperature=config.temperature,
    )
    return SharedProvider(remote, config.system_prompt)
