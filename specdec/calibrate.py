"""Forward and drafting costs as `specvoice calibrate` (commands/calibrate.py) and scripts/gpu-check.sh measure them:
through the runner and the drafters the engine uses."""

from __future__ import annotations

import torch

from .drafters import Drafter
from .runner import BatchRunner
from .sampling import SamplingParams
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


@torch.inference_mode()
def measured_draft_seconds(
    drafter: Drafter, context: list[int], k: int, device: torch.device, repeats: int = 5
) -> tuple[float, int]:
    """Median seconds of one greedy proposal of k drafts after `context`, in the state a step meets it: the drafter
    has seen context[:-1] and the newest token is new to it (a draft model feeds it, then runs k − 1 more forwards;
    heads draft from the target's features, which must cover context[:-1]); and how many drafts it proposed (fewer
    than k where the drafter has fewer, as medusa heads have one per head)."""
    params = SamplingParams()
    drafted: list[int] = []

    def propose() -> None:
        drafter.rollback(len(context) - 1)
        drafted.append(len(drafter.propose(context, k, params, None).tokens))  # a shape: no device read

    return median_seconds(propose, device, repeats), drafted[-1]
