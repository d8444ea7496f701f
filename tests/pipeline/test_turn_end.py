"""End of turn by words, preemptive generation (held early answers) and prefill while speaking."""

import dataclasses
import math
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import pytest

from commands.bench_server import wait_until
from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.audio import SAMPLE_RATE
from pipeline.events import AnswerDone, Audio, Transcript
from pipeline.llm import EngineLLM, ReplyStats
from pipeline.llm_provider import SharedProvider
from pipeline.preemptive import ChildCancel, Hold
from pipeline.timeline import STAGES, Timeline
from pipeline.turn_end import PauseSignals, TurnEnd, how_finished
from specdec.build import build_engine
from specdec.session import EngineSession
from tests.support.fakes import FakeTTS, ScriptedLLM
from tests.support.speech import needs_espeak, speak


@pytest.mark.parametrize(
    "text, finish",
    [
        ("What is the capital of France?", "finished"),
        ("Tell me a joke.", "finished"),
        ("Stop!", "finished"),
        ("What is the capital of", "unfinished"),
        ("What is the capital of?", "unfinished"),  # Whisper closes cut-off phrases too
        ("I want bread and", "unfinished"),
        ("So the", "unfinished"),
        ("Well, um...", "unfinished"),
        ("Let me think,", "unfinished"),
        ("how are you", "unfinished"),  # no closing punctuation: not known to be finished
        ("", "unfinished"),
        ("?", "unfinished"),
        ("What time zone is London in?", "unsure"),  # a finished question that ends like an unfinished one
        ("Why do birds fly south in?", "unsure"),
        ("How many legs does a spider have?", "unsure"),
    ],
)
def test_how_finished(text, finish):
    assert how_finished(text) == finish


def wait_ms(turn_end: TurnEnd, words=None, audio=None, target=None, smart=True, target_expected=True) -> float:
    return turn_end.decide(PauseSignals(words, audio, target), smart, target_expected).ms


def test_smart_waits_briefly_only_when_audio_and_words_both_say_finished():
    smart = TurnEnd(
        "smart", complete_ms=160, unsure_ms=700, incomplete_ms=1000, audio_threshold=0.5, words_threshold=0.2
    )
    assert wait_ms(smart, "Is it raining?", audio=0.9, target=0.6) == 160
    assert wait_ms(smart, "Is it raining?", audio=0.3, target=0.6) == 1000  # the voice goes on
    # Whisper closed a fragment with a period, and the voice fell as if finished: the target still reads it unfinished
    assert wait_ms(smart, "I would like to know.", audio=0.9, target=0.05) == 1000
    # Until the target's forward has read the words, finished-looking words are only unsure (Whisper closes
    # fragments with "?" too) ...
    assert wait_ms(smart, "Is it raining?", audio=0.9) == 700
    assert wait_ms(smart, "Is it raining in?", audio=0.9, target=0.6) == 160  # ... until the target says finished
    assert wait_ms(smart, "Is it raining?", audio=0.9, target=None, target_expected=False) == 160  # none will come
    assert wait_ms(dataclasses.replace(smart, transcript_stands_in=True), "Is it raining?", audio=0.9) == 160
    assert wait_ms(smart, "Is it raining?") == 1000  # the audio not scored yet
    assert wait_ms(smart, None, audio=0.9) == 1000  # the words not heard yet
    assert wait_ms(smart, "Is it raining?", audio=0.3, smart=False) == 160  # Smart Turn failed to load: words rule
    assert "audio 0.30 unfinished" in smart.decide(PauseSignals("Is it?", 0.3, 0.6)).why


def test_turn_end_waits_by_words_or_by_silence():
    words = TurnEnd("words", silence_ms=300, complete_ms=200, unsure_ms=700, incomplete_ms=1000)
    assert wait_ms(words, "Is it raining?") == 200
    assert wait_ms(words, "Is it raining in?") == 700
    assert wait_ms(words, "Is it raining and") == 1000
    assert wait_ms(words) == 1000  # not transcribed yet: wait for the words
    assert wait_ms(words, "Is it raining?", audio=0.0, target=0.0) == 200  # mode words: the transcript alone
    assert words.longest_ms == 1000
    silence = TurnEnd("silence", silence_ms=300)
    assert wait_ms(silence, "Is it raining in") == wait_ms(silence) == silence.longest_ms == 300
    with pytest.raises(ValueError, match="mode"):
        TurnEnd("vibes")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="audio_threshold"):
        TurnEnd(audio_threshold=1.5)
    with pytest.raises(ValueError, match="complete_ms"):
        TurnEnd(complete_ms=0)


