import re

import pytest

from pipeline.chunker import SpeechChunker


def deltas(text: str, size: int) -> list[str]:
    return [text[i : i + size] for i in range(0, len(text), size)]


def run(text: str, size: int = 3, **kwargs) -> list[str]:
    """Stream text in `size`-character deltas (LLM tokens split words and numbers anywhere)."""
    chunker = SpeechChunker(**kwargs)
    out = [chunk for d in deltas(text, size) for chunk in chunker.push(d)]
    return out + chunker.flush()


@pytest.mark.parametrize("size", [1, 2, 3, 7, 1000])
def test_first_chunk_after_n_words_then_sentences(size):
    text = "The capital of France is Paris. It is known for the Eiffel Tower. Anything else?"
    assert run(text, size) == [
        "The capital of France",
        "is Paris.",
        "It is known for the Eiffel Tower.",
        "Anything else?",
    ]


def test_first_chunk_cut_at_clause_boundary():
    assert run("Of course, the capital is Paris.")[0] == "Of course,"
    assert run("Paris; a city of light and food.")[0] == "Paris; a city of"  # "Paris;" is under min_first_chars
    assert run("Paris; a city of light.", min_first_chars=1)[0] == "Paris;"
    assert run("Honestly — it depends on the day.")[0] == "Honestly —"
    assert run("Hello there! I am a voice assistant.")[0] == "Hello there!"
    assert run("A B C D E F.", first_chunk_words=2, min_first_chars=1)[0] == "A B"


def test_first_chunk_waits_for_min_chars():
    assert run("Sure, the capital of France is Paris.")[0] == "Sure, the capital of"


def test_word_is_complete_only_when_whitespace_follows():
    chunker = SpeechChunker(first_chunk_words=2, min_first_chars=1)
    assert chunker.push("Hello wor") == []
    assert chunker.push("ld") == []  # "world" may still grow ("worldwide")
    assert chunker.push(" ") == ["Hello world"]


@pytest.mark.parametrize("size", [1, 2, 5])
def test_numbers_and_abbreviations_are_never_cut(size):
    text = (
        "So here it is: pi is 3.14 and e.g. a grand is 1,000 dollars. Mr. Smith and J. K. Rowling met in "
        "the U.S. on 3.5.2024 at 7:30 pm. Done."
    )
    chunks = run(text, size)
    assert chunks[0] == "So here it is:"
    assert chunks[1] == "pi is 3.14 and e.g. a grand is 1,000 dollars."
    assert chunks[2] == "Mr. Smith and J. K. Rowling met in the U.S. on 3.5.2024 at 7:30 pm."
    assert chunks[3] == "Done."
    assert " ".join(chunks) == text  # nothing lost, nothing split inside a word


def test_sentence_end_at_number_and_question_marks():
    assert run("The value is now known. It is 42. Is that right? Yes!") == [
        "The value is now",
        "known.",
        "It is 42.",
        "Is that right?",
        "Yes!",
    ]


def test_markdown_symbols_stripped_even_across_deltas():
    chunks = run("**Paris** is the `capital` of France.\n## Facts\nIt has ~2 million people.", size=1)
    assert chunks == ["Paris is the capital", "of France.", "Facts", "It has ~2 million people."]
    assert not any(re.search(r"[*#`]", c) for c in chunks)


def test_flush_returns_remainder_and_resets():
    chunker = SpeechChunker()
    assert chunker.push("The answer is") == []
    assert chunker.flush() == ["The answer is"]
    assert chunker.flush() == []
    # After flush the next reply gets an early first chunk again.
    assert chunker.push("One two three four five. Six") == ["One two three four", "five."]
    assert chunker.push(" seven. ") == ["Six seven."]


def test_running_dry_cuts_a_later_chunk_before_its_sentence_ends():
    chunker = SpeechChunker(first_chunk_words=2, min_first_chars=1)
    assert chunker.push("To make a cup ", running_dry=True) == ["To make"]  # the first chunk keeps its own rule
    assert chunker.push("of coffee, heat water") == []  # speech still playing: the sentence waits
    # Running dry: the last clause boundary ready, once; the words after it wait for the sentence again.
    assert chunker.push(" to boiling", running_dry=True) == ["a cup of coffee,"]
    assert chunker.push(" and", running_dry=True) == ["heat water to boiling"]  # no clause: the last whole word
    assert chunker.push("stir", running_dry=True) == []  # "andstir" is not a whole word yet
    assert chunker.push(". Then") == ["andstir."]
    assert chunker.flush() == ["Then"]


def test_only_markdown_or_whitespace_gives_nothing():
    chunker = SpeechChunker()
    assert chunker.push("** ` ## \n ") == []
    assert chunker.flush() == []


def test_invalid_first_chunk_words():
    with pytest.raises(ValueError):
        SpeechChunker(first_chunk_words=0)
