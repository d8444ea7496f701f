"""Drafters: propose K tokens, then observe what the target made of them. Verification lives in the engine.

A proposal stays on the device: its tokens, and how many of them pass the drafter's confidence gate, are tensors
that the engine reads back once per step, with the target's verdict.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Protocol

import torch

from .kv import PENDING
from .openings import opening_tree, question_copies
from .runner import BatchRunner
from .sampling import SamplingParams, logits_to_probs, sample
from .tree import DraftTree, keep_best

if TYPE_CHECKING:
    from transformers import PreTrainedModel

    from .events import StepEvent
    from .kv import SequenceCache
    from .openings import OpeningTable
    from .tokenizer import Tokenizer


@dataclass
class Proposal:
    tokens: torch.Tensor  # (K,) drafts, on the device; the target verifies all K rows
    proposed: torch.Tensor  # 0-d: how many of them count (the confidence gate stops at the first unsure one)
    probs: torch.Tensor | None  # (K, V) draft distribution q, or None when the drafter is deterministic
    forwards: int  # draft forward passes spent (0 for n-gram)
    tree: DraftTree | None = None  # the drafts are this tree's nodes (tokens = tree.tokens), verified as a tree
    # (K,) by rank (a chain's order; a tree's by score, tree.node_ranks): the drafter's probability that the draft
    # lies on the target's path (a tree node: its path probability; a chain's i-th: the product of the top
    # probabilities up to i), what the load-aware K keeps drafts by (best); None where the drafter has none
    confidence: torch.Tensor | None = None

    @classmethod
    def of_tree(cls, tree: DraftTree, forwards: int) -> Proposal:
        """A draft tree's nodes, all verified (specdec/tree.py)."""
        confidence = None
        if tree.q is None and tree.scores is not None:
            confidence = tree.scores.exp().sort(descending=True).values
        return cls(tree.tokens, torch.tensor(len(tree), device=tree.tokens.device), tree.q, forwards, tree, confidence)

    @classmethod
    def of(cls, tokens: list[int], device: torch.device) -> Proposal:
        """A deterministic proposal made on the host (n-gram, or nothing)."""
        ids = torch.tensor(tokens, dtype=torch.long, device=device)
        return cls(ids, torch.tensor(len(tokens), device=device), None, 0)

    @classmethod
    def gated(
        cls,
        drafts: list[torch.Tensor],
        tops: list[torch.Tensor],
        probs: list[torch.Tensor],
        min_prob: float,
        forwards: int,
    ) -> Proposal:
        """Drafts chosen position by position (choose_drafts), counted up to the confidence gate (confident_count)."""
        q = torch.cat(probs) if probs else None
        top = torch.cat(tops)
        return cls(torch.cat(drafts), confident_count(top, min_prob), q, forwards, confidence=top.float().cumprod(0))

    @property
    def cuttable(self) -> bool:
        """Whether best() may keep fewer drafts: not a sampled tree (q given), whose children were drawn for the
        shape it has."""
        return self.tree is None or self.tree.q is None

    def best(self, n: int) -> Proposal:
        """The n drafts of best rank, verified as this proposal's first n would be: a chain's first n, a tree's n
        nodes of highest score (tree.keep_best: every kept node's path is kept). Lossless as any gate is: what is
        kept depends on the drafter's own values, never on the target's. Only a cuttable proposal."""
        if n >= len(self.tokens):
            return self
        if not self.cuttable:
            raise ValueError("a sampled draft tree is verified whole (tree.draw_tree)")
        confidence = None if self.confidence is None else self.confidence[:n]
        if self.tree is None:
            q = None if self.probs is None else self.probs[:n]
            return replace(
                self, tokens=self.tokens[:n], proposed=self.proposed.clamp_max(n), probs=q, confidence=confidence
            )
        if n == 0:
            return replace(Proposal.of([], self.tokens.device), forwards=self.forwards)
        tree = keep_best(self.tree, n)
        return replace(self, tokens=tree.tokens, proposed=self.proposed.clamp_max(n), tree=tree, confidence=confidence)