def test_hold_releases_in_order_on_confirm_and_nothing_on_discard():
    sent, cancel = [], threading.Event()
    kept = Hold("hi")
    sink = kept.wrap(sent.append)
    sink(("token", 1))
    kept.post(lambda: sent.append(("turn", 0)))
    assert sent == []  # held
    kept.confirm()
    sink(("token", 2))
    assert sent == [("token", 1), ("turn", 0), ("token", 2)] and kept.wait()
    thrown = Hold("hi")
    thrown.link(cancel)
    thrown.wrap(sent.append)(("audio", 3))
    thrown.discard()
    thrown.post(lambda: sent.append(("late", 4)))
    thrown.confirm()  # too late: a discarded answer stays discarded
    assert len(sent) == 3 and cancel.is_set() and not thrown.wait()
    late = threading.Event()
    thrown.link(late)  # linked after the discard: set at once
    assert late.is_set()


def test_child_cancel_follows_its_parent_but_not_the_other_way():
    parent = threading.Event()
    child = ChildCancel(parent)
    child.set()
    assert child.is_set() and not parent.is_set()
    other = ChildCancel(parent)
    parent.set()
    assert other.is_set()


def test_an_early_answers_marks_count_from_the_confirmation():
    tl = Timeline()
    tl.mark("speech_end", 10.0)
    tl.early_start = 10.2
    for name, t in (("llm_first_token", 10.4), ("first_chunk_ready", 10.6)):  # before the turn was confirmed
        tl.mark(name, t)
    tl.first_audio_ready = 10.65
    tl.mark("end_of_turn", 10.5)
    tl.mark("asr_final", 10.52)
    tl.mark("first_audio_out", 10.66)
    tl.silence_rule_ms = 300
    stages = tl.stages_ms()
    assert set(stages) == set(STAGES) and min(stages.values()) >= 0
    assert math.isclose(sum(stages.values()), tl.ttfa_ms) and math.isclose(tl.ttfa_ms, 660)
    saved = tl.saved_ms()
    assert math.isclose(saved["preemptive"], 320)  # min(first audio ready, final transcript) − early start
    assert math.isclose(saved["turn end by words"], 300 - 500)  # waited longer than the silence rule would


class ScriptedASR:
    """Whisper's stand-in: the words spoken up to the end of the audio it is given (times known from the test)."""

    def __init__(self, parts: list[tuple[float, str]]) -> None:
        self.parts = parts  # (seconds from the start when these words are complete, the transcript from then on)

    def transcribe(self, audio):
        seconds = len(audio) / SAMPLE_RATE
        return next((text for until, text in reversed(self.parts) if seconds >= until), "")

    def warmup(self):
        pass


def spoken(*pieces: str | float) -> tuple[np.ndarray, list[float]]:
    """Speech (espeak) and silences (seconds) in a row; and where each piece's sound ends, in seconds."""
    audio, ends = [np.zeros(4000, np.float32)], []
    for p in pieces:
        before = sum(len(a) for a in audio)
        piece = np.zeros(int(p * SAMPLE_RATE), np.float32) if isinstance(p, float) else speak(p)
        audio.append(piece)
        loud = np.flatnonzero(np.abs(piece) > 0.01)
        ends.append((before + (loud[-1] + 1 if len(loud) else len(piece))) / SAMPLE_RATE)
    return np.concatenate(audio), ends


def agent_with(asr, answer="Ottawa is the capital of Canada.", end_of_message_probability=None, **config):
    llm = ScriptedLLM(answer, step_s=0.02, end_of_message_probability=end_of_message_probability)
    return VoiceAgent(AgentConfig(**config), SharedProvider(llm), asr, FakeTTS()), llm


class FakeSmartTurn:
    """Smart Turn's stand-in: score(audio) -> (P(finished), cost in s), on a thread of its own as the model's."""

    def __init__(self) -> None:
        self.thread = ThreadPoolExecutor(max_workers=1)

    def submit(self, audio16k):
        return self.thread.submit(self.score, audio16k)


class FixedSmartTurn(FakeSmartTurn):
    """The same P(finished) for any audio, after cost_s."""

    def __init__(self, p: float, cost_s: float = 0.0) -> None:
        super().__init__()
        self.p, self.cost_s = p, cost_s

    def score(self, audio16k):
        time.sleep(self.cost_s)
        return self.p, self.cost_s


def fragment_turn(mode, audio_p, target_p):
    """ "I would like to know why … the sky is blue." with a 0.5 s pause that Whisper closes with a period."""
    audio, ends = spoken("I would like to know why", 0.5, "the sky is blue.")
    asr = ScriptedASR(
        [(ends[0] - 0.1, "I would like to know why."), (ends[2] - 0.1, "I would like to know why the sky is blue.")]
    )
    agent, _ = agent_with(asr, end_of_message_probability=target_p, turn_end=TurnEnd(mode))
    agent.smart_turn = FixedSmartTurn(audio_p) if mode == "smart" else None
    return agent.turn_from_recording(agent.new_conversation(), audio, True)


