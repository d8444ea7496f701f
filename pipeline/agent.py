"""The voice turn: audio → VAD/ASR → LLM (speculative) → chunker → TTS, stamping one Timeline on the way."""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from specdec.fields import option

from .asr import DEFAULT_BEAM_SIZE, DEFAULT_WINDOW_S, Transcriber, window_seconds
from .audio import SAMPLE_RATE
from .capacity import Capacity
from .events import AnswerDone, EventSink, Notify, Transcript
from .listener import StartEarly, TurnListener
from .llm import LLMStage
from .llm_provider import LLM_WARMUP_STEPS, LLMConfig, LLMProvider, provider_from_config
from .preemptive import ChildCancel, Hold
from .smart_turn import SmartTurn, load_smart_turn
from .speaker import SpokenAnswer
from .timeline import Timeline
from .tts import TTS, make_tts, tts_choice, tts_help
from .turn_end import TurnEnd
from .turn_result import TurnResult
from .vad import FRAME, EndOfTurnDetector, VadEvent

log = logging.getLogger("specvoice.agent")


@dataclass
class AgentConfig(LLMConfig):
    """The LLM's configuration (LLMConfig: the engine or a server, the answer's and the prompt's budgets) and the
    voice stages' around it."""

    asr_model: str = option("tiny.en", flag="--asr", help="tiny.en (offline default), base, a directory or hub name")
    asr_beam_size: int = option(DEFAULT_BEAM_SIZE, flag="--asr-beam", help="ASR beam size (1: greedy)")
    asr_window_s: float | None = option(  # None: Whisper's full 30 s window
        DEFAULT_WINDOW_S,
        parse=window_seconds,
        help="seconds of audio the ASR encoder sees for a short turn (0: Whisper's full 30 s; 10 measured best)",
    )
    tts: str = option("hibari", parse=tts_choice, help=tts_help)
    turn_end: TurnEnd = option(factory=TurnEnd)  # the silence after the last voiced frame that ends a turn
    preemptive: bool = option(  # start the answer at the pause, held until the turn is confirmed
        True, help="start the answer only once the turn has ended (default: at the pause, held until it ends)"
    )
    prefill_while_speaking: bool = option(  # prefill the user's words from the partial transcripts as they come
        True, help="prefill the user's words only once the answer starts (default: from the partial transcripts)"
    )
    first_chunk_words: int = option(3)  # measured: 3 words cut the first-chunk stage from 770 to 568 ms (w8a8)
    history_turns: int = option(4)  # user/assistant pairs kept in the prompt at most (prompt_tokens bounds them too)


class Conversation:
    """One user's dialogue: bounded history and (for the in-process engine) KV caches kept between turns."""

    def __init__(self, agent: VoiceAgent) -> None:
        self.history: list[dict[str, str]] = []
        self.llm: LLMStage = agent.llm.for_conversation()
        self.lock = threading.Lock()  # one answer (or prefill) at a time per conversation
        self._pending: list[dict[str, str]] | None = None
        self._prefilling = False
        self._prefill_lock = threading.Lock()

    def prefill_soon(self, messages: list[dict[str, str]]) -> None:
        """Prefill messages (the last one the user's words so far) on a thread of its own: the latest only, and
        not while an answer holds the conversation. The mic's thread must not wait for a forward."""
        with self._prefill_lock:
            self._pending = messages
            if self._prefilling:
                return
            self._prefilling = True
        threading.Thread(target=self._prefill_latest, name="prefill", daemon=True).start()

    def _prefill_latest(self) -> None:
        while True:
            with self._prefill_lock:
                messages, self._pending = self._pending, None
                if messages is None:
                    self._prefilling = False
                    return
            if self.lock.acquire(blocking=False):
                try:
                    self.llm.prefill_words(messages)
                except Exception as e:  # an optimisation: the answer prefills what this did not
                    log.warning("prefill while speaking failed: %s: %s", type(e).__name__, e)
                finally:
                    self.lock.release()


def make_transcriber(config: AgentConfig) -> Transcriber:
    """The ASR on the engine's device (float16 on cuda, int8 on CPU)."""
    return Transcriber(
        config.asr_model, beam_size=config.asr_beam_size, window_s=config.asr_window_s, device=config.engine.device
    )


