"""Chunked prefill in the batched path: a long prompt joins a few tokens per step, in the forwards of the answers
already running, and its answer (drafts included) is the one a whole prefill gives."""

from __future__ import annotations

import threading

import pytest

from specdec.engine import GenerationConfig, collect
from specdec.scheduler import BatchScheduler
from specdec.session import EngineSession
from tests.support.engine import WORDS, draft_factory, heads_engine, make_engine, target_only, tiny_prompts

CHUNK = 16


def long_prompt(target) -> list[int]:
    return target.tokenizer.chat_ids([{"role": "user", "content": " ".join(WORDS * 5)}])


def record_fed(engine) -> list[dict[int, int]]:
    """Per target forward from now on: {id of a sequence's cache: tokens it fed}."""
    forwards: list[dict[int, int]] = []
    extend = engine.runner.extend

    def recording(feeds):
        forwards.append({id(f.cache): f.length - min(f.cache.common_prefix(f.tokens), f.length - 1) for f in feeds})
        return extend(feeds)

    engine.runner.extend = recording
    return forwards


def whole_prefill(engine, prompt, config):
    """The answer and its drafts with the prompt prefilled in one forward."""
    tokens, events = collect(BatchScheduler(engine, prefill_chunk=len(prompt)).stream(prompt, config))
    return tokens, [ev.draft_tokens for ev in events]


def test_a_long_prompt_prefills_in_chunks_between_the_others_steps_and_stays_lossless(tiny_engine):
    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "3")
    prompt, short = long_prompt(target), tiny_prompts(target, 1, seed=30)[0]
    config = GenerationConfig(20)
    expected = whole_prefill(engine, prompt, config)
    scheduler = BatchScheduler(engine, prefill_chunk=CHUNK)
    forwards = record_fed(engine)
    stop, other, joining = threading.Event(), EngineSession(engine), EngineSession(engine)
    # the other conversation decodes target-only, one token a step, far longer than the long prompt's prefill takes
    running = scheduler.stream(short, GenerationConfig(300, speculate=False), stop, session=other)
    head = [next(running) for _ in range(2)]
    tokens, events = collect(scheduler.stream(prompt, config, session=joining))
    stop.set()
    rest = collect(running)[0]
    assert (tokens, [ev.draft_tokens for ev in events]) == expected  # the drafter caught up chunk by chunk
    assert tokens == target_only(target, prompt, 20)
    others = [t for ev in head for t in ev.tokens] + rest
    assert others == target_only(target, short, 300)[: len(others)]
    chunks = -(-(len(prompt) - CHUNK) // CHUNK)  # until the rest fits one step
    mine = [fed[id(joining.target)] for fed in forwards if id(joining.target) in fed]
    assert chunks >= 4 and mine[:chunks] == [CHUNK] * chunks and max(mine[chunks:]) < CHUNK
    with_chunk = [fed for fed in forwards if fed.get(id(joining.target)) == CHUNK]
    assert all(fed.get(id(other.target)) == 1 for fed in with_chunk)  # the other answer stepped beside every chunk


def test_heads_read_the_features_of_a_prompt_prefilled_in_chunks(tiny_engine, tiny_heads):
    engine = heads_engine(tiny_engine, tiny_heads)
    prompt = long_prompt(engine.target)
    config = GenerationConfig(16)
    tokens, events = collect(BatchScheduler(engine, prefill_chunk=CHUNK).stream(prompt, config))
    assert (tokens, [ev.draft_tokens for ev in events]) == whole_prefill(engine, prompt, config)


def test_a_cancelled_answer_leaves_during_its_chunked_prefill(tiny_engine):
    target, _ = tiny_engine.models
    engine = make_engine(target, None)
    scheduler = BatchScheduler(engine, prefill_chunk=CHUNK)
    cancel = threading.Event()
    forwards = record_fed(engine)
    session = EngineSession(engine)
    stream = scheduler.stream(long_prompt(target), GenerationConfig(20), cancel, session=session)
    cancel.set()
    events = list(stream)
    assert events[-1].finish_reason == "cancelled" and not events[-1].tokens
    assert forwards == []  # no chunk read for an answer nobody waits for


def test_the_prefill_chunk_must_be_positive(tiny_engine):
    with pytest.raises(ValueError, match="prefill chunk"):
        BatchScheduler(make_engine(tiny_engine.target, None), prefill_chunk=0)