@needs_espeak
def test_todays_rule_cuts_a_fragment_whisper_closed_and_the_votes_keep_it_whole():
    assert fragment_turn("words", None, None).transcript == "I would like to know why."  # cut at the pause
    # The voice fell as if finished, but the target reads the words as unfinished: the turn waits the long wait.
    result = fragment_turn("smart", 0.9, 0.03)
    assert result.transcript == "I would like to know why the sky is blue."
    *before, last = result.timeline.pauses
    (mid,) = [p for p in before if p["silence_ms"] > 300]  # espeak's own short gaps aside
    assert mid["end_of_message_probability"] == 0.03 and mid["wait_ms"] == TurnEnd().incomplete_ms
    assert last["ended_turn"] and not mid["ended_turn"]
    # The voice going on is enough as well, whatever the words.
    assert fragment_turn("smart", 0.02, 0.9).transcript == "I would like to know why the sky is blue."


def went_on_after_its_wait_ran_out(step_s: float):
    """ "I would like to know why … the sky is blue." with a 0.6 s pause after words that both votes read as finished
    (so its short wait runs out within the pause), answered by an LLM that takes step_s a word."""
    audio, ends = spoken("I would like to know why", 0.6, "the sky is blue.")
    asr = FinalPassesASR(
        [(ends[0] - 0.1, "I would like to know why."), (ends[2] - 0.1, "I would like to know why the sky is blue.")]
    )
    llm = ScriptedLLM("Because of scattering.", step_s=step_s, end_of_message_probability=0.9)
    agent = VoiceAgent(AgentConfig(turn_end=TurnEnd("smart")), SharedProvider(llm), asr, FakeTTS())
    agent.smart_turn = FixedSmartTurn(0.9)
    events: list = []
    result = agent.turn_from_recording(agent.new_conversation(), audio, True, on_event=events.append)
    return result, events, llm, asr.final_passes


class FinalPassesASR(ScriptedASR):
    """Counts the passes made when the turn ends (not the streaming ones at pauses): each adds its time to TTFA."""

    final_passes = 0

    def transcribe(self, audio):
        self.final_passes += threading.current_thread().name != "asr-partial"
        return super().transcribe(audio)


@needs_espeak
def test_a_speaker_who_goes_on_before_the_answer_can_be_heard_keeps_the_turn():
    whole = "I would like to know why the sky is blue."
    # The answer's first audio comes ~1.2 s after the pause (3 words at 0.4 s): the speaker goes on at 0.6 s, after
    # the short wait ran out but before anything could be heard, and the turn goes on.
    result, events, llm, final_passes = went_on_after_its_wait_ran_out(0.4)
    assert result.transcript == whole
    assert final_passes == 0  # the pass at the last pause heard all of the speech, however long the turn was held
    *before, last = result.timeline.pauses
    (mid,) = [p for p in before if p["silence_ms"] > 300]
    assert mid["wait_ms"] == TurnEnd().complete_ms < mid["silence_ms"]  # the decision alone would have cut here
    assert mid["held_open"] and mid["answer_held"] and not mid["ended_turn"]
    assert result.timeline.early_discarded >= 1 and [m[-1]["content"] for m in llm.seen_messages][-1] == whole
    assert sum(isinstance(e, Transcript) for e in events) == 1  # nothing of the answer to the fragment went out
    # The last pause is held open too (its answer is slower than the longest wait), but its end of turn counts from
    # when its own wait ran out, its words were final then, and the stages still add up to TTFA.
    d = result.to_dict()
    assert last["ended_turn"] and last["held_open"] and d["stages"]["end_of_turn_wait"] < TurnEnd().unsure_ms
    assert d["stages"]["asr"] < 50 and math.isclose(sum(d["stages"].values()), d["ttfa_ms"])
    # An answer that can be heard before the speaker goes on is not held: the same turn is cut at the pause.
    fast, *_ = went_on_after_its_wait_ran_out(0.01)
    assert fast.transcript == "I would like to know why." and not fast.timeline.pauses[-1]["held_open"]


