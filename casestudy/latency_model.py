"""A latency model for speculative decoding in a voice agent, built from first principles rather than a lookup.

- Decode: a forward streams every weight (and the KV cache) from GPU memory once, so its time is
  bytes ÷ (bandwidth × GPUs × efficiency), unless the FLOPs of the tokens in the batch take longer
  (2 · params · tokens ÷ (FLOP/s × GPUs × efficiency)): t = max(memory, compute) + overhead.
- Speculation: E = (1 − α^(K+1)) / (1 − α) tokens per target step at a cost of (cK + v) target forwards,
  with c and v computed from the same roofline (specdec.metrics holds the formulas).
- Time to first audio (TTFA): end-of-turn wait + ASR + prefill + first-chunk tokens × time per token + TTS.
- Batching: verification processes B·(K+1) tokens; once that is compute-bound, rejected drafts are
  paid for in FLOPs, and speculation stops paying.

explain_story() feeds the reference story through the model and reports what its figures imply.
Every input or assumption is a labelled default; every output is computed.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from pipeline.timeline import STAGES
from specdec.metrics import alpha_from_acceptance_rate, expected_speedup, expected_tokens_per_step

# The model's stages are the timeline's, so a modelled budget reads like a measured one. Its llm_first_token is the
# prefill (the first token comes out of the prefill forward); first_chunk_tokens is the decode speculation speeds up.
DECODE_STAGE = "first_chunk_tokens"


@dataclass(frozen=True)
class ModelSpec:
    """What a transformer costs per forward: its weights and the KV cache it reads."""

    name: str
    params_b: float  # billions of parameters
    n_layers: int
    n_kv_heads: int
    head_dim: int
    bytes_per_param: float = 2.0  # fp16 / bf16
    kv_bytes_per_value: float = 2.0

    @property
    def weight_bytes(self) -> float:
        return self.params_b * 1e9 * self.bytes_per_param

    @property
    def kv_bytes_per_token(self) -> float:
        return 2 * self.n_layers * self.n_kv_heads * self.head_dim * self.kv_bytes_per_value  # K and V


@dataclass(frozen=True)
class Hardware:
    """Peak figures per GPU, tensor-parallel over n_gpus, scaled by one efficiency factor for both roofs."""

    name: str
    bandwidth_tbs: float  # peak HBM bandwidth per GPU, TB/s
    tflops: float  # peak dense fp16 tensor throughput per GPU, TFLOP/s
    n_gpus: int = 1
    efficiency: float = 1.0  # fraction of peak actually reached (kernels, tensor-parallel all-reduces)
    overhead_ms: float = 0.0  # fixed cost per forward (launches, sampling, scheduling)
    memory_gb: float = 80.0  # HBM per GPU: bounds how many sequences' KV caches fit


# Assumptions for the reference story (public architecture figures; labelled, not outputs).
LLAMA3_70B = ModelSpec("Llama-3-70B fp16", params_b=70.6, n_layers=80, n_kv_heads=8, head_dim=128)
LLAMA3_8B = ModelSpec("Llama-3-8B fp16", params_b=8.03, n_layers=32, n_kv_heads=8, head_dim=128)
A100 = Hardware("A100 80GB", bandwidth_tbs=2.0, tflops=312.0)


def memory_seconds(model: ModelSpec, hw: Hardware, batch: int = 1, context_tokens: int = 0) -> float:
    """Time to stream the weights once plus every sequence's KV cache."""
    nbytes = model.weight_bytes + batch * context_tokens * model.kv_bytes_per_token
    return nbytes / (hw.bandwidth_tbs * 1e12 * hw.n_gpus * hw.efficiency)


def compute_seconds(model: ModelSpec, hw: Hardware, tokens: int) -> float:
    """Matmul FLOPs (2 per parameter per token); attention FLOPs are left out, small at voice context lengths."""
    return 2 * model.params_b * 1e9 * tokens / (hw.tflops * 1e12 * hw.n_gpus * hw.efficiency)


def modelled_forward_seconds(
    model: ModelSpec, hw: Hardware, tokens: int = 1, batch: int = 1, context_tokens: int = 0
) -> float:
    """Modelled time of one forward over `tokens` new tokens of `batch` sequences: the slower roof wins."""
    return max(memory_seconds(model, hw, batch, context_tokens), compute_seconds(model, hw, tokens)) + (
        hw.overhead_ms / 1e3
    )


