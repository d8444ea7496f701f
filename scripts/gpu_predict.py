"""The GPU check's prediction (speedup and TTFA from the measured costs and the CPU-measured acceptance) and the
case study's roofline calibrated to the measured costs; scripts/gpu_check.py runs them."""

from __future__ import annotations

import dataclasses
import statistics
from typing import Any

from gpu_sections import ACCEPTANCE, DRAFT_MODEL, TARGETS, Acceptance

PAIRS = [(t, d) for t in reversed(TARGETS) for d in (DRAFT_MODEL, "heads")]  # the 7B with the 0.5B first


# ---------------------------------------------------------------------------------------------- prediction


def forward_costs(row: dict[str, Any]) -> Any:
    from specdec.cost_grid import ForwardCosts

    return ForwardCosts.from_dict(row["costs"])


def prediction(models: dict[str, Any]) -> dict[str, Any]:
    """Speedup and TTFA per target and drafter, from the measured costs and the CPU-measured acceptance."""
    from casestudy.latency_model import VoiceStages, stage_ms

    stages = VoiceStages()
    pairs = {}
    for target, drafter in [(t, d) for t, d in PAIRS if t in models and d in (*models, "heads")]:
        cost = forward_costs(models[target])
        source = models[drafter] if drafter == DRAFT_MODEL else models[target]
        draft_s = {int(k): s for k, s in source["draft_s_by_k"].items()}
        acceptance = ACCEPTANCE[drafter]

        def speedup(batch: int, k: int, cost: Any = cost, draft_s: dict = draft_s, acc: Acceptance = acceptance):
            """Tokens per second with k drafts ÷ without, every sequence of the batch drafting for itself."""
            step = cost(batch, batch * (k + 1)) + batch * draft_s[k]
            return acc.expected_tokens(k) * cost(batch, batch) / step

        per_k = [
            {"k": k, "expected_tokens_per_step": acceptance.expected_tokens(k), "speedup": speedup(1, k)}
            for k in sorted(draft_s)
        ]
        best = max(per_k, key=lambda r: r["speedup"])
        rate_off = 1 / cost(1, 1)
        # The draft model reads the prompt too before it drafts; heads draft from the target's own features.
        prefill_off = models[target]["prefill"]["seconds"]
        prefill_on = prefill_off + (models[drafter]["prefill"]["seconds"] if drafter == DRAFT_MODEL else 0.0)

        off = stage_ms(stages, prefill_off, rate_off)
        on = stage_ms(stages, prefill_on, rate_off * best["speedup"])
        pairs[f"{target} + {drafter}"] = {
            "best_k": best["k"],
            "speedup": best["speedup"],
            "tokens_per_s_off": rate_off,
            "tokens_per_s_on": rate_off * best["speedup"],
            "per_k": per_k,
            "by_batch": [
                {"batch": b, **max(({"k": k, "speedup": speedup(b, k)} for k in draft_s), key=lambda r: r["speedup"])}
                for b in models[target]["costs"]["batches"]
            ],
            "ttfa_ms_off": sum(off.values()),
            "ttfa_ms_on": sum(on.values()),
            "stages_ms_off": off,
            "stages_ms_on": on,
        }
    return {
        "label": "PREDICTION for this device, not a measurement: the forward and drafting costs measured here on "
        "random-weight models of the real shapes, with the acceptance measured on the CPU with the real weights",
        "acceptance": {name: dataclasses.asdict(a) for name, a in ACCEPTANCE.items()},
        "assumptions": {
            "acceptance": "the 7B target accepts as the 1.5B did; acceptance does not depend on the device",
            "stages": f"casestudy.latency_model.VoiceStages (a GPU-served voice agent): {dataclasses.asdict(stages)}",
            "draft_cost": "each sequence of a batch drafts on its own, one after another, as the engine does",
        },
        "pairs": pairs,
    }


# ---------------------------------------------------------------------------------------------- case study