@needs_espeak
def test_a_finished_question_is_answered_after_the_short_wait_when_both_say_finished():
    audio, ends = spoken("What is the capital of France?")
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    agent, _ = agent_with(asr, end_of_message_probability=0.8, turn_end=TurnEnd("smart"))
    agent.smart_turn = FixedSmartTurn(0.95)
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    wait = result.to_dict()["stages"]["end_of_turn_wait"]
    (pause,) = result.timeline.pauses
    assert pause["ended_turn"] and pause["end_of_turn_probability"] == 0.95 and "smart_turn_ms" in pause
    # The short wait chosen; the measured one is at least that (how much more depends on this machine's speed, so
    # only that it is below the next longer wait is asserted).
    assert pause["wait_ms"] == TurnEnd().complete_ms and TurnEnd().complete_ms - 40 <= wait < TurnEnd().unsure_ms


@needs_espeak
def test_smart_turn_scores_the_pause_beside_its_asr_pass_so_the_words_do_not_wait_for_it():
    audio, ends = spoken("What is the capital of France?")
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    agent, _ = agent_with(asr, end_of_message_probability=0.8, turn_end=TurnEnd("smart"))
    agent.smart_turn = FixedSmartTurn(0.95, cost_s=0.3)
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    (pause,) = result.timeline.pauses
    # In series the words came after the model's 300 ms; beside it they come first, and the early answer with them.
    assert pause["words_at_ms"] < 250 <= 300 <= pause["smart_turn_ms"] <= pause["end_of_turn_probability_at_ms"]
    assert pause["end_of_turn_probability"] == 0.95 and pause["wait_ms"] == TurnEnd().complete_ms
    assert result.timeline.early_start is not None and result.transcript == "What is the capital of France?"


class SlowOnTheFragment(FakeSmartTurn):
    """Audio up to the end of the fragment sounds finished (0.9) but takes 1 s to score, longer than the pause after
    it; the whole question sounds unfinished (0.05) and is scored at once."""

    def __init__(self, fragment_end_s: float) -> None:
        super().__init__()
        self.fragment_end_s = fragment_end_s

    def score(self, audio16k):
        fragment = len(audio16k) / SAMPLE_RATE < self.fragment_end_s + 0.2
        time.sleep(1.0 if fragment else 0.0)
        return (0.9, 1.0) if fragment else (0.05, 0.0)


@needs_espeak
def test_a_score_that_comes_after_the_speaker_went_on_is_not_the_next_pauses():
    audio, ends = spoken("I would like to know why", 0.5, "the sky is blue.")
    asr = ScriptedASR(
        [(ends[0] - 0.1, "I would like to know why."), (ends[2] - 0.1, "I would like to know why the sky is blue.")]
    )
    agent, _ = agent_with(asr, end_of_message_probability=0.9, turn_end=TurnEnd("smart"))
    agent.smart_turn = SlowOnTheFragment(ends[0])
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    assert result.transcript == "I would like to know why the sky is blue."
    *before, last = result.timeline.pauses
    (mid,) = [p for p in before if p["silence_ms"] > 300]
    # Unscored while it lasted, so it waited the long wait; its late 0.9 never reached the last pause.
    assert mid["end_of_turn_probability"] is None and "audio not scored yet" in mid["why"]
    assert last["end_of_turn_probability"] == 0.05 and last["wait_ms"] == TurnEnd().incomplete_ms


@needs_espeak
def test_a_pause_after_unfinished_words_does_not_end_the_turn_and_its_early_answer_leaves_nothing():
    audio, ends = spoken("What is the capital of", 0.5, "Canada?")
    asr = ScriptedASR([(ends[0] - 0.3, "What is the capital of"), (ends[2] - 0.1, "What is the capital of Canada?")])
    agent, llm = agent_with(asr)
    conv, events = agent.new_conversation(), []
    result = agent.turn_from_recording(conv, audio, True, on_event=lambda event: events.append(type(event)))
    assert result.transcript == "What is the capital of Canada?"  # the turn was not cut at "of"
    assert [m[-1]["content"] for m in llm.seen_messages] == ["What is the capital of", result.transcript]
    assert result.timeline.early_discarded == 1  # started at the pause, thrown away when speech went on
    assert events.count(AnswerDone) == 1 and events.count(Transcript) == 1 and not result.discarded
    assert [m["content"] for m in conv.history] == [result.transcript, result.answer]  # nothing of the early one
    assert result.timeline.early_start is not None  # the final words were answered early too, and kept
    assert result.to_dict()["saved_ms"]["preemptive"] >= 0


