"""The voice turn: audio → VAD/ASR → LLM (speculative) → chunker → TTS, stamping one Timeline on the way."""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np

from specdec.bench import read_prompts
from specdec.build import EngineSpec, build_engine
from specdec.cost_grid import cached_forward_costs
from specdec.engine import EngineSession, GenerationConfig
from specdec.models import asset_path
from specdec.sampling import SamplingParams
from specdec.scheduler import BackgroundLoad, BatchScheduler
from specdec.tokenizer import shared_prefix_ids

from .asr import DEFAULT_BEAM_SIZE, DEFAULT_WINDOW_S, StreamingTranscriber, Transcriber
from .audio import SAMPLE_RATE, AudioError
from .chunker import SpeechChunker
from .llm import SYSTEM_PROMPT, EngineLLM, LLMStage, ReplyStats
from .timeline import Timeline
from .tts import TTS, make_tts
from .vad import FRAME, EndOfTurnDetector, VadEvent

log = logging.getLogger("specvoice.agent")
# The app's simulated background conversations ask the shipped training prompts (never a benchmark prompt).
BACKGROUND_PROMPTS = asset_path("prompts", "train_prompts.jsonl")

# on_event(kind, payload): "transcript" str, "token" dict, "audio" np.ndarray, "chunk" str, "done" TurnResult
EventSink = Callable[[str, object], None]


@dataclass
class AgentConfig:
    engine: EngineSpec = field(default_factory=EngineSpec)
    asr_model: str = "tiny.en"
    asr_beam_size: int = DEFAULT_BEAM_SIZE
    asr_window_s: float | None = DEFAULT_WINDOW_S  # None: Whisper's full 30 s window
    tts: str = "hibari"
    hangover_ms: float = 300.0  # silence after the last voiced frame that ends the user's turn
    first_chunk_words: int = 3  # measured: 3 words cut the first-chunk stage from 770 to 568 ms (w8a8)
    max_new_tokens: int = 80
    history_turns: int = 4  # user/assistant pairs kept in the prompt
    system_prompt: str = SYSTEM_PROMPT
    temperature: float = 0.0
    seed: int = 0
    llm_url: str | None = None  # an OpenAI-compatible server (e.g. vLLM) instead of the in-process engine
    llm_url_no_spec: str | None = None  # optional target-only server, for speculation-off turns


@dataclass
class TurnResult:
    speculation: bool
    transcript: str
    answer: str
    spoken: str  # what reached the TTS (less than answer after a barge-in)
    timeline: Timeline
    stats: ReplyStats
    audio: list[np.ndarray]
    sample_rate: int
    cancelled: bool = False
    wasted_tokens: int = 0  # generated but never spoken (barge-in)

    def to_dict(self) -> dict:
        spec = self.stats.spec
        tl = self.timeline.to_dict()
        return {
            "speculation": self.speculation,
            "transcript": self.transcript,
            "answer": self.answer,
            "spoken": self.spoken,
            "ttfa_ms": tl["ttfa_ms"],
            "stages": tl["stages"],
            "timeline": tl,
            "first_chunk_tokens": self.timeline.first_chunk_tokens,
            "tokens": self.stats.tokens,
            "tokens_per_s": self.stats.tokens_per_s,
            "draft_acceptance_rate": spec.draft_acceptance_rate if spec.proposed else None,
            "tokens_per_target_forward": spec.tokens_per_target_forward if spec.speculative_steps else None,
            "rejected_draft_tokens": spec.proposed - spec.accepted,
            "wasted_tokens": self.wasted_tokens,
            "cancelled": self.cancelled,
            "notes": self.stats.notes,
            "audio_seconds": sum(len(a) for a in self.audio) / self.sample_rate,
        }


def ab_order(index: int) -> tuple[bool, bool]:
    """Speculation off/on order of the index-th paired run: alternating, so neither mode profits from going second."""
    return (False, True) if index % 2 == 0 else (True, False)


