"""The voice turn: timeline arithmetic, streaming order, barge-in, bad audio, and `say` on the real models."""

import json
import math
import subprocess
import sys
import threading

import numpy as np
import pytest

from pipeline.agent import AgentConfig, VoiceAgent
from pipeline.asr import Transcriber
from pipeline.audio import AudioError
from pipeline.events import AnswerDone, AnswerStep, Audio, Chunk
from pipeline.llm_provider import SharedProvider
from pipeline.timeline import MARKS, STAGES, Timeline
from pipeline.turn_end import TurnEnd
from tests.support.engine import ROOT
from tests.support.fakes import FakeTTS, ScriptedLLM, WordsTTS
from tests.support.speech import needs_espeak, speak


class NoASR:
    """Whisper's stand-in where no speech is transcribed (typed turns, noise): those tests load no ASR model."""

    def transcribe(self, audio):
        return ""

    def warmup(self):
        pass


@pytest.fixture(scope="module")
def transcriber():
    return Transcriber()


def scripted_agent(
    transcriber, answer="Sure, the capital of France is Paris. It is also its largest city.", step_s=0.01, tts=None
):
    llm = ScriptedLLM(answer, step_s)
    return VoiceAgent(AgentConfig(), SharedProvider(llm), transcriber, tts or FakeTTS()), llm


def test_timeline_stages_add_up_to_ttfa():
    tl = Timeline()
    for i, name in enumerate(MARKS):
        tl.mark(name, 10.0 + 0.1 * i * (i + 1))
    d = tl.to_dict()
    assert set(d["stages"]) == set(STAGES)
    assert math.isclose(sum(d["stages"].values()), d["ttfa_ms"])
    assert d["marks_ms"]["speech_end"] == 0
    tl.mark("speech_end", 99.0)  # the first stamp of a mark stands
    assert tl.marks["speech_end"] == 10.0
    with pytest.raises(KeyError):
        tl.mark("whenever", 1.0)


def test_typed_turn_streams_in_order_and_fills_timeline():
    agent, llm = scripted_agent(NoASR())
    conv = agent.new_conversation()
    events = []
    result = agent.respond(
        conv, "What is the capital of France?", Timeline(), True, on_event=lambda event: events.append(type(event))
    )
    d = result.to_dict()
    assert d["answer"].startswith("Sure, the capital") and d["spoken"] == d["answer"]
    assert set(d["stages"]) == set(STAGES) and math.isclose(sum(d["stages"].values()), d["ttfa_ms"])
    assert d["first_chunk_tokens"] < len(llm.words)  # audio started before the answer was complete
    assert events.index(AnswerStep) < events.index(Chunk) < events.index(Audio) < events.index(AnswerDone)
    assert agent.tts.spoken[0] == "Sure, the capital"  # the first chunk is cut early: 3 words by default
    assert conv.history[-1] == {"role": "assistant", "content": d["answer"]}


def test_a_turn_reports_its_first_chunks_tokens_per_forward(tiny_engine):
    """The opening's tokens per target forward: tokens up to the first spoken chunk ÷ the forwards that made them,
    the prefill's included; None from an LLM stage that counts no forwards."""
    from pipeline.llm import EngineLLM
    from specdec.build import build_engine
    from specdec.session import EngineSession

    engine, _ = build_engine(tiny_engine.spec)
    llm = EngineLLM(engine, 24, session=EngineSession(engine))
    seen: dict[int, int] = {}  # tokens so far -> target forwards so far, after each delta
    stream = llm.stream_reply

    def counted(messages, speculation, stats, cancel=None, end_probe=False):
        for delta in stream(messages, speculation, stats, cancel, end_probe):
            seen[stats.tokens] = stats.spec.target_forwards
            yield delta

    llm.stream_reply = counted
    agent = VoiceAgent(AgentConfig(first_chunk_words=1), SharedProvider(llm), NoASR(), FakeTTS())
    d = agent.respond(agent.new_conversation(), "Say something.", Timeline(), True).to_dict()
    n = d["first_chunk_tokens"]
    assert n >= 1 and d["first_chunk_tokens_per_forward"] == pytest.approx(n / seen[n])
    scripted, _ = scripted_agent(NoASR())
    turn = scripted.respond(scripted.new_conversation(), "Hi.", Timeline(), True).to_dict()
    assert turn["first_chunk_tokens_per_forward"] is None