@needs_espeak
@pytest.mark.parametrize("mode", ["words", "silence"])
def test_finished_words_end_the_turn_sooner_and_the_early_answer_is_kept(mode):
    audio, ends = spoken("What is the capital of France?")
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    turn_end = TurnEnd(mode, silence_ms=600, complete_ms=200, incomplete_ms=1000)
    agent, llm = agent_with(asr, turn_end=turn_end)
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    d = result.to_dict()
    wait = d["stages"]["end_of_turn_wait"]
    expected = 200 if mode == "words" else 600
    assert expected - 40 <= wait <= expected + 80
    assert len(llm.seen_messages) == 1 and result.timeline.early_start is not None  # started early, kept
    assert math.isclose(sum(d["stages"].values()), d["ttfa_ms"]) and d["ttfa_ms"] > wait
    assert d["saved_ms"]["preemptive"] > 0
    assert ("turn end by words" in d["saved_ms"]) is (mode == "words")


@needs_espeak
def test_without_preemption_the_answer_starts_after_the_turn():
    audio, ends = spoken("What is the capital of France?")
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    agent, llm = agent_with(asr, preemptive=False)
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    assert result.timeline.early_start is None and "preemptive" not in result.to_dict()["saved_ms"]
    assert result.timeline.marks["llm_first_token"] >= result.timeline.marks["asr_final"]


@needs_espeak
def test_a_barge_in_during_an_early_answer_stops_it_like_any_answer():
    audio, ends = spoken("Tell me everything.")
    asr = ScriptedASR([(ends[0] - 0.1, "Tell me everything.")])
    agent, llm = agent_with(asr, answer=" ".join(f"word{i}." for i in range(200)))
    cancel = threading.Event()

    def on_event(event):
        if isinstance(event, Audio):
            cancel.set()  # the user talks over the first audio

    conv = agent.new_conversation()
    result = agent.turn_from_recording(conv, audio, True, on_event=on_event, cancel=cancel)
    assert result.cancelled and not result.discarded and len(result.audio) == 1 and result.stats.tokens < 200
    assert conv.history[-1]["content"].endswith("…")


def test_prefill_while_speaking_caches_the_words_and_changes_no_token(tiny_engine):
    engine, _ = build_engine(tiny_engine.spec)
    system = {"role": "system", "content": "You answer."}
    final = [system, {"role": "user", "content": "What is the capital of France?"}]
    answers = []
    for prefill in (False, True):
        llm = EngineLLM(engine, 12, session=EngineSession(engine))
        if prefill:
            llm.prefill_words([system, {"role": "user", "content": "What is the capital"}])
            cached = list(llm.session.target.tokens)
            assert cached == llm.prompt_ids(final)[: len(cached)]  # a prefix of the final prompt
        stats = ReplyStats()
        answers.append([d.text for d in llm.stream_reply(final, True, stats)])
        assert (stats.prefilled_while_speaking_tokens > 0) is prefill
    assert answers[0] == answers[1]


def test_the_drafter_is_told_where_the_question_begins_in_the_prompt(tiny_engine):
    engine, target = build_engine(tiny_engine.spec)
    llm = EngineLLM(engine, 4, session=EngineSession(engine))
    llm.session.use_drafter("ngram")
    starts: list[tuple[int, int]] = []
    llm.session.drafter.start = lambda prompt_len, question_start=0: starts.append((prompt_len, question_start))
    history = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"}]
    question = {"role": "user", "content": "How do I tie a tie?"}
    messages = [{"role": "system", "content": "You answer."}, *history, question]
    list(llm.stream_reply(messages, True, ReplyStats()))
    prompt = llm.prompt_ids(messages)
    [(prompt_len, question_start)] = starts
    assert prompt_len == len(prompt)
    assert target.tokenizer.decode(prompt[question_start:]).startswith("How do I tie a tie?")
    assert "Hello!" not in target.tokenizer.decode(prompt[question_start:])


def test_the_words_are_prefilled_only_into_a_stage_that_keeps_a_cache():
    asr = ScriptedASR([(0.0, "What is")])
    agent, llm = agent_with(asr, prefill_while_speaking=True)
    # a stage without a cache (as a remote server's): no prefill thread for a no-op
    assert agent.listen(agent.new_conversation()).prefill is None
    llm.keeps_cache = True
    assert agent.listen(agent.new_conversation()).prefill is not None


def test_a_partial_is_prefilled_to_its_last_word_without_its_closing_punctuation():
    from pipeline.listener import words_to_prefill

    assert words_to_prefill("What is the boiling point?") == "What is the boiling point"
    assert words_to_prefill(" So the … ") == "So the"
    assert words_to_prefill("and, ") == "and"
    assert words_to_prefill("?") == words_to_prefill("") == ""


