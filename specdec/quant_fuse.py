"""w8a8's fused layers: the Linears of one module that read the same input built as one layer, each Linear's rows
then given back to transformers' own forward as a RowSlice of it."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor

import torch

from .quant_layers import RowW8A8LinearBase

Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a layer's int8 weights, scales and bias
# Linear layers of one module that read the same input, as Qwen2- and Llama-shaped decoders name them: w8a8 runs
# each group as one layer, one activation quantization and one GEMM instead of three or two (a one-token forward
# of the 1.5B target: 75 ms against 85, the same logits bit for bit, docs/results.md).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))
Job = tuple[str, ...]  # the names of the Linears that one w8a8 layer is built from: one, or a FUSED_GROUPS group


class RowSlice(torch.nn.Module):
    """One Linear's rows of a fused w8a8 layer (FUSED_GROUPS). The runner calls the fused layer once and splits its
    output (runner.layer_parts); code that calls the layers one by one, as transformers' own forward does (the
    quality tools), gets the same values, each slice computing the whole fused layer."""

    def __init__(self, fused: RowW8A8LinearBase, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.end]


def fused_layer(*layers: torch.nn.Module) -> RowW8A8LinearBase | None:
    """The fused layer that `layers`, in this order, are the whole of; None if they are not."""
    if not all(isinstance(one, RowSlice) for one in layers):
        return None
    slices: list[RowSlice] = list(layers)  # type: ignore[arg-type]
    fused = slices[0].fused
    bounds = [0, *(one.end for one in slices)]
    whole = all(one.fused is fused and one.start == at for one, at in zip(slices, bounds))
    return fused if whole and bounds[-1] == fused.out_features else None


def fused_jobs(names: Iterable[str]) -> list[Job]:
    """Linear names (full, dotted) as w8a8 layers are built from them: each FUSED_GROUPS group of one module as one
    job, in the group's order; every other Linear alone."""
    by_parent: dict[str, dict[str, str]] = {}
    for name in names:
        parent, _, child = name.rpartition(".")
        by_parent.setdefault(parent, {})[child] = name
    jobs: list[Job] = []
    for children in by_parent.values():
        for group in FUSED_GROUPS:
            if all(child in children for child in group):
                jobs.append(tuple(children.pop(child) for child in group))
        jobs += [(name,) for name in children.values()]
    return jobs


def build_all(
    layer: type[RowW8A8LinearBase], jobs: list[Job], rows: Callable[[str], Rows]
) -> Iterator[tuple[Job, RowW8A8LinearBase]]:
    """Each job's `layer`, built from rows(name) of its Linears on all of torch's threads, yielded in order as they
    are done (so the float layers they replace can go as they come)."""

    def build(job: Job) -> RowW8A8LinearBase:
        parts = [rows(name) for name in job]
        if len(parts) == 1:
            return layer.from_int8(*parts[0])
        bias = None
        if any(b is not None for _, _, b in parts):  # zeros for a layer without one
            bias = torch.cat([b if b is not None else q.new_zeros(len(q), dtype=torch.float32) for q, _, b in parts])
        return layer.from_int8(torch.cat([q for q, _, _ in parts]), torch.cat([s for _, s, _ in parts]), bias)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        yield from zip(jobs, pool.map(build, jobs))


def install(
    found: dict[str, tuple[torch.nn.Module, str, torch.nn.Linear]], built: Iterable[tuple[Job, RowW8A8LinearBase]]
) -> None:
    """Each built layer put in place of its Linear; a fused one as a RowSlice in place of each of its Linears."""
    for job, layer in built:
        at = 0
        for name in job:
            parent, child, linear = found[name]
            setattr(parent, child, layer if len(job) == 1 else RowSlice(layer, at, at + linear.out_features))
            at += linear.out_features
