"""`specvoice bench-load`: N concurrent synthetic conversations through the batch scheduler, speculation off, at a
fixed K = 4 and load-aware, side by side per N; the crossover where K = 4 starts to lose, measured and next to what
the case-study latency model predicts from this machine's measured forward costs. JSON and a plot out."""

from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from app.background import BackgroundLoad
from casestudy.latency_model import Hardware, ModelSpec, Scenario, breakeven_concurrency, evaluate
from pipeline.llm import SYSTEM_PROMPT
from specdec.bench import read_prompts
from specdec.build import build_engine
from specdec.cost_grid import ForwardCosts, measure_forward_costs
from specdec.engine import GenerationConfig, SpeculativeEngine, StepEvent
from specdec.kpolicy import FixedK
from specdec.metrics import DEFINITIONS, alpha_from_acceptance_rate
from specdec.models import estimate_bytes
from specdec.scheduler import BatchScheduler

from .options import add_engine_arguments, positive_int, spec_from_args

MODES = ("off", "k4", "load_aware")
FIXED_K = 4
DEFAULT_PROMPTS = "../shared/prompts/voice_prompts.jsonl"
DEFINED = ("aggregate_tokens_per_s", "per_sequence_tokens_per_s", "crossover_concurrency", "k_chosen", "batch_size")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--concurrency", default="1,2,4,8,16", help="comma-separated numbers of conversations")
    parser.add_argument("--max-new-tokens", type=positive_int, default=48, help="per answer")
    parser.add_argument(
        "--seconds",
        type=float,
        default=10.0,
        help="measured window per N, mode and round (longer, until every conversation has stepped in it)",
    )
    parser.add_argument(
        "--rounds", type=positive_int, default=2, help="windows per N and mode, the modes' order reversed each round"
    )
    parser.add_argument("--prompts", default=DEFAULT_PROMPTS, help='JSONL, one {"prompt": ...} a line')
    parser.add_argument("--json", required=True)
    parser.add_argument("--plot", default="", help="PNG of the sweep (default: the JSON's path with .png)")


