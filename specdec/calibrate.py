"""Forward costs as `specvoice calibrate` (app/calibrate.py) measures them."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from .kv import PrefixCache, sync

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@torch.inference_mode()
def measured_forward_seconds(
    model: PreTrainedModel, device: torch.device, n_tokens: int, context: int = 64, repeats: int = 5, min_feed: int = 1
) -> float:
    """Median seconds of one forward that feeds n_tokens on top of a cached context, as the engine feeds it."""
    cache = PrefixCache(model, device, min_feed)
    vocab = model.config.vocab_size
    ids = [(1000 + i) % vocab for i in range(context)]  # any ids do: cost does not depend on them
    cache.extend(ids)
    times = []
    for r in range(repeats + 1):
        sync(device)
        t0 = time.perf_counter()
        cache.extend(ids + [(2000 + r + i) % vocab for i in range(n_tokens)], n_logits=n_tokens)
        sync(device)
        times.append(time.perf_counter() - t0)
        cache.rollback(context)
    return statistics.median(times[1:])  # the first run pays one-off kernel selection
