"""One timeline per turn: every stage stamps it on the way, the UI and the CLI read the same JSON.

All marks are seconds on one monotonic clock (time.perf_counter). Stages are consecutive differences
between marks, so they add up exactly to ttfa_ms.
"""

from __future__ import annotations

from dataclasses import dataclass, field

# Marks in the order a turn passes them. TTFA runs from the first to "first_audio_out".
MARKS = (
    "speech_end",  # end of the last voiced user audio (not when end of turn was decided)
    "end_of_turn",  # the VAD's silence hang-over ran out
    "asr_final",  # the final transcript is ready
    "llm_first_token",  # the target emitted its first token (prefill + first step)
    "first_chunk_ready",  # the chunker released the first speakable text
    "first_audio_out",  # the TTS produced the first answer samples
)
STAGES = {  # stage name -> (from mark, to mark)
    "end_of_turn_wait": ("speech_end", "end_of_turn"),
    "asr": ("end_of_turn", "asr_final"),
    "llm_first_token": ("asr_final", "llm_first_token"),
    "first_chunk_tokens": ("llm_first_token", "first_chunk_ready"),
    "tts_first_audio": ("first_chunk_ready", "first_audio_out"),
}


@dataclass
class Timeline:
    marks: dict[str, float] = field(default_factory=dict)
    last_audio_out: float | None = None
    heard_ms: float | None = None  # filled by the browser: first sample heard, relative to speech_end
    first_chunk_tokens: int = 0  # tokens generated before the first chunk was released

    def mark(self, name: str, t: float) -> None:
        if name not in MARKS:
            raise KeyError(f"unknown timeline mark {name!r}")
        self.marks.setdefault(name, t)  # the first time counts

    def has(self, name: str) -> bool:
        return name in self.marks

    @property
    def ttfa_ms(self) -> float | None:
        if "speech_end" in self.marks and "first_audio_out" in self.marks:
            return (self.marks["first_audio_out"] - self.marks["speech_end"]) * 1000
        return None

    def stages_ms(self) -> dict[str, float]:
        return {
            name: (self.marks[b] - self.marks[a]) * 1000
            for name, (a, b) in STAGES.items()
            if a in self.marks and b in self.marks
        }

    def to_dict(self) -> dict:
        t0 = self.marks.get("speech_end")
        rel = {k: (v - t0) * 1000 for k, v in self.marks.items()} if t0 is not None else {}
        return {
            "ttfa_ms": self.ttfa_ms,
            "ttfa_heard_ms": self.heard_ms,
            "stages": self.stages_ms(),
            "marks_ms": rel,  # each mark relative to speech_end
            "last_audio_out_ms": (self.last_audio_out - t0) * 1000 if (t0 and self.last_audio_out) else None,
            "first_chunk_tokens": self.first_chunk_tokens,
        }
