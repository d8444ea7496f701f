"""CPU time the other threads of this process burn during, and for 0.5 s after, one 8 s log-mel (Smart Turn's
features; every ASR pass computes the same filter matmul). Run it as is, then with OPENBLAS_NUM_THREADS=1: numpy's
OpenBLAS helper thread spinning after each call shows as the difference (docs/results.md, thirty-fourth session)."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import numpy as np

from pipeline.smart_turn import LogMel


def others_cpu_ms() -> dict[int, float]:
    """CPU time so far of every thread of this process but the calling one (schedstat, ns)."""
    me = threading.get_native_id()
    return {
        int(task.name): int((task / "schedstat").read_text().split()[0]) / 1e6
        for task in Path("/proc/self/task").iterdir()
        if int(task.name) != me
    }


def grown(before: dict[int, float], after: dict[int, float]) -> dict[int, float]:
    return {tid: round(ms - before.get(tid, 0.0), 1) for tid, ms in after.items() if ms - before.get(tid, 0.0) > 0.5}


def main() -> None:
    log_mel = LogMel()
    audio = np.random.default_rng(0).standard_normal(16000 * 8).astype(np.float32) * 0.1
    log_mel(audio)
    time.sleep(1)
    for _ in range(5):
        start_cpu = others_cpu_ms()
        t0 = time.perf_counter()
        log_mel(audio)
        call_ms = (time.perf_counter() - t0) * 1000
        end_cpu = others_cpu_ms()
        time.sleep(0.5)
        print(
            f"log-mel {call_ms:.1f} ms; other threads' CPU ms during it {grown(start_cpu, end_cpu)}, "
            f"in the 0.5 s after {grown(end_cpu, others_cpu_ms())}"
        )


if __name__ == "__main__":
    main()
