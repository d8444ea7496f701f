"""An answer's first tokens guessed from how its question begins (specdec/openings.py): the table, the tree its
guesses make, the answer's first forward verifying them (output still the target's), and `specvoice corpus
openings`."""

from __future__ import annotations

import argparse
import dataclasses
import json
import random
import re

import pytest
import torch

from commands.corpus import count_corpus_openings
from pipeline.llm import SYSTEM_PROMPT
from specdec.build import build_engine
from specdec.corpus import AnswerRecipe, answer_shard, write_rows
from specdec.drafters import NGramDrafter, OpeningEchoDrafter
from specdec.engine import GenerationConfig, collect
from specdec.openings import (
    COPIES,
    ECHO_KEPT,
    LAMBDA,
    MIN_COUNT,
    OpeningTable,
    count_openings,
    load_openings,
    opening_key,
    opening_tree,
    question_copies,
)
from specdec.runner import BatchRunner
from specdec.sampling import SamplingParams
from specdec.tokenizer import ByteTokenizer, words_start
from specdec.tree import ROOT
from tests.support.engine import make_engine, target_only

CPU = torch.device("cpu")


def answered(question: list[int], first: int, times: int) -> list:
    """count_openings's examples: a question answered `times` times with `first` first, no word of it copied."""
    return [(question, [first], [])] * times


def test_the_table_keeps_each_prefix_seen_often_enough_with_its_count():
    examples = answered([1, 2, 3, 4, 5], 10, 3) + answered([1, 2, 3, 9], 11, 2) + answered([1, 7], 12, 2)
    table = count_openings(examples + answered([1, 2, 3, 4, 6], 13, 1), "t")
    assert table.answers == 8
    assert table.firsts[(1,)] == ((10, 3 / 8), (11, 2 / 8), (12, 2 / 8), (13, 1 / 8))  # ties: the lower id first
    assert table.firsts[(1, 2, 3, 4)] == ((10, 0.75), (13, 0.25))
    assert table.totals[(1,)] == 8 and table.totals[(1, 2, 3, 4)] == 4
    assert (1, 2, 3, 9) not in table.firsts and (1, 7) not in table.firsts  # seen fewer than MIN_COUNT times
    assert MIN_COUNT == 3 and (1, 2, 3, 4, 5) not in table.firsts  # no prefix longer than MAX_PREFIX (4)
    assert table.guesses([5, 1], 3) == [] and table.guesses([], 3) == []


def test_a_question_is_guessed_from_every_prefix_it_begins_with_not_only_the_longest():
    # (1, 2, 3, 4), (1, 2, 3) and (1, 2): 3 answers, all 10; (1,): 100, of which 97 are 20
    table = count_openings(answered([1, 2, 3, 4], 10, 3) + answered([1, 9], 20, 97), "t")
    w4 = 3 / (3 + LAMBDA)
    w3 = (1 - w4) * w4
    w2 = (1 - w4 - w3) * w4
    w1 = (1 - w4 - w3 - w2) * 100 / (100 + LAMBDA)
    guessed = table.guesses([1, 2, 3, 4, 5], 3)
    assert [ids for ids, _ in guessed] == [(10,), (20,)]  # the longest prefix alone knows 10 only
    assert guessed[0][1] == pytest.approx(w4 + w3 + w2 + w1 * 0.03) and guessed[1][1] == pytest.approx(w1 * 0.97)
    w19 = 97 / (97 + LAMBDA)  # (1, 9): 97 answers, all 20
    assert table.guesses([1, 9], 1) == [((20,), pytest.approx(w19 + (1 - w19) * 100 / (100 + LAMBDA) * 0.97))]


BYTES = ByteTokenizer()


def test_a_question_copies_its_first_content_words_as_an_answer_would_begin_with_them():
    question = BYTES.encode("What is the boiling point of water?\nassistant")
    copies = question_copies(question, BYTES)
    assert [BYTES.decode(list(c.ids)) for c in copies] == ["Boiling", "Point", "Water"]  # COPIES, not past the line
    assert [BYTES.decode(list(c.spoken)) for c in copies] == [" boiling", " point", " water"]
    assert COPIES == 3 and question_copies(BYTES.encode("Why is it so?"), BYTES) == []


