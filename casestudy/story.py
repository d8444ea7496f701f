"""The reference story (a 70B voice agent on 4× A100 at 28 → 76 tokens/s and 700 → 240 ms, "74% acceptance"), fed
through the latency model: the calibrated scenario every default of the case study starts from, and what the story's
figures imply (explain_story), each figure read within the rounding of its last digit.
"""

from __future__ import annotations

import itertools
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field, replace

from specdec.metrics import alpha_from_acceptance_rate

from .latency_model import (
    A100,
    LLAMA3_8B,
    LLAMA3_70B,
    Evaluation,
    Hardware,
    ModelSpec,
    Scenario,
    VoiceStages,
    breakeven_concurrency,
    evaluate,
    recommended_k,
    ridge_tokens,
    solve_draft_cost_ratio,
    solve_efficiency,
)


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