@needs_espeak
def test_the_words_heard_while_speaking_are_prefilled_up_to_the_last_one():
    from pipeline.listener import TurnListener
    from pipeline.vad import FRAME

    audio, ends = spoken("What is the capital of France?")
    asr = ScriptedASR([(ends[0] / 2, "What is the capital?")])  # Whisper closes a partial with "?"
    prefilled: list[str] = []
    listener = TurnListener(asr, TurnEnd(), asr_interval_s=0.02, prefill=prefilled.append)
    frames = range(0, int(ends[0] * SAMPLE_RATE) - 2 * FRAME, FRAME)  # while the words are still being said
    try:
        for i in frames:
            listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
        assert wait_until(lambda: listener.asr.partial == "What is the capital?", 5)  # the ASR thread's partial
        nxt = len(frames) * FRAME
        listener.feed(audio[nxt : nxt + FRAME], nxt / SAMPLE_RATE)  # the next frame, still voiced, reads it
    finally:
        listener.close()
    assert prefilled and prefilled[-1] == "What is the capital"


@needs_espeak
def test_an_early_answer_given_up_by_its_answerer_leaves_the_turn_to_be_answered_normally():
    """The app gives an early answer up when no answer slot is free: the turn then asks again once it ends."""
    from pipeline.listener import TurnListener
    from pipeline.vad import FRAME

    audio, ends = spoken("What is the capital of France?", 1.2)
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    started: list[Hold] = []
    listener = TurnListener(asr, TurnEnd(), start_early=lambda words, tl, hold: (started.append(hold), hold.discard()))
    end = None
    for i in range(0, len(audio), FRAME):
        end = listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
        if end is not None:
            break
        if listener.vad.paused and not started:  # fed faster than spoken: the pause's words start it, then on
            assert wait_until(lambda: (listener.poll(), started)[1], 5)
    heard = listener.finish(end)
    listener.close()
    assert len(started) == 1 and heard.early is None and heard.transcript == "What is the capital of France?"
    assert heard.timeline.early_start is None and heard.timeline.early_discarded == 1


class SlowASR(ScriptedASR):
    """A pass takes as long as Whisper's on this CPU, so its words come in between two audio frames."""

    def transcribe(self, audio):
        time.sleep(0.15)
        return super().transcribe(audio)


@needs_espeak
def test_the_early_answer_starts_when_the_pause_is_transcribed_not_at_the_next_frame():
    from pipeline.listener import TurnListener
    from pipeline.vad import FRAME

    audio, ends = spoken("What is the capital of France?", 1.0)
    asr = SlowASR([(ends[0] - 0.1, "What is the capital of France?")])
    started: list[str] = []
    woke = threading.Event()
    start = lambda words, tl, hold: started.append(words)  # noqa: E731
    listener = TurnListener(asr, TurnEnd(), asr_interval_s=60, start_early=start, wake=woke.set)
    try:
        for i in range(0, len(audio), FRAME):  # up to the first frame of the pause, then no more audio
            listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
            if listener.vad.paused:
                break
        assert listener.vad.paused and not started
        assert woke.wait(5)  # the pass at the pause ended
        listener.poll()
        assert started == ["What is the capital of France?"]
    finally:
        listener.close()


class GatedASR(ScriptedASR):
    """A pass that hears `gate_from` samples or more waits for the test's gate: the pass of all of the speech is
    still running while the listener polls."""

    def __init__(self, parts: list[tuple[float, str]], gate_from: int, exact: str | None = None) -> None:
        super().__init__(parts)
        self.gate_from, self.exact, self.gate = gate_from, exact, threading.Event()

    def transcribe(self, audio):
        if len(audio) < self.gate_from:
            return super().transcribe(audio)
        assert self.gate.wait(5)
        return self.exact or super().transcribe(audio)


def last_voiced_sample(audio: np.ndarray) -> int:
    from pipeline.vad import FRAME, EndOfTurnDetector

    vad = EndOfTurnDetector()
    for i in range(0, len(audio), FRAME):
        vad.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
        if vad.paused:
            return vad.last_voiced[1]
    raise AssertionError("no pause in the audio")


