"""The engine on tiny random fp32 models: lossless output, cache rollback, K policy, fallbacks, errors."""

import copy
import dataclasses

import pytest
import torch

from specdec.build import build_engine
from specdec.drafters import DraftModelDrafter, NGramDrafter, OpeningEchoDrafter, Proposal, echo_lookup
from specdec.engine import EndProbe, GenerationConfig, collect
from specdec.metrics import SpecStats
from specdec.runner import BatchRunner, fastest_min_feed
from specdec.sampling import SamplingParams
from tests.support.engine import ON_CPU, draft_factory, make_engine, target_only

PROMPTS = ["hello there", "what is two plus two?", "tell me a story about a cat", "a b a b a b a b", "x"]


def _echo(target, inner):
    return OpeningEchoDrafter(inner, target.tokenizer, target.device)


@pytest.mark.parametrize("k", ["1", "2", "4", "7", "adaptive"])
@pytest.mark.parametrize("drafter", ["model", "ngram", "echo"])
def test_greedy_output_identical_to_target_only(tiny_engine, k, drafter):
    target, draft = tiny_engine.models
    factories = {
        "model": draft_factory(draft),
        "ngram": lambda: NGramDrafter(target.device),
        "echo": lambda: _echo(target, NGramDrafter(target.device)),
    }
    factory = factories[drafter]
    engine = make_engine(target, factory, k)
    proposed = 0
    for text in PROMPTS:
        ids = target.tokenizer.chat_ids([{"role": "user", "content": text}])
        stats = SpecStats()
        spec, _ = collect(engine.stream(ids, GenerationConfig(40), stats=stats))
        assert spec == target_only(target, ids, 40), text
        proposed += stats.proposed
    assert proposed > 0  # speculation really ran


def test_echo_lookup_proposes_what_follows_the_answers_last_words_in_the_prompt():
    words = ["<q>", " What", " is", " the", " boiling", " point", " of", " water", "?", "<a>"]
    ids = list(range(len(words)))
    prompt_len = len(words)

    def key(token):
        return words[token].strip().lower()

    def echo(answer, k=4):
        return [words[t] for t in echo_lookup(ids + [words.index(w) for w in answer], prompt_len, k, key)]

    words += ["The"]  # the answer's "The" matches the question's " the": case and space do not count
    assert echo(["The"]) == [" boiling", " point"]  # at most n + 1 tokens after an n-token match
    assert echo(["The"], k=1) == [" boiling"]
    assert echo(["The", " point"]) == [" of", " water"]  # the longest match is " point": two tokens
    assert echo(["The", " point", " of"], k=9) == [" water"]  # words only: not the "?" nor the markers after it
    assert echo([" water", "?", "<a>"]) == []  # matched at the prompt's very end: nothing follows
    assert echo([" is", " the"]) == [" boiling", " point", " of"]
    assert echo(["<q>"])[:1] == [" What"]
    words += ["  ", "Hello"]
    assert echo(["  "]) == [] and echo(["Hello"]) == []  # a space-only token matches nothing; nor an unknown word


def test_echo_lookup_reads_the_question_not_the_system_prompt_before_it():
    words = ["<s>", " Answer", " in", " one", " to", " three", " sentences", "<q>", " How", " do", " I", " tie", " a"]
    words += [" tie", "?", "<a>", "To"]
    ids, prompt_len, question_start = list(range(len(words))), words.index("<a>") + 1, words.index("<q>") + 1

    def echo(answer, start):
        context = ids[:prompt_len] + [words.index(w) for w in answer]
        return [words[t] for t in echo_lookup(context, prompt_len, 4, lambda t: words[t].strip().lower(), start)]

    assert echo(["To"], 0) == [" three", " sentences"]  # the system prompt's " to": a wrong guess
    assert echo(["To"], question_start) == []  # the question has no " to": nothing proposed
    # the latest " tie" is followed by no word: passed over for the one before it
    assert echo(["To", " tie"], question_start) == [" a", " tie"]


