"""Forward costs as `specvoice calibrate` (app/calibrate.py) measures them: through the runner the engine uses."""

from __future__ import annotations

import torch

from .runner import BatchRunner
from .timing import median_seconds


@torch.inference_mode()
def measured_forward_seconds(runner: BatchRunner, n_tokens: int, context: int = 64, repeats: int = 5) -> float:
    """Median seconds of one forward that feeds n_tokens on top of a cached context, as the engine feeds them."""
    cache = runner.new_cache()
    vocab = runner.model.config.vocab_size
    ids = [(1000 + i) % vocab for i in range(context)]  # any ids do: cost does not depend on them
    cache.extend(ids)
    new = [(2000 + i) % vocab for i in range(n_tokens)]

    def forward() -> None:
        cache.extend(ids + new, n_logits=n_tokens)
        cache.rollback(context)

    return median_seconds(forward, runner.device, repeats)  # the warm-up pays one-off kernel selection
