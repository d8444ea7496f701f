"""A speculative step reads the device once: acceptance runs on the device, gate decisions and draft tokens stay
tensors, and the step's results come back in one read (what keeps a GPU busy between steps, as in gpt-fast)."""

from __future__ import annotations

from contextlib import contextmanager

import pytest
import torch
from conftest import heads_engine, tiny_prompts

from specdec.build import build_engine
from specdec.engine import GenerationConfig
from specdec.sampling import SamplingParams

# Every way Python code reads a tensor's value back to the host.
READS = ("item", "tolist", "cpu", "numpy", "__int__", "__float__", "__bool__", "__index__")


@contextmanager
def counting_host_reads():
    counter = {"reads": 0}
    originals = {name: getattr(torch.Tensor, name) for name in READS}

    def counted(fn):
        def read(self, *args, **kwargs):
            counter["reads"] += 1
            return fn(self, *args, **kwargs)

        return read

    for name, fn in originals.items():
        setattr(torch.Tensor, name, counted(fn))
    try:
        yield counter
    finally:
        for name, fn in originals.items():
            setattr(torch.Tensor, name, fn)


def reads_per_step(engine, prompt, params: SamplingParams, steps: int = 6) -> list[int]:
    answer = engine.new_answer(prompt, GenerationConfig(64, params, seed=1))
    engine.step([answer])  # the prefill
    counts = []
    for _ in range(steps):
        with counting_host_reads() as counter:
            (event,) = engine.step([answer])
        assert event.speculative and event.k_chosen == 4  # a full speculative step was counted
        counts.append(counter["reads"])
    return counts


def test_the_counter_sees_a_read():
    with counting_host_reads() as counter:
        torch.ones(3).sum().item()
        int(torch.tensor(2))
    assert counter["reads"] == 2


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_draft_model_step_reads_the_device_at_most_twice(tiny_engine, params):
    engine, target = build_engine(tiny_engine.spec_with(k="4", draft_min_prob=0.3))  # gated, on the device
    engine.auto_off = False
    assert max(reads_per_step(engine, tiny_prompts(target, 1)[0], params)) <= 2


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_heads_step_reads_the_device_at_most_twice(tiny_engine, tiny_heads, params):
    engine = heads_engine(tiny_engine, tiny_heads, k=4)
    assert max(reads_per_step(engine, tiny_prompts(engine.target, 1)[0], params)) <= 2


def test_a_batched_step_reads_the_device_at_most_twice(tiny_engine):
    engine, target = build_engine(tiny_engine.spec_with(k="4"))
    engine.auto_off = False
    answers = [engine.new_answer(p, GenerationConfig(64)) for p in tiny_prompts(target, 3, seed=4)]
    engine.step(answers)  # the prefills
    with counting_host_reads() as counter:
        events = engine.step(answers)
    assert len(events) == 3 and all(ev.k_chosen == 4 for ev in events)
    assert counter["reads"] <= 2
