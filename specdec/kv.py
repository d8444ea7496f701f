"""The KV cache made for speculation: one sequence's keys and values, preallocated, grown by doubling (never by a
concatenation per step). Positions 0 … len(tokens) − 1 hold `tokens`; rollback moves the length back and leaves
the rest to be overwritten. The single and the batched path use this one cache (BatchRunner fills it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from .tokenizer import common_prefix_length

if TYPE_CHECKING:
    from .runner import BatchRunner

MIN_CAPACITY = 256  # positions a sequence first allocates; doubled as it grows
PENDING = -1  # a cached position whose token is still on the device (a draft fed before the step's one read)


class SequenceCache:
    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.tokens: list[int] = []  # what positions 0 … len − 1 hold (PENDING where not yet read back)
        self.keys: list[torch.Tensor] = []  # per layer [kv_heads, capacity, dim]
        self.values: list[torch.Tensor] = []
        # keep_hidden: each forward also keeps the last hidden states (the LM head's input) of the positions it
        # fed, hidden[i] at position hidden_start + i, for a drafter that reads them (draft heads)
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_start = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1] if self.keys else 0

    def reset(self) -> None:
        self.tokens = []

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions (after a rejection)."""
        del self.tokens[length:]

    def settle(self, tokens: list[int]) -> None:
        """The first len(tokens) positions hold `tokens` (drafts fed as PENDING, now read back); the rest goes."""
        self.rollback(len(tokens))
        self.tokens[:] = tokens

    def common_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the cache already holds, from the start."""
        return common_prefix_length(self.tokens, tokens)

    def extend(self, tokens: list[int], n_logits: int = 1, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Make the cache hold tokens (+ drafts, a device tensor); logits (n, V) of the last n_logits positions."""
        from .runner import Feed

        return self.runner.extend([Feed(self, tokens, n_logits, drafts)])[0]

    def reserve(self, length: int) -> None:
        if length <= self.capacity:
            return
        capacity = max(MIN_CAPACITY, self.capacity)
        while capacity < length:
            capacity *= 2
        r = self.runner
        old = self.capacity
        for store in (self.keys, self.values):
            for layer in range(r.n_layers):
                grown = torch.zeros((r.kv_heads, capacity, r.head_dim), dtype=r.dtype, device=r.device)
                if old:
                    grown[:, :old] = store[layer]
                    store[layer] = grown
                else:
                    store.append(grown)
