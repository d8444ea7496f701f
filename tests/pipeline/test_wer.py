"""Word error rate against hand-counted edits."""

from __future__ import annotations

import pytest

from pipeline.wer import corpus_word_error_rate, normalize_words, word_edits, word_error_rate


def test_identical_text_has_no_errors():
    assert word_error_rate("How many legs does a spider have?", "How many legs does a spider have?") == 0.0


def test_substitutions():
    # legs -> lands, a -> that: 2 substitutions in 7 words (the issue's example).
    assert word_edits("How many legs does a spider have?", "How many lands does that spider have?") == (2, 7)
    assert word_error_rate("How many legs does a spider have?", "How many lands does that spider have?") == 2 / 7


def test_insertion():
    assert word_edits("why is the sky blue", "why is the the sky blue") == (1, 5)


def test_deletion():
    assert word_edits("what is the capital of france", "what is capital of france") == (1, 6)


def test_mixed_edits_from_the_issue():
    # name three planets in our solar system / then free planet solar system:
    # name->then, three->free, planets->planet (3 substitutions), in, our (2 deletions).
    assert word_edits("Name three planets in our solar system.", "Then free planet solar system") == (5, 7)


def test_empty_hypothesis_deletes_every_word():
    assert word_error_rate("Hi there, can you hear me?", "") == 1.0


def test_insertions_can_exceed_one():
    assert word_error_rate("hello", "hello hello hello") == 2.0


def test_punctuation_and_case_do_not_count():
    assert word_error_rate("Thanks, that was helpful.", "thanks that was helpful") == 0.0
    assert word_error_rate("Hi there, can you hear me?", "HI THERE! Can you hear me...") == 0.0
    assert word_error_rate("Don't stop.", "dont stop") == 0.0


def test_hyphens_split_words():
    assert normalize_words("a two-line poem") == ["a", "2", "line", "poem"]


def test_number_words_equal_digits():
    assert word_error_rate("a table for two tomorrow at seven", "A table for 2 tomorrow at 7.") == 0.0
    assert word_error_rate("Convert ten kilometres to miles", "Convert 10 kilometers to miles.") == 0.0
    assert normalize_words("It costs 1,000 or 2.5") == ["it", "costs", "1000", "or", "2.5"]


def test_empty_reference_has_no_rate():
    with pytest.raises(ValueError):
        word_error_rate("", "something")
    with pytest.raises(ValueError):
        corpus_word_error_rate([("...", "")])


def test_corpus_rate_sums_edits_over_words():
    # 1 edit in 1 word and 0 edits in 9 words: 1/10, not the mean of the rates (0.5).
    pairs = [("yes", "no"), ("one two three four five six seven eight nine", "1 2 3 4 5 6 7 8 9")]
    assert corpus_word_error_rate(pairs) == pytest.approx(0.1)