class VoiceAgent:
    """One voice turn: audio heard → transcript → the LLM's tokens → chunks → speech. llm: where each conversation's
    LLM stage comes from (built from the config unless given)."""

    WARMUP_STEPS = ("voice activity detection", "speech recognition", "text to speech", *LLM_WARMUP_STEPS)

    def __init__(
        self,
        config: AgentConfig,
        llm: LLMProvider | None = None,
        transcriber: Transcriber | None = None,
        tts: TTS | None = None,
    ) -> None:
        self.config = config
        self.llm = llm or provider_from_config(config)
        self.transcriber = transcriber or make_transcriber(config)
        self.tts = tts or make_tts(config.tts, config.engine.device)
        self.smart_turn: SmartTurn | None = None
        loaded = ""
        if config.turn_end.mode == "smart":  # a failed load falls back to the words rule, said in the status
            self.smart_turn, loaded = load_smart_turn()
            loaded += "; "
        self.turn_end_status = f"{loaded}end of turn: {config.turn_end.describe(self.smart_turn is not None)}"

    def new_conversation(self) -> Conversation:
        return Conversation(self)

    def rewind(self, conv: Conversation) -> None:
        """Back to the state a paired run starts from: only the shared system-prompt prefix stays cached."""
        conv.llm.rewind()

    def warmup(self, progress: Callable[[int], None] = lambda step: None) -> None:
        """Pay every stage's first-call costs (the VAD's native library and model, ASR buffers, TTS lexicons, the
        LLM's own) before anyone waits; progress(i) as WARMUP_STEPS[i] starts."""
        progress(0)
        EndOfTurnDetector().feed(np.zeros(SAMPLE_RATE, np.float32), 0.0)
        if self.smart_turn is not None:
            self.smart_turn.probability(np.zeros(SAMPLE_RATE, np.float32))
        progress(1)
        self.transcriber.warmup()
        progress(2)
        self.tts.warmup()
        self.llm.warmup(lambda step: progress(3 + step))

    def messages(self, conv: Conversation, user_text: str) -> list[dict[str, str]]:
        keep = conv.history[-2 * self.config.history_turns :] if self.config.history_turns else []
        return [{"role": "system", "content": self.config.system_prompt}, *keep, {"role": "user", "content": user_text}]

    def listen(
        self,
        conv: Conversation | None = None,
        start_early: StartEarly | None = None,
        notify: Notify | None = None,
        turn_end: TurnEnd | None = None,
        capacity: Capacity | None = None,
        wake: Callable[[], None] | None = None,
    ) -> TurnListener:
        """A listener for one turn of conv: with start_early (and config.preemptive) it starts answers at pauses;
        with conv (and config.prefill_while_speaking, and a stage that keeps a cache) it prefills the user's words as
        they come. turn_end: the configured one unless given; capacity: what its partial ASR passes share (none for
        one user); wake: called when a pause's signal comes in (an ASR pass, Smart Turn, the target's vote), on its
        thread, for the caller to poll() the listener from its own (poll() may end the turn)."""
        c = self.config
        prefill = None
        if conv is not None and c.prefill_while_speaking and conv.llm.keeps_cache:
            prefill = lambda words: conv.prefill_soon(self.messages(conv, words))  # noqa: E731
        return TurnListener(
            self.transcriber,
            turn_end or c.turn_end,
            start_early=start_early if c.preemptive else None,
            prefill=prefill,
            notify=notify,
            capacity=capacity,
            wake=wake,
            smart_turn=self.smart_turn,
            target_reads_words=c.llm_url is None,
        )

    def turn_from_recording(
        self,
        conv: Conversation,
        audio16k: np.ndarray,
        speculation: bool,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        remember: bool = True,
    ) -> TurnResult:
        """Replay a recording in real time, as if its speaker were talking now, then answer (starting early at a
        pause, as a live microphone's turn does). Once cancel is set the replay stops: AudioError, no turn heard."""
        early: list[tuple[Hold, threading.Thread, list]] = []

        def start_early(words: str, timeline: Timeline, hold: Hold) -> None:
            box: list = []  # the TurnResult, or the exception that ended the answer

            def run() -> None:
                try:
                    box.append(self.respond(conv, words, timeline, speculation, on_event, cancel, remember, hold))
                except BaseException as e:  # re-raised below, if this answer was the turn's
                    box.append(e)

            thread = threading.Thread(target=run, name="early-answer", daemon=True)
            thread.start()
            early.append((hold, thread, box))

        woke = threading.Event()  # a signal of the pause (words, Smart Turn, the vote) came in before the next frame
        listener = self.listen(conv, start_early, wake=woke.set)
        t0 = time.perf_counter()
        end: VadEvent | None = None
        try:
            # After the file, the speaker stays silent long enough for the longest hang-over to run out.
            tail = np.zeros(int(SAMPLE_RATE * (self.config.turn_end.longest_ms / 1000 + 0.2)), np.float32)
            padded = np.concatenate([audio16k, tail])
            for i in range(0, len(padded), FRAME):  # the page's mic sends one VAD frame at a time too
                if cancel is not None and cancel.is_set():
                    break  # with no end of turn, finish() raises AudioError
                t_chunk = t0 + i / SAMPLE_RATE
                # The chunk is complete only once its last sample was "spoken".
                while end is None and (delay := t_chunk + FRAME / SAMPLE_RATE - time.perf_counter()) > 0:
                    if woke.wait(delay):
                        woke.clear()
                        end = listener.poll()
                if end is None:
                    end = listener.feed(padded[i : i + FRAME], t_chunk)
                if end is not None:
                    break
            heard = listener.finish(end)
        finally:
            listener.close()  # discards an early answer still held
            for _, thread, _ in early:
                thread.join()
        if on_event:
            on_event(Transcript(heard.transcript))
        kept = next((box[0] for hold, _, box in early if hold is heard.early), None)
        if kept is None:
            return self.respond(conv, heard.transcript, heard.timeline, speculation, on_event, cancel, remember)
        if isinstance(kept, BaseException):
            raise kept
        return kept

    def respond(
        self,
        conv: Conversation,
        transcript: str,
        timeline: Timeline,
        speculation: bool,
        on_event: EventSink | None = None,
        cancel: threading.Event | None = None,
        remember: bool = True,
        hold: Hold | None = None,
    ) -> TurnResult:
        """Answer a transcript: LLM tokens → chunks → TTS audio, each chunk spoken as it is ready (SpokenAnswer, on
        this thread). With hold (an answer started before its turn ended), nothing is sent, played or remembered until
        hold is confirmed, and the answer stops when it is discarded."""
        emit, cancel = _held(on_event or (lambda event: None), cancel or threading.Event(), hold)
        if not timeline.has("speech_end"):  # typed input: the turn "ends" now, with no VAD or ASR stage
            now = time.perf_counter()
            for name in ("speech_end", "end_of_turn", "asr_final"):
                timeline.mark(name, now)
        answer = SpokenAnswer(self.tts, timeline, emit, cancel, hold, self.config.first_chunk_words)
        with conv.lock:
            failure: BaseException | None = None
            deltas = conv.llm.stream_reply(
                self.messages(conv, transcript), speculation, answer.stats, cancel, end_probe=hold is not None
            )
            try:
                with contextlib.closing(deltas):  # a failed TTS still lets the engine's place in the batch go
                    answer.run(deltas)
            except BaseException as e:  # an early answer discarded meanwhile fails quietly
                failure = e
            if hold is not None:
                hold.can_play()  # ended with no audio (none, or a failure): its turn need not stay open for it
            discarded = hold is not None and not hold.wait()
            if failure is not None and not discarded:
                raise failure
            result = self._result(answer, transcript, timeline, speculation, cancel.is_set(), discarded)
            if remember and not discarded:
                # History holds what the user actually heard, so the next turn's context matches reality.
                heard = result.spoken + (" …" if result.cancelled else "")
                conv.history += [{"role": "user", "content": transcript}, {"role": "assistant", "content": heard}]
        emit(AnswerDone(result))
        return result

    def _result(
        self,
        answer: SpokenAnswer,
        transcript: str,
        timeline: Timeline,
        speculation: bool,
        cancelled: bool,
        discarded: bool,
    ) -> TurnResult:
        stats = answer.stats
        return TurnResult(
            speculation,
            transcript,
            "".join(answer.text).strip(),
            " ".join(answer.spoken),
            timeline,
            stats,
            answer.audio,
            self.tts.sample_rate,
            cancelled,
            stats.tokens - answer.spoken_tokens,
            discarded,
        )


def _held(emit: EventSink, cancel: threading.Event, hold: Hold | None) -> tuple[EventSink, threading.Event]:
    """The answer's sink and cancel: an early answer's (hold) wait for its turn's confirmation, and its cancel is
    also set when it is discarded."""
    if hold is None:
        return emit, cancel
    own = ChildCancel(cancel)
    hold.link(own)
    return hold.wrap(emit), own
