"""Drafters: propose K tokens, then learn what the target accepted. Verification lives elsewhere."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Protocol

import torch

from .kv import PrefixCache
from .sampling import SamplingParams, logits_to_probs, sample

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Proposal:
    tokens: list[int]
    probs: torch.Tensor | None  # (K, V) draft distribution q, or None when the drafter is deterministic
    forwards: int  # draft model forward passes spent (0 for n-gram)


class Drafter(Protocol):
    """Proposes tokens for the target to verify; verification and acceptance live in the engine."""

    kind: str  # "draft-model", "ngram", "heads": what the app's drafter menu and the reports call it
    reads_target_hidden: bool  # wants the target's last hidden states through observe()

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens to follow context (fewer, even none, when the drafter has nothing worth proposing)."""

    def prefill(self, ids: list[int]) -> None:
        """Warm any state on a prefix that every answer shares (the system prompt)."""

    def rollback(self, length: int) -> None:
        """Forget state past the first `length` tokens of the conversation."""

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        """After each target forward (for a drafter that reads_target_hidden): the target now holds `tokens`, the
        verified conversation, and `hidden` are its last hidden states at positions start … len(tokens) − 1."""


def restrict_vocab(model: PreTrainedModel, keep_ids: torch.Tensor) -> int:
    """Replace the LM head by its rows for keep_ids, so the draft computes only those logits.

    BPE ids are ordered roughly by frequency, so the first N ids cover most text. The target still
    verifies every token, so this stays lossless; it changes only how often drafts are accepted.
    Returns the full vocabulary size.
    """
    head = model.get_output_embeddings()
    small = torch.nn.Linear(head.in_features, len(keep_ids), bias=head.bias is not None)
    small = small.to(device=head.weight.device, dtype=head.weight.dtype)
    with torch.no_grad():
        small.weight.copy_(head.weight[keep_ids])
        if head.bias is not None:
            small.bias.copy_(head.bias[keep_ids])
    model.config.tie_word_embeddings = False
    model.set_output_embeddings(small)
    return head.out_features


class DraftModelDrafter:
    """A small causal LM with the target's vocabulary, decoding K tokens with its own KV cache.

    keep_ids: when the model's head was cut down by restrict_vocab, the full ids of its output rows.
    min_prob: stop drafting at the first position where the draft's most likely token has a lower probability
    (possibly proposing nothing). The draft is well calibrated (its top token matched the target's about as often
    as its probability said), so an unlikely draft costs a forward and a verify slot for little. Lossless: the
    stop depends on the draft alone, and the target still verifies what is proposed.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        device: torch.device,
        keep_ids: torch.Tensor | None = None,
        full_vocab: int = 0,
        min_feed: int = 1,
        min_prob: float = 0.0,
    ) -> None:
        self.kind = "draft-model"
        self.reads_target_hidden = False
        self.model = model
        self.cache = PrefixCache(model, device, min_feed)
        self.keep_ids = keep_ids
        self.full_vocab = full_vocab
        self.min_prob = min_prob

    def _to_full(self, logits: torch.Tensor) -> torch.Tensor:
        if self.keep_ids is None:
            return logits
        full = logits.new_full((*logits.shape[:-1], self.full_vocab), float("-inf"))
        return full.index_copy_(-1, self.keep_ids, logits)

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        logits = self.cache.extend(context)
        forwards = 1
        tokens: list[int] = []
        probs = []
        for i in range(k):
            row = logits[-1]
            if params.greedy:
                top_p, local = torch.softmax(row.float(), -1).max(-1)
                if float(top_p) < self.min_prob:
                    break
                tok = int(self.keep_ids[local]) if self.keep_ids is not None else int(local)
            else:
                q = logits_to_probs(self._to_full(row), params)
                if float(q.max()) < self.min_prob:
                    break
                tok = sample(q, generator)
                probs.append(q)
            tokens.append(tok)
            if i + 1 < k:  # the last draft token needs no forward of its own
                logits = self.cache.extend(context + tokens)
                forwards += 1
        return Proposal(tokens, torch.stack(probs) if probs else None, forwards)

    def prefill(self, ids: list[int]) -> None:
        self.cache.extend(ids)

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        pass  # it reads its own model's states


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose
    what followed it. Costs no model forward; strong on structured or repeated text."""

    def __init__(self, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.kind = "ngram"
        self.reads_target_hidden = False
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal(ngram_lookup(context, k, self.max_ngram, self.min_ngram), None, forwards=0)

    def prefill(self, ids: list[int]) -> None:
        pass  # it reads the context it is given; nothing to keep

    def rollback(self, length: int) -> None:
        pass

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        pass


def ngram_lookup(context: list[int], k: int, max_ngram: int = 4, min_ngram: int = 1) -> list[int]:
    """Continuation of the most recent earlier match of the longest suffix n-gram (n from max to min)."""
    n_ctx = len(context)
    for n in range(min(max_ngram, n_ctx - 1), min_ngram - 1, -1):
        suffix = context[n_ctx - n :]
        for start in range(n_ctx - n - 1, -1, -1):
            if context[start : start + n] == suffix:
                follow = context[start + n : start + n + k]
                if follow:
                    return follow
    return []