class Drafter(Protocol):
    """Proposes tokens for the target to verify; verification and acceptance live in the engine."""

    kind: str  # "draft-model", "ngram", "heads": what the app's drafter menu and the reports call it
    reads_target_hidden: bool  # wants the target's last hidden states through observe()
    target_layers: tuple[int, ...]  # which: hidden_states indices, side by side; (): the final norm's output

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """Up to k tokens to follow context (fewer, even none, when the drafter has nothing worth proposing)."""

    def prefill(self, ids: list[int]) -> None:
        """Warm any state on a prefix that every answer shares (the system prompt)."""

    def start(self, prompt_len: int, question_start: int = 0) -> None:
        """A new answer starts: the first prompt_len tokens of the contexts it is given are its prompt, whose last
        message (the question) begins at question_start."""

    def rollback(self, length: int) -> None:
        """Forget state past the first `length` tokens of the conversation."""

    def observe(self, event: StepEvent, target: SequenceCache) -> None:
        """After each target forward: what the step emitted, and the target's cache (its `tokens` and, for a drafter
        that reads_target_hidden, its last hidden states `hidden` at positions hidden_start …)."""


def confident_count(top_probs: torch.Tensor, min_prob: float) -> torch.Tensor:
    """The confidence gate, on the device: how many leading positions have a top draft probability ≥ min_prob.
    Lossless: it depends on the draft alone, and the target still verifies what is proposed."""
    return (top_probs >= min_prob).long().cumprod(0).sum()