def test_timeline_counts_the_silences_inside_an_answer():
    tl = Timeline()
    tl.audio_out(10.0, 0.5)
    assert not tl.runs_dry(10.4) and tl.runs_dry(10.5)
    tl.audio_out(10.2, 0.3)  # the listener is still hearing the first samples: no stall
    tl.audio_out(11.0, 0.25)  # the speech ended at 10.8: 0.2 s of silence
    assert tl.marks["first_audio_out"] == 10.0 and tl.last_audio_out == 11.0
    assert math.isclose(tl.stall_s, 0.2) and tl.runs_dry(11.25) and not tl.runs_dry(11.2)
    assert math.isclose(tl.to_dict()["stall_ms"], 200.0)
    assert not Timeline().runs_dry(1e9)  # nothing out yet: nothing can run dry


def test_a_long_first_sentence_does_not_leave_a_silence_after_the_first_chunk():
    # The LLM speaks 5× faster than the voice, but the first sentence is long: waiting for its end after the
    # three-word first chunk would leave about a second of silence.
    answer = "Sure thing, " + " ".join(["word"] * 50) + ". Done."
    agent, llm = scripted_agent(NoASR(), answer, step_s=0.02, tts=WordsTTS(0.1))
    result = agent.respond(agent.new_conversation(), "Talk.", Timeline(), False)
    assert result.to_dict()["stall_ms"] < 50
    assert result.spoken == answer  # every word spoken once, in order
    assert not agent.tts.spoken[1].endswith(".")  # the second chunk did not wait for the sentence


def test_history_is_bounded_and_sent_to_the_llm():
    agent, llm = scripted_agent(NoASR(), "Okay.")
    agent.config.history_turns = 2
    conv = agent.new_conversation()
    for i in range(4):
        agent.respond(conv, f"question {i}", Timeline(), False)
    last = llm.seen_messages[-1]
    assert last[0]["role"] == "system" and last[-1] == {"role": "user", "content": "question 3"}
    assert [m["content"] for m in last[1:-1] if m["role"] == "user"] == ["question 1", "question 2"]


def test_barge_in_cancels_llm_and_tts_and_keeps_history_consistent():
    agent, llm = scripted_agent(NoASR(), " ".join(f"word{i}." for i in range(200)), step_s=0.02)
    conv = agent.new_conversation()
    cancel = threading.Event()

    def on_event(event):
        if isinstance(event, Audio):
            cancel.set()  # the user starts talking as soon as the agent does

    result = agent.respond(conv, "tell me everything", Timeline(), True, on_event=on_event, cancel=cancel)
    assert result.cancelled and len(result.audio) == 1
    assert result.wasted_tokens > 0 and result.stats.tokens < 200
    assert conv.history[-2]["role"] == "user" and conv.history[-1]["content"].endswith("…")
    agent.respond(conv, "next", Timeline(), True)  # the conversation goes on normally
    assert conv.history[-2:][0]["content"] == "next"


@pytest.mark.models
@needs_espeak
def test_turn_from_recording_marks_speech_end_before_end_of_turn(transcriber):
    agent, llm = scripted_agent(transcriber, "Paris.")
    agent.config.turn_end = TurnEnd("silence", silence_ms=300)
    audio = np.concatenate([np.zeros(8000, np.float32), speak("What is the capital of France?")])
    result = agent.turn_from_recording(agent.new_conversation(), audio, True)
    d = result.to_dict()
    assert "capital" in d["transcript"].lower() and "france" in d["transcript"].lower()
    wait = d["stages"]["end_of_turn_wait"]
    assert 300 - 40 <= wait <= 300 + 80
    assert math.isclose(sum(d["stages"].values()), d["ttfa_ms"])
    assert llm.seen_messages[-1][-1]["content"] == d["transcript"]


def test_recording_without_speech_is_a_clear_error():
    agent, _ = scripted_agent(NoASR())
    noise = np.random.default_rng(0).normal(0, 0.001, 16000).astype(np.float32)
    with pytest.raises(AudioError, match="no speech"):
        agent.turn_from_recording(agent.new_conversation(), noise, True)


@needs_espeak
def test_tiny_engine_turn_runs_the_speculative_path(tiny_engine):
    agent = VoiceAgent(AgentConfig(engine=tiny_engine.spec, max_new_tokens=24), transcriber=NoASR(), tts=FakeTTS())
    result = agent.respond(agent.new_conversation(), "hello", Timeline(), True)
    assert result.stats.tokens > 0 and result.stats.spec.proposed > 0


