"""Serving what the engine options name with vLLM: the `vllm serve` line (vllm_serve_command) that
`specvoice vllm-serve [engine options]` prints, for a server that --llm-url can then use as the LLM stage.
"""

from __future__ import annotations

import json

from specdec.build import EngineSpec, fixed_k
from specdec.drafters import NGramDrafter
from specdec.models import PRESETS


def vllm_serve_command(spec: EngineSpec, port: int = 8000, max_num_seqs: int = 256) -> list[str]:
    """`vllm serve` for the target and drafter that `spec` names, with this engine's options in vLLM's terms.

    vLLM fixes speculation at launch in one JSON --speculative-config: the method, the draft `model` and K as
    `num_speculative_tokens` (fixed there, so an adaptive K becomes its most, --k-max).
    --speculative-disable-by-batch-size N is vLLM's old flag. Moved into that JSON as `disable_by_batch_size`, it was
    read only by the V0 engine, so by nothing since v0.10.0, and vLLM has dropped it (vllm-project/vllm#35060).
    Current vLLM says the same with a batch-size schedule of K, `num_speculative_tokens_per_batch_size`: K for 1 to
    N sequences, 0 from N + 1 to --max-num-seqs.
    The CPU weight formats and the draft confidence gate have no vLLM counterpart and are left out.
    """
    if spec.draft == "heads":
        raise ValueError(
            "--draft heads: vLLM cannot load specvoice's draft heads (its EAGLE method needs an EAGLE checkpoint); "
            "use a draft model from the target's family (e.g. --draft qwen-0.5b) or --draft ngram"
        )
    command = ["vllm", "serve", _vllm_model(spec.target, "--target"), "--port", str(port), "--dtype", spec.dtype]
    if spec.draft == "none":
        return command
    k = fixed_k(spec.k) or spec.k_max
    config: dict[str, object]
    if spec.draft == "ngram":
        ngram = NGramDrafter()  # the n-gram sizes our drafter looks up
        config = {"method": "ngram", "prompt_lookup_max": ngram.max_ngram, "prompt_lookup_min": ngram.min_ngram}
    else:
        config = {"method": "draft_model", "model": _vllm_model(spec.draft, "--draft")}
    config["num_speculative_tokens"] = k
    limit = spec.disable_by_batch_size
    if limit is not None and limit < max_num_seqs:  # else vLLM never batches enough sequences for it to bite
        config["num_speculative_tokens_per_batch_size"] = [[1, limit, k], [limit + 1, max_num_seqs, 0]]
        command += ["--max-num-seqs", str(max_num_seqs)]
    return command + ["--speculative-config", json.dumps(config)]


def _vllm_model(name: str, option: str) -> str:
    """What vLLM loads for a preset (its hub id), a hub id or a local directory (as given)."""
    preset = PRESETS.get(name)
    if preset is None:
        return name
    if preset.hub_id is None:
        raise ValueError(f"{option} {name}: a preset without a hub model, so nothing vLLM can load")
    return preset.hub_id
