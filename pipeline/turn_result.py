"""What one answered turn gave: its words, audio, timeline and the LLM's figures (VoiceAgent.respond's result)."""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .llm import ReplyStats
from .timeline import Timeline


@dataclass
class TurnResult:
    speculation: bool
    transcript: str
    answer: str
    spoken: str  # what reached the TTS (less than answer after a barge-in)
    timeline: Timeline
    stats: ReplyStats
    audio: list[np.ndarray]
    sample_rate: int
    cancelled: bool = False
    wasted_tokens: int = 0  # generated but never spoken (barge-in)
    discarded: bool = False  # an early answer thrown away before its turn ended: nothing of it was sent

    def to_dict(self) -> dict:
        spec = self.stats.spec
        tl = self.timeline.to_dict()
        return {
            "speculation": self.speculation,
            "transcript": self.transcript,
            "answer": self.answer,
            "spoken": self.spoken,
            "ttfa_ms": tl["ttfa_ms"],
            "stall_ms": tl["stall_ms"],
            "stages": tl["stages"],
            "timeline": tl,
            "first_chunk_tokens": self.timeline.first_chunk_tokens,
            "first_chunk_tokens_per_forward": tl["first_chunk_tokens_per_forward"],
            "chunk_handoff_ms": tl["chunk_handoff_ms"],
            "tokens": self.stats.tokens,
            "tokens_per_s": self.stats.tokens_per_s,
            "draft_acceptance_rate": spec.draft_acceptance_rate if spec.proposed else None,
            "tokens_per_target_forward": spec.tokens_per_target_forward if spec.speculative_steps else None,
            "rejected_draft_tokens": spec.proposed - spec.accepted,
            "wasted_tokens": self.wasted_tokens,
            "cancelled": self.cancelled,
            "saved_ms": tl["saved_ms"],
            "prefilled_while_speaking_tokens": self.stats.prefilled_while_speaking_tokens,
            "notes": self.stats.notes,
            "audio_seconds": sum(len(a) for a in self.audio) / self.sample_rate,
        }