def test_an_answers_opening_is_drafted_from_its_prompt_where_it_matches_and_the_rest_by_the_inner_drafter(
    tiny_engine,
):
    target = tiny_engine.target
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "tell me a story about a cat"}])
    inner_calls: list[int] = []  # answer tokens before each call

    class Inner(NGramDrafter):
        def propose(self, context, k, params, generator):
            inner_calls.append(len(context) - len(ids))
            return super().propose(context, k, params, generator)

    drafter = _echo(target, Inner(target.device))
    calls: list[int] = []
    propose = drafter.propose
    drafter.propose = lambda context, *a: calls.append(len(context) - len(ids)) or propose(context, *a)
    tokens, _ = collect(make_engine(target, lambda: drafter, "2").stream(ids, GenerationConfig(30)))
    assert tokens == target_only(target, ids, 30)
    opening = [n for n in calls if 0 <= n < OpeningEchoDrafter.OPENING_TOKENS]  # the engine said where it began
    echoed = [n for n in opening if echo_lookup(ids + tokens[:n], len(ids), 2, drafter._key, drafter._question_start)]
    assert [n for n in inner_calls if n < OpeningEchoDrafter.OPENING_TOKENS] == [n for n in opening if n not in echoed]
    assert any(n >= OpeningEchoDrafter.OPENING_TOKENS for n in inner_calls)
    # the echo's own proposal for an answer that starts with the prompt's words, the inner drafter's where none match
    drafter.start(len(ids))
    inner_calls.clear()
    words = target.tokenizer.encode("A STORY")  # bytes: one letter a token, matched in the prompt's "a story"
    proposal = drafter.propose(ids + words[:5], 3, SamplingParams(), None)
    assert proposal.tokens.tolist() == target.tokenizer.encode("ry")  # words only: not the space after them
    assert not inner_calls
    drafter.propose(ids + target.tokenizer.encode("QQ"), 3, SamplingParams(), None)
    assert inner_calls == [2]


def test_draft_acceptance_is_partial_so_rejections_are_exercised(tiny_engine):
    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "4")
    stats = SpecStats()
    for text in PROMPTS:
        ids = target.tokenizer.chat_ids([{"role": "user", "content": text}])
        collect(engine.stream(ids, GenerationConfig(40), stats=stats))
    assert 0.2 < stats.draft_acceptance_rate < 0.95
    assert stats.rejections > 5


@pytest.mark.parametrize("seed", range(6))
def test_greedy_identical_across_seeds_of_draft_noise(tiny_engine, seed):
    from specdec.models import build_tiny_random

    target = tiny_engine.target
    draft_model = build_tiny_random(100 + seed).to(target.device)
    engine = make_engine(target, lambda: DraftModelDrafter(BatchRunner(draft_model, target.device)), "3")
    ids = target.tokenizer.chat_ids([{"role": "user", "content": f"seed {seed} prompt"}])
    assert collect(engine.stream(ids, GenerationConfig(30)))[0] == target_only(target, ids, 30)


def test_vocab_restricted_draft_stays_lossless(tiny_engine):
    target = tiny_engine.target
    spec = tiny_engine.spec_with(draft_quant="int8" if ON_CPU else "none", draft_vocab=120)  # int8: a CPU format
    engine, _ = build_engine(spec)
    engine.auto_off = False
    engine.target = target
    for text in PROMPTS[:3]:
        ids = target.tokenizer.chat_ids([{"role": "user", "content": text}])
        assert collect(engine.stream(ids, GenerationConfig(30)))[0] == target_only(target, ids, 30)


@torch.inference_mode()
def test_cache_rollback_matches_fresh_forward(tiny_engine):
    target = tiny_engine.target
    cache = BatchRunner(target.model, target.device).new_cache()
    ids = list(range(10, 40))
    cache.extend(ids + [50, 51, 52], n_logits=4)
    capacity = cache.capacity
    cache.rollback(len(ids) + 1)  # keep one accepted draft, drop two
    assert cache.tokens == ids + [50] and cache.capacity == capacity  # a position moved back, nothing reallocated
    got = cache.extend(ids + [50, 77])[-1]
    fresh = target.model(torch.tensor([ids + [50, 77]], device=target.device)).logits[0, -1]
    assert torch.allclose(got, fresh, atol=1e-4)


@torch.inference_mode()
def test_padded_single_token_feed_gives_the_unpadded_logits(tiny_engine):
    target = tiny_engine.target
    plain = BatchRunner(target.model, target.device).new_cache()
    padded = BatchRunner(target.model, target.device, min_feed=2).new_cache()
    ids = list(range(10, 30))
    for cache in (plain, padded):
        cache.extend(ids)
    for extra in ([40], [40, 41], [40, 41, 42]):  # one new token is padded, more are fed as they are
        want, got = plain.extend(ids + extra, n_logits=len(extra)), padded.extend(ids + extra, n_logits=len(extra))
        assert got.shape == want.shape and torch.allclose(got, want, atol=1e-4)
        assert padded.tokens == ids + extra  # the pad is not kept
    # A fully cached sequence is re-fed from its last token, padded too.
    assert torch.allclose(padded.extend(ids + [40, 41, 42])[-1], plain.extend(ids + [40, 41, 42])[-1], atol=1e-4)


