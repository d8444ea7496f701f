"""One short integration run on the real offline Qwen pair (1.5B target, 0.5B draft)."""

import pytest
import torch

from specdec.build import EngineSpec, build_engine
from specdec.engine import GenerationConfig, collect
from specdec.metrics import SpecStats


@pytest.mark.models
@pytest.mark.parametrize("target_quant", ["none", "w8a8"])
def test_qwen_pair_float32_greedy_is_identical_to_target_only(real_models, target_quant):
    engine, target = build_engine(
        EngineSpec(target="qwen-1.5b", draft="qwen-0.5b", k="4", dtype="float32", target_quant=target_quant)
    )
    engine.auto_off = False  # this checks losslessness, not speed
    ids = target.tokenizer.chat_ids([{"role": "user", "content": "List the days of the week."}])
    baseline, _ = collect(engine.stream(ids, GenerationConfig(20, speculate=False)))
    stats = SpecStats()
    spec, _ = collect(engine.stream(ids, GenerationConfig(20), stats=stats))
    assert spec == baseline
    assert "Monday" in target.tokenizer.decode(spec)
    assert stats.proposed > 0 and stats.accepted > 0
    assert target.model.dtype == torch.float32
