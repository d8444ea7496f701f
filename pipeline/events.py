"""What the pipeline tells its caller, as typed events: notices for the user while a turn is heard, and the steps of
an answer as it is generated and spoken. app/ alone turns them into the page's wire messages (app/wire.py); the
commands read them as they are."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

import numpy as np

from .llm import LLMDelta
from .turn_result import TurnResult

# --- notices: what the user should see while a turn is heard (the mic's thread, the listener's) ---------------------


@dataclass(frozen=True)
class VoiceActivity:
    event: Literal["listening", "speech_start", "end_of_turn"]


@dataclass(frozen=True)
class Partial:
    """The words heard so far, while the user speaks."""

    text: str


@dataclass(frozen=True)
class Transcript:
    """The turn's final words."""

    text: str


@dataclass(frozen=True)
class EarlyAnswer:
    """An answer started at a pause (pipeline/preemptive.py): started, kept as the turn's, or discarded."""

    event: Literal["started", "kept", "discarded"]
    text: str


@dataclass(frozen=True)
class Info:
    message: str


@dataclass(frozen=True)
class Failure:
    message: str


@dataclass(frozen=True)
class Busy:
    """No capacity for this turn: it is not answered."""

    message: str


Notice = VoiceActivity | Partial | Transcript | EarlyAnswer | Info | Failure | Busy
Notify = Callable[[Notice], None]


# --- an answer's events, in the order it makes them (its consumer thread) --------------------------------------------


@dataclass(frozen=True)
class AnswerStep:
    """One step of the LLM: its facts as LLMDelta names them, and the answer's totals so far."""

    delta: LLMDelta
    answer_tokens: int  # tokens of this answer so far, this step's included
    tokens_per_s: float  # ReplyStats.tokens_per_s so far


@dataclass(frozen=True)
class Chunk:
    """Text released to the TTS."""

    text: str


@dataclass(frozen=True)
class Audio:
    """Answer samples at the TTS's rate, as they are played."""

    samples: np.ndarray


@dataclass(frozen=True)
class AnswerDone:
    result: TurnResult


AnswerEvent = Transcript | AnswerStep | Chunk | Audio | AnswerDone
EventSink = Callable[[AnswerEvent], None]
