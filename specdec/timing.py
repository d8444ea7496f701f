"""One clock for everything the engine times: a device-synchronized wall clock, so GPU work queued before a read
is counted where it ran (on the CPU the sync is a no-op)."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def timed(fn: Callable[P, R], *args: P.args, **kwargs: P.kwargs) -> tuple[R, float]:
    """fn's result and the host seconds it took (work the host waits for; nothing queued on a device)."""
    t0 = time.perf_counter()
    result = fn(*args, **kwargs)
    return result, time.perf_counter() - t0


def sync(device: torch.device) -> None:
    """Wait for queued device work, so that a clock read after it times the work."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def clock(device: torch.device) -> float:
    """Seconds (perf_counter) once the device has finished what was queued."""
    sync(device)
    return time.perf_counter()


def median_seconds(run: Callable[[], object], device: torch.device, repeats: int = 5, warmup: int = 1) -> float:
    """Median seconds of run() over `repeats` timed calls, after `warmup` untimed ones (kernel selection)."""
    for _ in range(warmup):
        run()
    times = []
    for _ in range(repeats):
        t0 = clock(device)
        run()
        times.append(clock(device) - t0)
    return statistics.median(times)
