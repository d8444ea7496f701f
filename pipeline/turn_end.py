"""End of turn by what was said, not only by silence: how long the silence after the last voiced audio must last.

A fixed silence cuts off a speaker who pauses mid-sentence ("What is the capital of … Canada?") and keeps a finished
question waiting. At the pause the streaming ASR transcribes what was said; words that look finished end the turn
after a short silence, words that trail off ("… of", "and …") get a long one, and until the words are known the
turn waits for them (up to the long silence).
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

# A phrase ending in one of these words is unfinished whatever its punctuation: Whisper often closes a cut-off
# phrase with "?" or "." ("What is the capital of?").
CONTINUATION_WORDS = frozenset(
    """a an the and or but so because of to for with in on at from by about into onto like than then if when while
    as that which who whose whom what where how why is are was were am be been being my your his her their our its
    this these those um uh er erm hmm can could would should will shall do does did has have had not very more most
    let's i'm it's there's""".split()
)
_END_PUNCTUATION = (".", "?", "!")
_TRAILING_OFF = ("...", "…", ",", "-", "—", ":", ";")

EndOfTurnMode = Literal["words", "silence"]


def looks_complete(text: str) -> bool:
    """True when the transcript reads like a finished utterance: it ends in . ? or ! and its last word is not one
    that needs more after it."""
    text = text.strip()
    if not text or text.endswith(_TRAILING_OFF) or not text.endswith(_END_PUNCTUATION):
        return False
    words = re.findall(r"[a-z']+", text.lower())
    return bool(words) and words[-1] not in CONTINUATION_WORDS


@dataclass(frozen=True)
class TurnEnd:
    """The silence that ends a turn. mode "silence": always silence_ms. mode "words": complete_ms after words that
    look finished, incomplete_ms after words that do not, and incomplete_ms while the words are not known yet."""

    mode: EndOfTurnMode = "words"
    silence_ms: float = 300.0
    complete_ms: float = 200.0
    incomplete_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.mode not in ("words", "silence"):
            raise ValueError(f"end-of-turn mode must be 'words' or 'silence', got {self.mode!r}")
        for name in ("silence_ms", "complete_ms", "incomplete_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 ms, got {getattr(self, name)}")

    @property
    def longest_ms(self) -> float:
        return self.silence_ms if self.mode == "silence" else max(self.complete_ms, self.incomplete_ms)

    def describe(self) -> str:
        if self.mode == "silence":
            return f"{self.silence_ms:g} ms of silence"
        return f"by words: {self.complete_ms:g} ms after finished words, {self.incomplete_ms:g} ms otherwise"

    def hangover_ms(self, words: str | None) -> float:
        """Silence needed after the last voiced audio, given the words heard up to it (None: not transcribed yet)."""
        if self.mode == "silence":
            return self.silence_ms
        return self.complete_ms if words is not None and looks_complete(words) else self.incomplete_ms
