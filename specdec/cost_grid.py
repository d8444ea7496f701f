"""The forward-cost grid the load-aware K reads: seconds of one target forward by batch size × tokens per sequence,
measured on this machine, and kept per machine, model, format and torch version so a warm start skips the ~30 s it
takes to measure."""

from __future__ import annotations

import hashlib
import itertools
import json
import os
import platform
import statistics
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from .engine import SpeculativeEngine
from .kv import Feed
from .models import cache_dir
from .quant_layers import kernel_format
from .quant_smooth import CALIBRATION_TEXT
from .runner import BatchRunner, fastest_min_feed
from .timing import median_seconds


def interpolate(x: float, xs: list[int], ys: list[float]) -> float:
    """Piecewise linear through (xs, ys): flat below the first point, extended from the last two beyond the last."""
    if len(xs) == 1 or x <= xs[0]:
        return ys[0]
    for (x0, y0), (x1, y1) in itertools.pairwise(zip(xs, ys)):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    (x0, y0), (x1, y1) = (xs[-2], ys[-2]), (xs[-1], ys[-1])
    return y1 + (y1 - y0) * (x - x1) / (x1 - x0)


@dataclass
class ForwardCosts:
    """Seconds of one target forward over `batch` sequences feeding `rows` tokens in all, measured on this machine
    on a grid of batch sizes × tokens per sequence. Both matter: each sequence adds its own attention and
    bookkeeping, so 8 sequences × 1 token cost more than 1 sequence × 8 (measured here: 210 vs 197 ms for the w8a8
    1.5B, 443 vs 335 at 32 tokens). Linear in between, extended from the last two points beyond."""

    batches: list[int]
    per_sequence: list[int]  # tokens each sequence fed
    seconds: list[list[float]]  # [batch][per_sequence], made non-decreasing in tokens
    measured: list[list[float]] = field(default_factory=list)  # the medians as timed

    def __call__(self, batch: int, rows: float) -> float:
        at_batch = [
            interpolate(rows, [b * p for p in self.per_sequence], seconds)
            for b, seconds in zip(self.batches, self.seconds)
        ]
        return interpolate(batch, self.batches, at_batch)

    def as_dict(self) -> dict:
        return {
            "batches": self.batches,
            "per_sequence": self.per_sequence,
            "seconds": self.seconds,
            "measured_seconds": self.measured,
        }

    @classmethod
    def from_dict(cls, d: dict) -> ForwardCosts:
        return cls(d["batches"], d["per_sequence"], d["seconds"], d["measured_seconds"])


COST_BATCHES = (1, 2, 4, 8, 16)
COST_PER_SEQUENCE = (1, 2, 3, 5)  # a plain step, and steps verifying 1, 2 and 4 drafts
COST_CONTEXT = 128  # tokens already cached per sequence, about a voice turn's prompt and answer so far


@torch.inference_mode()
def measure_forward_costs(
    engine: SpeculativeEngine,
    batches: tuple[int, ...] = COST_BATCHES,
    per_sequence: tuple[int, ...] = COST_PER_SEQUENCE,
    trials: int = 3,
) -> ForwardCosts:
    """Median seconds of a batched forward: b sequences with COST_CONTEXT cached tokens each, each feeding p more."""
    runner = engine.runner
    text = engine.target.tokenizer.encode(CALIBRATION_TEXT)
    length = COST_CONTEXT + max(per_sequence) + max(batches)
    ids = (text * (1 + length // len(text)))[:length]
    caches = [runner.new_cache() for _ in range(max(batches))]
    for i, cache in enumerate(caches):  # each sequence its own text
        cache.extend(ids[i : i + COST_CONTEXT])

    def forward(b: int, p: int) -> None:
        runner.extend([Feed(cache, ids[i : i + COST_CONTEXT + p], p) for i, cache in enumerate(caches[:b])])
        for cache in caches[:b]:
            cache.rollback(COST_CONTEXT)

    times: dict[tuple[int, int], list[float]] = {(b, p): [] for b in batches for p in per_sequence}
    for trial in range(trials + 1):  # shapes interleaved, so a slow spell of the machine hits them alike
        for b, p in times:
            seconds = median_seconds(lambda: forward(b, p), runner.device, repeats=1, warmup=0)  # noqa: B023
            if trial:  # the first round warms every shape (the first forwards after loading run slow)
                times[b, p].append(seconds)
    medians = [[statistics.median(times[b, p]) for p in per_sequence] for b in batches]
    # More tokens never cost less: a median above a larger size's is noise, and would make drafts look free.
    monotone = [[min(row[i:]) for i in range(len(row))] for row in medians]
    return ForwardCosts(list(batches), list(per_sequence), monotone, medians)


def cpu_name() -> str:
    """The processor's model name (Linux), else what the platform says."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def runner_key(runner: BatchRunner, model: str) -> dict:
    """Everything a forward's time depends on: the machine, the model and its format, torch."""
    layer = runner.layers[0]
    device = runner.device
    return {
        "machine": cpu_name() if device.type == "cpu" else torch.cuda.get_device_name(device),
        "cores": os.cpu_count(),
        "threads": torch.get_num_threads(),
        "torch": torch.__version__,
        "device": device.type,
        "model": model,
        "format": f"{kernel_format(layer.mlp.down_proj)}/{runner.dtype}{'/fused' if runner.fused else ''}",
        "exact_rows": runner.exact_rows,
    }


def grid_key(engine: SpeculativeEngine) -> dict:
    """Everything a measured grid depends on: runner_key, the one-token steps' width, the grid's shape."""
    grid = [COST_BATCHES, COST_PER_SEQUENCE, COST_CONTEXT]
    return {**runner_key(engine.runner, engine.target.name), "min_feed": engine.runner.min_feed, "grid": grid}


def _cached(prefix: str, field: str, key: dict, measure: Callable[[], Any]) -> tuple[Any, bool]:
    """What measure() gives for key, from the cache or measured now and stored as {"key": key, field: value} in a
    file named by prefix and key; and whether it came from the cache."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:16]
    path = cache_dir() / "forward-costs" / f"{prefix}{digest}.json"
    if path.exists():
        try:
            return json.loads(path.read_text())[field], True
        except (ValueError, KeyError):  # a torn or foreign file: measure again
            pass
    value = measure()
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial")
    partial.write_text(json.dumps({"key": key, field: value}, indent=1))
    partial.replace(path)
    return value, False


def cached_forward_costs(engine: SpeculativeEngine, trials: int = 3) -> tuple[ForwardCosts, bool]:
    """The grid for this engine from the cache, or measured now and stored; and whether it came from the cache.
    A grid measured once on a machine stands for it, so each shape is the median of `trials`: with one, a slow spell
    during an app's warm-up set five tokens at 1.7× one for good on an AMD EPYC, where alone it is 1.2×, and the
    load-aware K drafted ~1 a step (docs/results.md)."""
    measure = lambda: measure_forward_costs(engine, trials=trials).as_dict()  # noqa: E731
    value, cached = _cached("", "costs", grid_key(engine), measure)
    return ForwardCosts.from_dict(value), cached


def cached_min_feed(runner: BatchRunner, model: str) -> int:
    """fastest_min_feed, timed once per machine, model, format and torch version (it took ~0.8 s of every start;
    on a GPU it times nothing and the cache keeps its 1)."""
    value, _ = _cached("min-feed-", "min_feed", runner_key(runner, model), lambda: fastest_min_feed(runner))
    return int(value)
