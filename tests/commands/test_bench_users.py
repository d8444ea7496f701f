"""`specvoice bench-users`: its counting and mixed-turn check on made-up turns, then N = 1 and 3 clients against the
tiny-engine app with two answer slots, their answers held until every client was admitted or refused so that they
overlap on any machine."""

from __future__ import annotations

import argparse
import statistics
import threading

import numpy as np
import pytest

from app.protocol import FLAG_REPLAY, pack_audio
from commands.bench_users import add_arguments, bench_users, is_mixed, load_utterances, summarize_run
from commands.voice_client import ClientTurn, Utterance, answer_audio_s
from pipeline.wer import word_error_rate
from specdec.models import asset_path
from tests.support.browser import running_app, shared_agent, wait_ready

QUESTIONS = {
    "capital": "What is the capital of France?",
    "egg": "How do I boil an egg?",
    "moon": "Why does the moon change shape?",
}


def utterance(name: str) -> Utterance:
    return Utterance(name, np.zeros(16, np.float32), QUESTIONS[name])


def test_a_turn_is_mixed_when_it_is_nearer_another_clients_question():
    group = [utterance(n) for n in QUESTIONS]
    capital, egg = group[0], group[1]
    own = ClientTurn(0, "capital", "answered", True, "What's the capital of France?", "What's the capital of France?")
    assert not is_mixed(own, capital, group)  # a small mishearing is still its own question
    assert is_mixed(own, egg, group)  # the egg client was heard saying the capital question
    swapped = ClientTurn(0, "capital", "answered", True, "What is the capital of France?", "How do I boil an egg?")
    assert is_mixed(swapped, capital, group)  # answered for a transcript it was never told it said
    assert not is_mixed(ClientTurn(0, "capital"), capital, group)  # nothing heard: lost, not mixed
    # Without a known text, the transcript heard in the warm-up pass is the reference.
    bare = [Utterance(u.name, u.audio, heard=u.text) for u in group]
    assert not is_mixed(own, bare[0], bare) and is_mixed(own, bare[1], bare)
    # A warm-up that heard no words ("...") gives no reference, and no error: the written text still counts.
    assert Utterance("capital", capital.audio, heard="...").references() == []
    wordless = [Utterance(u.name, u.audio, u.text, heard="...") for u in group]
    assert not is_mixed(own, wordless[0], wordless) and is_mixed(own, wordless[1], wordless)


def test_a_clients_answer_audio_is_its_turns_packets_without_replays():
    second = np.zeros(16000, np.float32)
    seen = [
        {"type": "token"},
        pack_audio(second, turn=3, seq=0, rate=16000, server_ms=0.0),
        pack_audio(second[:8000], turn=3, seq=1, rate=16000, server_ms=0.0),
        pack_audio(second, turn=2, seq=0, rate=16000, server_ms=0.0),  # another turn's
        pack_audio(second, turn=3, seq=0, rate=16000, server_ms=0.0, flags=FLAG_REPLAY),  # a replay, not the answer
    ]
    assert answer_audio_s(seen, 3) == 1.5 and answer_audio_s(seen, 4) == 0.0


def test_busy_is_counted_apart_from_lost_and_errors_over_every_client():
    turns = [
        ClientTurn(0, "capital", "answered", True, ttfa_ms=400.0),
        ClientTurn(1, "egg", "answered", True, ttfa_ms=600.0),
        ClientTurn(2, "moon", "busy"),
        ClientTurn(3, "capital", note="timed out"),
    ]
    extra = [ClientTurn(4, "egg", "left", True, errors=["answer failed: boom"])]
    run = summarize_run(4, turns, extra, {"passed": True})
    assert (run["turns_sent"], run["turns_answered"], run["busy"], run["lost"]) == (4, 2, 1, 1)
    assert run["silent"] == 2  # answered, but no audio reached either client
    turns[0].audio_s = 1.2
    assert summarize_run(4, turns, extra)["silent"] == 1
    assert run["server_errors"] == 1 and run["mixed"] == 0
    assert run["ttfa_ms_p50"] == 500.0 and 400.0 < run["ttfa_ms_p95"] <= 600.0  # interpolated, never beyond
    assert summarize_run(1, [ClientTurn(0, "egg", "busy")])["ttfa_ms_p50"] is None


