"""One timeline per turn: every stage stamps it on the way, the UI and the CLI read the same JSON.

All marks are seconds on one monotonic clock (time.perf_counter). Stages are consecutive differences
between marks, so they add up exactly to ttfa_ms. An answer started early (pipeline/preemptive.py) may reach a mark
before the turn is confirmed: a mark counts from when the turn had it, i.e. no earlier than the marks before it, so
the stages still add up, and what the early start hid is saved_ms()["preemptive"].
"""

from __future__ import annotations

import statistics
import threading
from dataclasses import dataclass, field

# Marks in the order a turn passes them. TTFA runs from the first to "first_audio_out".
MARKS = (
    "speech_end",  # end of the last voiced user audio (not when end of turn was decided)
    "end_of_turn",  # the VAD's silence hang-over ran out
    "asr_final",  # the final transcript is ready (its own time counted from end_of_turn: see TurnListener.finish)
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
    first_chunk_forwards: int = 0  # the target forwards that generated them (0: the LLM stage does not count them)
    early_start: float | None = None  # the answer started at the pause, before the turn was confirmed
    first_audio_ready: float | None = None  # the TTS had the first samples (held until confirmed if early)
    early_discarded: int = 0  # early answers of this turn thrown away (the user went on, or other final words)
    silence_rule_ms: float | None = None  # what a fixed silence would have waited, when words ended the turn
    pauses: list[dict] = field(default_factory=list)  # the turn's pauses: signals, wait chosen and why (listener)
    played_until: float | None = None  # when the answer audio out so far ends, played from its first sample on
    stall_s: float = 0.0  # metrics.DEFINITIONS["stall_ms"], in seconds
    chunk_handoffs_s: list[float] = field(default_factory=list)  # metrics.DEFINITIONS["chunk_handoff_ms"], each
    # the listener's threads (mic, ASR) and the answer's stamp one turn: each write holds it
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def mark(self, name: str, t: float) -> None:
        if name not in MARKS:
            raise KeyError(f"unknown timeline mark {name!r}")
        with self.lock:
            self.marks.setdefault(name, t)  # the first time counts

    def audio_out(self, t: float, seconds: float) -> None:
        """Answer samples lasting `seconds` left the TTS at t: a listener still playing earlier ones hears them
        next, one who has run out waited t − played_until in silence (a stall)."""
        self.mark("first_audio_out", t)
        with self.lock:
            self.last_audio_out = t
            if self.played_until is not None and t > self.played_until:
                self.stall_s += t - self.played_until
            self.played_until = max(t, self.played_until or t) + seconds

    def first_chunk(self, t: float, tokens: int, forwards: int) -> None:
        """The chunker released the first speakable text at t, after tokens from forwards target forwards."""
        self.mark("first_chunk_ready", t)
        with self.lock:
            self.first_chunk_tokens, self.first_chunk_forwards = tokens, forwards

    def chunk_to_tts(self, t: float, step_done_t: float | None) -> None:
        """A chunk reached the TTS at t; the step that completed it was done at step_done_t (None: unknown)."""
        with self.lock:
            if step_done_t is not None:
                self.chunk_handoffs_s.append(t - step_done_t)

    def audio_ready(self, t: float) -> None:
        """The TTS had answer samples at t (held until the turn is confirmed, for an early answer)."""
        with self.lock:
            self.first_audio_ready = self.first_audio_ready or t

    def heard_at(self, server_ms: float) -> float | None:
        """The page heard the first answer sample at server_ms (perf_counter ms): ttfa_heard_ms, None before the
        turn had a speech_end."""
        with self.lock:
            if "speech_end" in self.marks:
                self.heard_ms = server_ms - self.marks["speech_end"] * 1000
            return self.heard_ms

    def heard_turn(self, pauses: list[dict], silence_rule_ms: float | None, early_discarded: int) -> None:
        """The listener's facts of the turn, at its end (an early answer may be stamping the same timeline)."""
        with self.lock:
            self.pauses, self.silence_rule_ms, self.early_discarded = pauses, silence_rule_ms, early_discarded

    def runs_dry(self, by: float) -> bool:
        """The answer's audio out so far ends by time `by`: without more text soon the listener hears a stall.
        False before the first sample (nothing plays yet)."""
        return self.played_until is not None and self.played_until <= by

    def has(self, name: str) -> bool:
        return name in self.marks

    @property
    def ttfa_ms(self) -> float | None:
        reached = self._reached()
        if "speech_end" in reached and "first_audio_out" in reached:
            return (reached["first_audio_out"] - reached["speech_end"]) * 1000
        return None

    def _reached(self) -> dict[str, float]:
        """Each mark as the turn reached it: never before an earlier mark (an early answer's marks wait for the
        turn's confirmation)."""
        reached, latest = {}, float("-inf")
        for name in MARKS:
            if name in self.marks:
                latest = max(latest, self.marks[name])
                reached[name] = latest
        return reached

    def stages_ms(self) -> dict[str, float]:
        reached = self._reached()
        return {
            name: (reached[b] - reached[a]) * 1000 for name, (a, b) in STAGES.items() if a in reached and b in reached
        }

    def saved_ms(self) -> dict[str, float]:
        """What each technique saved this turn. preemptive: the answer's work done before the turn was confirmed
        (min(first audio ready, final transcript) − early start). turn end by words: the fixed silence's wait
        minus the wait the words chose (negative: unfinished words waited longer)."""
        saved = {}
        if self.early_start is not None and self.first_audio_ready is not None and "asr_final" in self.marks:
            hidden = min(self.first_audio_ready, self.marks["asr_final"]) - self.early_start
            saved["preemptive"] = max(0.0, hidden) * 1000
        wait = self.stages_ms().get("end_of_turn_wait")
        if self.silence_rule_ms is not None and wait is not None:
            saved["turn end by words"] = self.silence_rule_ms - wait
        return saved

    def to_dict(self) -> dict:
        with self.lock:
            marks = dict(self.marks)
        t0 = marks.get("speech_end")
        rel = {k: (v - t0) * 1000 for k, v in marks.items()} if t0 is not None else {}
        return {
            "ttfa_ms": self.ttfa_ms,
            "ttfa_heard_ms": self.heard_ms,
            "stages": self.stages_ms(),
            "marks_ms": rel,  # each mark relative to speech_end
            "last_audio_out_ms": (self.last_audio_out - t0) * 1000 if (t0 and self.last_audio_out) else None,
            "stall_ms": self.stall_s * 1000,
            "chunk_handoff_ms": statistics.median(self.chunk_handoffs_s) * 1000 if self.chunk_handoffs_s else None,
            "first_chunk_tokens": self.first_chunk_tokens,
            "first_chunk_tokens_per_forward": (
                self.first_chunk_tokens / self.first_chunk_forwards if self.first_chunk_forwards else None
            ),
            "early_start_ms": (self.early_start - t0) * 1000 if (t0 and self.early_start) else None,
            "early_discarded": self.early_discarded,
            "saved_ms": self.saved_ms(),
            "pauses": self.pauses,
        }
