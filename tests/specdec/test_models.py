"""Model loading levers: the draft's int8 quantization keeps its outputs close and frees its float weights at once."""

from __future__ import annotations

import copy
import gc
import weakref

import pytest
import torch

from specdec.build import build_engine
from specdec.models import build_tiny_random
from specdec.quant import quantize_linears
from specdec.quant_layers import w8a8_layer
from tests.support.engine import cpu_only


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_int8_draft_keeps_its_top_tokens_in_place(dtype):
    model = build_tiny_random(4321).to(dtype).eval()
    reference = copy.deepcopy(model).float()
    quantized = quantize_linears(model, "w8a8")
    assert quantized is model  # in place: no second copy of the model
    ids = torch.randint(0, model.config.vocab_size, (1, 24), generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        got, want = quantized(ids).logits, reference(ids).logits
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.8  # random ids: many near-ties
    assert not any(type(m) is torch.nn.Linear for m in quantized.modules())
    table = quantized.get_input_embeddings().weight
    assert table.dtype == dtype  # kept as loaded, handing out float32 rows
    assert {p.dtype for p in quantized.parameters() if p is not table} == {torch.float32}


def test_int8_quantization_frees_each_float_linear_without_the_garbage_collector():
    # A replaced Linear left to gc (a reference cycle, or a list holding it) kept 2 GB of float32 weights
    # alive while the 0.5B draft loaded; freed by reference counting, each goes as soon as it is replaced.
    model = build_tiny_random(4321).to(torch.bfloat16)
    linears = [weakref.ref(m) for m in model.modules() if type(m) is torch.nn.Linear]
    assert linears
    was_enabled = gc.isenabled()
    gc.disable()
    try:
        quantize_linears(model, "w8a8")
        assert [r for r in linears if r() is not None] == []
    finally:
        if was_enabled:
            gc.enable()


@cpu_only
def test_int8_draft_in_the_engine_holds_no_float_linear(tiny_engine):
    engine, _ = build_engine(tiny_engine.spec_with(draft_quant="int8"))
    draft = engine.drafter_factory().cache.runner.model
    assert not any(type(m) is torch.nn.Linear for m in draft.modules())
    assert sum(isinstance(m, w8a8_layer()) for m in draft.modules()) > 0
