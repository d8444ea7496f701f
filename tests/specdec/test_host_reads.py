"""A speculative step reads the device once: acceptance runs on the device, gate decisions and draft tokens stay
tensors, and the step's results come back in one read (what keeps a GPU busy between steps, as in gpt-fast)."""

from __future__ import annotations

import pytest
import torch

from specdec.build import build_engine
from specdec.cost_grid import ForwardCosts
from specdec.engine import GenerationConfig
from specdec.sampling import SamplingParams
from specdec.scheduler import BatchScheduler, LoadEstimate, _Running
from tests.support.engine import heads_engine, tiny_prompts
from tests.support.host_reads import counting_host_reads, reads_per_step


def test_the_counter_sees_a_read():
    with counting_host_reads() as counter:
        torch.ones(3).sum().item()
        int(torch.tensor(2))
    assert counter["reads"] == 2


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_draft_model_step_reads_the_device_at_most_twice(tiny_engine, params):
    engine, target = build_engine(tiny_engine.spec_with(k="4", draft_min_prob=0.3))
    engine.auto_off = False
    drafter = engine.drafter_factory
    engine.drafter_factory = lambda: gated_where(drafter(), on_host=False)  # on the device, as on a GPU
    assert max(reads_per_step(engine, tiny_prompts(target, 1)[0], params)) <= 2


def gated_where(drafter, on_host: bool):
    drafter.gate_on_host = on_host
    return drafter


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_gate_on_the_host_reads_one_confidence_a_draft(tiny_engine, params):
    """The CPU's path (a read costs nothing there): each draft's confidence is read, at most K more reads."""
    engine, target = build_engine(tiny_engine.spec_with(k="4", draft_min_prob=0.3))
    engine.auto_off = False
    drafter = engine.drafter_factory
    assert drafter().gate_on_host == (target.device.type == "cpu")  # the default: on the host only on a CPU
    engine.drafter_factory = lambda: gated_where(drafter(), on_host=True)  # a GPU may take this path too
    assert max(reads_per_step(engine, tiny_prompts(target, 1)[0], params)) <= 2 + 4


@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_heads_step_reads_the_device_at_most_twice(tiny_engine, tiny_heads, params):
    engine = heads_engine(tiny_engine, tiny_heads, k=4)
    assert max(reads_per_step(engine, tiny_prompts(engine.target, 1)[0], params)) <= 2


@pytest.mark.parametrize("tiny_heads", ["medusa", "eagle"], indirect=True)
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_tree_step_reads_the_device_at_most_twice(tiny_engine, tiny_heads, params):
    """Built, fed (fused attention: its mask on the device), verified and its path moved into place: one read."""
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3)
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


@pytest.mark.parametrize("tiny_heads", ["medusa"], indirect=True)
def test_a_tree_cut_by_its_confidence_reads_the_device_once_more(tiny_engine, tiny_heads):
    """The load-aware scheduler reads the batch's confidences once, between drafting and verifying."""
    engine = heads_engine(tiny_engine, tiny_heads, k=4, tree=3)
    answers = [engine.new_answer(p, GenerationConfig(64, seed=1)) for p in tiny_prompts(engine.target, 2)]
    engine.step(answers)  # the prefills
    scheduler = BatchScheduler(engine, ForwardCosts([1], [1, 16], [[1.0, 1.0]]))
    runs = [_Running(a, LoadEstimate.geometric(0.5)) for a in answers]
    counts = []
    for _ in range(6):
        with counting_host_reads() as counter:
            events = engine.step(answers, cut=lambda proposals: scheduler._verified_ks(runs, proposals, []))
        assert all(ev.speculative for ev in events) and all(r.confidence for r in runs)  # the cut read them
        counts.append(counter["reads"])
    assert max(counts) <= 2  # the step's one read (greedy) and the confidences' one, not one an answer