class TurnListener:
    """VAD and streaming ASR over one user turn, fed as audio arrives (microphone or replayed file)."""

    def __init__(self, transcriber: Transcriber, hangover_ms: float, asr_interval_s: float = 1.0) -> None:
        self.vad = EndOfTurnDetector(hangover_ms=hangover_ms)
        # A whisper call costs ~0.5 s here whatever the length (it pads to 30 s). Partials every second leave
        # the ASR thread idle half the time, so the call started when the speaker pauses can begin at once.
        self.asr = StreamingTranscriber(transcriber, interval_s=asr_interval_s)
        self.started = False
        self._was_paused = False

    def feed(self, chunk16k: np.ndarray, t_start: float) -> VadEvent | None:
        """Feed audio whose first sample was captured at t_start (perf_counter clock). Returns end_of_turn."""
        self.asr.feed(chunk16k)
        for ev in self.vad.feed(chunk16k, t_start):
            if ev.kind == "speech_start":
                self.started = True
            elif ev.kind == "end_of_turn":
                return ev
        if self.vad.paused and not self._was_paused:
            self.asr.speech_paused()
        self._was_paused = self.vad.paused
        return None

    def stop(self) -> VadEvent | None:
        """The audio stopped before the VAD ended the turn (push-to-talk released, length limit): end it now."""
        return next((ev for ev in self.vad.finish() if ev.kind == "end_of_turn"), None)

    def finish(self, end: VadEvent | None, timeline: Timeline) -> str:
        """The turn's final transcript, its end stamped on timeline; AudioError when there is nothing to answer."""
        if end is None:
            raise AudioError("no speech detected")
        timeline.mark("speech_end", end.last_voiced_t)
        timeline.mark("end_of_turn", end.decided_t)
        text = self.asr.finish(trailing_silence_s=end.decided_t - end.last_voiced_t).strip()
        timeline.mark("asr_final", time.perf_counter())
        if not text:
            raise AudioError("speech was detected but nothing intelligible was transcribed")
        return text

    def close(self) -> None:
        self.asr.close()


class Conversation:
    """One user's dialogue: bounded history and (for the in-process engine) KV caches kept between turns."""

    def __init__(self, agent: VoiceAgent) -> None:
        self.history: list[dict[str, str]] = []
        self.llm: LLMStage = agent.llm_for_conversation()
        self.lock = threading.Lock()  # one answer at a time per conversation


def make_transcriber(config: AgentConfig) -> Transcriber:
    return Transcriber(config.asr_model, beam_size=config.asr_beam_size, window_s=config.asr_window_s)