def ridge_tokens(model: ModelSpec, hw: Hardware) -> float:
    """Tokens per forward beyond which the weights-only forward turns compute-bound (efficiency cancels)."""
    return model.bytes_per_param * hw.tflops / (2 * hw.bandwidth_tbs)


def solve_efficiency(model: ModelSpec, hw: Hardware, tokens_per_s: float, context_tokens: int = 0) -> float:
    """The efficiency factor at which one-sequence decoding runs at `tokens_per_s` (memory-bound)."""
    seconds = 1 / tokens_per_s - hw.overhead_ms / 1e3
    if seconds <= 0:
        raise ValueError(f"{tokens_per_s} tokens/s is faster than the per-forward overhead allows")
    eff = memory_seconds(model, replace(hw, efficiency=1.0), 1, context_tokens) / seconds
    solved = replace(hw, efficiency=eff)
    if compute_seconds(model, solved, 1) > memory_seconds(model, solved, 1, context_tokens):
        raise ValueError("decoding would be compute-bound at batch 1: the memory roofline cannot explain the rate")
    return eff


def solve_draft_cost_ratio(speedup: float, alpha: float, k: int, v: float = 1.0) -> float:
    """Invert S = E / (cK + v) for c: the draft cost ratio a measured speedup requires."""
    return (expected_tokens_per_step(alpha, k) / speedup - v) / k


@dataclass(frozen=True)
class VoiceStages:
    """The pause the user hears, stage by stage (assumptions; the decode share comes from the model)."""

    end_of_turn_ms: float = 200.0  # silence hangover before the turn counts as over (Pipecat's stop_secs default)
    asr_ms: float = 100.0  # final transcript after end of turn (Whisper-class ASR on a GPU, a short utterance)
    tts_first_chunk_ms: float = 80.0  # first audio out of a streaming TTS once it has its first chunk of text
    prompt_tokens: int = 256  # prompt tokens prefilled per turn (system prompt + recent history, uncached)
    first_chunk_tokens: float = 8.0  # tokens the TTS needs before it can start speaking


@dataclass(frozen=True)
class Scenario:
    """Everything one evaluation depends on."""

    alpha: float  # per-token acceptance probability (Leviathan et al.)
    k: int = 4  # draft tokens per step; 0 = speculation off
    c: float | None = None  # draft forward ÷ target forward; None = from the roofline of draft vs target
    target: ModelSpec = LLAMA3_70B
    draft: ModelSpec = LLAMA3_8B
    hw: Hardware = A100
    context_tokens: int = 1024  # tokens already in each sequence's KV cache
    concurrency: int = 1  # sequences decoding together in one batch
    stages: VoiceStages = field(default_factory=VoiceStages)

    def draft_seconds(self, tokens: int, batch: int) -> float:
        if self.c is not None:  # a given ratio holds at every batch size (same arithmetic intensity)
            return self.c * modelled_forward_seconds(self.target, self.hw, tokens, batch, self.context_tokens)
        return modelled_forward_seconds(self.draft, self.hw, tokens, batch, self.context_tokens)


@dataclass(frozen=True)
class Evaluation:
    scenario: Scenario
    baseline_tokens_per_s: float  # per sequence, target alone
    speculative_tokens_per_s: float  # per sequence
    tokens_per_step: float  # E
    c: float  # draft cost ratio at this batch size
    v: float  # verify forward (B·(K+1) tokens) ÷ plain forward (B tokens)
    baseline_stages: dict[str, float]  # ms per stage, in STAGES order
    speculative_stages: dict[str, float]

    @property
    def speedup(self) -> float:
        return self.speculative_tokens_per_s / self.baseline_tokens_per_s

    @property
    def baseline_ttfa_ms(self) -> float:
        return sum(self.baseline_stages.values())

    @property
    def speculative_ttfa_ms(self) -> float:
        return sum(self.speculative_stages.values())

    @property
    def ttfa_floor_ms(self) -> float:
        """The lowest TTFA faster decoding alone can reach: every stage but the decode."""
        return self.baseline_ttfa_ms - self.baseline_stages[DECODE_STAGE]


