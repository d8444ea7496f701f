"""One user turn heard as it is spoken: VAD and streaming ASR, the end of the turn by words and silence, and the
two things started before the turn ends (the user's words prefilled as they come, an early answer at the pause)."""

from __future__ import annotations

import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Literal

import numpy as np

from .asr import StreamingTranscriber, Transcriber
from .audio import SAMPLE_RATE, AudioError
from .capacity import Capacity
from .events import EarlyAnswer, Notify
from .preemptive import Hold
from .smart_turn import SmartTurn
from .timeline import Timeline
from .turn_end import PauseSignals, TurnEnd, Wait, unclosed
from .vad import FRAME_S, EndOfTurnDetector, VadEvent

# start_early(words, timeline, hold): answer words now, holding everything until the hold is confirmed
StartEarly = Callable[[str, Timeline, Hold], None]
# prefill(words): the words heard so far (words_to_prefill) may be prefilled
Prefill = Callable[[str], None]
# Silero's last voiced frame ends ~0.1 s after the audible end, so a pass that heard all but the last 0.1 s of the
# speech has almost always heard every word: the same transcript as a pass of all of it in 34 of 36 recordings
# (the assets' three sets), 35 at 64 ms. An early answer starts on it while the pass of all of it runs.
NEAR_S = 0.1


def words_to_prefill(partial: str) -> str:
    """The words of a partial transcript worth prefilling: all of them, without its closing punctuation. The last
    word may still change (a word cut by the snapshot); the answer's prefill then recomputes from where the tokens
    differ, and the words before it stay cached."""
    return unclosed(partial)


@dataclass
class HeardTurn:
    transcript: str
    timeline: Timeline
    early: Hold | None = None  # an early answer on exactly these words, confirmed: it is this turn's answer


