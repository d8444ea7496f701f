"""The KV cache made for speculation: one sequence's keys and values, preallocated, grown by doubling (never by a
concatenation per step). Positions 0 … len(tokens) − 1 hold `tokens`; rollback moves the length back and leaves
the rest to be overwritten. The single and the batched path use this one cache (BatchRunner fills it)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .tokenizer import common_prefix_length
from .tree import DraftTree

MIN_CAPACITY = 256  # positions a sequence first allocates; doubled as it grows
PENDING = -1  # a cached position whose token is still on the device (a draft fed before the step's one read)


def grown(t: torch.Tensor, dim: int, needed: int) -> torch.Tensor:
    """t itself if it has room for `needed` along dim, else a zero-filled copy with the room doubled until it does
    (MIN_CAPACITY at least): growing a few positions a step then costs amortized O(1), never a copy per step."""
    size = t.shape[dim]
    if needed <= size:
        return t
    capacity = max(MIN_CAPACITY, size)
    while capacity < needed:
        capacity *= 2
    out = t.new_zeros(t.shape[:dim] + (capacity,) + t.shape[dim + 1 :])
    out.narrow(dim, 0, size).copy_(t)
    return out


@dataclass
class Feed:
    """What one sequence asks of a forward: make its cache hold `tokens` followed by `drafts` (a device tensor, fed
    as PENDING positions), and return the logits of the last n_logits positions (at least that many are fed, re-
    feeding cached ones if needed, so row i always lines up with position len − n_logits + i).
    tree: the drafts are a draft tree's nodes (specdec/tree.py): each at its depth's position, seeing only its path."""

    cache: SequenceCache
    tokens: list[int]
    n_logits: int = 1
    drafts: torch.Tensor | None = None
    tree: DraftTree | None = None

    @property
    def length(self) -> int:
        return len(self.tokens) + (0 if self.drafts is None else len(self.drafts))


class Runner(Protocol):
    """What a cache asks of the forward that fills it (runner.BatchRunner): its shapes, and one forward."""

    kv_heads: int
    head_dim: int
    n_layers: int
    dtype: torch.dtype
    device: torch.device

    def extend(self, feeds: list[Feed]) -> list[torch.Tensor]: ...


class SequenceCache:
    def __init__(self, runner: Runner) -> None:
        self.runner = runner
        self.tokens: list[int] = []  # what positions 0 … len − 1 hold (PENDING where not yet read back)
        empty = (runner.kv_heads, 0, runner.head_dim)  # per layer [kv_heads, capacity, dim], allocated by reserve
        self.keys = [torch.zeros(empty, dtype=runner.dtype, device=runner.device) for _ in range(runner.n_layers)]
        self.values = [torch.zeros_like(k) for k in self.keys]
        # keep_hidden: each forward also keeps the last hidden states (the LM head's input) of the positions it
        # fed, hidden[i] at position hidden_start + i, for a drafter that reads them (draft heads); with
        # keep_layers, those of these hidden_states indices instead (i: after i decoder layers), concatenated
        self.keep_hidden = False
        self.keep_layers: tuple[int, ...] = ()
        self.hidden: torch.Tensor | None = None
        self.hidden_start = 0

    @property
    def capacity(self) -> int:
        return self.keys[0].shape[1]

    def reset(self) -> None:
        self.tokens = []

    def rollback(self, length: int) -> None:
        """Keep only the first `length` positions (after a rejection)."""
        del self.tokens[length:]

    @torch.inference_mode()
    def keep_path(self, start: int, path: list[int]) -> None:
        """A tree was fed at positions start …: node path[d] (the accepted node at depth d + 1) moves to start + d,
        its keys and values, and its hidden state where kept, so the cache reads as if the path alone was fed."""
        if not path or path == list(range(len(path))):
            return
        index = torch.tensor(path, device=self.keys[0].device) + start
        for kv in (*self.keys, *self.values):
            kv[:, start : start + len(path)] = kv.index_select(1, index)
        if self.hidden is not None and start >= self.hidden_start:
            at = start - self.hidden_start
            self.hidden[at : at + len(path)] = self.hidden.index_select(0, index - self.hidden_start)

    @torch.inference_mode()
    def copy_prefix(self, other: SequenceCache, length: int) -> None:
        """Hold other's first `length` positions, their keys and values copied: a prompt's head computed once."""
        self.reserve(length)
        for mine, theirs in zip((*self.keys, *self.values), (*other.keys, *other.values)):
            mine[:, :length] = theirs[:, :length]
        self.tokens = other.tokens[:length]

    def settle(self, tokens: list[int]) -> None:
        """The first len(tokens) positions hold `tokens` (drafts fed as PENDING, now read back); the rest goes."""
        self.rollback(len(tokens))
        self.tokens[:] = tokens

    def common_prefix(self, tokens: list[int]) -> int:
        """How many of `tokens` the cache already holds, from the start."""
        return common_prefix_length(self.tokens, tokens)

    def extend(self, tokens: list[int], n_logits: int = 1, drafts: torch.Tensor | None = None) -> torch.Tensor:
        """Make the cache hold tokens (+ drafts, a device tensor); logits (n, V) of the last n_logits positions."""
        return self.runner.extend([Feed(self, tokens, n_logits, drafts)])[0]

    def reserve(self, length: int) -> None:
        self.keys = [grown(k, 1, length) for k in self.keys]
        self.values = [grown(v, 1, length) for v in self.values]
