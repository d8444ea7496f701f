"""Cut streaming LLM text into pieces a TTS can speak: the first piece early (it sets time-to-first-audio), the rest
at sentence ends (whole sentences sound better and the earlier pieces are playing meanwhile), unless the speech is
running dry: then the words ready so far go at once, since a cut phrase sounds better than a silence."""

from __future__ import annotations

import re

# Markdown a TTS would read aloud ("asterisk", "hash").
_MARKDOWN = str.maketrans("", "", "*#`")
# A word and the whitespace after it: only a word followed by whitespace is complete ("3." may become "3.14").
_WORD = re.compile(r"(\S+)\s+")
_CLOSERS = "\"')]”’"
_CLAUSE_END = (",", ";", ":", "—", "–")
_SENTENCE_END = (".", "!", "?", "…")
# Words whose period is not a sentence end; single letters ("J. K.") and dotted forms ("e.g.", "U.S.") are caught
# by rule in _ends_sentence.
_ABBREVIATIONS = frozenset("mr mrs ms dr prof sr jr st mt vs etc approx inc ltd dept".split())
_DOTTED = re.compile(r"(?:[a-z]\.)+[a-z]")


def _ends_sentence(word: str) -> bool:
    core = word.rstrip(_CLOSERS)
    if not core.endswith(_SENTENCE_END):
        return False
    if not core.endswith("."):
        return True
    stem = core.rstrip(".").lstrip("\"'(“‘[").lower()
    return bool(stem) and not (stem in _ABBREVIATIONS or (len(stem) == 1 and stem.isalpha()) or _DOTTED.fullmatch(stem))


def _ends_clause(word: str) -> bool:
    return word.rstrip(_CLOSERS).endswith(_CLAUSE_END) or _ends_sentence(word)


class SpeechChunker:
    """push() text deltas as the LLM streams them, get speakable chunks; flush() at the end of the reply.

    first_chunk_words: the first chunk ends after this many words, or sooner at a clause or sentence boundary.
    min_first_chars: ...but not before it has this many characters: a one-word fragment ("Well,") sounds clipped
    and its audio runs out before the next sentence is ready.
    """

    def __init__(self, first_chunk_words: int = 4, min_first_chars: int = 8) -> None:
        if first_chunk_words < 1:
            raise ValueError("first_chunk_words must be at least 1")
        self.first_chunk_words = first_chunk_words
        self.min_first_chars = min_first_chars
        self._buf = ""
        self._first = True

    def _cut(self, running_dry: bool) -> int | None:
        """End index (exclusive) of the next chunk in the buffer, or None if none is complete yet."""
        clause_end = word_end = None
        for count, m in enumerate(_WORD.finditer(self._buf), start=1):
            word, end = m.group(1), m.end(1)
            if self._first:
                boundary = _ends_clause(word) or count >= self.first_chunk_words
                if boundary and len(self._buf[:end].strip()) >= self.min_first_chars:
                    return end
            elif _ends_sentence(word) or "\n" in m.group(0):  # a line break ends a list item or a heading
                return end
            elif _ends_clause(word):
                clause_end = end
            word_end = end
        return (clause_end or word_end) if running_dry and not self._first else None

    def push(self, text_delta: str, running_dry: bool = False) -> list[str]:
        """Chunks complete after this delta. running_dry: the speech out so far is about to end, so a later chunk
        ends at the last clause boundary ready, else at the last whole word, instead of waiting for the sentence."""
        self._buf += text_delta.translate(_MARKDOWN)
        chunks: list[str] = []
        while (end := self._cut(running_dry)) is not None:
            chunks.append(" ".join(self._buf[:end].split()))
            self._buf, self._first = self._buf[end:], False
            running_dry = False  # one such cut buys the speech time: the rest waits for its sentence again
        return chunks

    def flush(self) -> list[str]:
        """The reply is complete: whatever is left is the last chunk. Resets the chunker for the next reply."""
        rest = " ".join(self._buf.split())
        self._buf, self._first = "", True
        return [rest] if rest else []
