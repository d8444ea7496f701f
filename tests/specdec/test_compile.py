"""torch.compile of the target's dense layer halves (--compile) changes nothing of what the engine emits."""

from __future__ import annotations

import pytest
import torch

from specdec.build import build_engine
from specdec.engine import GenerationConfig, collect
from tests.support.engine import tiny_prompts

pytestmark = pytest.mark.slow  # inductor compiles C++ for each layer: about a minute on 2 cores


def test_compiled_and_eager_steps_give_identical_tokens(tiny_engine):
    from torch._dynamo.utils import counters

    counters.clear()
    eager, target = build_engine(tiny_engine.spec_with(k="3"))
    compiled, _ = build_engine(tiny_engine.spec_with(k="3", compile=True))
    for engine in (eager, compiled):
        engine.auto_off = False
    for ids in tiny_prompts(target, 3, seed=30):
        for speculate in (False, True):
            config = GenerationConfig(24, speculate=speculate)
            want, _ = collect(eager.stream(ids, config))
            got, _ = collect(compiled.stream(ids, config))
            assert got == want
    assert counters["stats"]["unique_graphs"] > 0  # the compiled path really ran compiled graphs
    cache_eager, cache_compiled = eager.runner.new_cache(), compiled.runner.new_cache()
    ids = tiny_prompts(target, 1, seed=31)[0]
    torch.testing.assert_close(cache_compiled.extend(ids, 4), cache_eager.extend(ids, 4), rtol=1e-4, atol=1e-4)
