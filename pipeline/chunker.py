"""Cut streaming LLM text into pieces a TTS can speak: the first piece early (it sets time-to-first-audio), the rest
at sentence ends (whole sentences sound better and the first piece is playing meanwhile)."""

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

    def _cut(self) -> int | None:
        """End index (exclusive) of the next chunk in the buffer, or None if none is complete yet."""
        for count, m in enumerate(_WORD.finditer(self._buf), start=1):
            word, end = m.group(1), m.end(1)
            if self._first:
                boundary = _ends_clause(word) or count >= self.first_chunk_words
                if boundary and len(self._buf[:end].strip()) >= self.min_first_chars:
                    return end
            elif _ends_sentence(word) or "\n" in m.group(0):  # a line break ends a list item or a heading
                return end
        return None

    def push(self, text_delta: str) -> list[str]:
        self._buf += text_delta.translate(_MARKDOWN)
        chunks: list[str] = []
        while (end := self._cut()) is not None:
            chunks.append(" ".join(self._buf[:end].split()))
            self._buf, self._first = self._buf[end:], False
        return chunks

    def flush(self) -> list[str]:
        """The reply is complete: whatever is left is the last chunk. Resets the chunker for the next reply."""
        rest = " ".join(self._buf.split())
        self._buf, self._first = "", True
        return [rest] if rest else []
