"""Every metric the product shows, defined once. The UI and the CLI read DEFINITIONS from here."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .events import StepEvent

DEFINITIONS: dict[str, str] = {
    "draft_acceptance_rate": "accepted draft tokens ÷ proposed draft tokens (vLLM's definition); with a draft tree "
    "(--draft-tree), every verified node counts as proposed, and at most one node per depth can be accepted",
    "tokens_per_target_forward": "tokens emitted ÷ target forward passes, every pass counted (plain steps, the "
    "governor's probes and the prefill too), bonus/correction tokens included, tokens past EOS not",
    "mean_k": "draft tokens proposed ÷ speculative steps (target forwards that verified a drafter's proposal; a step "
    "whose drafter ran but proposed nothing, e.g. stopped by the confidence gate, counts as one)",
    "speculative_step_fraction": "speculative steps ÷ target forwards, both counted as SpecStats counts them (every "
    "forward: the prefill's, plain steps and the governor's probes too), pooled over a bench run's speculative "
    "answers. Near 1 while drafts run on every step (the governor's probes, one to three an answer, take a little "
    "off); far below, speculation was switched off or paused for much of the answers (speculation_off), which "
    "draft_acceptance_rate, mean_k and expected_speedup do not show: they count only the steps that drafted",
    "speculation_off": "bench: the answers whose speculation stopped before their end, with the StepEvent notes that "
    "stopped it (the governor switching it off, with the rates it measured; a failing drafter; a pause by batch size): "
    "answers, of how many, and per prompt its notes",
    "alpha": "per-token acceptance probability α (Leviathan et al.), estimated as accepted ÷ (accepted + "
    "rejections), the maximum-likelihood value when each draft token is accepted independently",
    "per_position_acceptance": "for draft position i, accepted ÷ proposed at that position (a draft tree's nodes "
    "are listed as its accepted path, then the others)",
    "tokens_per_s": "generated tokens ÷ seconds generating them: in bench and generate the whole generation, "
    "prefill included; in a voice turn the decode rate, tokens after the first target step ÷ seconds from the first "
    "step's tokens to the last (the first step, with the prefill, is its own stage; it may carry several tokens "
    "with speculation, so they are left out in both modes)",
    "decode_tokens_per_s": "bench --llamacpp, llama.cpp's run: tokens after the first ÷ seconds from the first new "
    "token to the last (prompt processing and the first token left out)",
    "llamacpp_tokens_per_s_median": "bench --llamacpp: median over prompts of llama.cpp's tokens_per_s (prefill "
    "included, as ours): llama-cpp-python on the target preset's own GGUF file, the same prompt tokens, greedy, the "
    "same thread count, every prompt from an empty KV cache like our engine's bench runs; in a process of its own "
    "while ours waits (summary.llamacpp_isolation)",
    "speculative_vs_llamacpp": "bench --llamacpp: median over prompts of our speculative tokens_per_s ÷ llama.cpp's on "
    "the same prompt; above 1 we are faster. llama.cpp computes with the quantized GGUF weights, our engine with the "
    "dequantized model (--dtype, --target-quant), so the two answers can differ",
    "llamacpp_identical_fraction": "bench --llamacpp: share of prompts whose llama.cpp greedy answer equals our "
    "target-only answer token for token (quantized and dequantized arithmetic can break near-ties differently)",
    "forward_ms": "bench-target: median milliseconds of one target forward feeding N new tokens on top of a "
    "64-token KV cache, as the engine feeds them (N = 1 is a plain decode step, N = K + 1 verifies K drafts)",
    "verify_cost_ratio": "bench-target: forward_ms at N tokens ÷ forward_ms at one token, the same target format and "
    "attention (what verifying N − 1 drafts costs, in one-token steps)",
    "target_only_tokens_per_s": "bench-target: median over prompts of a target-only greedy answer's tokens_per_s",
    "top1_agreement": "bench-target: teacher-forced over the reference target's greedy answers, the share of answer "
    "positions where this target format's top token is the reference's token (drift of a quantized target)",
    "mean_logprob": "bench-target: the mean log-probability this target format gives the reference target's greedy "
    "answer tokens, teacher-forced (the reference's own value is the ceiling it is compared with)",
    "expected_speedup": "Leviathan et al.: (1 − α^(K+1)) / ((1 − α)(cK + 1)), c = draft forward ÷ target forward",
    "draft_cost_ratio": "c = seconds per draft forward ÷ seconds per target forward (in a speculative step)",
    "verify_cost_curve": "the app: v(n) = forward(n) ÷ forward(1), the seconds of one target forward feeding n tokens "
    "per sequence ÷ those of one feeding a single token, at the same batch size, from the forward-cost grid measured "
    "at warm-up (about a voice turn of tokens cached per sequence); verifying K drafts feeds n = K + 1",
    "predicted_speedup": "the app: E ÷ v(K + 1) at batch 1, E = (1 − α^(K+1)) / (1 − α) the expected tokens per target "
    "forward when each of K drafts is accepted independently with probability α (an i.i.d. assumption); α and K "
    "(mean_k, rounded) pooled over the session's finished speculation-on turns; the drafter's own time is left out "
    "(small for draft heads, not for a draft model)",
    "measured_speedup": "the app: the median tokens_per_s of the session's finished speculation-on turns ÷ the median "
    "of its speculation-off turns, each at the load it ran under",
    "batch_size": "sequences whose steps shared one target forward (continuous batching: every active conversation, "
    "the app's simulated background conversations included)",
    "k_chosen": "drafts verified for a sequence in one step (a draft tree's nodes): its K policy's K; with the "
    "load-aware choice, the best of those drafted that maximise the batch's expected tokens per second, from the "
    "measured forward cost at the batch's tokens and each draft's chance of acceptance (the drafter's confidence in "
    "it this step × how often the target agreed with that confidence; by draft rank where the drafter gives none); "
    "0 is a plain step",
    "aggregate_tokens_per_s": "bench-load: tokens emitted by all N concurrent conversations during the measured "
    "window ÷ the window's seconds (steady state: conversations start a new prompt as soon as one is answered, "
    "prefills included)",
    "per_sequence_tokens_per_s": "bench-load: the median over the N conversations of tokens it emitted in the window "
    "÷ the window's seconds: the rate one user sees",
    "crossover_concurrency": "bench-load: the smallest N in the sweep at which fixed K = 4 gives fewer aggregate "
    "tokens/s than speculation off (null if none)",
    "ttfa_ms": "time to first audio: end of the last voiced user audio → first answer sample out of the TTS "
    "(server side); includes the end-of-turn silence wait, and its stages add up to it",
    "first_chunk_tokens_per_forward": "a voice turn: the tokens emitted up to the release of the first spoken chunk "
    "÷ the target forwards that emitted them, the prefill's forward included (what a listener waits for: each "
    "forward saved there comes off TTFA); bench-voice reports the median per mode",
    "chunk_handoff_ms": "a voice turn: from the end of the target step whose tokens completed a spoken chunk to that "
    "chunk reaching the TTS, the median over the turn's chunks (the threads and queues between the LLM and the TTS, "
    "and the TTS still speaking the chunk before); bench-voice reports the median per mode",
    "end_of_message_probability": "the target's probability that the user's message ends after the words heard up "
    "to a pause: P(next token ends the message, or is a closing . ? !) at the last word's position (the words "
    "without the punctuation Whisper closes them with), read from the early answer's first forward, which feeds "
    "that row anyway",
    "held_open": "a pause whose end-of-turn silence ran out while the answer started early on its words had no "
    "audio to play yet: the turn stays open until it has (at most the longest end-of-turn wait after the last voiced "
    "audio), and speech meanwhile takes the end back, so nothing of that answer is ever heard; the end of the turn "
    "still counts from when the silence ran out (end_of_turn_wait), and TTFA runs as before",
    "end_of_turn_probability": "Smart Turn v3.2's probability that the speaker has finished, from the last ≤ 8 s of "
    "the turn's audio up to a pause (prosody as well as words; pipecat's model, its weights run here in torch)",
    "words_at_ms": "a pause: from its last voiced audio to when the words of all of the speech before it were "
    "transcribed (the ASR pass it asked for, and any pass in flight before it); bench-turn reports the median and the "
    "longest over its pauses",
    "asr_pass_ms": "a pause: how long the latest ASR pass took by the time the pause ended (one Whisper call on the "
    "turn's audio so far); bench-turn reports the median and the longest over its pauses",
    "stall_ms": "silence inside an answer (server side): with its audio played at real speed from the first sample "
    "out of the TTS, the total time the listener waits between the end of the samples out so far and the next ones; "
    "0 when the speech never runs dry",
    "ttfa_heard_ms": "the same start → the first answer sample heard in the browser (AudioWorklet output time, "
    "mapped to the server clock)",
    "heard_delay_ms": "first answer sample heard in the browser (AudioWorklet output time mapped through "
    "AudioContext.getOutputTimestamp, converted to the server clock by ping/pong) − the server's emission time of "
    "that sample's packet",
    "ttfa_ratio_on_off": "the A/B statistic (bench-voice and the app's A/B runs): the same utterance answered with "
    "speculation off and on from the same conversation state, the order alternating, gives one pair per repeat; "
    "the median over pairs of TTFA on ÷ TTFA off, with a 95% percentile-bootstrap interval of that median (2000 "
    "resamples of the pairs); below 1 speculation is faster",
}


def expected_tokens_per_step(alpha: float, k: int) -> float:
    """E = (1 − α^(K+1)) / (1 − α): expected tokens per target forward with K drafts."""
    if alpha >= 1.0:
        return float(k + 1)
    return (1 - alpha ** (k + 1)) / (1 - alpha)


def expected_speedup(alpha: float, k: int, c: float, v: float = 1.0) -> float:
    """Leviathan et al. expected speedup E / (cK + v); v = verify cost ÷ one-token target forward."""
    return expected_tokens_per_step(alpha, k) / (c * k + v)


def expected_acceptance_rate(alpha: float, k: int) -> float:
    """Draft acceptance rate implied by per-token α at K: (E − 1) / K."""
    return (expected_tokens_per_step(alpha, k) - 1) / k if k else 0.0


def alpha_from_acceptance_rate(rate: float, k: int) -> float:
    """Invert expected_acceptance_rate by bisection (it is increasing in α)."""
    if k <= 0 or rate <= 0:
        return 0.0
    if rate >= 1:
        return 1.0
    lo, hi = 0.0, 1.0
    for _ in range(60):
        mid = (lo + hi) / 2
        if expected_acceptance_rate(mid, k) < rate:
            lo = mid
        else:
            hi = mid
    return (lo + hi) / 2


@dataclass
class SpecStats:
    """Running counters for one generation (or a whole benchmark). Observes each target forward's StepEvent once,
    after the EOS/budget trim, so nothing past the answer's end counts."""

    target_forwards: int = 0  # every target forward
    speculative_steps: int = 0  # target forwards that verified a drafter's proposal (the drafter ran)
    proposed: int = 0
    accepted: int = 0
    emitted: int = 0
    rejections: int = 0  # speculative steps that stopped at a rejected draft token
    draft_seconds: float = 0.0
    draft_forwards: int = 0
    verify_seconds: float = 0.0  # target time of the speculative steps
    per_position_proposed: list[int] = field(default_factory=list)
    per_position_accepted: list[int] = field(default_factory=list)

    def observe(self, event: StepEvent) -> None:
        """One target forward. event.speculative: a drafter ran this step (it may have proposed nothing)."""
        self.target_forwards += 1
        self.emitted += len(event.tokens)
        if not event.speculative:
            return
        k, n = event.drafted, event.accepted
        self.speculative_steps += 1
        self.proposed += k
        self.accepted += n
        self.rejections += int(n < k)
        self.draft_seconds += event.draft_seconds
        self.draft_forwards += event.draft_forwards
        self.verify_seconds += event.verify_seconds
        self._grow_positions(k)
        for i in range(k):
            self.per_position_proposed[i] += 1
            self.per_position_accepted[i] += int(i < n)

    def _grow_positions(self, k: int) -> None:
        while len(self.per_position_proposed) < k:
            self.per_position_proposed.append(0)
            self.per_position_accepted.append(0)

    def merge(self, other: SpecStats) -> None:
        """Add another generation's counters to these: every field, so a counter added later is merged too."""
        self._grow_positions(len(other.per_position_proposed))
        for f in fields(self):
            mine, theirs = getattr(self, f.name), getattr(other, f.name)
            if isinstance(mine, list):  # per-position counts, added position by position
                for i, n in enumerate(theirs):
                    mine[i] += n
            else:
                setattr(self, f.name, mine + theirs)

    @property
    def draft_acceptance_rate(self) -> float:
        return self.accepted / self.proposed if self.proposed else 0.0

    @property
    def tokens_per_target_forward(self) -> float:
        return self.emitted / self.target_forwards if self.target_forwards else 0.0

    @property
    def mean_k(self) -> float:
        return self.proposed / self.speculative_steps if self.speculative_steps else 0.0

    @property
    def alpha(self) -> float:
        seen = self.accepted + self.rejections
        return self.accepted / seen if seen else 0.0

    @property
    def draft_cost_ratio(self) -> float:
        if not self.draft_forwards or not self.speculative_steps or not self.verify_seconds:
            return 0.0
        return (self.draft_seconds / self.draft_forwards) / (self.verify_seconds / self.speculative_steps)

    @property
    def per_position_acceptance(self) -> list[float]:
        return [a / p if p else 0.0 for a, p in zip(self.per_position_accepted, self.per_position_proposed)]

    @property
    def expected_speedup(self) -> float:
        k = round(self.mean_k)
        return expected_speedup(self.alpha, k, self.draft_cost_ratio) if k else 1.0

    def as_dict(self) -> dict:
        return {
            "draft_acceptance_rate": self.draft_acceptance_rate,
            "tokens_per_target_forward": self.tokens_per_target_forward,
            "alpha": self.alpha,
            "per_position_acceptance": self.per_position_acceptance,
            "draft_cost_ratio": self.draft_cost_ratio,
            "expected_speedup": self.expected_speedup,
            "proposed": self.proposed,
            "accepted": self.accepted,
            "target_forwards": self.target_forwards,
            "speculative_steps": self.speculative_steps,
            "draft_forwards": self.draft_forwards,
            "mean_k": self.mean_k,
        }


LOW_ACCEPTANCE_WARNING = 0.60
