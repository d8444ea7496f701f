"""A KV cache that knows which tokens it holds, so rollback is 'crop to the common prefix'."""

from __future__ import annotations

import statistics
import time
from typing import TYPE_CHECKING

import torch

from .tokenizer import common_prefix_length

if TYPE_CHECKING:  # transformers loads lazily, at the first forward
    from transformers import DynamicCache, PreTrainedModel


class PrefixCache:
    """min_feed: feed at least this many new tokens per forward, padding with copies of the last one (whose
    cache entries are dropped again). It exists because a one-row bf16 matmul on this CPU is slower than a two-row
    one (see fastest_min_feed). Causal attention keeps the real positions' logits the same only where each row is
    computed on its own: dynamic int8 quantization scales activations per tensor, so a pad row moves the real
    row's logits (by up to 0.2–0.4 for the 0.5B draft). That stays lossless (the q a draft records is the q it
    sampled from), but it would make acceptance depend on how tokens are fed, so int8 drafts use min_feed 1."""

    def __init__(self, model: PreTrainedModel, device: torch.device, min_feed: int = 1) -> None:
        self.model = model
        self.device = device
        self.min_feed = min_feed
        self.tokens: list[int] = []
        self.kv: DynamicCache | None = None
        # keep_hidden: each extend also keeps the last hidden states (the LM head's input) of the positions it fed,
        # hidden[i] at position hidden_start + i, for a drafter that reads them (draft heads)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_start = 0

    def reset(self) -> None:
        self.tokens = []
        self.kv = None

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (after a rejection)."""
        drop = len(self.tokens) - length
        if drop > 0:
            assert self.kv is not None  # tokens are cached only once a forward has made the cache
            self.kv.crop(-drop)
            del self.tokens[length:]

    def common_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the cache already holds, from the start."""
        return common_prefix_length(self.tokens, tokens)

    @torch.inference_mode()
    def extend(self, tokens: list[int], n_logits: int = 1) -> torch.Tensor:
        """Make the cache hold `tokens`; return logits (n, V) for the last n = min(n_logits, fed) positions.

        At least n_logits tokens are fed (re-feeding cached ones if needed), so row i always lines up with
        position len(tokens) - n + i, even when `tokens` is entirely cached already.
        """
        from transformers import DynamicCache

        keep = max(0, min(self.common_prefix(tokens), len(tokens) - n_logits))
        if self.kv is None:
            self.kv = DynamicCache()
        self.rollback(keep)
        new = tokens[keep:]
        pad = max(0, self.min_feed - len(new))
        ids = torch.tensor([new + new[-1:] * pad], device=self.device)
        try:
            if self.keep_hidden:  # the model's own forward, split where the hidden states are
                hidden = self.model.get_decoder()(input_ids=ids, cache=self.kv, use_cache=True).last_hidden_state
                logits = self.model.get_output_embeddings()(hidden[:, -(n_logits + pad) :])[0]
                self.hidden, self.hidden_start = hidden[0, : len(new)], keep
            else:
                out = self.model(input_ids=ids, cache=self.kv, use_cache=True, logits_to_keep=n_logits + pad)
                logits = out.logits[0]
            if pad:
                self.kv.crop(-pad)
        except BaseException:
            self.reset()  # a forward that failed half-way may have grown some layers' caches: start over
            raise
        self.tokens = list(tokens)
        return logits[: len(logits) - pad]


def sync(device: torch.device) -> None:
    """Wait for queued GPU work, so that a clock read after it times the work (a no-op on the CPU)."""
    if device.type == "cuda":
        torch.cuda.synchronize(device)


@torch.inference_mode()
def fastest_min_feed(model: torch.nn.Module, device: torch.device, trials: int = 3) -> int:
    """1 or 2: which of a one-token and a padded two-token decode step is faster for this model here, timed
    alternately on a short cached prefix (bf16 on this 2-core CPU: 243 vs 190 ms for the 1.5B target;
    the int8 draft is fastest at one)."""
    times: dict[int, list[float]] = {1: [], 2: []}
    cache = PrefixCache(model, device)
    prefix = list(range(100, 116))
    cache.extend(prefix)
    for i in range(2 * trials + 2):
        width = 1 + i % 2
        cache.min_feed = width
        sync(device)
        t0 = time.perf_counter()
        cache.extend(prefix + [116])
        sync(device)
        if i >= 2:  # the first of each width warms its kernels
            times[width].append(time.perf_counter() - t0)
        cache.rollback(len(prefix))
    return min(times, key=lambda w: statistics.median(times[w]))