def _concurrencies(text: str) -> list[int]:
    try:
        values = [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise ValueError(f"--concurrency must be comma-separated integers, got {text!r}") from None
    if not values or min(values) < 1:
        raise ValueError(f"--concurrency needs numbers ≥ 1, got {text!r}")
    return sorted(set(values))


def run_window(
    engine: SpeculativeEngine,
    costs: ForwardCosts,
    prompts: list[list[int]],
    n: int,
    mode: str,
    args: argparse.Namespace,
) -> tuple[list[list[StepEvent]], float]:
    """n conversations answering prompts back to back; each one's steps within `seconds` once every one has
    started (longer, until each has stepped in it), and the window's length."""
    scheduler = BatchScheduler(engine, costs if mode == "load_aware" else None)
    config = GenerationConfig(args.max_new_tokens, speculate=mode != "off", k_policy=lambda: FixedK(FIXED_K))
    seen: list[list[tuple[float, StepEvent]]] = [[] for _ in range(n)]
    errors: list[Exception] = []
    load = BackgroundLoad(
        scheduler, prompts, config, on_event=lambda i, ev, t: seen[i].append((t, ev)), on_error=errors.append
    )
    load.set(n)
    while not all(seen) and not errors:  # every conversation past its first prefill
        time.sleep(0.05)
    start = time.perf_counter()
    time.sleep(args.seconds)
    # A window holds a step of every conversation: on a loaded machine it lasts longer, rather than measure nothing.
    while not all(any(t >= start for t, _ in conv) for conv in seen) and not errors:
        time.sleep(0.05)
    end = time.perf_counter()
    load.set(0)
    while scheduler.active:
        time.sleep(0.05)
    if errors:
        raise RuntimeError(f"a conversation failed: {errors[0]}")
    return [[ev for t, ev in conv if start <= t < end] for conv in seen], end - start


def summarize_mode(n: int, mode: str, windows: list[tuple[list[list[StepEvent]], float]]) -> dict:
    """One (N, mode) over its windows (rounds): tokens over the windows' total time."""
    seconds = sum(w for _, w in windows)
    per_conversation = [sum(len(ev.tokens) for convs, _ in windows for ev in convs[i]) / seconds for i in range(n)]
    events = [ev for convs, _ in windows for conv in convs for ev in conv]
    drafted = sum(ev.drafted for ev in events)
    return {
        "concurrency": n,
        "mode": mode,
        "aggregate_tokens_per_s": sum(per_conversation),
        "per_sequence_tokens_per_s": statistics.median(per_conversation),
        "aggregate_tokens_per_s_by_round": [sum(len(ev.tokens) for c in convs for ev in c) / w for convs, w in windows],
        "window_s": seconds,
        "tokens": sum(len(ev.tokens) for ev in events),
        "mean_batch_size": statistics.mean(ev.batch_size for ev in events) if events else 0.0,
        "mean_k_chosen": statistics.mean(ev.k_chosen for ev in events) if events else 0.0,
        "draft_acceptance_rate": sum(ev.accepted for ev in events) / drafted if drafted else 0.0,
        "drafted": drafted,
        "sequence_steps": len(events),  # one per conversation per target forward it took part in
        "speculative_steps": sum(ev.speculative for ev in events),
        "draft_seconds": sum(ev.draft_seconds for ev in events),
    }


def target_spec(engine: SpeculativeEngine) -> ModelSpec:
    cfg = engine.target.model.config
    params = estimate_bytes(cfg, engine.target.dtype) / engine.target.dtype.itemsize
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    return ModelSpec(engine.target.name, params / 1e9, cfg.num_hidden_layers, cfg.num_key_value_heads, head_dim)


def fitted_hardware(costs: ForwardCosts, model: ModelSpec) -> Hardware:
    """The case study's roofline fitted to measured forward costs: the memory roof is the one-token forward, the
    compute roof the seconds per token between the two largest forwards measured (no overhead term)."""
    hw = Hardware("this machine, fitted", bandwidth_tbs=model.weight_bytes / costs(1, 1) / 1e12, tflops=1.0)
    return dataclasses.replace(hw, tflops=2 * model.params_b * 1e9 / seconds_per_token(costs) / 1e12)


def seconds_per_token(costs: ForwardCosts) -> float:
    """The slope of the largest batch's forward cost between its two largest measured sizes."""
    b, (p0, p1) = costs.batches[-1], costs.per_sequence[-2:]
    return max((costs(b, b * p1) - costs(b, b * p0)) / (b * (p1 - p0)), 1e-9)


def predictions(runs: list[dict], costs: ForwardCosts, model: ModelSpec, concurrencies: list[int]) -> dict:
    """K = 4's speedup per N, predicted from what K = 4 measured with the fewest conversations: tokens per step E,
    draft rows verified per step d (a confidence gate proposes fewer than 4) and drafting seconds per step.

    By the case-study model: on the roofline fitted to the forward costs, with the drafter it would take as an
    ungated one (K = d rounded, α giving the same E) and a draft cost ratio c fixed at every N. By the measured
    costs themselves: E / (N · draft seconds ÷ forward(N, N) + forward(N, N(1 + d)) ÷ forward(N, N)), drafting per
    sequence, so its share grows with N while a memory-bound forward does not."""
    one = next(r for r in runs if r["mode"] == "k4" and r["concurrency"] == concurrencies[0])
    if not one["speculative_steps"]:
        return {"note": "no speculative steps at the lowest concurrency: nothing to predict from"}
    n0 = one["concurrency"]
    tokens_per_step = one["tokens"] / one["sequence_steps"]
    rows = one["drafted"] / one["speculative_steps"]
    draft_step_s = one["draft_seconds"] / one["speculative_steps"]
    k = max(1, round(rows))
    alpha = alpha_from_acceptance_rate((tokens_per_step - 1) / k, k)
    c = draft_step_s / k / costs(n0, n0)
    hw = fitted_hardware(costs, model)
    scenario = Scenario(alpha, k=k, c=c, target=model, hw=hw, context_tokens=0)
    by_model = {n: evaluate(dataclasses.replace(scenario, concurrency=n)).speedup for n in concurrencies}
    by_costs = {
        n: tokens_per_step / ((n * draft_step_s + costs(n, n * (1 + rows))) / costs(n, n)) for n in concurrencies
    }
    return {
        "from_concurrency": n0,
        "tokens_per_step": tokens_per_step,
        "draft_rows_per_step": rows,
        "draft_seconds_per_step": draft_step_s,
        "case_study_inputs": {"alpha": alpha, "k": k, "c": c},
        "fitted_roofline": {"bandwidth_tbs": hw.bandwidth_tbs, "tflops": hw.tflops},
        "ridge_tokens": costs(1, 1) / seconds_per_token(costs),
        "case_study_speedup_k4": by_model,
        "case_study_crossover_concurrency": breakeven_concurrency(scenario),
        "measured_costs_speedup_k4": by_costs,
        "measured_costs_crossover_concurrency": next((n for n in concurrencies if by_costs[n] < 1), None),
    }


def crossover(runs: list[dict]) -> int | None:
    rate = {(r["concurrency"], r["mode"]): r["aggregate_tokens_per_s"] for r in runs}
    return next((n for n, mode in sorted(rate) if mode == "k4" and rate[n, "k4"] < rate[n, "off"]), None)


def plot(result: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, ax_cost) = plt.subplots(1, 2, figsize=(11, 4.2))
    for mode in MODES:
        rows = [r for r in result["runs"] if r["mode"] == mode]
        ax.plot([r["concurrency"] for r in rows], [r["aggregate_tokens_per_s"] for r in rows], "o-", label=mode)
    marks = [("measured crossover", result["crossover_concurrency"], "-")]
    marks.append(("case-study model", result["predicted"].get("case_study_crossover_concurrency"), "--"))
    marks.append(("measured-cost model", result["predicted"].get("measured_costs_crossover_concurrency"), ":"))
    for label, n, style in marks:
        if n is not None:
            ax.axvline(n, color="grey", linestyle=style, label=f"{label}: N = {n}")
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent conversations N")
    ax.set_ylabel("aggregate tokens/s")
    ax.set_title("speculation off, K = 4, load-aware")
    ax.legend(fontsize=8)
    costs = result["forward_costs"]
    for b, seconds in zip(costs["batches"], costs["seconds"]):
        ax_cost.plot([b * p for p in costs["per_sequence"]], [x * 1e3 for x in seconds], "o-", label=f"{b} seq")
    ax_cost.set_xlabel("tokens fed in one target forward")
    ax_cost.set_ylabel("ms")
    ax_cost.set_title("measured forward cost by batch size (the ridge)")
    ax_cost.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(args: argparse.Namespace) -> int:
    concurrencies = _concurrencies(args.concurrency)
    if args.seconds <= 0:
        raise ValueError(f"--seconds must be > 0, got {args.seconds}")
    spec = dataclasses.replace(spec_from_args(args), batched=True, auto_off=False)  # K = 4 must stay 4
    rows = read_prompts(args.prompts)
    engine, target = build_engine(spec)
    prompts = [
        target.tokenizer.chat_ids(
            [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": r["prompt"]}]
        )
        for r in rows
    ]
    print("measuring forward costs …", file=sys.stderr)
    costs = measure_forward_costs(engine)
    for b, row in zip(costs.batches, costs.measured):
        cells = ", ".join(f"{b}×{p}: {s * 1e3:.0f}" for p, s in zip(costs.per_sequence, row))
        print(f"  ms {cells}", file=sys.stderr)
    runs = []
    for n in concurrencies:
        windows: dict[str, list] = {mode: [] for mode in MODES}
        for r in range(args.rounds):  # ABBA…: modes side by side, the order reversed each round, so a drift of the
            for mode in MODES if r % 2 == 0 else reversed(MODES):  # machine's speed hits all three alike
                windows[mode].append(run_window(engine, costs, prompts, n, mode, args))
        for mode in MODES:
            run = summarize_mode(n, mode, windows[mode])
            runs.append(run)
            print(
                f"N={n:<3} {mode:<10} aggregate {run['aggregate_tokens_per_s']:6.2f} tok/s, per sequence "
                f"{run['per_sequence_tokens_per_s']:5.2f}, mean K {run['mean_k_chosen']:.2f}, "
                f"acceptance {run['draft_acceptance_rate']:.2f}",
                file=sys.stderr,
            )
    result = {
        "definitions": {k: DEFINITIONS[k] for k in DEFINED},
        "engine": dataclasses.asdict(spec),
        "options": {
            "max_new_tokens": args.max_new_tokens,
            "seconds": args.seconds,
            "rounds": args.rounds,
            "prompts": args.prompts,
        },
        "threads": torch.get_num_threads(),
        "forward_costs": costs.as_dict(),
        "runs": runs,
        "crossover_concurrency": crossover(runs),
        "predicted": predictions(runs, costs, target_spec(engine), concurrencies),
    }
    Path(args.json).write_text(json.dumps(result, indent=2))
    plot_path = Path(args.plot) if args.plot else Path(args.json).with_suffix(".png")
    plot(result, plot_path)
    print(
        f"crossover (K = 4 below off): {result['crossover_concurrency']}; wrote {args.json} and {plot_path}",
        file=sys.stderr,
    )
    return 0