def stage_ms(st: VoiceStages, prefill_s: float, tokens_per_s: float) -> dict[str, float]:
    """A voice turn's stages (ms, in STAGES order) for an LLM that prefills in prefill_s and decodes tokens_per_s."""
    values = (
        st.end_of_turn_ms,
        st.asr_ms,
        prefill_s * 1e3,
        st.first_chunk_tokens * 1e3 / tokens_per_s,
        st.tts_first_chunk_ms,
    )
    return dict(zip(STAGES, values))


def evaluate(s: Scenario) -> Evaluation:
    b = s.concurrency
    plain = modelled_forward_seconds(s.target, s.hw, b, b, s.context_tokens)
    base_rate = 1 / plain
    if s.k > 0:
        c = s.draft_seconds(b, b) / plain
        v = modelled_forward_seconds(s.target, s.hw, b * (s.k + 1), b, s.context_tokens) / plain
        spec_rate = base_rate * expected_speedup(s.alpha, s.k, c, v)
        # The draft has to read the prompt too before it can propose anything.
        draft_prefill = s.draft_seconds(s.stages.prompt_tokens, 1)
    else:
        c, v, spec_rate, draft_prefill = 0.0, 1.0, base_rate, 0.0
    prefill = modelled_forward_seconds(s.target, s.hw, s.stages.prompt_tokens, 1, s.context_tokens)
    return Evaluation(
        scenario=s,
        baseline_tokens_per_s=base_rate,
        speculative_tokens_per_s=spec_rate,
        tokens_per_step=expected_tokens_per_step(s.alpha, s.k),
        c=c,
        v=v,
        baseline_stages=stage_ms(s.stages, prefill, base_rate),
        speculative_stages=stage_ms(s.stages, prefill + draft_prefill, spec_rate),
    )


def memory_needed_gb(s: Scenario, concurrency: int | None = None) -> float:
    """Weights of target (and draft when speculating) plus every sequence's KV cache, incl. K draft slots."""
    b = s.concurrency if concurrency is None else concurrency
    kv_per_token = s.target.kv_bytes_per_token + (s.draft.kv_bytes_per_token if s.k else 0)
    weights = s.target.weight_bytes + (s.draft.weight_bytes if s.k else 0)
    return (weights + b * (s.context_tokens + s.k + 1) * kv_per_token) / 1e9


def fits_in_memory(s: Scenario, concurrency: int | None = None) -> bool:
    return memory_needed_gb(s, concurrency) <= s.hw.memory_gb * s.hw.n_gpus


def speedup_at(s: Scenario, concurrency: int, k: int | None = None) -> float:
    return evaluate(replace(s, concurrency=concurrency, k=s.k if k is None else k)).speedup


# Below this expected gain speculation is not worth its draft memory, extra variance and complexity.
MIN_GAIN = 1.05


def recommended_k(
    concurrency: int,
    alpha: float,
    c: float | None = None,
    *,
    scenario: Scenario | None = None,
    k_max: int = 8,
    min_gain: float = MIN_GAIN,
) -> int:
    """The K with the best modelled speedup at this concurrency; 0 (off) when no K gains min_gain.

    Idle, the target is memory-bound and verification is nearly free, so deeper drafts pay; under load
    the B·(K+1)-token verify turns compute-bound and every rejected draft costs real FLOPs.
    Hardware and models come from `scenario`, by default the calibrated reference story.
    """
    s = replace(scenario or calibrated_scenario(), alpha=alpha, c=c, concurrency=concurrency)
    best_k, best = 0, 0.0
    for k in range(1, k_max + 1):
        gain = evaluate(replace(s, k=k)).speedup
        if gain > best:
            best_k, best = k, gain
    return best_k if best >= min_gain else 0


def breakeven_concurrency(s: Scenario, max_concurrency: int = 1 << 14) -> int | None:
    """The smallest concurrency at which speculation at s.k no longer beats the target alone."""
    if s.k == 0 or speedup_at(s, 1) <= 1:
        return 1
    lo, hi = 1, 2
    while speedup_at(s, hi) > 1:  # speedup falls with concurrency: double, then bisect
        lo, hi = hi, hi * 2
        if hi > max_concurrency:
            return None
    while hi - lo > 1:
        mid = (lo + hi) // 2
        lo, hi = (mid, hi) if speedup_at(s, mid) > 1 else (lo, mid)
    return hi


