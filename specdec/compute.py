"""The one thread that runs the engine's tensor work: every forward and every speculative step.

On a CPU, torch's OpenMP runtime gives each thread that runs a parallel region a pool of workers of its own. Once
the pooled threads outnumber the cores, libgomp stops spinning between regions, and every region then waits for a
sleeping worker: on 2 cores the 1.5B target's forward took ~175 ms on one thread while another thread kept its pool,
against ~105 ms on the only one (docs/results.md). So the steps and forwards of every conversation run here, one
after another, and a thread that loaded models lets its workers go (release_workers). On a GPU one thread issuing
the kernels costs nothing either.
"""

from __future__ import annotations

import ctypes
import os
import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TypeVar

import torch
from threadpoolctl import threadpool_limits  # type: ignore[import-untyped]

T = TypeVar("T")

_jobs: queue.SimpleQueue[tuple[Callable[[], object], int, Future]] = queue.SimpleQueue()
_thread: threading.Thread | None = None
_start_lock = threading.Lock()


def run(fn: Callable[[], T]) -> T:
    """fn() on the compute thread (at once when called there), its result or its exception here. It runs on as
    many torch threads as the caller's torch.get_num_threads(). fn must not wait on a thread that calls run: it
    would wait for itself."""
    if threading.current_thread() is _thread:
        return fn()
    return submit(fn).result()


def submit(fn: Callable[[], T]) -> Future[T]:
    """fn() queued for the compute thread, not waited for: its Future."""
    _start()
    done: Future[T] = Future()
    _jobs.put((fn, torch.get_num_threads(), done))
    return done


def serve_pending() -> None:
    """Run the jobs queued so far, here on the compute thread: a long job (the batch scheduler's loop) calls this
    between its steps, so that the others' forwards (a prefill while the user speaks) wait one step, not the loop."""
    assert threading.current_thread() is _thread, "serve_pending runs on the compute thread"
    threads = torch.get_num_threads()
    while True:
        try:
            job = _jobs.get_nowait()
        except queue.Empty:
            break
        _serve_one(*job)
    if torch.get_num_threads() != threads:
        torch.set_num_threads(threads)


def _start() -> None:
    global _thread
    with _start_lock:
        if _thread is None:
            _thread = threading.Thread(target=_serve, name="compute", daemon=True)
            _thread.start()


def _serve() -> None:
    while True:
        _serve_one(*_jobs.get())


def _serve_one(fn: Callable[[], object], threads: int, done: Future) -> None:
    if torch.get_num_threads() != threads:  # torch.set_num_threads holds for the thread that calls it
        torch.set_num_threads(threads)
    try:
        done.set_result(fn())
    except BaseException as e:  # the caller re-raises it; this thread serves the next job
        done.set_exception(e)


def release_workers() -> None:
    """Let the calling thread's OpenMP workers go (omp_pause_resource_all), so that they no longer count against the
    compute thread's; a later parallel region on this thread starts them again. Call it where a thread is done
    loading models. A no-op where torch's OpenMP runtime is not found."""
    pause = _omp("omp_pause_resource_all")
    if pause is not None:
        pause(1)  # omp_pause_soft


def single_threaded() -> bool:
    """Run the calling thread's torch work on itself alone, with no pool of OpenMP workers: for small models beside
    the compute thread (Smart Turn). The runtime's own omp_set_num_threads(1) sets this thread's count only;
    torch.set_num_threads would also change the count every thread started later takes. False where torch's
    OpenMP runtime is not found (the caller must then run its work on the compute thread)."""
    torch.get_num_threads()  # torch's first call on a thread sets the thread's count: before ours, not after
    set_threads = _omp("omp_set_num_threads")
    if set_threads is None:
        return False
    set_threads(1)
    return torch.get_num_threads() == 1


def numpy_blas_on_one_thread() -> None:
    """numpy's and scipy's BLAS (OpenBLAS), process-wide, on the calling thread alone. After each call OpenBLAS's
    helper thread spins on a core for up to ~0.1 s waiting for the next one: a log-mel's filter matmul (Smart Turn,
    every ASR pass) took a core from the compute thread's pool and from Smart Turn that long (docs/results.md).
    Their matrices are small; torch's BLAS (MKL, inside libtorch) is not this library and keeps its threads."""
    threadpool_limits(limits=1, user_api="blas")


def _omp(name: str) -> Callable[..., int] | None:
    libs = sorted((Path(torch.__file__).parent / "lib").glob("lib*omp*.so*"))
    for lib in libs:  # the runtime torch loaded: libgomp on Linux x86 wheels, libomp elsewhere
        try:
            handle = ctypes.CDLL(os.fspath(lib), mode=os.RTLD_NOLOAD if hasattr(os, "RTLD_NOLOAD") else 0)
            return getattr(handle, name)
        except (OSError, AttributeError):
            continue
    return None