class VoiceAgent:
    WARMUP_STEPS = (
        "voice activity detection",
        "speech recognition",
        "text to speech",
        "forward costs for the load-aware K",
        "LLM, speculation off",
        "LLM, speculation on",
    )

    def __init__(
        self,
        config: AgentConfig,
        llm: LLMStage | None = None,
        transcriber: Transcriber | None = None,
        tts: TTS | None = None,
    ) -> None:
        self.config = config
        self.engine = None
        if llm is None and config.llm_url:
            from .remote_llm import OpenAICompatibleLLM

            llm = OpenAICompatibleLLM(
                config.llm_url,
                base_url_no_spec=config.llm_url_no_spec,
                max_tokens=config.max_new_tokens,
                temperature=config.temperature,
            )
        self.scheduler: BatchScheduler | None = None
        self.background: BackgroundLoad | None = None
        if llm is None:
            self.engine, _ = build_engine(config.engine)
            if config.engine.batched:  # load-aware once warmup has measured the forward costs
                self.scheduler = BatchScheduler(self.engine)
        self._shared_llm = llm
        self.transcriber = transcriber or make_transcriber(config)
        self.tts = tts or make_tts(config.tts)
        self.shared_prefix: list[int] = []  # the system prompt's tokens, cached once per conversation

    def llm_for_conversation(self) -> LLMStage:
        if self.engine is None:
            return self._shared_llm
        session = EngineSession(self.engine)
        if not self.shared_prefix:
            self.shared_prefix = shared_prefix_ids(self.engine.target.tokenizer, self.config.system_prompt)
        session.prefill(self.shared_prefix)  # the system prompt is paid once per conversation, not per turn
        return EngineLLM(
            self.engine,
            self.config.max_new_tokens,
            SamplingParams(self.config.temperature),
            self.config.seed,
            session,
            self.scheduler,
        )

    def set_background(self, n: int) -> int:
        """Run n simulated conversations beside the real ones (the app's load control); returns how many run."""
        if self.scheduler is None:
            raise ValueError("background load needs the in-process engine with batching (specvoice app)")
        if self.background is None:
            assert self.engine is not None  # a scheduler implies the engine
            tokenizer, system = self.engine.target.tokenizer, {"role": "system", "content": self.config.system_prompt}
            prompts = [
                tokenizer.chat_ids([system, {"role": "user", "content": row["prompt"]}])
                for row in read_prompts(str(BACKGROUND_PROMPTS))
            ]
            config = GenerationConfig(self.config.max_new_tokens, SamplingParams(self.config.temperature))
            self.background = BackgroundLoad(self.scheduler, prompts, config, on_error=self._background_failed)
        self.background.set(n)
        return self.background.count

    @staticmethod
    def _background_failed(error: Exception) -> None:
        log.warning("a background conversation stopped: %s: %s", type(error).__name__, error)

    def new_conversation(self) -> Conversation:
        return Conversation(self)

    def rewind(self, conv: Conversation) -> None:
        """Back to the state a paired run starts from: only the shared system-prompt prefix stays cached."""
        session = getattr(conv.llm, "session", None)
        if session is not None:
            session.rollback(len(self.shared_prefix))

    def warmup(self, progress: Callable[[int], None] = lambda step: None) -> None:
        """Pay every stage's first-call costs (the VAD's native library and model, ASR buffers, TTS lexicons,
        kernels for both LLM modes) and measure the forward costs the load-aware K needs, before anyone waits;
        progress(i) as WARMUP_STEPS[i] starts."""
        progress(0)
        EndOfTurnDetector(hangover_ms=self.config.hangover_ms).feed(np.zeros(SAMPLE_RATE, np.float32), 0.0)
        progress(1)
        self.transcriber.warmup()
        progress(2)
        self.tts.warmup()
        progress(3)
        if self.scheduler is not None and self.config.engine.load_aware:
            assert self.engine is not None  # a scheduler implies the engine
            # the ridge, measured here once per machine, model and format (~30 s), then read from the cache
            self.scheduler.costs, _ = cached_forward_costs(self.engine)
        conv = self.new_conversation()
        for step, speculation in enumerate((False, True), start=4):
            progress(step)
            self.respond(conv, "Say hi.", Timeline(), speculation, remember=False)

    def messages(self, conv: Conversation, user_text: str) -> list[dict[str, str]]:
        keep = conv.history[-2 * self.config.history_turns :] if self.config.history_turns else []
        return [{"role": "system", "content": self.config.system_prompt}, *keep, {"role": "user", "content": user_text}]

    def listen(self) -> TurnListener:
        return TurnListener(self.transcriber, self.config.hangover_ms)

    def turn_from_recording(
        self,
        conv: Conversation,
        audio16k: np.ndarray,
        speculation: bool,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        remember: bool = True,
        timeline: Timeline | None = None,
    ) -> TurnResult:
        """Replay a recording in real time, as if its speaker were talking now, then answer."""
        listener = self.listen()
        timeline = timeline or Timeline()
        t0 = time.perf_counter()
        end: VadEvent | None = None
        try:
            # After the file, the speaker stays silent long enough for the hang-over to run out.
            tail = np.zeros(int(SAMPLE_RATE * (self.config.hangover_ms / 1000 + 0.2)), np.float32)
            padded = np.concatenate([audio16k, tail])
            for i in range(0, len(padded), FRAME):  # the page's mic sends one VAD frame at a time too
                t_chunk = t0 + i / SAMPLE_RATE
                delay = t_chunk + FRAME / SAMPLE_RATE - time.perf_counter()
                if delay > 0:
                    time.sleep(delay)  # the chunk is complete only once its last sample was "spoken"
                end = listener.feed(padded[i : i + FRAME], t_chunk)
                if end is not None:
                    break
            transcript = listener.finish(end, timeline)
        finally:
            listener.close()
        if on_event:
            on_event("transcript", transcript)
        return self.respond(conv, transcript, timeline, speculation, on_event, cancel, remember)

    def respond(
        self,
        conv: Conversation,
        transcript: str,
        timeline: Timeline,
        speculation: bool,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        remember: bool = True,
    ) -> TurnResult:
        """Answer a transcript: LLM tokens → chunks → TTS audio, with TTS running as chunks become ready."""
        emit = on_event or (lambda kind, payload: None)
        cancel = cancel or threading.Event()
        if not timeline.has("speech_end"):  # typed input: the turn "ends" now, with no VAD or ASR stage
            now = time.perf_counter()
            for name in ("speech_end", "end_of_turn", "asr_final"):
                timeline.mark(name, now)
        stats = ReplyStats()
        chunks: queue.Queue = queue.Queue()
        answer: list[str] = []
        failure: list[BaseException] = []

        def produce() -> None:
            chunker = SpeechChunker(self.config.first_chunk_words)
            try:
                for delta in conv.llm.stream_reply(self.messages(conv, transcript), speculation, stats, cancel):
                    timeline.mark("llm_first_token", delta.t)
                    answer.append(delta.text)
                    emit(
                        "token",
                        {
                            "text": delta.text,
                            "pieces": delta.pieces or [(delta.text, None)],
                            "from_draft": delta.from_draft,
                            "drafted": delta.drafted,
                            "accepted": delta.accepted,
                            "tokens": stats.tokens,
                            "tokens_per_s": stats.tokens_per_s,
                            "batch_size": delta.batch_size,
                            "k_chosen": delta.k_chosen,
                        },
                    )
                    for chunk in chunker.push(delta.text):
                        chunks.put((chunk, time.perf_counter(), stats.tokens))
                for chunk in chunker.flush():
                    chunks.put((chunk, time.perf_counter(), stats.tokens))
            except BaseException as e:  # surfaced in the caller's thread below
                failure.append(e)
            finally:
                chunks.put(None)

        with conv.lock:
            producer = threading.Thread(target=produce, name="llm", daemon=True)
            producer.start()
            audio: list[np.ndarray] = []
            spoken: list[str] = []
            spoken_tokens = 0
            while (item := chunks.get()) is not None:
                text, released_t, tokens_so_far = item
                if cancel.is_set():
                    continue  # drain: the producer stops at its next step
                if not timeline.has("first_chunk_ready"):
                    timeline.mark("first_chunk_ready", released_t)
                    timeline.first_chunk_tokens = tokens_so_far
                emit("chunk", text)
                for samples in self.tts.stream(text):
                    if cancel.is_set():  # checked before sending: an interrupted answer plays nothing more
                        break
                    timeline.mark("first_audio_out", time.perf_counter())
                    timeline.last_audio_out = time.perf_counter()
                    audio.append(samples)
                    emit("audio", samples)
                else:
                    spoken.append(text)
                    spoken_tokens = tokens_so_far
            producer.join()
            if failure:
                raise failure[0]
            result = TurnResult(
                speculation,
                transcript,
                "".join(answer).strip(),
                " ".join(spoken),
                timeline,
                stats,
                audio,
                self.tts.sample_rate,
                cancel.is_set(),
                stats.tokens - spoken_tokens,
            )
            if remember:
                # History holds what the user actually heard, so the next turn's context matches reality.
                heard = result.spoken + (" …" if result.cancelled else "")
                conv.history += [{"role": "user", "content": transcript}, {"role": "assistant", "content": heard}]
        emit("done", result)
        return result
