"""A latency model for speculative decoding in a voice agent, built from first principles rather than a lookup.

- Decode: a forward streams every weight (and the KV cache) from GPU memory once, so its time is
  bytes ÷ (bandwidth × GPUs × efficiency), unless the FLOPs of the tokens in the batch take longer
  (2 · params · tokens ÷ (FLOP/s × GPUs × efficiency)): t = max(memory, compute) + overhead.
- Speculation: E = (1 − α^(K+1)) / (1 − α) tokens per target step at a cost of (cK + v) target forwards,
  with c and v computed from the same roofline (specdec.metrics holds the formulas).
- Time to first audio (TTFA): end-of-turn wait + ASR + prefill + first-chunk tokens × time per token + TTS.
- Batching: verification processes B·(K+1) tokens; once that is compute-bound, rejected drafts are
  paid for in FLOPs, and speculation stops paying.

casestudy/story.py feeds the reference story through the model and reports what its figures imply.
Every input or assumption is a labelled default; every output is computed.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field, replace

from pipeline.timeline import STAGES
from specdec.metrics import expected_speedup, expected_tokens_per_step

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
    scenario: Scenario,
    k_max: int = 8,
    min_gain: float = MIN_GAIN,
) -> int:
    """The K with the best modelled speedup at this concurrency; 0 (off) when no K gains min_gain.

    Idle, the target is memory-bound and verification is nearly free, so deeper drafts pay; under load
    the B·(K+1)-token verify turns compute-bound and every rejected draft costs real FLOPs.
    Hardware and models come from `scenario` (the calibrated reference story: story.calibrated_scenario()).
    """
    s = replace(scenario, alpha=alpha, c=c, concurrency=concurrency)
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