@pytest.mark.parametrize("gate_on_host", [False, True], ids=["device-gate", "host-gate"])
def test_greedy_identical_with_confidence_gate(tiny_engine, gate_on_host):
    target, draft = tiny_engine.models
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "tell me a story about a cat"}])
    with torch.inference_mode():  # a gate at the draft's median confidence along the answer: it must bite sometimes
        answer = target_only(target, ids, 40)
        logits = draft.model(torch.tensor([ids + answer], device=draft.device)).logits
        conf = torch.softmax(logits[0, len(ids) - 1 : -1], -1).amax(-1)
    gate = float(conf.median())
    engine = make_engine(target, draft_factory(draft, min_prob=gate, gate_on_host=gate_on_host), "4")
    spec, events = collect(engine.stream(ids, GenerationConfig(40)))
    assert spec == answer
    before = [sum(len(e.tokens) for e in events[:i]) for i in range(len(events))]
    early = [ev.drafted for ev, n in zip(events, before) if n < 30]  # later, the token budget also caps K
    assert min(early) < 4 and max(early) == 4


def test_greedy_identical_with_padded_feeds(tiny_engine):
    target, draft = tiny_engine.models
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "tell me a story about a cat"}])
    want = target_only(target, ids, 40)
    padded_draft = BatchRunner(draft.model, draft.device, min_feed=2)
    for factory in (draft_factory(draft), lambda: DraftModelDrafter(padded_draft)):
        assert collect(make_engine(target, factory, min_feed=2).stream(ids, GenerationConfig(40)))[0] == want
    padded_only = make_engine(target, None, min_feed=2)
    assert collect(padded_only.stream(ids, GenerationConfig(40, speculate=False)))[0] == want


@pytest.mark.parametrize("one_row_ms,two_rows_ms,want", [(243, 190, 2), (30, 32, 1)])
def test_fastest_min_feed_picks_the_faster_width(tiny_engine, monkeypatch, one_row_ms, two_rows_ms, want):
    """On a clock that a one-token forward advances by one_row_ms and a padded two-token one by two_rows_ms. On a
    GPU the width is 1, untimed."""
    target = tiny_engine.target
    clock = {"ms": 0.0}
    cost = {1: one_row_ms, 2: two_rows_ms}

    real_forward = BatchRunner._forward

    def timed_forward(self, feeds, spans, ids, *rest):
        clock["ms"] += cost.get(len(ids), 0.0)
        return real_forward(self, feeds, spans, ids, *rest)

    monkeypatch.setattr(BatchRunner, "_forward", timed_forward)
    monkeypatch.setattr("specdec.timing.time.perf_counter", lambda: clock["ms"] / 1000)
    assert fastest_min_feed(BatchRunner(target.model, target.device)) == (want if ON_CPU else 1)


def test_session_reuses_prefix_and_stays_lossless(tiny_engine):
    from specdec.session import EngineSession
    from specdec.tokenizer import shared_prefix_ids

    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "3")
    session = EngineSession(engine)
    system = shared_prefix_ids(target.tokenizer, "be brief")
    session.prefill(system)
    assert session.target.tokens == system
    history = [{"role": "system", "content": "be brief"}]
    for text in ["hello", "and again"]:
        history.append({"role": "user", "content": text})
        ids = target.tokenizer.chat_ids(history)
        assert session.target.common_prefix(ids) >= len(system)  # the shared prefix stays cached
        tokens, _ = collect(engine.stream(ids, GenerationConfig(20), session=session))
        assert tokens == target_only(target, ids, 20)
        history.append({"role": "assistant", "content": target.tokenizer.decode(tokens)})
    session.rollback(len(system))
    assert session.target.tokens == system and session.drafter.cache.tokens == system


def test_session_with_prompt_already_cached_stays_lossless(tiny_engine):
    """A repeated turn finds its whole prompt cached; verification must still line up its logits."""
    from specdec.session import EngineSession

    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "4")
    session = EngineSession(engine)
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "same question"}])
    expected = target_only(target, ids, 25)
    for speculate in (False, True, True, False):
        tokens, _ = collect(engine.stream(ids, GenerationConfig(25, speculate=speculate), session=session))
        assert tokens == expected, speculate