def batch_sweep(s: Scenario, concurrencies: Sequence[int], k_max: int = 8) -> list[dict[str, float]]:
    rows = []
    for b in concurrencies:
        ev = evaluate(replace(s, concurrency=b))
        rows.append(
            {
                "concurrency": b,
                "baseline_tokens_per_s": ev.baseline_tokens_per_s,
                "speculative_tokens_per_s": ev.speculative_tokens_per_s,
                "speedup": ev.speedup,
                "verify_cost_v": ev.v,
                "recommended_k": recommended_k(b, s.alpha, s.c, scenario=s, k_max=k_max),
                "fits_in_memory": fits_in_memory(s, b),
            }
        )
    return rows


# ---------------------------------------------------------------------------------------------- the story


@dataclass(frozen=True)
class Story:
    """The reference story's figures (inputs) and what the model has to assume around them (labelled)."""

    baseline_tokens_per_s: float = 28.0
    speculative_tokens_per_s: float = 76.0
    acceptance: float = 0.74  # "74% acceptance": which definition is one of the questions
    k: int = 4
    baseline_ttfa_ms: float = 700.0
    speculative_ttfa_ms: float = 240.0
    target: ModelSpec = LLAMA3_70B
    draft: ModelSpec = LLAMA3_8B
    hw: Hardware = replace(A100, n_gpus=4)  # efficiency is solved so the baseline rate comes out
    context_tokens: int = 1024
    stages: VoiceStages = field(default_factory=VoiceStages)  # first_chunk_tokens is solved from the TTFA
    # Each figure is taken as exact to half a unit of its last digit: that is the tolerance of "reproduces".
    tokens_per_s_rounding: float = 0.5
    acceptance_rounding: float = 0.005
    ms_rounding: float = 5.0


STORY = Story()


def calibrated_scenario(story: Story = STORY) -> Scenario:
    """The story's setup with the efficiency solved from its baseline rate and α read as vLLM's acceptance
    rate; first_chunk_tokens is solved so that the baseline TTFA is the story's."""
    eff = solve_efficiency(story.target, story.hw, story.baseline_tokens_per_s, story.context_tokens)
    s = Scenario(
        alpha=alpha_from_acceptance_rate(story.acceptance, story.k),
        k=story.k,
        c=None,
        target=story.target,
        draft=story.draft,
        hw=replace(story.hw, efficiency=eff),
        context_tokens=story.context_tokens,
        concurrency=1,
        stages=story.stages,
    )
    floor = evaluate(s).ttfa_floor_ms
    tokens = (story.baseline_ttfa_ms - floor) * story.baseline_tokens_per_s / 1e3
    return replace(s, stages=replace(s.stages, first_chunk_tokens=max(tokens, 0.0)))


@dataclass(frozen=True, kw_only=True)  # thirty-one figures: named where it is built
class StoryExplanation:
    story: Story
    efficiency: float  # solved bandwidth efficiency
    ridge_tokens: float  # tokens per forward where the target turns compute-bound
    alpha: float  # per-token α if 74% is vLLM's draft acceptance rate
    acceptance_rate_if_alpha: float  # what vLLM would report if 74% were α
    tokens_per_step: float
    c_roofline: float  # draft forward ÷ target forward from the weights and KV bytes
    v: float
    c_required: float  # the c that gives exactly the story's speedup (rate reading)
    c_required_if_alpha: float  # the same if 74% were α
    baseline_tokens_per_s: float
    speculative_tokens_per_s: float
    speculative_tokens_per_s_band: tuple[float, float]  # over the rounding of the story's inputs
    speculative_tokens_per_s_if_alpha: float
    rate_reading_consistent: bool
    alpha_reading_consistent: bool
    first_chunk_tokens: float  # tokens before the first audio chunk that 700 ms implies, other stages given
    baseline_stages: dict[str, float]
    speculative_stages: dict[str, float]
    baseline_ttfa_ms: float
    speculative_ttfa_ms: float
    ttfa_floor_ms: float  # the non-decode stages: the lowest TTFA faster decoding alone can reach
    decode_only_first_chunk_tokens: float  # if the whole 700 ms were decoding
    decode_only_speculative_ttfa_ms: float  # the least any decode-only speedup of this size gives
    decode_only_ttfa_band: tuple[float, float]
    story_ttfa_reachable: bool  # can 240 ms come from faster decoding alone (within rounding)?
    acceptance_rate_for_story_ttfa: float  # what 700 → 240 would need at K, decode-only reading
    other_stages_must_shrink_ms: float  # in the pipeline reading, beyond what decoding gives
    recommended_k_idle: int
    breakeven_concurrency: int | None
    sentences: list[str]

    def as_dict(self) -> dict:
        return asdict(self)