def full_vocab_logits(sub_logits: torch.Tensor, keep_ids: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Logits over the whole vocabulary from a head over keep_ids only: −inf elsewhere (never drafted)."""
    full = sub_logits.new_full((*sub_logits.shape[:-1], vocab_size), float("-inf"))
    return full.index_copy_(-1, keep_ids, sub_logits)


def choose_drafts(
    sub_logits: torch.Tensor,
    keep_ids: torch.Tensor | None,
    vocab_size: int,
    params: SamplingParams,
    generator: torch.Generator | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """Draft tokens (full ids), their top probabilities (for the gate) and, when sampling, q, from logits (K, V')
    over keep_ids (None: the whole vocabulary)."""
    if params.greedy:
        top, local = torch.softmax(sub_logits.float(), -1).max(-1)
        return (local if keep_ids is None else keep_ids[local]), top, None
    full = sub_logits if keep_ids is None else full_vocab_logits(sub_logits, keep_ids, vocab_size)
    q = logits_to_probs(full, params)
    tokens = torch.stack([sample(row, generator) for row in q])
    return tokens, q.max(-1).values, q


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
    """A small causal LM with the target's vocabulary, decoding K tokens on its own KV cache (in its own runner),
    each draft fed back to it on the device.

    keep_ids: when the model's head was cut down by restrict_vocab, the full ids of its output rows.
    min_prob: the confidence gate (confident_count): the draft is well calibrated (its top token matched the
    target's about as often as its probability said), so an unsure draft is rarely worth a verify slot.
    gate_on_host: stop drafting at the first unsure draft, reading each draft's confidence, so its forwards and
    verify rows are not spent (None: where the draft runs on the CPU, on which a read costs nothing). Off, every
    step drafts K and the gate is decided on the device, with no read: a GPU's path.
    """

    def __init__(
        self,
        runner: BatchRunner,
        keep_ids: torch.Tensor | None = None,
        full_vocab: int = 0,
        min_prob: float = 0.0,
        gate_on_host: bool | None = None,
    ) -> None:
        self.kind = "draft-model"
        self.reads_target_hidden = False
        self.target_layers: tuple[int, ...] = ()
        self.cache = runner.new_cache()
        self.keep_ids = keep_ids
        self.vocab_size = full_vocab or runner.model.config.vocab_size
        self.min_prob = min_prob
        on_cpu = runner.device.type == "cpu"
        self.gate_on_host = min_prob > 0 and (on_cpu if gate_on_host is None else gate_on_host)
        self._context = 0  # the context length of the last proposal: its drafts follow it in the cache, PENDING

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        self._context = len(context)
        logits = self.cache.extend(context)
        drafts, tops, probs = [], [], []
        for i in range(k):
            token, top, q = choose_drafts(logits, self.keep_ids, self.vocab_size, params, generator)
            if self.gate_on_host and float(top) < self.min_prob:
                break  # neither this draft nor those after it are worth their forwards and verify rows
            drafts.append(token)
            tops.append(top)
            if q is not None:
                probs.append(q)
            if i + 1 < k:  # the last draft needs no forward of its own
                logits = self.cache.extend(context + [PENDING] * i, drafts=token)
        forwards = min(len(drafts) + 1, k)  # the forward that made an unsure draft ran too
        if not drafts:
            return replace(Proposal.of([], logits.device), forwards=forwards)
        return Proposal.gated(drafts, tops, probs, self.min_prob, forwards)

    def prefill(self, ids: list[int]) -> None:
        self.cache.extend(ids)

    def start(self, prompt_len: int, question_start: int = 0) -> None:
        pass

    def rollback(self, length: int) -> None:
        self.cache.rollback(length)

    def observe(self, event: StepEvent, target: SequenceCache) -> None:
        """The accepted drafts, now read back, replace their PENDING positions; the rest of the drafts go."""
        keep = min(len(self.cache.tokens), self._context + event.accepted)
        self.cache.settle(self.cache.tokens[: self._context] + event.draft_tokens[: keep - self._context])


class NGramDrafter:
    """Prompt lookup: find the latest earlier occurrence of the context's last n tokens and propose
    what followed it. Costs no model forward; strong on structured or repeated text."""

    def __init__(self, device: torch.device | None = None, max_ngram: int = 4, min_ngram: int = 1) -> None:
        self.kind = "ngram"
        self.reads_target_hidden = False
        self.target_layers: tuple[int, ...] = ()
        self.device = device or torch.device("cpu")
        self.max_ngram = max_ngram
        self.min_ngram = min_ngram

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        return Proposal.of(ngram_lookup(context, k, self.max_ngram, self.min_ngram), self.device)

    def prefill(self, ids: list[int]) -> None:
        pass  # it reads the context it is given; nothing to keep

    def start(self, prompt_len: int, question_start: int = 0) -> None:
        pass

    def rollback(self, length: int) -> None:
        pass

    def observe(self, event: StepEvent, target: SequenceCache) -> None:
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


class OpeningEchoDrafter:
    """Drafts an answer's first OPENING_TOKENS tokens from the words of its prompt where they match, else and for the
    rest with `inner`.

    Spoken answers often restate the question ("What is the boiling point of water?" → "The boiling point of water
    is …"). Matching ignores case and spaces, so the answer's "The" finds the question's " the"; what is proposed
    are the prompt's own next tokens. With no match the inner drafter proposes: the shipped heads guess
    openings too (an answer's tokens 2–9 at 1.51 tokens per forward with them, 1.18 without; the first heads'
    acceptance there was about 0; docs/results.md), and the load-aware K learns openings apart
    (scheduler.OPENING_STEPS) and drops drafts that do not pay.

    openings: with a table (specdec/openings.py), the answer's first forward verifies drafts too: the `width`
    likeliest openings after how the question begins (a first token, or a word of the question it copies), each
    continued by the echo, as one draft tree.
    """

    OPENING_TOKENS = 8

    def __init__(
        self,
        inner: Drafter,
        tokenizer: Tokenizer,
        device: torch.device,
        openings: OpeningTable | None = None,
        width: int = 1,
    ) -> None:
        self.inner, self.device = inner, device
        self.openings, self.width = openings, width
        self.kind = inner.kind
        self.reads_target_hidden, self.target_layers = inner.reads_target_hidden, inner.target_layers
        self.tokenizer = tokenizer
        self._keys: dict[int, str] = {}
        self._prompt_len: int | None = None  # None: no answer started, so no opening to echo
        self._question_start = 0

    def _key(self, token: int) -> str:
        key = self._keys.get(token)
        if key is None:
            key = self._keys[token] = self.tokenizer.decode([token]).strip().lower()
        return key

    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        start = self._prompt_len
        if start is not None and start <= len(context) < start + self.OPENING_TOKENS:
            if len(context) == start and (guessed := self._guessed(context, k)):
                return guessed
            if echo := echo_lookup(context, start, k, self._key, self._question_start):
                return Proposal.of(echo, self.device)
        return self.inner.propose(context, k, params, generator)

    def _guessed(self, prompt: list[int], k: int) -> Proposal | None:
        """The answer's first tokens guessed from how the question begins, each continued by the echo: a chain for
        one guess, else a tree of at most k nodes (one-hot candidates: lossless whatever chose them)."""
        if self.openings is None:
            return None
        n, question = len(prompt), prompt[self._question_start :]
        copies = question_copies(question, self.tokenizer)
        chains = []
        for ids, share in self.openings.guesses(question, self.width, copies):
            spoken = next((c.spoken for c in copies if c.ids == ids), ids)  # a copied word's echo: after the question's
            chains.append(([*ids, *echo_lookup([*prompt, *spoken], n, k, self._key, self._question_start)], share))
        if not chains:
            return None
        if len(chains) == 1:
            return Proposal.of(chains[0][0][:k], self.device)
        return Proposal.of_tree(opening_tree(chains, k, self.device), forwards=0)

    def prefill(self, ids: list[int]) -> None:
        self.inner.prefill(ids)

    def start(self, prompt_len: int, question_start: int = 0) -> None:
        self._prompt_len, self._question_start = prompt_len, question_start
        self.inner.start(prompt_len, question_start)

    def rollback(self, length: int) -> None:
        self.inner.rollback(length)

    def observe(self, event: StepEvent, target: SequenceCache) -> None:
        self.inner.observe(event, target)


def echo_lookup(
    context: list[int],
    prompt_len: int,
    k: int,
    key: Callable[[int], str],
    question_start: int = 0,
    max_ngram: int = 3,
) -> list[int]:
    """The words of the question (the prompt from question_start) that follow the latest place in it whose words
    match the answer's last n tokens, for the longest n ≤ max_ngram that matches; [] if none does.
    - At most n + 1 tokens: a match of one word ("the", "to") is weak evidence, and each draft verified costs a row
      of the target's forward.
    - Only the question: the system prompt's words ("to three short spoken sentences") are not what an answer
      restates.
    - Only words: they stop before the first token without a letter or digit (the question's "?", the chat
      template's markers), which an answer rarely repeats; a match followed by none is passed over.
    key: a token's text without case and spaces; a token that is only space (an empty key) matches nothing."""
    answer = [key(t) for t in context[prompt_len:]]
    prompt = [key(t) for t in context[:prompt_len]]
    for n in range(min(max_ngram, len(answer)), 0, -1):
        suffix = answer[-n:]
        if not all(suffix):
            continue
        for begin in range(prompt_len - n - 1, question_start - 1, -1):  # with at least one prompt token after it
            if prompt[begin : begin + n] == suffix:
                follow = range(begin + n, min(begin + n + min(k, n + 1), prompt_len))
                words = [context[i] for i in itertools.takewhile(lambda i: _has_word(prompt[i]), follow)]
                if words:
                    return words
    return []


def _has_word(key: str) -> bool:
    return any(c.isalnum() for c in key)