@needs_espeak
@pytest.mark.parametrize(
    "missed_s, exact, starts",
    [
        (0.05, None, ["What is the capital of France?"]),  # the same words: started once, at the pause
        (0.05, "Capital of Frankfurt?", ["What is the capital of France?", "Capital of Frankfurt?"]),
        (0.3, None, []),  # too much unheard: it waits for the pass of all of the speech
    ],
)
def test_a_pass_that_heard_all_but_the_last_tenth_of_a_second_starts_the_early_answer(missed_s, exact, starts):
    from pipeline.listener import TurnListener
    from pipeline.vad import FRAME

    audio, ends = spoken("What is the capital of France?", 1.0)
    last = last_voiced_sample(audio)
    heard = last - int(missed_s * SAMPLE_RATE)
    asr = GatedASR([(ends[0] - 0.3, "What is the capital of France?")], gate_from=heard + 1, exact=exact)
    holds: list[Hold] = []
    listener = TurnListener(asr, TurnEnd(), asr_interval_s=60, start_early=lambda words, tl, hold: holds.append(hold))
    try:
        listener.feed(audio[:heard], 0.0)  # a pass made now hears all but the last missed_s of the speech
        listener.asr.speech_paused(heard)
        assert wait_until(lambda: listener.asr.covering(heard) is not None, 5)
        for i in range(heard, len(audio), FRAME):  # to the first frame of the pause
            listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
            if listener.vad.paused:
                break
        assert listener.vad.paused and listener.vad.last_voiced[1] == last
        time.sleep(0.05)
        listener.poll()
        started_before_the_pass = [hold.words for hold in holds]
        assert listener.vad.hangover_s == wait_ms(TurnEnd("words")) / 1000  # only words heard to the end set it
        asr.gate.set()  # the pass of all of the speech ends
        assert wait_until(lambda: listener.asr.covering(last) is not None, 5)
        listener.poll()
        final = exact or "What is the capital of France?"
        assert listener.vad.hangover_s == wait_ms(TurnEnd("words"), final) / 1000
    finally:
        listener.close()
    assert started_before_the_pass == starts[:1]
    assert [hold.words for hold in holds] == (starts if starts else [final])
    assert [hold.state for hold in holds[:-1]] == ["discarded"] * (len(holds) - 1)  # the one on other words


def finished_question(holds: list[Hold], wake=None):
    """ "What is the capital of France?" and 1 s of silence, and a listener in smart mode over it whose early answers
    go to holds: Smart Turn says finished (at once); the words come with the first pass that hears them all."""
    from pipeline.listener import TurnListener

    audio, ends = spoken("What is the capital of France?", 1.0)
    asr = ScriptedASR([(ends[0] - 0.1, "What is the capital of France?")])
    start = lambda words, tl, hold: holds.append(hold)  # noqa: E731
    listener = TurnListener(
        asr, TurnEnd("smart"), asr_interval_s=60, start_early=start, smart_turn=FixedSmartTurn(0.95), wake=wake
    )
    return audio, listener


def audio_and_words_in(listener) -> None:
    """Wait, at a pause, for Smart Turn's score and the words up to it, and read them."""
    assert wait_until(lambda: listener._scoring is None or listener._scoring.done(), 5)
    assert wait_until(lambda: listener.asr.covering(listener.vad.last_voiced[1]) is not None, 5)
    assert listener.poll() is None  # the words and the audio are in, the target's vote is not


class CountingScriptedASR(ScriptedASR):
    def __init__(self, parts: list[tuple[float, str]]) -> None:
        super().__init__(parts)
        self.heard_s: list[float] = []  # the audio each pass heard

    def transcribe(self, audio):
        self.heard_s.append(len(audio) / SAMPLE_RATE)
        return super().transcribe(audio)


@needs_espeak
def test_the_silence_of_a_pause_is_not_transcribed_so_the_early_answer_keeps_its_words():
    """Whisper may hear the same speech differently with more silence after it ("Who wrote Pride and Prejudice?",
    then "… prejudice this": the "austen" recording). A pass made on a pause's silence changed the turn's words after
    the early answer had started on them, and the answer was discarded at the end. The passes stop at a pause once one
    has heard it, and go on when the speaker does."""
    from pipeline.listener import TurnListener
    from pipeline.vad import FRAME

    audio, ends = spoken("Who wrote Hamlet?", 0.6, "And when?", 1.5)
    first, both, other = "Who wrote Hamlet?", "Who wrote Hamlet? And when?", "Who wrote Hamlet this"
    asr = CountingScriptedASR(
        [(ends[0] - 0.1, first), (ends[0] + 0.45, other), (ends[2] - 0.1, both), (ends[2] + 0.45, "?")]
    )
    holds: list[Hold] = []
    turn_end = TurnEnd("silence", silence_ms=1000)
    start = lambda words, tl, hold: holds.append(hold)  # noqa: E731
    listener = TurnListener(asr, turn_end, asr_interval_s=0.05, start_early=start)
    try:
        for i in range(0, len(audio), FRAME):  # as it comes, in frames
            if (ended := listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)) is not None:
                break
            time.sleep(FRAME / SAMPLE_RATE)
        assert ended is not None
        heard = listener.finish(ended)
    finally:
        listener.close()
    assert heard.transcript == both and heard.early is holds[-1]  # the answer started on the words is the turn's
    assert [hold.words for hold in holds] == [first, both] and holds[0].state == "discarded"
    assert not [s for s in asr.heard_s if ends[0] + 0.45 <= s < ends[1] or s >= ends[2] + 0.45]  # no pass on silence
    assert [s for s in asr.heard_s if ends[1] < s < ends[2]]  # the passes went on with the speaker