def test_a_token_crosses_the_compute_thread_and_the_answers_own(tiny_engine):
    """The engine's steps run on the compute thread (the scheduler's loop), and the answer's reader chunks and speaks
    on the thread that asked for it: no thread or queue of chunks between them (the app's event loop is the third)."""
    seen: dict[str, set] = {"step": set(), "tts": set(), "sink": set(), "new": set()}
    me = threading.current_thread()

    class Watching(FakeTTS):
        def stream(self, text):
            seen["tts"].add(threading.current_thread())
            seen["new"] |= set(threading.enumerate()) - before
            yield from super().stream(text)

    agent = VoiceAgent(AgentConfig(engine=tiny_engine.spec, max_new_tokens=24), transcriber=NoASR(), tts=Watching())
    engine = agent.llm.engine
    assert engine is not None
    step = engine._step
    engine._step = lambda *a: seen["step"].add(threading.current_thread().name) or step(*a)
    conv = agent.new_conversation()
    before = set(threading.enumerate())
    result = agent.respond(
        conv, "hello", Timeline(), True, on_event=lambda event: seen["sink"].add(threading.current_thread())
    )
    assert result.spoken and seen["step"] == {"compute"} and seen["tts"] == {me} and seen["sink"] == {me}
    assert {t.name for t in seen["new"]} <= {"compute"}  # nothing started for this answer but, once, that thread
    assert result.to_dict()["timeline"]["chunk_handoff_ms"] >= 0


@pytest.mark.models
@needs_espeak
def test_say_on_the_real_default_models(real_models, tmp_path):
    """One full turn, speculation off then on, on the offline Qwen pair, faster-whisper and hibari."""
    out = tmp_path / "say.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "commands.cli",
            "say",
            "--wav",
            str(ROOT / "assets/utterances/capital.wav"),
            "--speculation",
            "both",
            "--max-new-tokens",
            "24",
            "--json",
            str(out),
            "--out",
            str(tmp_path / "answer.wav"),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    data = json.loads(out.read_text())
    off, on = data["turns"]
    assert not off["speculation"] and on["speculation"]
    for turn in (off, on):
        assert "capital" in turn["transcript"].lower()
        assert "paris" in turn["answer"].lower()
        assert math.isclose(sum(turn["stages"].values()), turn["ttfa_ms"], rel_tol=1e-6)
        assert turn["audio_seconds"] > 0.5
    assert on["draft_acceptance_rate"] is not None and off["draft_acceptance_rate"] is None
    assert data["summary"]["ttfa_ratio_on_off"] == on["ttfa_ms"] / off["ttfa_ms"]
    assert (tmp_path / "answer-on.wav").stat().st_size > 10000


def test_remote_openai_compatible_server_as_llm_stage():
    """--llm-url: the same turn through a server speaking vLLM's wire format and Prometheus counters."""
    from tests.support.fake_vllm import FakeVLLM

    with FakeVLLM(reply="Paris is the capital of France. It sits on the Seine.") as fake:
        agent = VoiceAgent(AgentConfig(llm_url=fake.url), transcriber=NoASR(), tts=FakeTTS())
        d = agent.respond(agent.new_conversation(), "capital of France?", Timeline(), True).to_dict()
    assert d["answer"].startswith("Paris is the capital")
    assert 0 < d["draft_acceptance_rate"] <= 1 and d["ttfa_ms"] > 0


@pytest.mark.parametrize("budget, room", [(380, 380), (2048, 512 - 16)])  # the tiny model's context is 512
def test_long_history_is_trimmed_to_fit_the_context(tiny_engine, budget, room):
    """The whole prompt (system, history, the user's turn) fits the budget in tokens, and never more than the context
    leaves beside the answer: the oldest exchanges go first. A turn over it on its own is a clear error."""
    config = AgentConfig(engine=tiny_engine.spec, max_new_tokens=16, history_turns=50, prompt_tokens=budget)
    agent = VoiceAgent(config, transcriber=NoASR(), tts=FakeTTS())
    conv = agent.new_conversation()
    fit, prompts = conv.llm._prompt, []

    def recording(messages, stats=None):
        ids, question_start, fitted = fit(messages, stats)
        prompts.append(ids)
        return ids, question_start, fitted

    conv.llm._prompt = recording
    for i in range(12):  # 12 exchanges of ~60 bytes overflow both
        result = agent.respond(conv, f"question number {i}: " + "x" * 40, Timeline(), True)
        assert result.stats.tokens > 0
    # filled to within one exchange (~100 of the tiny model's byte tokens) of the budget, never past it
    assert room - 110 < max(len(p) for p in prompts) <= room
    assert any("dropped" in n for n in result.stats.notes)
    last = conv.llm.tokenizer.decode(prompts[-1])
    assert "question number 11" in last and "question number 10" in last and "question number 0:" not in last
    kept = list(conv.history)
    with pytest.raises(ValueError, match=f"prompt is .* tokens .* over the {room}-token limit"):
        agent.respond(conv, "y" * 600, Timeline(), True)
    assert conv.history == kept  # nothing of the refused turn was remembered