def test_draft_model_crashing_inside_its_forward_leaves_a_usable_session(tiny_engine):
    from specdec.session import EngineSession

    target, draft = tiny_engine.models

    class CrashOnce(BatchRunner):
        calls = 0

        def _forward(self, *args):
            self.calls += 1
            out = super()._forward(*args)  # the cache was written already when the failure hits
            if self.calls == 4:
                raise RuntimeError("out of memory in the draft")
            return out

    crashing = CrashOnce(draft.model, draft.device)
    engine = make_engine(target, lambda: DraftModelDrafter(crashing), "3")
    session = EngineSession(engine)
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "hello there"}])
    tokens, events = collect(engine.stream(ids, GenerationConfig(20), session=session))
    assert tokens == target_only(target, ids, 20) and any("drafter failed" in ev.note for ev in events)
    again = target.tokenizer.chat_ids([{"role": "user", "content": "and once more"}])
    stats = SpecStats()
    tokens, _ = collect(engine.stream(again, GenerationConfig(20), stats=stats, session=session))
    assert tokens == target_only(target, again, 20) and stats.proposed > 0
    cache = session.drafter.cache  # it still holds exactly what it says: its logits are a fresh cache's
    held = [t for t in cache.tokens if t >= 0]
    assert held == cache.tokens[: len(held)]
    fresh = BatchRunner(draft.model, draft.device).new_cache()
    assert torch.allclose(cache.extend(held + [5]), fresh.extend(held + [5]), atol=1e-4)


def test_drafts_past_eos_are_not_counted(tiny_engine):
    """An oracle drafter proposes the target's own answer, 4 at a time; a token in the second step's drafts is made
    the EOS, so the drafts after it are accepted by the target but never part of the answer."""
    target = tiny_engine.target
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "tell me a story about a cat"}])
    answer = target_only(target, ids, 20)
    end = next(i for i in range(5, 8) if answer[i] not in answer[:i])  # not the last draft, so some come after
    eos = answer[end]
    tokenizer = copy.copy(target.tokenizer)
    tokenizer.eos_token_ids = {eos}
    with_eos = dataclasses.replace(target, tokenizer=tokenizer)

    class Oracle(NGramDrafter):
        def propose(self, context, k, params, generator):
            done = len(context) - len(ids)
            return Proposal.of(answer[done : done + k], self.device)

    stats = SpecStats()
    tokens, events = collect(
        make_engine(with_eos, lambda: Oracle(target.device), "4").stream(ids, GenerationConfig(20), stats=stats)
    )
    assert tokens == answer[: end + 1] and events[-1].finish_reason == "eos"
    assert [ev.accepted for ev in events] == [4, end - 4]
    assert (stats.proposed, stats.accepted, stats.emitted, stats.rejections) == (end, end, end + 1, 0)


def test_a_seed_reproduces_its_sampled_answer_with_a_fixed_k_schedule(tiny_engine):
    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "3")
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "hello"}])
    params = SamplingParams(temperature=1.0)
    answers = {tuple(collect(engine.stream(ids, GenerationConfig(30, params, seed=5)))[0]) for _ in range(3)}
    assert len(answers) == 1
    other = collect(engine.stream(ids, GenerationConfig(30, params, seed=6)))[0]
    assert tuple(other) not in answers  # the seed is what fixes it


@pytest.mark.parametrize("speculate", [False, True])
def test_end_probe_reads_the_words_row_in_the_first_forward_and_changes_nothing(tiny_engine, speculate):
    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "4")
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "what is two plus two?"}])
    words_end = len(target.tokenizer.chat_ids([{"role": "user", "content": "what is two plus two"}])) - 1
    end_ids = (ids[words_end], 65)
    probe = EndProbe(words_end, end_ids)
    events = list(engine.stream(ids, GenerationConfig(20, speculate=speculate, end_probe=probe)))
    probs = [e.end_of_message_probability for e in events]
    assert probs[0] is not None and all(p is None for p in probs[1:])  # the first step only
    # What a forward of the words alone says of the token after them:
    cache = engine.runner.new_cache()
    alone = torch.softmax(cache.extend(ids[:words_end])[0].float(), -1)
    assert probs[0] == pytest.approx(float(alone[list(end_ids)].sum()), abs=1e-5)
    assert [t for e in events for t in e.tokens] == target_only(target, ids, 20)  # the answer is unchanged


def test_an_end_probe_where_the_prompt_ends_reads_the_last_row_once(tiny_engine):
    target, draft = tiny_engine.models
    engine = make_engine(target, draft_factory(draft), "4")
    ids = target.tokenizer.encode("what is two plus two")
    probe = EndProbe(len(ids), (65, 66))  # the words end the prompt: no row before the verified ones
    events = list(engine.stream(ids, GenerationConfig(12, end_probe=probe)))
    probs = [e.end_of_message_probability for e in events]
    assert probs[0] is not None and all(p is None for p in probs[1:])
    alone = torch.softmax(engine.runner.new_cache().extend(ids)[0].float(), -1)
    assert probs[0] == pytest.approx(float(alone[[65, 66]].sum()), abs=1e-5)
    assert [t for e in events for t in e.tokens] == target_only(target, ids, 12)