class TurnListener:
    """VAD and streaming ASR over one user turn, fed as audio arrives (microphone or replayed file).

    At the first silence after speech the ASR transcribes at once; the words it hears up to the last voiced sample
    set the silence that ends the turn (TurnEnd) and, given start_early, start an answer on them that stays held.
    Speech again discards it; the end of the turn confirms it if the final words are the same. Once that silence has
    run out, the turn stays open while its held answer has nothing to play yet (at most the longest wait after the
    last voiced audio): a speaker who goes on then has heard nothing of it, so their turn goes on too.
    """

    def __init__(
        self,
        transcriber: Transcriber,
        turn_end: TurnEnd,
        asr_interval_s: float = 1.0,
        start_early: StartEarly | None = None,
        prefill: Prefill | None = None,
        notify: Notify | None = None,
        capacity: Capacity | None = None,
        wake: Callable[[], None] | None = None,
        smart_turn: SmartTurn | None = None,
        target_reads_words: bool = True,
    ) -> None:
        self.turn_end = turn_end
        self.smart_turn = smart_turn  # None: the words rule alone (mode "words", or the model did not load)
        # an early answer's first forward gives the target's P(end of message) (not a remote LLM's)
        self.target_reads_words = target_reads_words and start_early is not None
        self._pause = PauseSignals()  # what is known of the current pause
        self._wait = self._decide()
        self.pauses: list[dict] = []  # each pause of the turn: its signals, the wait chosen and why (Timeline.pauses)
        self._pause_costs: dict[str, float] = {}
        self._scoring: Future[tuple[float, float]] | None = None  # Smart Turn on the current pause: (P, cost in s)
        self.vad = EndOfTurnDetector(hangover_ms=self._wait.ms)
        self.vad.keep_open = self._answer_unheard
        self._held_open = False  # the current pause's silence ran out while its answer had nothing to play
        # A whisper call costs ~0.15 s here (10 s window). Partials every second leave the ASR thread idle most of
        # the time, so the call started when the speaker pauses can begin at once.
        # wake: called after each ASR pass, Smart Turn call and the target's vote, on their threads, so the owner can
        # poll() between audio frames.
        self.wake = wake
        self.asr = StreamingTranscriber(transcriber, interval_s=asr_interval_s, capacity=capacity, on_pass=wake)
        self.start_early, self.prefill, self.notify = start_early, prefill, notify
        self._pause_words: str | None = None  # what was said up to the current pause, once transcribed
        self._pause_heard_all = False  # _pause_words come from a pass that heard all of the speech before the pause
        self._prefilled = ""
        self._early: tuple[Hold, Timeline] | None = None
        self._paused_at: float | None = None  # stream time of the current pause's last voiced audio
        self._discarded = 0

    def feed(self, chunk16k: np.ndarray, t_start: float) -> VadEvent | None:
        """Feed audio whose first sample was captured at t_start (perf_counter clock). Returns end_of_turn."""
        self.asr.feed(chunk16k)
        # A signal in since the last frame sets the wait this frame ends or not: read after the VAD's decision, it
        # ended the turn a frame later.
        self._read_signals()
        was_paused = self.vad.paused
        for ev in self.vad.feed(chunk16k, t_start):
            if ev.kind == "end_of_turn":
                return ev
        if not self.vad.paused:
            if was_paused:  # the speaker went on: what was started on the words before the pause is not the turn
                assert self._paused_at is not None  # set when the pause began
                resumed_t = self.vad.last_voiced[0] - FRAME_S  # the start of the frame that was voiced again
                self._close_pause(max(0.0, resumed_t - self._paused_at))
                self.asr.speech_resumed()
                self._pause_words, self._pause_heard_all, self._held_open = None, False, False
                self._pause, self._pause_costs, self._scoring = PauseSignals(), {}, None
                self._apply()
                self._discard_early()
            self._prefill_words()
            return None
        if not was_paused:
            self._paused_at = self.vad.last_voiced[0]
            self.asr.speech_paused(self.vad.last_voiced[1])
            self._score_audio()
        self._read_signals()
        return None

    def _answer_unheard(self, t: float) -> bool:
        """vad.keep_open: at stream time t, the pause's silence has run out, and the answer started early on its words
        has nothing to play yet. A speaker who goes on now has heard nothing of it: the turn stays open, no longer
        than the longest wait after the pause's last voiced audio."""
        hold = self._answer_on_words()
        unheard = (
            hold is not None and not hold.playable and t - self.vad.last_voiced[0] < self.turn_end.longest_ms / 1000
        )
        self._held_open |= unheard
        return unheard

    def _answer_on_words(self) -> Hold | None:
        """The early answer started on the pause's words (all of them heard), still held."""
        if self._early is None or self._pause.words is None:
            return None
        hold = self._early[0]
        return hold if hold.state == "held" and hold.words == self._pause.words.strip() else None

    def _decide(self) -> Wait:
        return self.turn_end.decide(self._pause, self.smart_turn is not None, self.target_reads_words)

    def _apply(self) -> None:
        """Set the silence that ends the turn from what is known of the pause now."""
        self._wait = self._decide()
        self.vad.hangover_s = self._wait.ms / 1000

    def _learn(self, **signal: str | float) -> None:
        """A signal of the pause is in: note when (ms after its last voiced audio, for bench-turn's replay of the
        decision) and decide again."""
        (name,) = signal
        self._pause_costs[f"{name}_at_ms"] = (time.perf_counter() - self.vad.last_voiced[0]) * 1000
        self._pause = replace(self._pause, **signal)
        self._apply()

    def _score_audio(self) -> None:
        """Smart Turn on the turn's audio up to the pause's last voiced sample, beside the pause's ASR pass (one core
        each): in series it delayed the words, and so the early answer, by its whole cost. poll() reads the result;
        until then the pause waits the long wait."""
        if self.smart_turn is None or self.turn_end.mode != "smart":
            return
        self._scoring = self.smart_turn.submit(self.asr.audio(self.vad.last_voiced[1]))
        if (wake := self.wake) is not None:
            self._scoring.add_done_callback(lambda _: wake())

    def _read_audio_probability(self) -> None:
        if self._scoring is None or not self._scoring.done():
            return
        scoring, self._scoring = self._scoring, None
        p, cost_s = scoring.result()  # its exception, if any, ends the turn as the ASR's would
        self._pause_costs["smart_turn_ms"] = cost_s * 1000
        self._learn(end_of_turn_probability=p)

    def _close_pause(self, silence_s: float | None) -> None:
        """Record the pause that ends now: the speaker went on after silence_s, or (None) it ended the turn."""
        record = {
            "words": self._pause.words,
            "end_of_turn_probability": self._pause.end_of_turn_probability,
            "end_of_message_probability": self._pause.end_of_message_probability,
            "wait_ms": self._wait.ms,
            "why": self._wait.why,
            "silence_ms": None if silence_s is None else silence_s * 1000,
            "ended_turn": silence_s is None,
            "answer_held": self._answer_on_words() is not None,  # an early answer on these words was held
            "held_open": self._held_open,  # its silence ran out while that answer had nothing to play yet
            **self._pause_costs,
        }
        if self.asr.last_pass_s is not None:
            record["asr_pass_ms"] = self.asr.last_pass_s * 1000
        self.pauses.append(record)

    def poll(self) -> VadEvent | None:
        """For an owner given wake, as soon as it is called: read the pause's signals (below), and end the turn now
        (the event) if the wait they set is already covered by the silence heard, not at the next frame (32 ms)."""
        self._read_signals()
        return self.vad.end_if_waited(time.perf_counter())

    def _read_signals(self) -> None:
        """During a pause, once the words up to it are transcribed: set the silence that ends the turn and start the
        early answer. feed() reads them each frame, poll() when one comes in. A pass that heard all but the last
        NEAR_S of the speech starts the answer too, without waiting for the pass of all of it; if that one hears
        other words, the answer is discarded and started again on them."""
        if not self.vad.paused:
            return
        self._read_audio_probability()
        self._read_end_probability()
        self._note_playable()
        if self._pause_heard_all:
            return
        last = self.vad.last_voiced[1]
        words = self.asr.covering(last)
        if words is not None:
            self._pause_heard_all = True
            # Only words heard to the end set the silence: a pass short of the last word could make unfinished words
            # look finished ("What is the capital?" for "… the capital of") and end the turn on the speaker.
            self._learn(words=words)
        else:
            words = self.asr.covering(max(1, last - int(NEAR_S * SAMPLE_RATE)))
        if words is None or words == self._pause_words:
            return
        self._discard_early()  # started on a pass that missed the last words, and they changed the transcript
        self._pause_words = words
        self._start_early(words)

    def _read_end_probability(self) -> None:
        """The target's P(end of message), once the early answer on the pause's whole words has read it."""
        if self._early is None or self._pause.end_of_message_probability is not None or self._pause.words is None:
            return
        hold = self._early[0]
        if hold.end_of_message_probability is not None and hold.words == self._pause.words.strip():
            self._learn(end_of_message_probability=hold.end_of_message_probability)

    def _note_playable(self) -> None:
        """When the early answer had its first audio to play (for bench-turn's replay of a turn held open)."""
        if self._early is not None and self._early[0].playable and "answer_playable_at_ms" not in self._pause_costs:
            self._pause_costs["answer_playable_at_ms"] = (time.perf_counter() - self.vad.last_voiced[0]) * 1000

    def _prefill_words(self) -> None:
        if self.prefill is None:
            return
        words = words_to_prefill(self.asr.partial)
        if words and words != self._prefilled:
            self._prefilled = words
            self.prefill(words)

    def _start_early(self, words: str) -> None:
        if self.start_early is None or not words.strip() or self._early is not None:
            return
        timeline, hold = Timeline(), Hold(words.strip(), on_signal=self.wake)
        timeline.mark("speech_end", self.vad.last_voiced[0])
        timeline.early_start = time.perf_counter()
        self._early = (hold, timeline)
        self._tell("started", hold.words)
        self.start_early(hold.words, timeline, hold)

    def _discard_early(self) -> None:
        if self._early is not None:
            hold, _ = self._early
            self._early = None
            hold.discard()
            self._discarded += 1
            self._tell("discarded", hold.words)

    def _tell(self, event: Literal["started", "kept", "discarded"], words: str) -> None:
        if self.notify is not None:
            self.notify(EarlyAnswer(event, words))

    def stop(self) -> VadEvent | None:
        """The audio stopped before the VAD ended the turn (push-to-talk released, length limit): end it now."""
        return next((ev for ev in self.vad.finish() if ev.kind == "end_of_turn"), None)

    def finish(self, end: VadEvent | None) -> HeardTurn:
        """The turn's final transcript and timeline; an early answer on the same words is confirmed, any other
        discarded. AudioError when there is nothing to answer."""
        if end is None:
            self._discard_early()
            raise AudioError("no speech detected")
        self._close_pause(None)  # while its early answer, if any, is still held
        asked = time.perf_counter()
        text = self.asr.finish(speech_samples=end.end_sample).strip()  # the silence after it may be long (held open)
        # The final words' own time, from the end's decision: a turn held open for its answer is not slower to hear.
        asr_final = end.decided_t + time.perf_counter() - asked
        early = self._early
        kept = (
            early is not None
            and early[0].state == "held"  # not given up by its answerer (e.g. no room to answer it early)
            and early[0].words == text
            and early[1].marks["speech_end"] == end.last_voiced_t
        )
        if early is None or not kept:
            self._discard_early()  # another answer than the turn's, if any
            early = None
        self._early = None
        timeline = early[1] if early is not None else Timeline()
        timeline.mark("speech_end", end.last_voiced_t)
        timeline.mark("end_of_turn", end.decided_t)
        timeline.mark("asr_final", asr_final)
        silence_rule_ms = self.turn_end.silence_ms if self.turn_end.mode != "silence" else None
        timeline.heard_turn(self.pauses, silence_rule_ms, self._discarded)
        if not text:
            raise AudioError("speech was detected but nothing intelligible was transcribed")
        if early is None:
            return HeardTurn(text, timeline)
        self._tell("kept", text)
        early[0].confirm()  # what the answer held goes out now, after the word that it was kept
        return HeardTurn(text, timeline, early[0])

    def close(self) -> None:
        """Abandon the turn: the ASR stops and an early answer still held is discarded."""
        self._discard_early()
        self.asr.close()
        if self._scoring is not None:
            self._scoring.cancel()  # not started yet: never run
