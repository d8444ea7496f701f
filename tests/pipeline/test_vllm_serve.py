"""The `vllm serve` line for specvoice's engine options (`specvoice vllm-serve`)."""

from __future__ import annotations

import json
import shlex

import pytest

from pipeline.vllm_serve import vllm_serve_command
from specdec.build import EngineSpec
from tests.support.cli import specvoice


def served_config(command: list[str]) -> dict:
    return json.loads(command[command.index("--speculative-config") + 1])


def test_vllm_command_for_a_draft_model_with_a_batch_size_limit() -> None:
    spec = EngineSpec(target="qwen-1.5b", draft="qwen-0.5b", k="4", disable_by_batch_size=8)
    command = vllm_serve_command(spec, port=8001, max_num_seqs=64)
    assert command[:3] == ["vllm", "serve", "Qwen/Qwen2.5-Coder-1.5B-Instruct"]
    assert command[command.index("--port") + 1] == "8001" and command[command.index("--dtype") + 1] == spec.dtype
    assert command[command.index("--max-num-seqs") + 1] == "64"
    assert not [a for a in command if "disable" in a]  # vLLM's old flag and key are gone
    assert served_config(command) == {
        "method": "draft_model",
        "model": "Qwen/Qwen2.5-Coder-0.5B-Instruct",
        "num_speculative_tokens": 4,
        # K up to 8 sequences, none from 9 on: what --speculative-disable-by-batch-size 8 means
        "num_speculative_tokens_per_batch_size": [[1, 8, 4], [9, 64, 0]],
    }


def test_vllm_command_for_adaptive_k_ngram_and_no_draft() -> None:
    adaptive = vllm_serve_command(EngineSpec(draft="qwen-0.5b", k="adaptive", k_max=6))
    assert served_config(adaptive)["num_speculative_tokens"] == 6  # vLLM's K is fixed: the most ours drafts
    assert "--max-num-seqs" not in adaptive and "num_speculative_tokens_per_batch_size" not in served_config(adaptive)
    ngram = served_config(vllm_serve_command(EngineSpec(draft="ngram", k="3")))
    assert ngram == {"method": "ngram", "prompt_lookup_max": 4, "prompt_lookup_min": 1, "num_speculative_tokens": 3}
    plain = vllm_serve_command(EngineSpec(draft="none", disable_by_batch_size=2))
    assert "--speculative-config" not in plain and "--max-num-seqs" not in plain
    never = vllm_serve_command(EngineSpec(draft="qwen-0.5b", disable_by_batch_size=300), max_num_seqs=256)
    assert "num_speculative_tokens_per_batch_size" not in served_config(never)  # above vLLM's batch: never bites
    local = vllm_serve_command(EngineSpec(target="/models/target", draft="org/draft"))
    assert local[2] == "/models/target" and served_config(local)["model"] == "org/draft"


@pytest.mark.parametrize(
    ("spec", "message"),
    [
        (EngineSpec(draft="heads"), "vLLM cannot load specvoice's draft heads"),
        (EngineSpec(target="tiny-random-target", draft="none"), "tiny-random-target: a preset without a hub model"),
    ],
)
def test_vllm_command_refuses_what_vllm_cannot_load(spec: EngineSpec, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        vllm_serve_command(spec)


def test_vllm_command_from_the_engine_options() -> None:
    out = specvoice("vllm-serve", "--draft", "qwen-0.5b", "--k", "4", "--speculative-disable-by-batch-size", "8").stdout
    spec = EngineSpec(draft="qwen-0.5b", k="4", disable_by_batch_size=8)
    assert shlex.split(out) == vllm_serve_command(spec)
    refused = specvoice("vllm-serve", check=False)  # the default drafter, heads
    assert refused.returncode == 2 and "--draft heads" in refused.stderr