@needs_espeak
@pytest.mark.parametrize("playable", [False, True])
def test_a_turn_is_held_open_while_its_answer_has_nothing_to_play_up_to_the_longest_wait(playable):
    from pipeline.vad import FRAME

    holds: list[Hold] = []
    audio, listener = finished_question(holds)
    audio = np.concatenate([audio, np.zeros(SAMPLE_RATE, np.float32)])  # 2 s of silence after the question
    waited_at = None  # the pause whose signals were waited for (the words may already be in when feed() returns)
    try:
        for i in range(0, len(audio), FRAME):
            if (ended := listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)) is not None:
                break
            if listener.vad.paused and waited_at != listener.vad.last_voiced[0]:
                waited_at = listener.vad.last_voiced[0]
                audio_and_words_in(listener)  # the early answer starts on the words
            if holds:  # the target votes finished; the answer has audio to play, or not yet
                holds[0].end_of_message_probability, holds[0].playable = 0.8, playable
        assert ended is not None
        last = listener.finish(ended).timeline.pauses[-1]
    finally:
        listener.close()
    heard_s = (i + FRAME) / SAMPLE_RATE - ended.last_voiced_t  # the silence heard when the turn ended
    # Decided when the short wait ran out either way; held open to the longest wait only while nothing could play.
    assert TurnEnd().complete_ms / 1000 <= ended.decided_t - ended.last_voiced_t < TurnEnd().unsure_ms / 1000
    if playable:
        assert math.isclose(heard_s, ended.decided_t - ended.last_voiced_t) and not last["held_open"]
    else:
        assert TurnEnd().longest_ms / 1000 <= heard_s < TurnEnd().longest_ms / 1000 + 2 * FRAME / SAMPLE_RATE
        assert last["held_open"]


@needs_espeak
def test_the_targets_vote_read_between_two_frames_ends_the_turn_on_the_next_frame():
    from pipeline.vad import FRAME

    holds: list[Hold] = []
    audio, listener = finished_question(holds)
    complete_s = TurnEnd().complete_ms / 1000
    try:
        for i in range(0, len(audio), FRAME):
            start_s = i / SAMPLE_RATE
            if (
                listener.vad.paused
                and holds
                and start_s + FRAME / SAMPLE_RATE - listener.vad.last_voiced[0] > complete_s
            ):
                break  # this frame's end is past the short wait: the target's vote comes in before it
            assert listener.feed(audio[i : i + FRAME], start_s) is None  # the target has not voted yet
            if listener.vad.paused:
                audio_and_words_in(listener)
        assert holds and listener.vad.hangover_s > complete_s
        holds[0].playable = True  # the answer has audio to play: the turn is not held open for it
        holds[0].end_of_message_probability = 0.8  # the early answer's first forward read it, between two frames
        ended = listener.feed(audio[i : i + FRAME], i / SAMPLE_RATE)
    finally:
        listener.close()
    assert ended is not None and ended.kind == "end_of_turn"
    assert listener.vad.hangover_s == complete_s


@needs_espeak
def test_the_targets_vote_wakes_the_listener_and_ends_the_turn_between_two_frames():
    from pipeline.vad import FRAME

    holds: list[Hold] = []
    woke = threading.Event()
    audio, listener = finished_question(holds, wake=woke.set)
    complete_s = TurnEnd().complete_ms / 1000
    t0 = time.perf_counter() - len(audio) / SAMPLE_RATE  # the audio was spoken up to now, as a live stream's
    try:
        for i in range(0, len(audio), FRAME):
            assert listener.feed(audio[i : i + FRAME], t0 + i / SAMPLE_RATE) is None
            if listener.vad.paused:
                audio_and_words_in(listener)
                heard_s = t0 + (i + FRAME) / SAMPLE_RATE - listener.vad.last_voiced[0]
                if holds and heard_s >= complete_s:
                    break  # silence enough for the short wait is heard, the turn waits on for the vote
        assert holds and listener.vad.hangover_s > complete_s
        holds[0].playable = True  # the answer has audio to play: the turn is not held open for it
        woke.clear()
        holds[0].vote(0.8)  # the early answer's first forward read it, between two frames
        assert woke.is_set()
        ended = listener.poll()  # what the owner does when woken: no more audio is fed
    finally:
        listener.close()
    assert ended is not None and ended.kind == "end_of_turn"
    assert listener.vad.hangover_s == complete_s and ended.decided_t - ended.last_voiced_t >= complete_s
