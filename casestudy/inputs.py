"""The case study's inputs, shared by `specvoice casestudy` (its options) and the page's tab (its sliders): the
calibrated story with the inputs a user moves replaced, and the check that they make sense.
"""

from __future__ import annotations

from dataclasses import replace

from .latency_model import Scenario

DEFAULT_CONCURRENCY = (1, 2, 4, 8, 16, 32, 64, 128, 256)  # the batch sizes the table and the plots sweep


def _pick(value, default):
    return default if value is None else value


def with_inputs(
    base: Scenario,
    *,
    alpha: float | None = None,
    k: int | None = None,
    c: float | None = None,
    params_b: float | None = None,
    draft_params_b: float | None = None,
    bytes_per_param: float | None = None,
    bandwidth_tbs: float | None = None,
    tflops: float | None = None,
    gpus: int | None = None,
    efficiency: float | None = None,
    first_chunk_tokens: float | None = None,
    prompt_tokens: int | None = None,
    context_tokens: int | None = None,
    end_of_turn_ms: float | None = None,
    asr_ms: float | None = None,
    tts_ms: float | None = None,
    concurrency: int | None = None,
) -> Scenario:
    """`base` with each given input replaced (None keeps it); the CLI and the tab both go through here."""
    target = replace(
        base.target,
        params_b=_pick(params_b, base.target.params_b),
        bytes_per_param=_pick(bytes_per_param, base.target.bytes_per_param),
    )
    draft = replace(
        base.draft, params_b=_pick(draft_params_b, base.draft.params_b), bytes_per_param=target.bytes_per_param
    )
    hw = replace(
        base.hw,
        bandwidth_tbs=_pick(bandwidth_tbs, base.hw.bandwidth_tbs),
        tflops=_pick(tflops, base.hw.tflops),
        n_gpus=_pick(gpus, base.hw.n_gpus),
        efficiency=_pick(efficiency, base.hw.efficiency),
    )
    st = base.stages
    stages = replace(
        st,
        first_chunk_tokens=_pick(first_chunk_tokens, st.first_chunk_tokens),
        prompt_tokens=_pick(prompt_tokens, st.prompt_tokens),
        end_of_turn_ms=_pick(end_of_turn_ms, st.end_of_turn_ms),
        asr_ms=_pick(asr_ms, st.asr_ms),
        tts_first_chunk_ms=_pick(tts_ms, st.tts_first_chunk_ms),
    )
    return replace(
        base,
        alpha=_pick(alpha, base.alpha),
        k=_pick(k, base.k),
        c=_pick(c, base.c),
        target=target,
        draft=draft,
        hw=hw,
        stages=stages,
        context_tokens=_pick(context_tokens, base.context_tokens),
        concurrency=_pick(concurrency, base.concurrency),
    )


def check_scenario(s: Scenario) -> str | None:
    """A reason the inputs make no sense, or None."""
    problems = [
        (not 0 < s.alpha <= 1, f"α must be in (0, 1], got {s.alpha}"),
        (s.k < 0, f"K must be ≥ 0, got {s.k}"),
        (s.c is not None and s.c < 0, f"c must be ≥ 0, got {s.c}"),
        (
            min(s.target.params_b, s.draft.params_b, s.hw.bandwidth_tbs, s.hw.tflops, s.hw.efficiency) <= 0,
            "model sizes, bandwidth, TFLOP/s and efficiency must be positive",
        ),
        (s.hw.n_gpus < 1 or s.concurrency < 1, "GPU count and concurrency must be ≥ 1"),
        (s.stages.first_chunk_tokens < 0 or s.stages.prompt_tokens < 1, "token counts must be positive"),
    ]
    return next((msg for bad, msg in problems if bad), None)
