"""Counting the host reads of an engine step: every way Python code reads a tensor's value back."""

from __future__ import annotations

from contextlib import contextmanager

import torch

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
