"""The LLM stage: chat messages in, a stream of text deltas (with speculation facts) out."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Protocol

from specdec.build import k_policy_factory
from specdec.engine import EndProbe, GenerationConfig, PromptError, SpeculativeEngine
from specdec.kpolicy import KPolicy
from specdec.metrics import SpecStats
from specdec.sampling import SamplingParams
from specdec.scheduler import BatchScheduler
from specdec.session import EngineSession
from specdec.tokenizer import IncrementalDecoder, common_prefix_length, words_start

from .turn_end import END_PUNCTUATION, unclosed

SYSTEM_PROMPT = (
    "You are a friendly voice assistant. Answer in one to three short spoken sentences, plain words, "
    "no lists, no markdown, no code unless asked."
)


@dataclass
class LLMDelta:
    """One step of the LLM stage: its facts named as specdec.events.StepEvent names them, and the wire too."""

    text: str  # newly decoded text (may be empty while a multi-byte character is incomplete)
    step_tokens: int  # tokens emitted this step (StepEvent.tokens, counted)
    t: float  # time.perf_counter() when the stage yielded it
    pieces: list[tuple[str, bool | None]] = field(default_factory=list)  # per token: (text, from an accepted draft)
    drafted: int = 0  # draft tokens proposed this step
    accepted: int = 0  # of those, accepted
    k_chosen: int = 0  # metrics.DEFINITIONS["k_chosen"]
    batch_size: int = 1  # metrics.DEFINITIONS["batch_size"], of this step's target forward
    finish_reason: str | None = None
    end_of_message_probability: float | None = None  # metrics.DEFINITIONS; an early answer's first delta
    done_t: float | None = None  # StepEvent.done_t: when the step's forward and verdict were done (None: unknown)


@dataclass
class ReplyStats:
    """Facts about one reply, filled while it streams."""

    tokens: int = 0
    first_step_tokens: int = 0  # tokens that arrived with the first one (several, with speculation)
    first_token_t: float | None = None
    last_token_t: float | None = None
    spec: SpecStats = field(default_factory=SpecStats)
    notes: list[str] = field(default_factory=list)
    prefilled_while_speaking_tokens: int = 0  # the user's words already in the KV cache when the answer started

    def add(self, tokens: int, t: float) -> None:
        """Tokens that arrived together at time t."""
        if self.first_token_t is None:
            self.first_token_t, self.first_step_tokens = t, tokens
        self.last_token_t = t
        self.tokens += tokens

    @property
    def tokens_per_s(self) -> float:
        """metrics.DEFINITIONS["tokens_per_s"], voice turn: the decode rate after the first step."""
        later = self.tokens - self.first_step_tokens
        if later < 1 or self.last_token_t is None or self.first_token_t is None:
            return 0.0
        return later / max(self.last_token_t - self.first_token_t, 1e-9)


@dataclass(frozen=True)
class Controls:
    """The page's per-conversation controls (None: leave it as it is): the drafter ("draft-model", "heads",
    "ngram"), K ("4", "adaptive"), the temperature, and whether a batched answer's K is capped by load."""

    drafter: str | None = None
    k: str | None = None
    temperature: float | None = None
    load_aware: bool | None = None


class LLMStage(Protocol):
    """What a conversation's LLM stage does for its callers (EngineLLM, the remote server's, a test's fake)."""

    name: str
    keeps_cache: bool  # whether prefill_words reads anything ahead (a cache kept until the answer)

    def stream_reply(
        self,
        messages: list[dict[str, str]],
        speculation: bool,
        stats: ReplyStats,
        cancel: threading.Event | None = None,
        end_probe: bool = False,
    ) -> Iterator[LLMDelta]:
        """The reply, delta by delta. end_probe: an answer started at a pause; its first delta carries
        end_of_message_probability where the stage can read it (None elsewhere)."""
        ...

    def configure(self, controls: Controls) -> None:
        """The page's per-conversation controls; ValueError where the stage has none of them."""
        ...

    def prefill_words(self, messages: list[dict[str, str]]) -> None:
        """Read the prompt up to the last message's words (the user's, still speaking) ahead of the answer; nothing
        where the stage keeps no cache. Not concurrently with an answer."""
        ...

    def rewind(self) -> None:
        """Back to the state a paired run starts from (only the system prompt cached); nothing where nothing is
        kept between turns."""
        ...


