"""Self-speculation, measured: the target with some decoder layers skipped as its own drafter (no training).

Layers are chosen by measured acceptance: each layer is skipped alone and scored by how often the skipped model's
top token is still the target's (teacher-forced over recorded greedy answers); the least needed go first. The
draft's cost is the skipped model's measured one-token forward against the whole target's.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING

import torch

from .calibrate import measured_forward_seconds
from .heads_data import Sequence
from .runner import BatchRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@contextmanager
def skipping(model: PreTrainedModel, skip: set[int]) -> Iterator[None]:
    """The model runs without the decoder layers in `skip` (their cache slots renumbered), until the block ends."""
    decoder = model.get_decoder()
    layers = decoder.layers
    kept = [layer for i, layer in enumerate(layers) if i not in skip]
    indices = [layer.self_attn.layer_idx for layer in kept]
    n_layers = model.config.num_hidden_layers
    for j, layer in enumerate(kept):
        layer.self_attn.layer_idx = j  # the KV cache is indexed by position in the stack
    decoder.layers = torch.nn.ModuleList(kept)
    model.config.num_hidden_layers = len(kept)
    try:
        yield
    finally:
        decoder.layers = layers
        model.config.num_hidden_layers = n_layers
        for layer, index in zip(kept, indices):
            layer.self_attn.layer_idx = index


@torch.inference_mode()
def agreement(model: PreTrainedModel, seqs: list[Sequence], skip: set[int]) -> float:
    """Teacher-forced: how often the model with `skip` left out picks the recorded greedy answer's next token."""
    agree = total = 0
    with skipping(model, skip):
        for s in seqs:
            n = len(s.tokens) - s.answer_start
            logits = model(input_ids=torch.tensor([s.tokens[:-1]]), logits_to_keep=n).logits[0]
            agree += int((logits.argmax(-1) == torch.tensor(s.tokens[s.answer_start :])).sum())
            total += n
    return agree / max(total, 1)


def rank_layers(model: PreTrainedModel, seqs: list[Sequence]) -> list[tuple[int, float]]:
    """(layer, agreement with that layer alone skipped), the least needed first."""
    scores = [(i, agreement(model, seqs, {i})) for i in range(model.config.num_hidden_layers)]
    return sorted(scores, key=lambda pair: -pair[1])


def draft_cost_ratio(model: PreTrainedModel, skip: set[int], device: torch.device, repeats: int = 5) -> float:
    """c: the skipped model's one-token forward over the whole target's, measured as the engine feeds them."""
    full = measured_forward_seconds(BatchRunner(model, device), 1, repeats=repeats)
    with skipping(model, skip):
        part = measured_forward_seconds(BatchRunner(model, device), 1, repeats=repeats)
    return part / full
