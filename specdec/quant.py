"""Quantization, the target's and the draft's in one place: every Linear of a model replaced by a quantized layer
(quant_layers.py: w8a8, int8 or int4 weight-only, CPU), w8a8 smoothed first (quant_smooth.py), fused where Linears
read one input (quant_fuse.py) and kept in a file for the next start (quant_cache.py). The draft model and the
heads use the same w8a8 layers (--draft-quant int8).
"""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .models import release_free_memory
from .quant_cache import early_packing, mark_used, read_cache, write_cache
from .quant_fuse import Rows, build_all, fused_jobs, install
from .quant_layers import (
    INT4_GROUP,
    W8A8_LAYERS,
    Int4WeightOnlyLinear,
    Int8WeightOnlyLinear,
    RowW8A8LinearBase,
    int8_rows,
)
from .quant_smooth import smooth_mlp_inputs

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# w8a8 takes the kernel measured faster on this kind of CPU (w8a8_layer); w8a8-onednn and w8a8-fbgemm name one.
TARGET_QUANTS = ("none", "int8", "w8a8", "w8a8-onednn", "w8a8-fbgemm", "int4")


def _int4_or_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    """int4 where the packed kernel takes the shape (outputs a multiple of 16), else int8 weight-only."""
    if linear.out_features % 16 or linear.in_features % INT4_GROUP:
        return Int8WeightOnlyLinear(linear)
    return Int4WeightOnlyLinear(linear)


def quantize_linears(
    model: PreTrainedModel, quant: str, calibration_ids: torch.Tensor | None = None, cache: Path | None = None
) -> PreTrainedModel:
    """Replace every Linear layer in place, the LM head included (a head tied to the input embeddings gets its own
    quantized copy: a float head would be the one layer left whose rows depend on each other), and run the rest
    (embeddings, norms, attention) in float32.

    float32, because a bf16 remainder rounds a row differently when it shares its forward with other rows, and a
    quantized layer turns that last-bit difference into a whole int8 step now and then: with a bf16 remainder, 3 of
    6 speculative answers left target-only's greedy path. float32 is also 2–7% faster here.

    w8a8 fuses the layers that read the same input (quant_fuse.FUSED_GROUPS) into one.
    calibration_ids: token ids of quant_smooth.CALIBRATION_TEXT; given, w8a8 smooths the MLPs' down projections first.
    cache: for w8a8, a file of the int8 weights: read when it exists (no smoothing, no quantizing), else written.
    """
    if quant == "none":
        return model
    weight_only: dict[str, Callable[[torch.nn.Linear], torch.nn.Module]] = {
        "int8": Int8WeightOnlyLinear,
        "int4": _int4_or_int8,
    }
    if quant in W8A8_LAYERS:
        _w8a8_rows(model, W8A8_LAYERS[quant](), calibration_ids, cache)
    elif quant in weight_only:
        replace_linears(model, weight_only[quant])
    else:
        raise ValueError(f"--target-quant must be one of {', '.join(TARGET_QUANTS)}, got {quant!r}")
    # The embedding table stays as loaded (bf16: 445 MB less for the 1.5B) and hands out float32 rows, the same
    # values a float32 table would (bf16 → float32 is exact). Left out of the conversion, not converted back: that
    # round trip of the 1.5B's table took 0.6–0.8 s of the start.
    embeddings = model.get_input_embeddings()
    for module in model.modules():
        if module is not embeddings:
            module._apply(lambda t: t.float() if t.is_floating_point() else t, recurse=False)  # Module.float's rule
    embeddings.register_forward_hook(lambda module, args, out: out.float())
    # Its own storage: as loaded it is a view into the memory-mapped checkpoint, which then stays mapped, and every
    # page read while quantizing stays resident with it (3 GB for the 1.5B; 0.27 s to copy).
    embeddings.weight.data = embeddings.weight.data.clone()
    release_free_memory()
    return model


def _w8a8_rows(
    model: PreTrainedModel,
    layer: type[RowW8A8LinearBase],
    calibration_ids: torch.Tensor | None,
    cache: Path | None,
) -> None:
    """w8a8 from the cached int8 weights (packed early by quant_cache.early_packing if it guessed this file), or
    quantized (smoothed first) with the int8 weights written to cache. The cache keeps each Linear's rows under its
    own name, whatever is fused."""
    found = {name: (parent, child, linear) for name, parent, child, linear in _linears(model)}
    jobs = fused_jobs(found)
    if cache is not None and cache.exists():
        mark_used(cache)
        early = early_packing.take(cache)
        if early is not None and set(early) == set(jobs):
            install(found, early.items())
            return
        install(found, build_all(layer, jobs, read_cache(cache)))
        return
    if calibration_ids is not None:
        smooth_mlp_inputs(model, calibration_ids)
    rows: dict[str, torch.Tensor] = {}

    def quantize(name: str) -> Rows:
        linear = found[name][2]
        q, scale = int8_rows(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        if cache is not None:  # kept for the file; without one, each layer's int8 copy is freed once packed
            rows[f"{name}.q"], rows[f"{name}.scale"] = q, scale
            if bias is not None:
                rows[f"{name}.bias"] = bias
        return q, scale, bias

    install(found, build_all(layer, jobs, quantize))
    if cache is not None:
        write_cache(cache, rows)


def replace_linears(module: torch.nn.Module, make: Callable[[torch.nn.Linear], torch.nn.Module]) -> None:
    """Every nn.Linear inside `module` replaced, in place, by make(linear), built on all of torch's threads: packing
    a weight runs on one, and the 1.5B target's took 18 s that way."""
    found = _linears(module)
    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        for (_, parent, name, _), layer in zip(found, pool.map(lambda one: make(one[3]), found)):
            setattr(parent, name, layer)  # as each arrives, so the float layers go as the int8 ones come


def _linears(module: torch.nn.Module) -> list[tuple[str, torch.nn.Module, str, torch.nn.Linear]]:
    """Every nn.Linear inside `module`: (its full name, its parent, its name there, it)."""
    return [
        (f"{prefix}.{name}" if prefix else name, parent, name, child)
        for prefix, parent in module.named_modules()
        for name, child in parent.named_children()
        if type(child) is torch.nn.Linear
    ]
