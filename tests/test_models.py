"""Model loading levers: the draft's int8 quantization keeps its outputs and frees its float weights at once."""

from __future__ import annotations

import copy
import gc
import warnings
import weakref

import pytest
import torch
from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

from specdec.build import build_engine
from specdec.models import build_tiny_random, quantize_int8


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_quantize_int8_gives_the_logits_of_quantizing_a_float32_copy(dtype):
    model = build_tiny_random(4321).to(dtype).eval()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        reference = quantize_dynamic(
            copy.deepcopy(model).float(), {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8
        )
    quantized = quantize_int8(model)
    assert quantized is model  # in place: no second copy of the model
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        assert torch.equal(quantized(ids).logits, reference(ids).logits)
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    assert {p.dtype for p in quantized.parameters()} == {torch.float32}


def test_quantize_int8_frees_each_float_linear_without_the_garbage_collector():
    # A replaced Linear left to gc (a reference cycle, or a list holding it) kept 2 GB of float32 weights
    # alive while the 0.5B draft loaded; freed by reference counting, each goes as soon as it is replaced.
    model = build_tiny_random(4321).to(torch.bfloat16)
    linears = [weakref.ref(m) for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        quantize_int8(model)
        assert [r for r in linears if r() is not None] == []
    finally:
        if was_enabled:
            gc.enable()


def test_int8_draft_in_the_engine_holds_no_float_linear(tiny_engine):
    engine, _ = build_engine(tiny_engine.spec_with(draft_quant="int8"))
    draft = engine.drafter_factory().model
    assert not any(type(m) is torch.nn.Linear for m in draft.modules())
    assert sum(m.__class__.__module__.startswith("torch.ao.nn.quantized") for m in draft.modules()) > 0
