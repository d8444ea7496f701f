"""The file of a w8a8 target's int8 weights: its name (a key of the model and the quantization), reading and
writing it, and packing it early, while the app starts, on a guess of which file the model will read."""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .models import cache_dir
from .quant_fuse import Job, Rows, build_all, fused_jobs
from .quant_layers import W8A8_LAYERS, FbgemmW8A8Linear, OneDNNW8A8Linear, RowW8A8LinearBase, w8a8_layer
from .quant_smooth import CALIBRATION_TEXT, SMOOTHING_ALPHA

if TYPE_CHECKING:
    from transformers import PreTrainedModel

CACHED_FROM_PARAMS = 100_000_000  # smaller models quantize in moments and keep no cache file
# The w8a8 layers as the key names them: their class names before they were renamed, kept so that no cache file
# written before goes unread (a new key would make every user quantize again).
KEY_LAYER_NAMES: dict[type[RowW8A8LinearBase], str] = {
    OneDNNW8A8Linear: "Int8RowLinear",
    FbgemmW8A8Linear: "Int8RowLinearFbgemm",
}


def key_layer_name(quant: str) -> str:
    """The layer as the key names it: plain w8a8 picks its layer by the CPU, so the key says which one it is."""
    return KEY_LAYER_NAMES[w8a8_layer()] if quant == "w8a8" else quant


def quantized_cache_path(model: PreTrainedModel, quant: str, name: str) -> Path | None:
    """Where the int8 weights of this model in this w8a8 format are kept, keyed by the weights' own fingerprint, the
    layer, the smoothing and torch's version; None for a model quick to quantize (the tests' tiny ones). The name
    says the dtype too: the same model loads in bfloat16 for the app and float32 for the tests, and EarlyPacking
    must not guess the other one's file."""
    params = list(model.state_dict().items())
    if sum(t.numel() for _, t in params) < CACHED_FROM_PARAMS:
        return None
    digest = hashlib.sha256()
    for key in (quant, key_layer_name(quant), torch.__version__, CALIBRATION_TEXT, repr(SMOOTHING_ALPHA)):
        digest.update(key.encode())
    for key, tensor in params:  # names, shapes, and every tensor's first and last 2048 values
        flat = tensor.detach().reshape(-1)
        # Contiguous samples: an even stride touched a page of every 4 KB of the memory-mapped checkpoint, so the
        # whole 3 GB file became resident before packing (the start's memory peak).
        sample = torch.cat([flat[:2048], flat[-2048:]]).float().cpu().numpy().tobytes()
        digest.update(f"{key}{tuple(tensor.shape)}{tensor.dtype}".encode() + sample)
    dtype = str(model.dtype).removeprefix("torch.")
    return cache_dir() / "quantized" / f"{_safe(name)}-{quant}-{dtype}-{digest.hexdigest()[:16]}.safetensors"


def _safe(name: str) -> str:
    return "".join(c if c.isalnum() or c in "-." else "_" for c in name)


def mark_used(cache: Path) -> None:
    """The file marked the one used last: EarlyPacking's guess next time."""
    with contextlib.suppress(OSError):  # a read-only cache still loads
        os.utime(cache)


def read_cache(cache: Path) -> Callable[[str], Rows]:
    """A Linear's rows by its name, from the cache file."""
    from safetensors.torch import load_file

    return cache_reader(load_file(cache))


def cache_reader(saved: dict[str, torch.Tensor]) -> Callable[[str], Rows]:
    """A Linear's rows by its name, from the tensors of a cache file."""
    return lambda name: (saved[f"{name}.q"], saved[f"{name}.scale"], saved.get(f"{name}.bias"))


def write_cache(cache: Path, rows: dict[str, torch.Tensor]) -> None:
    """`rows` (each Linear's "{name}.q", "{name}.scale" and "{name}.bias" if it has one) saved as the cache file."""
    from safetensors.torch import save_file

    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")  # never a half-written file under the name
    save_file(rows, str(partial))
    os.replace(partial, cache)


class EarlyPacking:
    """Packing a cached w8a8 target is seconds of C++ work that holds no GIL (fbgemm: ~7 core-s for the 1.5B). Started
    early on a guess of the cache file (start), it runs beside the start's Python (imports, the page, the model's
    load); the load takes the layers (take) if the guess was its file. One for the process: `early_packing`."""

    def __init__(self) -> None:
        self._pending: dict[Path, Future[dict[Job, RowW8A8LinearBase]]] = {}

    def start(self, name: str, quant: str, dtype: str) -> Path | None:
        """Start packing, on background threads, the int8 cache file that the model `name` in `quant` and `dtype`
        most likely reads: the one used last for that name, format and dtype. Only a guess, made before the model is
        loaded; quantize_linears takes its layers only if the model's own key (quantized_cache_path) names this very
        file, and packs afresh otherwise. Returns the file, or None when there is none to guess (or it is already
        being packed)."""
        if quant not in W8A8_LAYERS:
            return None
        found = list((cache_dir() / "quantized").glob(f"{_safe(name)}-{quant}-{dtype}-*.safetensors"))
        if not found:
            return None
        cache = max(found, key=lambda path: path.stat().st_mtime)
        if cache in self._pending:
            return None
        layer = W8A8_LAYERS[quant]()
        future: Future[dict[Job, RowW8A8LinearBase]] = Future()

        def pack() -> None:
            try:
                from safetensors.torch import load_file

                saved = load_file(cache)
                names = [key.removesuffix(".q") for key in saved if key.endswith(".q")]
                future.set_result(dict(build_all(layer, fused_jobs(names), cache_reader(saved))))
            except Exception as e:  # a bad file: the load reads (and reports) it as before
                future.set_exception(e)

        self._pending[cache] = future
        threading.Thread(target=pack, name="w8a8-prepack", daemon=True).start()
        return cache

    def wait(self) -> None:
        """Until every packing started has finished (its layers stay for take): what memory grows by after this is
        not the packing's."""
        for future in list(self._pending.values()):
            future.exception()

    def take(self, cache: Path) -> dict[Job, RowW8A8LinearBase] | None:
        """The layers packed early from `cache` (waiting for them), or None; every other early packing is dropped, as
        no model will read it."""
        early = self._pending.pop(cache, None)
        self._pending.clear()
        try:
            return None if early is None else early.result()
        except Exception:  # read again by the load, which reports what is wrong with the file
            return None


early_packing = EarlyPacking()