class EngineLLM:
    """The in-process speculative engine as the LLM stage."""

    def __init__(
        self,
        engine: SpeculativeEngine,
        max_new_tokens: int = 96,
        sampling: SamplingParams | None = None,
        seed: int = 0,
        session: EngineSession | None = None,
        scheduler: BatchScheduler | None = None,
        prompt_tokens: int | None = None,
    ) -> None:
        self.name = "engine"
        self.keeps_cache = True
        self.engine = engine
        self.scheduler = scheduler  # given: this conversation's steps are batched with the others'
        self.tokenizer = engine.target.tokenizer
        self.max_new_tokens = max_new_tokens
        if prompt_tokens is not None and prompt_tokens < 1:
            raise ValueError(f"the prompt budget must be ≥ 1 token, got {prompt_tokens}")
        # the whole prompt's budget in tokens: what the context leaves beside the answer, or less
        self.prompt_room = engine.target.max_context - max_new_tokens
        if prompt_tokens is not None:
            self.prompt_room = min(prompt_tokens, self.prompt_room)
        self.sampling = sampling or SamplingParams()
        self.seed = seed
        self.session = session  # KV caches kept between this conversation's turns
        self.rewind_to = len(session.target.tokens) if session is not None else 0  # the shared prefix, prefilled
        self._spoken_prefix: tuple[list[int], int] | None = None  # prefill_words' tokens, and where the words begin
        self.k: str | None = None  # as configured; None: the engine's default K policy
        self.k_policy: Callable[[], KPolicy] | None = None  # k read once: a fresh policy per reply
        self.load_aware = True  # batched: K capped by load (specdec/scheduler.py)

    def configure(self, controls: Controls) -> None:
        c = controls
        if c.load_aware is not None:
            self.load_aware = c.load_aware
        if c.drafter is not None:
            if self.session is None:
                raise ValueError("switching drafters needs a conversation session")
            self.session.use_drafter(c.drafter)
        if c.k is not None:
            self.k_policy = k_policy_factory(c.k)
            self.k = c.k
        if c.temperature is not None:
            self.sampling = SamplingParams(c.temperature, self.sampling.top_p)

    def rewind(self) -> None:
        """Only the shared system-prompt prefix (cached when this stage was made) stays cached."""
        if self.session is not None:
            self.session.rollback(self.rewind_to)

    def prompt_ids(self, messages: list[dict[str, str]], stats: ReplyStats | None = None) -> list[int]:
        """The chat prompt within prompt_room tokens, the oldest exchanges dropped first. PromptError when the
        system prompt and the last message alone are over it."""
        return self._prompt(messages, stats)[0]

    def _prompt(
        self, messages: list[dict[str, str]], stats: ReplyStats | None
    ) -> tuple[list[int], int, list[dict[str, str]]]:
        """prompt_ids, where its last message's words begin, and the messages it holds."""
        fitted, ids = self._fit(messages)
        if len(ids) > self.prompt_room:
            raise PromptError(
                f"this turn's prompt is {len(ids)} tokens (the system prompt and your words), over the "
                f"{self.prompt_room}-token limit: say it in fewer words"
            )
        dropped = (len(messages) - len(fitted)) // 2
        if dropped and stats is not None:
            stats.notes.append(f"the oldest {dropped} exchanges dropped to fit the prompt's {self.prompt_room} tokens")
        return ids, words_start(self.tokenizer, fitted[:-1]), fitted

    def _fit(self, messages: list[dict[str, str]]) -> tuple[list[dict[str, str]], list[int]]:
        """The messages with the oldest user/assistant exchanges dropped until they fit prompt_room (or none is
        left), and their tokens."""
        msgs = list(messages)
        ids = self.tokenizer.chat_ids(msgs)
        has_system = bool(msgs) and msgs[0]["role"] == "system"
        while len(ids) > self.prompt_room and len(msgs) > 1 + has_system:
            del msgs[has_system : has_system + 2]  # one user/assistant exchange
            ids = self.tokenizer.chat_ids(msgs)
        return msgs, ids

    def prefill_words(self, messages: list[dict[str, str]]) -> None:
        """Prefill the prompt up to the end of the last message's words (the user's, still speaking): every
        prompt whose last message starts with them shares these tokens. Not concurrently with an answer."""
        if self.session is None:
            return
        fitted, _ = self._fit(messages)  # the history the answer keeps, as far as the words so far tell
        head, words = fitted[:-1], fitted[-1]["content"]
        ids = self._through_words(head, words)
        start = words_start(self.tokenizer, head)
        if start < len(ids) <= self.prompt_room:
            self.session.prefill(ids)
            self._spoken_prefix = (ids, start)

    def _through_words(self, head: list[dict[str, str]], words: str) -> list[int]:
        """The chat prompt's tokens up to the end of a user message's words after `head`: what every message starting
        with these words shares."""
        tails = (" a", " zz")  # the next word starts with a space: the words' own tokens are the shared ones
        with_words = [self.tokenizer.chat_ids([*head, {"role": "user", "content": words + tail}]) for tail in tails]
        return with_words[0][: common_prefix_length(*with_words)]

    def _end_probe(self, fitted: list[dict[str, str]], prompt: list[int], question_start: int) -> EndProbe | None:
        """Where the prompt's last message's words end (without closing punctuation) and the tokens that would end
        the message there: its end token in the chat template, or . ? ! (each when a token of its own). fitted and
        question_start: the prompt's messages and where their last one's words begin (_prompt's)."""
        head, words = fitted[:-1], unclosed(fitted[-1]["content"])
        if not words:
            return None
        ids = self._through_words(head, words)
        alone = self.tokenizer.chat_ids([*head, {"role": "user", "content": words}])
        if prompt[: len(ids)] != ids or len(alone) <= len(ids) or len(ids) <= question_start:
            return None
        closers = [self.tokenizer.encode(c) for c in END_PUNCTUATION]
        end_ids = {alone[len(ids)]} | {c[0] for c in closers if len(c) == 1}
        return EndProbe(len(ids), tuple(sorted(end_ids)))

    def stream_reply(
        self,
        messages: list[dict[str, str]],
        speculation: bool,
        stats: ReplyStats,
        cancel: threading.Event | None = None,
        end_probe: bool = False,
    ) -> Iterator[LLMDelta]:
        """The reply, step by step. end_probe: the first delta carries end_of_message_probability (at a pause)."""
        prompt, question_start, fitted = self._prompt(messages, stats)
        if self._spoken_prefix is not None:
            ids, start = self._spoken_prefix
            stats.prefilled_while_speaking_tokens = max(0, common_prefix_length(prompt, ids) - start)
            self._spoken_prefix = None
        config = GenerationConfig(
            self.max_new_tokens,
            self.sampling,
            self.seed,
            speculation,
            self.k_policy,
            self.load_aware,
            question_start,
            self._end_probe(fitted, prompt, question_start) if end_probe else None,
        )
        decoder = IncrementalDecoder(self.tokenizer)
        eos = self.tokenizer.eos_token_ids
        source = self.scheduler or self.engine
        for ev in source.stream(prompt, config, cancel, stats.spec, self.session):
            now = time.perf_counter()
            if ev.note:
                stats.notes.append(ev.note)
            stats.add(len(ev.tokens), now)
            pieces = [(decoder.push([t]), d) for t, d in zip(ev.tokens, ev.from_draft) if t not in eos]
            text = "".join(p for p, _ in pieces)
            yield LLMDelta(
                text,
                len(ev.tokens),
                now,
                pieces,
                ev.drafted,
                ev.accepted,
                ev.k_chosen,
                ev.batch_size,
                ev.finish_reason,
                ev.end_of_message_probability,
                ev.done_t,
            )
