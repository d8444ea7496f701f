"""Word error rate: how many words an ASR got wrong, as the fraction of the words that were said.

Both texts are normalised first, so that only hearing mistakes count, not spelling conventions: lowercase,
punctuation dropped (apostrophes too: "don't" = "dont"), hyphens split words, number words 0-20 and the tens
written as digits ("seven" = "7"), and a few British spellings written the American way (Whisper writes
"kilometers" for a speaker who said "kilometres"). Compound numbers are not joined: "twenty one" vs "21" counts
as two errors, which is rare in short spoken questions.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

_NUMBERS = {
    word: str(i)
    for i, word in enumerate(
        "zero one two three four five six seven eight nine ten eleven twelve thirteen fourteen fifteen sixteen "
        "seventeen eighteen nineteen twenty".split()
    )
}
_NUMBERS.update({w: str(10 * i) for i, w in enumerate("thirty forty fifty sixty seventy eighty ninety".split(), 3)})
_SPELLING = {
    "kilometre": "kilometer",
    "kilometres": "kilometers",
    "metre": "meter",
    "metres": "meters",
    "colour": "color",
    "colours": "colors",
    "favourite": "favorite",
    "centre": "center",
    "theatre": "theater",
    "grey": "gray",
}


def normalize_words(text: str) -> list[str]:
    """Text -> the words WER compares (see the module docstring for the rules)."""
    text = text.lower().replace("'", "").replace("\u2019", "")
    text = re.sub(r"(?<=\d),(?=\d{3})", "", text)  # "1,000" = "1000"
    words = re.findall(r"\d+\.\d+|[a-z0-9]+", text)  # a decimal point stays inside its number; other marks split
    return [_NUMBERS.get(w) or _SPELLING.get(w) or w for w in words]


def word_edits(reference: str, hypothesis: str) -> tuple[int, int]:
    """(substitutions + insertions + deletions, reference words): the Levenshtein distance over normalised words."""
    ref, hyp = normalize_words(reference), normalize_words(hypothesis)
    prev = list(range(len(hyp) + 1))  # distance from ref[:0] to each hyp prefix: that many insertions
    for i, r in enumerate(ref, 1):
        cur = [i]  # ref[:i] against an empty hypothesis: i deletions
        for j, h in enumerate(hyp, 1):
            cur.append(min(prev[j] + 1, cur[j - 1] + 1, prev[j - 1] + (r != h)))
        prev = cur
    return prev[-1], len(ref)


def word_error_rate(reference: str, hypothesis: str) -> float:
    """Edits ÷ reference words; 0.0 is perfect, and insertions can take it above 1.0.

    A reference with no words has no rate (division by zero): ValueError.
    """
    edits, n = word_edits(reference, hypothesis)
    if n == 0:
        raise ValueError(f"the reference {reference!r} has no words")
    return edits / n


def corpus_word_error_rate(pairs: Iterable[tuple[str, str]]) -> float:
    """Aggregate WER of (reference, hypothesis) pairs: the sum of edits ÷ the sum of reference words, so a long
    question weighs more than a short one (the mean of per-clip rates would let one short clip dominate)."""
    edits = words = 0
    for reference, hypothesis in pairs:
        e, n = word_edits(reference, hypothesis)
        edits, words = edits + e, words + n
    if words == 0:
        raise ValueError("the references have no words")
    return edits / words