def test_answers_that_copy_a_word_of_their_question_teach_the_table_to_copy_another_questions_word():
    def example(animal: str, answer: str) -> tuple:
        question = BYTES.encode(f"Why do {animal} sleep?")
        return question, BYTES.encode(answer), question_copies(question, BYTES)

    examples = [example(a, f"{a.title()} sleep to rest.") for a in ("cats", "dogs", "owls")]
    examples.append(example("cows", "Sleep is rest."))  # copies the second word
    assert [opening_key(answer, copies) for _, answer, copies in examples] == [-1, -1, -1, -2]
    table = count_openings(examples, "t")
    assert table.firsts[tuple(BYTES.encode("Why "))] == ((-1, 0.75), (-2, 0.25))
    question = BYTES.encode("Why do bees sleep?")
    guessed = table.guesses(question, 2, question_copies(question, BYTES))
    assert [BYTES.decode(list(ids)) for ids, _ in guessed] == ["Bees", "Sleep"]
    assert table.guesses(question, 2) == []  # a copy needs the question's words


class Words:
    """A tokenizer of whole words (a space before each but the first) and punctuation, as an LLM's often are."""

    def __init__(self) -> None:
        self.pieces: list[str] = []

    def encode(self, text: str) -> list[int]:
        pieces = re.findall(r" ?[A-Za-z']+|[^A-Za-z' ]", text)
        self.pieces += [p for p in dict.fromkeys(pieces) if p not in self.pieces]
        return [self.pieces.index(p) for p in pieces]

    def decode(self, ids: list[int]) -> str:
        return "".join(self.pieces[i] for i in ids)


def test_the_opening_drafter_drafts_the_copied_word_and_echoes_the_question_after_it():
    words = Words()
    question = words.encode("Why do bees sleep?")
    table = count_openings([(question, words.encode("Bees sleep to rest."), question_copies(question, words))] * 3, "t")
    drafter = OpeningEchoDrafter(NGramDrafter(CPU), words, CPU, table)
    prompt = [*words.encode("You answer."), *question, *words.encode("\nassistant")]
    drafter.start(len(prompt), question_start=len(prompt) - len(question) - 2)
    proposal = drafter.propose(prompt, 8, SamplingParams(), None)
    assert words.decode(proposal.tokens.tolist()) == "Bees sleep"  # the question's word, then its next one


def test_a_table_is_saved_and_loaded_and_refused_for_another_target(tmp_path):
    table = count_openings(answered([1, 2], 5, 3) + answered([1, 3], 6, 3), "qwen-1.5b")
    path = tmp_path / "t.json"
    table.save(path)
    assert load_openings(str(path), "qwen-1.5b") == table
    old = json.loads(path.read_text())
    old["firsts"] = [[prefix, found] for prefix, _, found in old["firsts"]]  # as tables were before their counts
    (tmp_path / "old.json").write_text(json.dumps(old))
    with pytest.raises(ValueError, match="without answer counts.*corpus openings"):
        load_openings(str(tmp_path / "old.json"), "qwen-1.5b")
    with pytest.raises(ValueError, match="counts 'qwen-1.5b'"):
        load_openings(str(path), "qwen-0.5b")
    with pytest.raises(FileNotFoundError, match="corpus openings"):
        load_openings(str(tmp_path / "missing.json"), "qwen-1.5b")
    assert load_openings("none", "qwen-1.5b") is None
    assert load_openings("", "no-such-target") is None  # no shipped table: no guesses


def test_the_tree_keeps_the_best_nodes_by_share_and_echo_in_topological_order():
    chains = [([10, 11, 12], 0.5), ([20, 21], 0.3), ([30], 0.2)]
    # scores: 10 .5, 11 .35, 12 .245, 20 .3, 21 .21, 30 .2: the best four are 10, 11, 20, 12
    tree = opening_tree(chains, 4, CPU)
    assert tree.tokens.tolist() == [10, 20, 11, 12]
    assert tree.parents.tolist() == [ROOT, ROOT, 0, 2]
    assert tree.depths.tolist() == [1, 1, 2, 3]
    assert tree.scores is not None
    assert torch.allclose(tree.scores.exp(), torch.tensor([0.5, 0.3, 0.5 * ECHO_KEPT, 0.5 * ECHO_KEPT**2]))
    assert len(opening_tree(chains, 99, CPU)) == 6