def test_early_answers_are_counted_kept_only_when_answered():
    turns = [
        ClientTurn(0, "capital", "answered", True, early=["started", "kept"]),
        ClientTurn(1, "egg", "answered", True, early=["started", "discarded", "started", "discarded"]),
        ClientTurn(2, "moon", note="timed out", early=["started", "kept"]),  # kept, but its answer never came
    ]
    run = summarize_run(3, turns)
    assert (run["early_kept"], run["early_discarded"]) == (1, 2)


def test_options_are_the_apps_plus_the_clients():
    parser = argparse.ArgumentParser()
    add_arguments(parser)
    args = parser.parse_args(["--clients", "1,3", "--max-concurrent-answers", "2", "--draft", "ngram"])
    assert (args.clients, args.max_concurrent_answers, args.draft, args.port) == ([1, 3], 2, "ngram", 0)
    assert parser.parse_args([]).clients == [1, 2, 4] and not parser.parse_args([]).disconnect_one
    with pytest.raises(SystemExit):
        parser.parse_args(["--clients", "0,2"])


class HeldLLM:
    """A conversation's LLM stage whose answers wait for a permit while `holding` is set."""

    def __init__(self, llm, permits: threading.Semaphore, holding: threading.Event) -> None:
        self.llm, self.permits, self.holding = llm, permits, holding

    def __getattr__(self, name: str):
        return getattr(self.llm, name)

    def stream_reply(self, messages, speculation, stats, cancel=None, end_probe=False):
        if self.holding.is_set() and not self.permits.acquire(timeout=120):
            raise TimeoutError("the answer was never released")
        yield from self.llm.stream_reply(messages, speculation, stats, cancel)


@pytest.mark.models
def test_many_users_at_once_on_the_tiny_engine(monkeypatch):
    agent = shared_agent()
    permits, holding = threading.Semaphore(0), threading.Event()
    per_conversation = agent.llm.for_conversation
    monkeypatch.setattr(agent.llm, "for_conversation", lambda: HeldLLM(per_conversation(), permits, holding))
    utterances = load_utterances(asset_path("utterances"))[:3]

    def release(admitted: int) -> None:  # a group was admitted or refused: its admitted answers may go
        if admitted:
            permits.release(admitted)

    with running_app(max_concurrent_answers=2) as app:
        wait_ready(app)
        holding.set()  # after the loader's own warm-up turns
        one, three = bench_users(app.url, utterances, [1, 3], disconnect_one=True, on_admitted=release, progress=print)
    for run in (one, three):
        assert (run["lost"], run["silent"], run["mixed"], run["server_errors"]) == (0, 0, 0, 0), run
        ttfa = [t["ttfa_ms"] for t in run["turns"] if t["outcome"] == "answered"]
        assert min(ttfa) > 250 and run["ttfa_ms_p50"] == statistics.median(ttfa)  # the hang-over is in TTFA
    assert (one["turns_answered"], one["busy"], one["disconnect"]) == (1, 0, None)
    # Three questions at once, two slots: the one past capacity is refused, never lost.
    assert (three["turns_sent"], three["turns_answered"], three["busy"]) == (3, 2, 1)
    assert three["disconnect"] == {
        "left_mid_answer": True,
        "fresh_clients": 2,
        "fresh_answered": 2,
        "fresh_busy": 0,
        "passed": True,
    }
    texts = {u.name: u.text for u in utterances}
    for t in three["turns"]:  # each answered client was heard saying its own question; the refused one not at all
        if t["outcome"] == "answered":
            assert word_error_rate(texts[t["utterance"]], t["transcript"]) < 0.3, t
        else:  # its speech found no answer slot, so it was never transcribed (ASR runs under the same slots), unless
            # an early answer started at its pause waited for one: the pass at the end of the turn ran as that answer's
            assert t["outcome"] == "busy" and (t["transcript"] is None or "started" in t["early"]), t
    assert not app.server.sessions