def fit_efficiency(at_peak: list[float], measured: list[float]) -> tuple[float, float, str]:
    """t = overhead + bytes ÷ (bandwidth · efficiency): a line through the models' one-token forwards, as
    (efficiency, overhead in seconds, how). When the forwards do not grow with the bytes they read (tiny models, or
    one forward timed in a slow spell), the largest model's forward alone gives the efficiency and no overhead is
    fitted: what the check reports must not depend on how fast the machine ran that minute."""
    fit = statistics.linear_regression(at_peak, measured)
    if fit.slope > 0:
        return 1 / fit.slope, max(fit.intercept, 0.0), f"fitted to the {len(measured)} models' one-token forwards"
    largest = max(range(len(at_peak)), key=at_peak.__getitem__)
    how = (
        f"from the largest model's one-token forward alone (no overhead): the {len(measured)} models' "
        f"forwards {[round(t * 1e3, 2) for t in measured]} ms did not grow with the bytes they read"
    )
    return at_peak[largest] / measured[largest], 0.0, how


def casestudy_calibration(device_name: str, small: bool, models: dict[str, Any]) -> dict[str, Any]:
    """The case study's roofline for this device: its roofs measured (a copy, a square matmul), one efficiency and one
    per-forward overhead fitted to the three models' one-token forwards, its modelled grid beside the measured one,
    and its speedup for the 7B with the 0.5B at K = 4 (the measured curve's is prediction.pairs[…].per_k)."""
    import torch

    from casestudy.latency_model import (
        Hardware,
        ModelSpec,
        Scenario,
        evaluate,
        memory_seconds,
        modelled_forward_seconds,
    )
    from specdec.cost_grid import COST_CONTEXT, cpu_name
    from specdec.timing import median_seconds

    device = torch.device(device_name)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    x = torch.empty(1 << (23 if small else 28), dtype=dtype, device=device)  # 32 MiB of float32, 512 MiB of bf16
    y = torch.empty_like(x)
    copied = 2 * x.nbytes  # read once, written once
    copy_s = median_seconds(lambda: y.copy_(x), device, 5)
    n = 512 if small else 8192
    a = torch.randn(n, n, dtype=dtype, device=device)
    matmul_s = median_seconds(lambda: a @ a, device, 5)
    name = cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device)
    peak = Hardware(name, bandwidth_tbs=copied / copy_s / 1e12, tflops=2 * n**3 / matmul_s / 1e12)
    specs = {}
    for model, row in models.items():
        s = row["shape"]
        size = torch.finfo(getattr(torch, row["dtype"])).bits / 8
        specs[model] = ModelSpec(
            model,
            params_b=row["params"] / 1e9,
            n_layers=s["num_hidden_layers"],
            n_kv_heads=s["num_key_value_heads"],
            head_dim=s["hidden_size"] // s["num_attention_heads"],
            bytes_per_param=size,
            kv_bytes_per_value=size,
        )
    at_peak = [memory_seconds(specs[m], peak, 1, COST_CONTEXT) for m in models]
    measured = [forward_costs(models[m])(1, 1) for m in models]
    efficiency, overhead_s, fitted = fit_efficiency(at_peak, measured)
    hw = dataclasses.replace(peak, efficiency=efficiency, overhead_ms=overhead_s * 1e3)
    per_model = {}
    for model, row in models.items():
        costs = row["costs"]
        ratios = [
            costs["measured_seconds"][i][j] / modelled_forward_seconds(specs[model], hw, b * p, b, COST_CONTEXT)
            for i, b in enumerate(costs["batches"])
            for j, p in enumerate(costs["per_sequence"])
        ]
        per_model[model] = {
            "params_b": specs[model].params_b,
            "one_token_ms_measured": forward_costs(row)(1, 1) * 1e3,
            "one_token_ms_modelled": modelled_forward_seconds(specs[model], hw, 1, 1, COST_CONTEXT) * 1e3,
            "measured_over_modelled": {"median": statistics.median(ratios), "min": min(ratios), "max": max(ratios)},
        }
    alpha = ACCEPTANCE[DRAFT_MODEL].by_position[0]
    scenario = Scenario(
        alpha=alpha, k=4, target=specs["qwen2.5-7b"], draft=specs[DRAFT_MODEL], hw=hw, context_tokens=COST_CONTEXT
    )
    return {
        "hardware": dataclasses.asdict(hw),
        "how": f"bandwidth_tbs and tflops measured here in {str(dtype).removeprefix('torch.')} (a copy, a square "
        f"matmul); efficiency and overhead_ms {fitted}",
        "models": per_model,
        "roofline_speedup_7b_with_0.5b_k4": evaluate(scenario).speedup,
    }
