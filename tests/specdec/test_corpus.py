"""The heads' corpus (specdec/corpus.py, `specvoice corpus`): batched generation equal to one-at-a-time decoding,
request parsing, near-duplicate and benchmark-overlap removal, resumable shards."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import pytest
import torch

from commands.corpus import FOLDER, WRITES_PER_SHARD, add_arguments, benchmark_texts, utterance_texts
from specdec.corpus import (
    WRITING_TEMPERATURE,
    AnswerRecipe,
    Job,
    answer_plan,
    answer_shard,
    check_recipe,
    decode_throughput,
    dedupe,
    generate_many,
    parse_requests,
    read_rows,
    run_shards,
    select_requests,
    writing_jobs,
)
from specdec.runner import BatchRunner
from tests.support.engine import tiny_prompts


def _alone(runner: BatchRunner, job: Job, max_new: int, eos: set[int]) -> list[int]:
    return next(iter(generate_many(runner, [job], 1, max_new, eos)))[1]


def test_batched_answers_are_each_answer_decoded_alone(tiny_engine):
    """Continuous batching changes nothing an answer gets: greedy and sampled (each job's own seed) answers equal the
    same job decoded alone, whatever width and whatever joins mid-way."""
    target = tiny_engine.cpu_target
    runner = BatchRunner(target.model, target.device)
    eos = target.tokenizer.eos_token_ids
    prompts = tiny_prompts(target, 7)
    jobs = [Job(p, temperature=(0.0 if i % 2 else 0.8), seed=i) for i, p in enumerate(prompts)]
    got = dict(generate_many(runner, jobs, 3, 12, eos))
    assert sorted(got) == list(range(7))
    for i, job in enumerate(jobs):
        alone = _alone(runner, job, 12, eos)
        assert got[i] == alone
        assert 1 <= len(alone) <= 12 and all(t not in eos for t in alone[:-1])


def test_a_greedy_job_is_the_targets_argmax_chain(tiny_engine):
    target = tiny_engine.cpu_target
    runner = BatchRunner(target.model, target.device)
    prompt = tiny_prompts(target, 1)[0]
    answer = _alone(runner, Job(prompt), 6, set())
    ids = torch.tensor([prompt + answer])
    with torch.inference_mode():
        chosen = target.model(ids).logits[0, len(prompt) - 1 : -1].argmax(-1).tolist()
    assert chosen == answer


def test_throughput_reports_each_width(tiny_engine):
    target = tiny_engine.cpu_target
    run = decode_throughput(BatchRunner(target.model, target.device), tiny_prompts(target, 3), 4, 2)
    assert run["width"] == 4 and run["steps"] == 2 and run["tokens_per_s"] > 0


def test_requests_are_parsed_from_a_writers_lines():
    text = (
        "Sure! Here are some requests:\n"
        "1. What time does the sun set in winter?\n"
        '- "Can you tell me how to plant tulips?"\n'
        "Hi\n"
        "(3) Remind me why leaves change color in autumn.\n"
        "A line that ends without a sentence end\n"
    )
    assert parse_requests(text) == [
        "What time does the sun set in winter?",
        "Can you tell me how to plant tulips?",
        "Remind me why leaves change color in autumn.",
    ]


def test_near_duplicates_go_and_distinct_requests_stay():
    texts = [
        "How do I boil an egg for breakfast?",
        "how do I boil an egg for breakfast",  # the same words
        "How do I boil an egg for my breakfast?",  # nearly the same
        "What is the tallest tree in the world?",
        "Tell me a joke about a penguin.",
    ]
    assert dedupe(texts) == [0, 3, 4]


def test_requests_that_overlap_a_benchmark_prompt_are_removed_and_the_shipped_ones_lead():
    shipped = [{"prompt": "How do I fold a paper plane?"}]
    written = [
        {"prompt": "Why is the sky blue during the day?"},
        {"prompt": "Why is the sea salty?"},
        {"prompt": "Why is the sea salty, really?"},
        {"prompt": "How do I fold a paper plane, please?"},
    ]
    kept, counts = select_requests(shipped, written, ["Why is the sky blue?"])
    assert [(r["prompt"], r["source"]) for r in kept] == [
        ("How do I fold a paper plane?", "shipped"),
        ("Why is the sea salty?", "written"),
    ]
    assert counts == {"shipped": 1, "written": 4, "benchmark_overlap": 1, "near_duplicates": 2, "kept": 2}
    more, _ = select_requests(shipped, written + [{"prompt": "Tell me about owls."}], ["Why is the sky blue?"])
    assert more[: len(kept)] == kept  # written requests added later only append


def test_the_benchmark_texts_include_every_recording():
    texts = utterance_texts()
    assert "Why is the sky blue?" in texts and "What should I pack for a beach holiday?" in texts
    assert len(texts) >= 36 and set(texts) <= set(benchmark_texts([]))


def test_the_default_writes_are_what_the_committed_corpus_was_made_with():
    """`corpus requests` with fewer writes rewrites requests.jsonl from fewer written shards, dropping requests the
    committed answer shards were made from: the default must grow with the folder."""
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    written = sorted((FOLDER / "written").glob("written_*.jsonl.gz"))
    assert parser.parse_args(["requests"]).writes == len(written) * WRITES_PER_SHARD


def test_a_texts_file_without_the_recordings_lists_is_refused(tmp_path):
    moved = tmp_path / "utterance_texts.py"
    moved.write_text('OTHER = {"a": "Why is the sky blue?"}\n')  # the lists moved elsewhere: nothing is kept out
    with pytest.raises(ValueError, match="no QUESTIONS"):
        utterance_texts(moved)


def test_writing_jobs_cycle_categories_with_sampled_decoding(tiny_engine):
    tok = tiny_engine.cpu_target.tokenizer
    examples = {"math": ["What is two plus two?", "Halve ten for me."]}
    jobs = writing_jobs(tok, ["bees", "trains"], 16, 5, seed=0, examples=examples)
    assert jobs[:4] == writing_jobs(tok, ["bees", "trains"], 4, 5, seed=0, examples=examples)  # not by count
    assert "Halve ten for me." in tok.decode(jobs[7][1].prompt) and "style" not in tok.decode(jobs[0][1].prompt)
    assert [c for c, _ in jobs[:8]] == [
        "factual",
        "explain",
        "howto",
        "structured",
        "code",
        "creative",
        "dialog",
        "math",
    ]
    assert all(j.temperature == WRITING_TEMPERATURE for _, j in jobs) and len({j.seed for _, j in jobs}) == 16


def test_answer_shards_resume_and_refuse_another_recipe(tiny_engine, tmp_path):
    """A stopped run resumes at the first missing shard (made shards are not made again), rows keep request order,
    requests appended later start a new shard (a short made one stays as it is), and a folder made from another
    recipe is refused."""
    target = tiny_engine.cpu_target
    runner = BatchRunner(target.model, target.device)
    requests = [{"prompt": f"word {i} and more", "category": "factual"} for i in range(5)]
    recipe = AnswerRecipe(max_new_tokens=6, shard_size=2, sampled_share=0.5)
    made = []

    def run(current: list[dict], limit: int = 0) -> list[Path]:
        plan = answer_plan(tmp_path, current, recipe)
        keys = [key for _, key in plan]

        def make(i: int) -> list[dict]:
            made.append(plan[i][0])
            return answer_shard(runner, target.tokenizer, current, recipe, "be brief", plan[i][0], 2)

        return run_shards(tmp_path, "answers", keys[: limit or len(keys)], make)

    run(requests, limit=2)
    paths = run(requests)
    assert made == [(0, 2), (2, 4), (4, 5)]
    rows = [r for p in paths for r in read_rows(p)]
    assert [r["request"] for r in rows] == [0, 1, 2, 3, 4]
    assert [r["system"] for r in rows] == [True, False, True, False, True]
    assert all(1 <= len(r["answer_ids"]) <= 6 for r in rows)
    assert {r["temperature"] for r in rows} <= {0.0, *recipe.temperatures}
    paths = run(requests + [{"prompt": "one more", "category": ""}, {"prompt": "and another", "category": ""}])
    assert made[3:] == [(5, 7)] and [len(read_rows(p)) for p in paths] == [2, 2, 1, 2]
    assert [r["request"] for p in paths for r in read_rows(p)] == list(range(7))
    changed = requests[:4] + [{"prompt": "another", "category": ""}]
    run(changed)
    assert made[4:] == [(4, 5)] and len(list(tmp_path.glob("answers_0002-*"))) == 1  # only the changed shard
    check_recipe(tmp_path / "recipe.json", {"a": 1})
    check_recipe(tmp_path / "recipe.json", {"a": 1})
    with pytest.raises(ValueError, match="another recipe"):
        check_recipe(tmp_path / "recipe.json", {"a": 2})
    assert json.loads((tmp_path / "recipe.json").read_text()) == {"a": 1}


def test_a_requests_decoding_is_fixed_by_its_index():
    recipe = AnswerRecipe(sampled_share=0.5)
    first = [recipe.decoding(i) for i in range(200)]
    assert first == [recipe.decoding(i) for i in range(200)]
    share = sum(t > 0 for t, _ in first) / 200
    assert 0.35 < share < 0.65
