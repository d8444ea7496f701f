"""What only a GPU runs, run where one is (the `gpu` marker skips these elsewhere): the device-synchronized clock,
the tiny engine built on cuda with both drafters (no padded one-token steps, memory from the GPU's own counter, the
cost grid keyed by the GPU's name), a step's host reads there, and the memory check against the GPU's free memory.
The rest of the suite reaches the GPU through SPECVOICE_TEST_DEVICE=cuda (tests/conftest.py)."""

from __future__ import annotations

import pytest
import torch

from specdec.build import build_engines
from specdec.cost_grid import grid_key
from specdec.models import ModelLoadError, check_memory
from specdec.sampling import SamplingParams
from specdec.timing import clock, median_seconds
from tests.support.engine import tiny_prompts, untrained_heads
from tests.support.host_reads import reads_per_step

pytestmark = pytest.mark.gpu

CUDA = torch.device("cuda")


def test_the_clock_waits_for_queued_gpu_work():
    x = torch.randn(8192, 8192, device=CUDA)
    for _ in range(10):  # 1.1 TFLOP each, queued in microseconds: the host runs ahead of the GPU
        x = torch.tanh(x @ x)
    assert not torch.cuda.current_stream(CUDA).query()
    clock(CUDA)
    assert torch.cuda.current_stream(CUDA).query()  # nothing left queued once the clock has read
    # Above a millisecond at any speed a GPU has; an unsynchronized clock would time the launch alone (microseconds).
    assert median_seconds(lambda: x @ x, CUDA, repeats=3) > 1e-3


@pytest.fixture(scope="module")
def gpu_engines(tiny_engine, tmp_path_factory):
    heads = untrained_heads(tiny_engine.target, tmp_path_factory.mktemp("heads") / "medusa.safetensors")
    spec = tiny_engine.spec_with(device="cuda", k="4", heads=str(heads))
    engines, target, added = build_engines(spec, [spec.draft, "heads"])
    for engine in engines.values():
        engine.auto_off = False  # every step drafts
    return engines, target, added


def test_the_tiny_engine_builds_on_the_gpu(gpu_engines):
    engines, target, added = gpu_engines
    assert target.device.type == "cuda" and target.model.device.type == "cuda"
    for engine in engines.values():
        assert engine.runner.min_feed == 1  # a GPU never pads a one-token step: no timing at load
        assert grid_key(engine)["machine"] == torch.cuda.get_device_name(target.device)
    assert all(n > 0 for n in added.values())  # the GPU's allocated bytes grew with each drafter


@pytest.mark.parametrize("drafter", ["draft-model", "heads"])
@pytest.mark.parametrize("params", [SamplingParams(), SamplingParams(temperature=0.8)], ids=["greedy", "sampled"])
def test_a_gpu_step_reads_the_device_at_most_twice(gpu_engines, drafter, params):
    engines, target, _ = gpu_engines
    (engine,) = [e for e in engines.values() if e.drafter_kind == drafter]
    assert max(reads_per_step(engine, tiny_prompts(target, 1)[0], params)) <= 2


def test_the_memory_check_reads_the_gpu():
    with pytest.raises(ModelLoadError, match="not enough memory.*free on cuda"):
        check_memory([("huge", 1 << 50)], CUDA)