def _corners(story: Story) -> list[Story]:
    """The story with each rounded figure at either end of its rounding interval."""
    r_tps, r_acc, r_ms = story.tokens_per_s_rounding, story.acceptance_rounding, story.ms_rounding
    return [
        replace(
            story,
            baseline_tokens_per_s=story.baseline_tokens_per_s + a,
            acceptance=story.acceptance + b,
            baseline_ttfa_ms=story.baseline_ttfa_ms + m,
        )
        for a, b, m in itertools.product((-r_tps, r_tps), (-r_acc, r_acc), (-r_ms, r_ms))
    ]


def _band(values: Sequence[float]) -> tuple[float, float]:
    return min(values), max(values)


def _decode_only_ttfa(story: Story, ev: Evaluation) -> float:
    return story.baseline_ttfa_ms / ev.speedup


def explain_story(story: Story = STORY) -> StoryExplanation:
    s = calibrated_scenario(story)
    ev = evaluate(s)
    as_alpha = evaluate(replace(s, alpha=story.acceptance))
    # Each corner of the rounding box, calibrated once and read both ways.
    corners = [(c, calibrated_scenario(c)) for c in _corners(story)]
    corner_evals = [(c, evaluate(cs)) for c, cs in corners]
    tps_band = _band([e.speculative_tokens_per_s for _, e in corner_evals])
    ttfa_band = _band([_decode_only_ttfa(c, e) for c, e in corner_evals])
    alpha_band = _band([evaluate(replace(cs, alpha=c.acceptance)).speculative_tokens_per_s for c, cs in corners])
    story_speedup = story.speculative_tokens_per_s / story.baseline_tokens_per_s
    tol = story.tokens_per_s_rounding
    rate_ok = tps_band[0] - tol <= story.speculative_tokens_per_s <= tps_band[1] + tol
    alpha_ok = alpha_band[0] - tol <= story.speculative_tokens_per_s <= alpha_band[1] + tol
    c_req = solve_draft_cost_ratio(story_speedup, s.alpha, story.k, ev.v)
    c_req_alpha = solve_draft_cost_ratio(story_speedup, story.acceptance, story.k, ev.v)
    decode_only = _decode_only_ttfa(story, ev)
    decode_only_tokens = story.baseline_ttfa_ms * story.baseline_tokens_per_s / 1e3
    reachable = story.speculative_ttfa_ms + story.ms_rounding >= ttfa_band[0]
    # 700 → 240 from decoding alone needs a speedup of 700/240: E = S (cK + v), rate = (E − 1) / K.
    needed_e = story.baseline_ttfa_ms / story.speculative_ttfa_ms * (ev.c * story.k + ev.v)
    rate_for_ttfa = (needed_e - 1) / story.k
    shrink = ev.speculative_ttfa_ms - story.speculative_ttfa_ms
    eff = s.hw.efficiency
    ridge = ridge_tokens(s.target, s.hw)
    k_idle = recommended_k(1, s.alpha, None, scenario=s)
    breakeven = breakeven_concurrency(s)
    st = s.stages
    floor = ev.ttfa_floor_ms
    sentences = [
        f"Roofline: {s.target.name} is {s.target.weight_bytes / 1e9:.0f} GB of weights "
        f"(+{story.context_tokens * s.target.kv_bytes_per_token / 1e9:.2f} GB KV cache at {story.context_tokens} "
        f"tokens) streamed per forward over {s.hw.n_gpus}× {s.hw.name} at {s.hw.bandwidth_tbs} TB/s; "
        f"{story.baseline_tokens_per_s:g} tokens/s means {eff:.0%} of peak bandwidth is reached (solved).",
        f"If '{story.acceptance:.0%} acceptance' is vLLM's draft acceptance rate (accepted ÷ proposed), the "
        f"per-token α is {s.alpha:.3f} and a step yields E = {ev.tokens_per_step:.2f} tokens; if it were α itself, "
        f"vLLM would show only {as_alpha.tokens_per_step - 1:.2f}/{story.k} = "
        f"{(as_alpha.tokens_per_step - 1) / story.k:.0%} and E = {as_alpha.tokens_per_step:.2f}.",
        f"The draft's share of bytes gives c = {ev.c:.3f} and verifying {story.k + 1} tokens costs v = {ev.v:.3f} "
        f"forwards, so the model predicts {ev.speculative_tokens_per_s:.1f} tokens/s "
        f"(band {tps_band[0]:.1f}–{tps_band[1]:.1f} over the rounding of the inputs) against the story's "
        f"{story.speculative_tokens_per_s:g}: {'consistent' if rate_ok else 'inconsistent'}.",
        f"Exactly {story.speculative_tokens_per_s:g} tokens/s needs c = {c_req:.3f} with the acceptance-rate "
        f"reading (the roofline gives {ev.c:.3f}), but c = {c_req_alpha:.3f} if 74% were α, a draft "
        f"{ev.c / max(c_req_alpha, 1e-9):.1f}× cheaper than an {s.draft.params_b:g}B model's bytes allow; with the "
        f"roofline c the α reading gives only {as_alpha.speculative_tokens_per_s:.1f} tokens/s. So the 74% is the "
        "draft acceptance rate vLLM reports.",
        f"Stage assumptions: end of turn {st.end_of_turn_ms:g} ms, ASR {st.asr_ms:g} ms, prefill of "
        f"{st.prompt_tokens} tokens {ev.baseline_stages['llm_first_token']:.0f} ms (roofline), TTS first chunk "
        f"{st.tts_first_chunk_ms:g} ms. Then {story.baseline_ttfa_ms:g} ms leaves room for "
        f"{st.first_chunk_tokens:.1f} tokens before the first audio chunk, and speculation brings the pause to "
        f"{ev.speculative_ttfa_ms:.0f} ms (the draft's own prefill included).",
        f"The non-decode stages, {floor:.0f} ms, are the lowest TTFA faster decoding alone can reach.",
        f"Even if all {story.baseline_ttfa_ms:g} ms were decoding ({decode_only_tokens:.1f} tokens at "
        f"{story.baseline_tokens_per_s:g} tokens/s), a {ev.speedup:.2f}× decode speedup gives "
        f"{decode_only:.0f} ms (band {ttfa_band[0]:.0f}–{ttfa_band[1]:.0f}), so {story.speculative_ttfa_ms:g} ms is "
        + (
            "within reach."
            if reachable
            else f"out of reach from decoding alone: it needs an acceptance rate of {rate_for_ttfa:.0%} "
            f"at K = {story.k}, or "
            f"other stages shrinking by {shrink:.0f} ms in the pipeline reading."
        ),
        f"The target turns compute-bound beyond ≈ {ridge:.0f} tokens per forward; K = {story.k} stops paying at "
        f"≈ {breakeven} concurrent sequences, and an idle server would do best at K = {k_idle}.",
    ]
    return StoryExplanation(
        story=story,
        efficiency=eff,
        ridge_tokens=ridge,
        alpha=s.alpha,
        acceptance_rate_if_alpha=(as_alpha.tokens_per_step - 1) / story.k,
        tokens_per_step=ev.tokens_per_step,
        c_roofline=ev.c,
        v=ev.v,
        c_required=c_req,
        c_required_if_alpha=c_req_alpha,
        baseline_tokens_per_s=ev.baseline_tokens_per_s,
        speculative_tokens_per_s=ev.speculative_tokens_per_s,
        speculative_tokens_per_s_band=tps_band,
        speculative_tokens_per_s_if_alpha=as_alpha.speculative_tokens_per_s,
        rate_reading_consistent=rate_ok,
        alpha_reading_consistent=alpha_ok,
        first_chunk_tokens=st.first_chunk_tokens,
        baseline_stages=ev.baseline_stages,
        speculative_stages=ev.speculative_stages,
        baseline_ttfa_ms=ev.baseline_ttfa_ms,
        speculative_ttfa_ms=ev.speculative_ttfa_ms,
        ttfa_floor_ms=floor,
        decode_only_first_chunk_tokens=decode_only_tokens,
        decode_only_speculative_ttfa_ms=decode_only,
        decode_only_ttfa_band=ttfa_band,
        story_ttfa_reachable=reachable,
        acceptance_rate_for_story_ttfa=rate_for_ttfa,
        other_stages_must_shrink_ms=shrink,
        recommended_k_idle=k_idle,
        breakeven_concurrency=breakeven,
        sentences=sentences,
    )
