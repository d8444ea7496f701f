"""The pipeline's typed events (pipeline/events.py) as the page's wire messages: made here alone."""

from __future__ import annotations

import dataclasses

from pipeline.events import AnswerStep, Busy, EarlyAnswer, Failure, Info, Notice, Partial, Transcript, VoiceActivity

NOTICE_TYPES: dict[type, str] = {
    VoiceActivity: "vad",
    Partial: "partial",
    Transcript: "transcript",
    EarlyAnswer: "early",
    Info: "info",
    Failure: "error",
    Busy: "busy",
}
STEP_FACTS = (
    "step_tokens",
    "drafted",
    "accepted",
    "k_chosen",
    "batch_size",
)  # LLMDelta's names, on the wire as they are


def notice_message(notice: Notice) -> dict:
    """{"type": …, and the notice's fields by their names}."""
    return {"type": NOTICE_TYPES[type(notice)], **dataclasses.asdict(notice)}


def token_message(step: AnswerStep, turn: int, step_tokens_per_s: float | None) -> dict:
    """One LLM step of turn's answer, for the live panels."""
    delta = step.delta
    return {
        "type": "token",
        "turn": turn,
        "pieces": [list(p) for p in delta.pieces],
        **{name: getattr(delta, name) for name in STEP_FACTS},
        "answer_tokens": step.answer_tokens,
        "tokens_per_s": step.tokens_per_s,
        "step_tokens_per_s": step_tokens_per_s,
    }
