"""A KV cache that knows which tokens it holds, so rollback is 'crop to the common prefix'."""

from __future__ import annotations

import torch


class PrefixCache:
    def __init__(self, model: torch.nn.Module, device: torch.device) -> None:
        self.model = model
        self.device = device
        self.tokens: list[int] = []
        self.kv = None

    def reset(self) -> None:
        self.tokens = []
        self.kv = None

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (after a rejection)."""
        drop = len(self.tokens) - length
        if drop > 0:
            self.kv.crop(-drop)
            del self.tokens[length:]

    def common_prefix(self, tokens: list[int]) -> int:
        n = min(len(self.tokens), len(tokens))
        i = 0
        while i < n and self.tokens[i] == tokens[i]:
            i += 1
        return i

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
        ids = torch.tensor([new], device=self.device)
        try:
            out = self.model(input_ids=ids, cache=self.kv, use_cache=True, logits_to_keep=n_logits)
        except BaseException:
            self.reset()  # a forward that failed half-way may have grown some layers' caches: start over
            raise
        self.tokens = list(tokens)
        return out.logits[0]
