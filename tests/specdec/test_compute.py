"""The compute thread: every forward and speculative step of every caller runs on one thread, and a thread done
loading lets its OpenMP workers go (specdec/compute.py)."""

from __future__ import annotations

import sys
import threading
from pathlib import Path

import pytest
import torch

from commands.bench_server import wait_until
from specdec import compute
from specdec.engine import GenerationConfig, collect
from specdec.runner import BatchRunner
from specdec.scheduler import BatchScheduler
from specdec.session import EngineSession
from tests.support.engine import cpu_only, draft_factory, heads_engine, make_engine, tiny_prompts


def test_run_returns_and_raises_on_the_compute_thread_and_runs_inline_there():
    def where() -> str:
        return threading.current_thread().name

    assert compute.run(where) == "compute"
    assert compute.run(lambda: compute.run(where)) == "compute"  # a job that asks again runs at once, no deadlock
    names: list[str] = []
    callers = [threading.Thread(target=lambda: names.append(compute.run(where))) for _ in range(3)]
    for t in callers:
        t.start()
    for t in callers:
        t.join(10)
    assert names == ["compute"] * 3

    def fail() -> None:
        raise ValueError("bad prompt")

    with pytest.raises(ValueError, match="bad prompt"):
        compute.run(fail)
    assert compute.run(where) == "compute"  # the thread serves on after a failure


def test_a_job_runs_on_as_many_torch_threads_as_its_caller_asked_for():
    before = torch.get_num_threads()
    try:
        for threads in (1, 2, 1):
            torch.set_num_threads(threads)
            assert compute.run(torch.get_num_threads) == threads
    finally:
        torch.set_num_threads(before)


@pytest.fixture
def forward_threads(monkeypatch) -> list[str]:
    """The thread of every target and draft forward from now on."""
    seen: list[str] = []
    forward = BatchRunner._forward

    def recorded(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return forward(self, *args, **kwargs)

    monkeypatch.setattr(BatchRunner, "_forward", recorded)
    return seen


def test_every_forward_of_every_caller_runs_on_the_compute_thread(tiny_engine, forward_threads):
    target, draft = tiny_engine.models
    prompts = tiny_prompts(target, 2, seed=3)
    engine = make_engine(target, draft_factory(draft), "3")
    session = EngineSession(engine)
    session.prefill(prompts[0][:5])  # a conversation's shared prefix, from this (the main) thread
    collect(engine.stream(prompts[0], GenerationConfig(8), session=session))  # steps without a scheduler
    collect(BatchScheduler(engine).stream(prompts[1], GenerationConfig(8)))  # and on the scheduler's thread
    assert len(forward_threads) > 10 and set(forward_threads) == {"compute"}


def test_draft_heads_learn_a_prefill_on_the_compute_thread(tiny_engine, tiny_heads, monkeypatch):
    engine = heads_engine(tiny_engine, tiny_heads)
    session = EngineSession(engine)
    drafter = session.drafter
    assert drafter is not None
    seen: list[str] = []
    observe = type(drafter).observe

    def recorded(self, *args, **kwargs):
        seen.append(threading.current_thread().name)
        return observe(self, *args, **kwargs)

    monkeypatch.setattr(type(drafter), "observe", recorded)
    session.prefill(tiny_prompts(tiny_engine.cpu_target, 1, seed=4)[0])
    assert seen == ["compute"]


def _threads() -> int:
    return len(list(Path("/proc/self/task").iterdir()))


@cpu_only
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="counts the process's threads in /proc")
@pytest.mark.skipif(not torch.backends.openmp.is_available(), reason="torch without OpenMP")
def test_release_workers_lets_a_threads_openmp_workers_go():
    threads = torch.get_num_threads()
    if threads < 2:
        pytest.skip("one torch thread: no OpenMP workers to let go")
    counts: dict[str, int] = {}

    def load_then_release() -> None:
        torch.set_num_threads(threads)
        counts["before"] = _threads()
        torch.ones(4_000_000).mul_(2)  # a parallel region: this thread's pool of workers starts
        counts["pooled"] = _threads()
        compute.release_workers()
        counts["released"] = wait_until(lambda: _threads() <= counts["before"], 5)  # the workers exited

    loader = threading.Thread(target=load_then_release)
    loader.start()
    loader.join(30)
    assert counts["pooled"] > counts["before"]  # the test can fail: there were workers to let go
    assert counts["released"]
