"""End of turn by how it was said as well as what: how long the silence after the last voiced audio must last.

A fixed silence cuts off a speaker who pauses mid-sentence ("What is the capital of … Canada?") and keeps a finished
question waiting. At each pause two signals vote (`decide`):
- the audio: Smart Turn's probability that the speaker has finished (prosody, not only words: pipeline/smart_turn.py);
- the words: the target's probability that the message ends after them (read from the early answer's first forward),
  or, until that forward has run, how the transcript reads (how_finished: Whisper closes fragments with "." or "?"
  too, so it only stands in).
Both finished: a short wait; either unfinished: a long one; otherwise a middle one. Without Smart Turn (mode "words",
or its model failed to load) the words alone decide, as before.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Literal

from specdec.fields import option

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
END_PUNCTUATION = (".", "?", "!")  # what closes a finished message
# What Whisper closes a partial transcript with, though the speaker may go on: "What is the boiling point?"
CLOSING = ".?!,;:…-— "
_TRAILING_OFF = ("...", "…", ",", "-", "—", ":", ";")

EndOfTurnMode = Literal["smart", "words", "silence"]
MODES = ("smart", "words", "silence")


Finish = Literal["finished", "unsure", "unfinished"]


def unclosed(text: str) -> str:
    """The words of a transcript without the punctuation that closes it."""
    return text.strip().rstrip(CLOSING)


def how_finished(text: str) -> Finish:
    """Whether the transcript reads like a finished utterance: it ends in . ? or ! and its last word does not need
    more after it ("finished"), its last word often does ("unsure"), or it trails off ("unfinished")."""
    text = text.strip()
    words = re.findall(r"[a-z']+", text.lower())
    if not words or text.endswith(_TRAILING_OFF) or not text.endswith(END_PUNCTUATION):
        return "unfinished"
    if words[-1] in UNFINISHED_WORDS:
        return "unfinished"
    return "unsure" if words[-1] in UNSURE_WORDS else "finished"


@dataclass(frozen=True)
class PauseSignals:
    """What is known at a pause: each None until it is in."""

    words: str | None = None  # the transcript up to the pause
    end_of_turn_probability: float | None = None  # metrics.DEFINITIONS: Smart Turn's, from the audio
    end_of_message_probability: float | None = None  # metrics.DEFINITIONS: the target's, from the words


@dataclass(frozen=True)
class Wait:
    """The silence a pause must last to end the turn, and why."""

    ms: float
    why: str


@dataclass(frozen=True)
class TurnEnd:
    """The silence that ends a turn. mode "silence": always silence_ms. mode "words": complete_ms after words that
    look finished, unsure_ms after words that may or may not be (how_finished), incomplete_ms after words that do
    not, and incomplete_ms while the words are not known yet. mode "smart": the audio's and the words' votes
    (`decide`), with audio_threshold and words_threshold on their probabilities."""

    mode: EndOfTurnMode = option(
        "smart",
        flag="--end-of-turn",
        choices=MODES,
        help="smart: Smart Turn's audio model and the target's words vote at each pause (falls back to words when "
        "the model is missing); words: the silence depends on whether the transcript looks finished; "
        "silence: always --hangover-ms",
    )
    silence_ms: float = option(300.0, flag="--hangover-ms", help="--end-of-turn silence: the silence that ends a turn")
    complete_ms: float = option(
        200.0,
        flag="--hangover-complete-ms",
        help="--end-of-turn smart or words: the silence after words that look finished",
    )
    unsure_ms: float = option(
        700.0,
        flag="--hangover-unsure-ms",
        help="--end-of-turn smart or words: the silence after words that may or may not go on (… in?, … have?)",
    )
    incomplete_ms: float = option(
        1000.0,
        flag="--hangover-incomplete-ms",
        help="--end-of-turn smart or words: the silence after words that trail off (… of, and …), or not yet "
        "transcribed",
    )
    # chosen on assets/utterances-turns-tune with `bench-turn --replay` (docs/results.md)
    audio_threshold: float = option(
        0.1,
        flag="--turn-audio-threshold",
        help="--end-of-turn smart: Smart Turn's P(finished) at or above this votes finished",
    )
    words_threshold: float = option(
        0.2,
        flag="--turn-words-threshold",
        help="--end-of-turn smart: the target's P(end of message) at or above this votes finished",
    )
    # the transcript may vote finished before the target's forward has read the words: a shorter wait on finished
    # questions, but Whisper closes fragments with "." and "?" too ("Can you explain?"), and falling speech agrees
    transcript_stands_in: bool = False

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"end-of-turn mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        for name in ("silence_ms", "complete_ms", "unsure_ms", "incomplete_ms"):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be > 0 ms, got {getattr(self, name)}")
        for name in ("audio_threshold", "words_threshold"):
            if not 0 < getattr(self, name) < 1:
                raise ValueError(f"{name} must be in (0, 1), got {getattr(self, name)}")

    @property
    def longest_ms(self) -> float:
        return self.silence_ms if self.mode == "silence" else max(self.complete_ms, self.unsure_ms, self.incomplete_ms)

    def describe(self, smart: bool = True) -> str:
        """The rule in words; smart=False: Smart Turn did not load, so mode "smart" runs the words rule."""
        if self.mode == "silence":
            return f"{self.silence_ms:g} ms of silence"
        waits = f"{self.complete_ms:g} ms when finished, {self.unsure_ms:g} ms when unsure, {self.incomplete_ms:g} ms"
        if self.mode == "words" or not smart:
            return f"by words: {waits} when they trail off"
        return (
            f"by Smart Turn (audio ≥ {self.audio_threshold:g}) and the target's words (≥ {self.words_threshold:g}): "
            f"{waits} when either says unfinished"
        )

    def decide(self, pause: PauseSignals, smart: bool = True, target: bool = True) -> Wait:
        """The wait after a pause's last voiced audio, given what is known of it. smart=False: Smart Turn is not
        available (it failed to load), so mode "smart" falls back to the words rule. target=False: no target's
        probability will come (no early answer, or a remote LLM), so the transcript stands in for it."""
        if self.mode == "silence":
            return Wait(self.silence_ms, "fixed silence")
        if self.mode == "words" or not smart:  # today's rule: the transcript alone
            words = self._words_vote(PauseSignals(pause.words))
            return Wait(self._ms(words[0]), words[1])
        words = self._words_vote(pause)
        waiting = target and not self.transcript_stands_in and pause.end_of_message_probability is None
        if words[0] == "finished" and waiting:
            words = "unsure", f"{words[1]}, the target's not in yet"
        audio_p = pause.end_of_turn_probability
        if audio_p is None:
            return Wait(self.incomplete_ms, f"{words[1]}; audio not scored yet")
        audio = "finished" if audio_p >= self.audio_threshold else "unfinished"
        why = f"audio {audio_p:.2f} {audio}; {words[1]}"
        if "unfinished" in (audio, words[0]):
            return Wait(self.incomplete_ms, why)
        return Wait(self._ms("finished" if words[0] == "finished" else "unsure"), why)

    def _words_vote(self, pause: PauseSignals) -> tuple[Finish, str]:
        """The words' vote and why: the target's probability once read, the transcript's look until then."""
        p = pause.end_of_message_probability
        if p is not None:
            vote: Finish = "finished" if p >= self.words_threshold else "unfinished"
            return vote, f"words {p:.2f} {vote} (target)"
        if pause.words is None:
            return "unfinished", "words not transcribed yet"
        vote = how_finished(pause.words)
        return vote, f"words {vote} (transcript)"

    def _ms(self, finish: Finish) -> float:
        return {"finished": self.complete_ms, "unsure": self.unsure_ms, "unfinished": self.incomplete_ms}[finish]
