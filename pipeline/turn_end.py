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
UNFINISHED_WORDS = frozenset(
    """a an the and or but so because if than that of to between my your his her their our its this these those
    um uh er erm hmm very more most not let's i'm it's there's""".split()
)
# These end unfinished phrases ("Why do birds fly south in …") and finished questions alike ("What time zone is
# London in?", "How many legs does a spider have?"): the turn waits longer than after finished words, less than
# after unfinished ones.
UNSURE_WORDS = frozenset(
    """in on at for from with about like into onto by how what why where when who which is are was were am be been
    have has had do does did can could would should will""".split()
)
_END_PUNCTUATION = (".", "?", "!")
_TRAILING_OFF = ("...", "…", ",", "-", "—", ":", ";")

EndOfTurnMode = Literal["words", "silence"]


Finish = Literal["finished", "unsure", "unfinished"]


def how_finished(text: str) -> Finish:
    """Whether the transcript reads like a finished utterance: it ends in . ? or ! and its last word does not need
    more after it ("finished"), its last word often does ("unsure"), or it trails off ("unfinished")."""
    text = text.strip()
    words = re.findall(r"[a-z']+", text.lower())
    if not words or text.endswith(_TRAILING_OFF) or not text.endswith(_END_PUNCTUATION):
        return "unfinished"
    if words[-1] in UNFINISHED_WORDS:
        return "unfinished"
    return "unsure" if words[-1] in UNSURE_WORDS else "finished"


@dataclass(frozen=True)
class TurnEnd:
    """The silence that ends a turn. mode "silence": always silence_ms. mode "words": complete_ms after words that
    look finished, unsure_ms after words that may or may not be (how_finished), incomplete_ms after words that do
    not, and incomplete_ms while the words are not known yet."""

    mode: EndOfTurnMode = "words"
    silence_ms: float = 300.0
    complete_ms: float = 200.0
    unsure_ms: float = 700.0
    incomplete_ms: float = 1000.0

    def __post_init__(self) -> None:
        if self.mode not in ("words", "silence"):
            raise ValueError(f"end-of-turn mode must be 'words' or 'silence', got {self.mode!r}")
        for name in ("silence_ms", "complete_ms", "unsure_ms", "incomplete_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 ms, got {getattr(self, name)}")

    @property
    def longest_ms(self) -> float:
        return self.silence_ms if self.mode == "silence" else max(self.complete_ms, self.unsure_ms, self.incomplete_ms)

    def describe(self) -> str:
        if self.mode == "silence":
            return f"{self.silence_ms:g} ms of silence"
        return (
            f"by words: {self.complete_ms:g} ms after finished words, {self.unsure_ms:g} ms after words that may "
            f"go on, {self.incomplete_ms:g} ms after unfinished ones"
        )

    def hangover_ms(self, words: str | None) -> float:
        """Silence needed after the last voiced audio, given the words heard up to it (None: not transcribed yet)."""
        if self.mode == "silence":
            return self.silence_ms
        finish = "unfinished" if words is None else how_finished(words)
        return {"finished": self.complete_ms, "unsure": self.unsure_ms, "unfinished": self.incomplete_ms}[finish]
