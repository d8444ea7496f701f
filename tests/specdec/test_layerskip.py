"""Self-speculation's measurement (specdec/layerskip.py, `specvoice bench-layerskip`) on the tiny target."""

from __future__ import annotations

import json

import torch

from commands import cli
from specdec.heads_data import load_shards
from specdec.layerskip import agreement, skipping
from specdec.runner import BatchRunner


def test_skipping_leaves_the_model_as_it_was(tiny_engine):
    model, device = tiny_engine.target.model, tiny_engine.target.device
    ids = [5, 6, 7, 8, 9]
    before = model(torch.tensor([ids], device=device)).logits
    with skipping(model, {0}):
        assert len(model.get_decoder().layers) == 1
        cache = BatchRunner(model, device).new_cache()  # a cached forward on the shortened stack
        cache.extend(ids[:3])
        skipped = cache.extend(ids, n_logits=2)
        assert not torch.allclose(skipped, before[0, -2:])
    assert len(model.get_decoder().layers) == 2
    assert [layer.self_attn.layer_idx for layer in model.get_decoder().layers] == [0, 1]
    assert torch.equal(model(torch.tensor([ids], device=device)).logits, before)


def test_agreement_is_whole_without_skips_and_lower_with_them(tiny_engine, tiny_data):
    seqs = load_shards(tiny_data)[:8]
    model = tiny_engine.cpu_target.model  # bench-layerskip runs on the CPU
    assert agreement(model, seqs, set()) > 0.95  # its own greedy answers (batched then, one at a time now)
    assert agreement(model, seqs, {1}) < 0.5


def test_bench_layerskip_reports_alpha_c_and_the_expected_speedup(tiny_data, tmp_path):
    out = tmp_path / "skip.json"
    argv = ["bench-layerskip", "--target", "tiny-random-target", "--target-quant", "none", "--dtype", "float32"]
    argv += ["--work", str(tiny_data), "--limit", "8", "--skip-counts", "1", "--k-values", "1,2", "--json", str(out)]
    assert cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert [r["layer"] for r in data["layer_ranking"]] and len(data["runs"]) == 1
    run = data["runs"][0]
    assert len(run["skipped"]) == 1 and 0 < run["draft_cost_ratio"] < 1.5
    assert set(run["expected_speedup"]) == {"1", "2"}