def test_a_kept_node_always_has_its_parent_before_it():
    rng = random.Random(0)
    for _ in range(200):
        chains = [([rng.randrange(50) for _ in range(rng.randint(1, 4))], rng.random() + 1e-3) for _ in range(3)]
        tree = opening_tree(chains, rng.randint(1, 8), CPU)
        for i, (parent, depth) in enumerate(zip(tree.parents.tolist(), tree.depths.tolist())):
            assert (parent == ROOT) == (depth == 1)
            assert parent < i and (parent == ROOT or tree.depths[parent] == depth - 1)


def _prompts(target):
    texts = ["hello there", "what is two plus two?", "tell me a story about a cat", "a b a b a b a b", "x"]
    return [target.tokenizer.chat_ids([{"role": "user", "content": t}]) for t in texts]


@pytest.mark.parametrize("width", [1, 3])
def test_the_first_forward_verifies_the_guesses_and_the_output_stays_the_targets(tiny_engine, width):
    """Guessed right, the answer's first forward emits more than one token; guessed wrong, one; the tokens are the
    target-only answer's either way."""
    target = tiny_engine.target
    start = words_start(target.tokenizer, [])
    prompts = _prompts(target)
    answers = [target_only(target, ids, 20) for ids in prompts]
    vocab = target.model.config.vocab_size

    def table(*counts: tuple[int, int]) -> OpeningTable:
        """Each question's first token + offset, count times: (offset, count) …"""
        return count_openings(
            [
                row
                for ids, a in zip(prompts, answers)
                for d, n in counts
                for row in answered(ids[start:], (a[0] + d) % vocab, n)
            ],
            "tiny",
        )

    right, wrong = table((0, 3), (1, 2)), table((1, 3), (2, 2))  # two guesses each: a tree when width > 1
    for table, guessed in ((right, True), (wrong, False)):
        engine = make_engine(
            target,
            lambda t=table: OpeningEchoDrafter(NGramDrafter(target.device), target.tokenizer, target.device, t, width),
        )
        for ids, answer in zip(prompts, answers):
            tokens, events = collect(engine.stream(ids, GenerationConfig(20, question_start=start)))
            assert tokens == answer
            assert events[0].draft_tokens  # the first forward verified drafts
            assert (events[0].accepted > 0) == guessed and (len(events[0].tokens) > 1) == guessed


def test_corpus_openings_counts_each_answer_after_its_question_with_or_without_the_system_prompt(tiny_engine, tmp_path):
    target = tiny_engine.cpu_target
    requests = [{"prompt": f"word {i} and more", "category": ""} for i in range(6)]
    rows = answer_shard(
        BatchRunner(target.model, target.device),
        target.tokenizer,
        requests,
        AnswerRecipe(max_new_tokens=4),
        SYSTEM_PROMPT,
        (0, 6),
        2,
    )
    assert {r["system"] for r in rows} == {True, False}
    write_rows(tmp_path / "answers" / "answers_0000-x.jsonl.gz", rows)
    out = tmp_path / "openings.json"
    args = argparse.Namespace(target=target.name, folder=str(tmp_path), openings=str(out))
    assert count_corpus_openings(args) == 0
    table = load_openings(str(out), target.name)
    assert table is not None and table.answers == 6
    word = tuple(target.tokenizer.encode("word"))  # every question begins so, after either prompt's head
    firsts = sorted(r["answer_ids"][0] for r in rows)
    assert sorted(table.firsts) == [word[:n] for n in range(1, 5)]
    assert table.firsts[word][0][0] == max(set(firsts), key=lambda t: (firsts.count(t), -t))
    with pytest.raises(ValueError, match="no answer shards"):
        count_corpus_openings(argparse.Namespace(target=target.name, folder=str(tmp_path / "none"), openings=""))


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)
def test_an_engine_with_heads_guesses_from_the_table_it_is_given(tiny_engine, tiny_heads, tmp_path):
    heads, _ = tiny_heads
    table = count_openings(answered([1, 2], 5, MIN_COUNT), tiny_engine.spec.target)
    table.save(tmp_path / "openings.json")
    spec = tiny_engine.spec_with(draft="heads", heads=str(heads), opening_echo=True, draft_tree=2)
    engine, _ = build_engine(dataclasses.replace(spec, opening_table=str(tmp_path / "openings.json")))
    drafter = engine.drafter_factory()
    assert isinstance(drafter, OpeningEchoDrafter) and drafter.openings == table and drafter.width == 2
    engine, _ = build_engine(dataclasses.replace(spec, opening_table="none"))
    assert engine.drafter_factory().openings is None
