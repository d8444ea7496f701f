"""Quantization, the target's and the draft's in one place: Linear layers in w8a8, int8 or int4 weight-only (CPU).

Lossless needs every row of a forward computed on its own: a token verified among K others must get the logits
it gets decoded alone. The weight-only kernels multiply each row separately; w8a8 quantizes each row with its own
scale (Int8RowLinear on oneDNN with AMX, Int8RowLinearFbgemm without); attention.row_attention does the same for
attention. The draft model and the heads use the same w8a8 layers (--draft-quant int8).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .models import cache_dir, release_free_memory

if TYPE_CHECKING:
    from transformers import PreTrainedModel

# w8a8 takes the kernel measured faster on this kind of CPU (w8a8_layer); w8a8-onednn and w8a8-fbgemm name one.
TARGET_QUANTS = ("none", "int8", "w8a8", "w8a8-onednn", "w8a8-fbgemm", "int4")
INT4_GROUP = 32  # inputs per int4 scale; the GGUF source is Q4_K_M, quantized in groups of 32 too
INT4_INNER_K_TILES = 2


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q int8 [out, in], scale float32 [out]) with weight ≈ q · scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8WeightLinear(torch.nn.Module):
    """y = x · (q · s)ᵀ + b with q int8 [out, in] and s one scale per output channel, computed in bf16 (torch's
    CPU kernel is ~9× slower with float32 activations)."""

    qweight: torch.Tensor

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        qweight, scale = int8_rows(linear.weight)
        self.register_buffer("qweight", qweight)
        self._scale = scale.bfloat16()  # not a buffer: model.float() must leave it in bf16
        self.packed_weight_bytes = self._scale.numel() * 2
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.in_features, self.out_features = linear.in_features, linear.out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int8pack_mm(flat, self.qweight, self._scale).reshape(*x.shape[:-1], self.out_features)
        y = y.to(x.dtype)
        return y if self.bias is None else y + self.bias


class RowInt8Linear(torch.nn.Module):
    """A w8a8 layer: int8 weights with a scale per output row, and each input row quantized with its own scale.
    Built from a Linear, or from int8 weights already computed (the cache of a quantized target)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self._build(*int8_rows(linear.weight), linear.bias)

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> RowInt8Linear:
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer._build(qweight, scale, bias)
        return layer

    def _build(self, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> None:
        # copies, not .float(): a float32 tensor loaded from the int8 cache file is a view into its mapping, and would
        # keep the whole file resident beside the packed weights (1.5 GB for the 1.5B)
        own = None if bias is None else bias.detach().to(torch.float32, copy=True)
        self.bias = None if own is None else torch.nn.Parameter(own, requires_grad=False)
        self.out_features, self.in_features = qweight.shape
        self._pack(qweight, scale)

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        raise NotImplementedError


class Int8RowLinear(RowInt8Linear):
    """W8A8 on oneDNN's prepacked int8 matmul, rows independent: the layer for CPUs with AMX.

    Each row is quantized with its own scale (max |x| ÷ 127), so the kernel sees one fixed activation scale and
    zero point for every call: int8 products summed in int32 are exact in any order, so a row's result is the same
    whether it is fed alone or among others (what losslessness needs of a verifying forward). With AMX tiles its
    cost stays nearly flat up to 16 rows (measured on an AMX VM, issue 20); without AMX it runs on VNNI and was
    measured slower than fbgemm at every row count up to 9 (docs/results.md), hence Int8RowLinearFbgemm there.
    """

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self._packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self._scale = scale.to(torch.float32, copy=True)  # its own memory: see _build
        self._zero = torch.zeros(len(qweight), dtype=torch.long)
        self.packed_weight_bytes = qweight.numel() + 12 * len(qweight)  # int8, a float32 scale and a zero point a row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / 127.0
        # symmetric int8 stored as uint8 around zero point 128, which the kernel takes for activations
        q = torch.round(flat / row_scale).add_(128).to(torch.uint8)
        y = _onednn_int8_matmul(q, self._packed, self._scale, self._zero).mul_(row_scale)
        if self.bias is not None:  # after the row's scale, which the kernel's own bias would be multiplied by
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def _onednn_int8_matmul(q: torch.Tensor, packed: torch.Tensor, scale: torch.Tensor, zero: torch.Tensor) -> torch.Tensor:
    """x · wᵀ in float32 from uint8 rows (zero point 128, scale 1) and prepacked int8 weights with per-row scales."""
    return torch.ops.onednn.qlinear_pointwise(
        q, 1.0, 128, packed, scale, zero, None, 1.0, 0, torch.float32, "none", [], ""
    )


def keep_int8_matmul_eager() -> None:
    """Leave the oneDNN int8 matmul out of torch.compile's graphs (inductor lowers it only with the weight frozen into
    the graph). Called where compiling starts, not at import: torch.compiler.disable imports torch._dynamo, 1.4 s of
    every start otherwise."""
    global _onednn_int8_matmul
    if not hasattr(_onednn_int8_matmul, "__wrapped__"):
        _onednn_int8_matmul = torch.compiler.disable(_onednn_int8_matmul)


class Int8RowLinearFbgemm(RowInt8Linear):
    """W8A8 on fbgemm's dynamic int8 GEMM, made row-independent: the layer for CPUs without AMX.

    fbgemm quantizes activations with one scale for the whole tensor, taken from its min and max, so a row's
    result would depend on the other rows fed with it. Here each row is divided by its own max |x| first and two
    constant inputs, +1 and -1 (against zero weight columns, so they add nothing), pin the tensor's range to
    exactly [-1, 1]: every call quantizes with the same scale, each row at its own resolution, and int32 sums
    are exact in any order. The row's scale is multiplied back afterwards.

    A layer of more than PACK_ROWS output rows (an LM head) is packed in slices of at most that many: fbgemm's
    packing time grows faster than its size (the 1.5B's 151936-row head: 6.1 s whole, 0.4 s for each quarter), and
    each output column is computed alone, so the slices give the same logits bit for bit. The price is ~0.5 ms on
    each forward's 8.5 ms head (measured, docs/results.md).
    """

    _RANGE_PINS = torch.tensor([[1.0, -1.0]])
    PACK_ROWS = 40_000

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        pinned = torch.cat([qweight, qweight.new_zeros(len(qweight), self._RANGE_PINS.shape[1])], dim=1)
        slices = -(-len(pinned) // self.PACK_ROWS)
        rows = -(-len(pinned) // slices)  # even slices
        self._packed: list[tuple[int, int, torch.ScriptObject]] = []
        for start in range(0, len(pinned), rows):
            end = min(start + rows, len(pinned))
            slice_scale, zero = scale[start:end].double(), torch.zeros(end - start, dtype=torch.long)
            with warnings.catch_warnings():  # quantized tensors are deprecated; fbgemm's prepacked GEMM is not
                warnings.simplefilter("ignore")
                quantized = torch._make_per_channel_quantized_tensor(pinned[start:end], slice_scale, zero, 0)
            self._packed.append((start, end, torch.ops.quantized.linear_prepack(quantized, None)))
        self.packed_weight_bytes = pinned.numel() + 8 * len(pinned)  # int8 weights, a float64 scale per row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-8)
        pinned = torch.cat([flat / row_scale, self._RANGE_PINS.expand(len(flat), -1)], dim=1)
        y = flat.new_empty(len(flat), self.out_features)
        for start, end, packed in self._packed:
            # reduce_range: 7-bit activations, so fbgemm's 16-bit pair sums cannot saturate on CPUs without VNNI
            torch.mul(torch.ops.quantized.linear_dynamic(pinned, packed, True), row_scale, out=y[:, start:end])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX int8 tiles (Linux's CPU flags; elsewhere assumed not)."""
    try:
        return " amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


def w8a8_layer() -> type[RowInt8Linear]:
    """The w8a8 layer measured faster on this kind of CPU: oneDNN with AMX, fbgemm without (docs/results.md)."""
    return Int8RowLinear if cpu_has_amx() else Int8RowLinearFbgemm


# the w8a8 --target-quant values and the layer each builds
W8A8_LAYERS: dict[str, Callable[[], type[RowInt8Linear]]] = {
    "w8a8": w8a8_layer,
    "w8a8-onednn": lambda: Int8RowLinear,
    "w8a8-fbgemm": lambda: Int8RowLinearFbgemm,
}


class Int4WeightLinear(torch.nn.Module):
    """Asymmetric int4 weights in groups of INT4_GROUP inputs, packed for torch's CPU int4 matmul (bf16 in/out)."""

    packed: torch.Tensor

    def __init__(self, linear: torch.nn.Linear, group: int = INT4_GROUP) -> None:
        super().__init__()
        w = linear.weight.detach().float()  # [out, in]
        out_f, in_f = w.shape
        g = w.reshape(out_f, in_f // group, group)
        lo, hi = g.amin(dim=2), g.amax(dim=2)
        scale = (hi - lo).clamp(min=1e-6) / 15.0
        q = torch.round((g - lo[..., None]) / scale[..., None]).clamp(0, 15).to(torch.int32).reshape(out_f, in_f)
        zero = lo + 8.0 * scale  # the kernel computes (q - 8) · scale + zero
        self.register_buffer("packed", torch._convert_weight_to_int4pack_for_cpu(q, INT4_INNER_K_TILES))
        # [in/group, out, 2]: scale and zero of one group side by side, as the kernel reads them. Not a buffer, so
        # model.float() leaves it in the bf16 the kernel needs.
        self._scale_zero = torch.stack([scale, zero], dim=2).transpose(0, 1).contiguous().bfloat16()
        self.packed_weight_bytes = self._scale_zero.numel() * 2
        self.bias = None if linear.bias is None else torch.nn.Parameter(linear.bias.detach(), requires_grad=False)
        self.group, self.in_features, self.out_features = group, in_f, out_f

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).to(torch.bfloat16)
        y = torch._weight_int4pack_mm_for_cpu(flat, self.packed, self.group, self._scale_zero)
        y = y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)
        return y if self.bias is None else y + self.bias


# Text whose activations set the smoothing scales: spoken-assistant English like the product's answers, written
# here (never a benchmark prompt).
CALIBRATION_TEXT = (
    "Sure! Here is a quick answer. The water cycle moves water between the oceans, the air and the land: the sun "
    "warms the sea, vapour rises, cools into clouds and falls again as rain or snow. To boil an egg, put it in "
    "cold water, bring it to a boil, then simmer for nine minutes and cool it in ice water. In Python, reverse a "
    "list with items[::-1] or items.reverse(). Three tips for better sleep: keep a regular schedule, avoid screens "
    "an hour before bed, and keep the room cool and dark. Paris is the capital of France; it has about two million "
    "people. Would you like me to explain any of these in more detail?"
)
SMOOTHING_ALPHA = 0.5  # SmoothQuant's balance between activation and weight ranges


@torch.inference_mode()
def smooth_mlp_inputs(model: PreTrainedModel, calibration_ids: torch.Tensor, alpha: float = SMOOTHING_ALPHA) -> None:
    """SmoothQuant for each MLP's down projection, before w8a8: its input (act(gate) · up) has channels far larger
    than the rest, and one per-token scale then leaves the small ones a few int8 steps. Channel j is divided by
    s_j = max|x_j|^α / max|W_down[:, j]|^(1 − α) and W_down's column j multiplied by it; the division is folded
    into up_proj's row j, so the float model computes the same function and nothing is added at run time."""
    mlps = [m for m in model.modules() if all(hasattr(m, n) for n in ("gate_proj", "up_proj", "down_proj"))]
    peaks: dict[int, torch.Tensor] = {}

    def record(mlp_index: int):
        def hook(module: torch.nn.Module, args: tuple[torch.Tensor, ...]) -> None:
            peak = args[0].detach().abs().float().reshape(-1, args[0].shape[-1]).amax(dim=0)
            peaks[mlp_index] = torch.maximum(peaks[mlp_index], peak) if mlp_index in peaks else peak

        return hook

    handles = [mlp.down_proj.register_forward_pre_hook(record(i)) for i, mlp in enumerate(mlps)]
    try:
        model(input_ids=calibration_ids)
    finally:
        for h in handles:
            h.remove()
    for i, mlp in enumerate(mlps):
        down, up = mlp.down_proj.weight, mlp.up_proj.weight
        w_peak = down.detach().abs().float().amax(dim=0).clamp(min=1e-5)
        scale = (peaks[i].clamp(min=1e-5) ** alpha / w_peak ** (1 - alpha)).clamp(min=1e-5)
        down.copy_((down.float() * scale[None, :]).to(down.dtype))
        up.copy_((up.float() / scale[:, None]).to(up.dtype))
        if mlp.up_proj.bias is not None:
            mlp.up_proj.bias.copy_((mlp.up_proj.bias.float() / scale).to(mlp.up_proj.bias.dtype))


def _int4_or_int8(linear: torch.nn.Linear) -> torch.nn.Module:
    """int4 where the packed kernel takes the shape (outputs a multiple of 16), else int8 weight-only."""
    if linear.out_features % 16 or linear.in_features % INT4_GROUP:
        return Int8WeightLinear(linear)
    return Int4WeightLinear(linear)


def quantize_linears(
    model: PreTrainedModel, quant: str, calibration_ids: torch.Tensor | None = None, cache: Path | None = None
) -> PreTrainedModel:
    """Replace every Linear layer in place, the LM head included (a head tied to the input embeddings gets its own
    quantized copy: a float head would be the one layer left whose rows depend on each other), and run the rest
    (embeddings, norms, attention) in float32.

    float32, because a bf16 remainder rounds a row differently when it shares its forward with other rows, and a
    quantized layer turns that last-bit difference into a whole int8 step now and then: with a bf16 remainder, 3 of
    6 speculative answers left target-only's greedy path. float32 is also 2–7% faster here.

    w8a8 fuses the layers that read the same input (FUSED_GROUPS) into one.
    calibration_ids: token ids of CALIBRATION_TEXT; given, w8a8 smooths the MLPs' down projections first.
    cache: for w8a8, a file of the int8 weights: read when it exists (no smoothing, no quantizing), else written.
    """
    if quant == "none":
        return model
    weight_only: dict[str, Callable[[torch.nn.Linear], torch.nn.Module]] = {
        "int8": Int8WeightLinear,
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
    layer: type[RowInt8Linear],
    calibration_ids: torch.Tensor | None,
    cache: Path | None,
) -> None:
    """w8a8 from the cached int8 weights (packed early by prepack_cache if it guessed this file), or quantized
    (smoothed first) with the int8 weights written to cache. The cache keeps each Linear's rows under its own name,
    whatever is fused."""
    from safetensors.torch import load_file, save_file

    found = {name: (parent, child, linear) for name, parent, child, linear in _linears(model)}
    jobs = _fused_jobs(found)
    if cache is not None and cache.exists():
        with contextlib.suppress(OSError):  # a read-only cache still loads
            os.utime(cache)  # the one used last: prepack_cache's guess next time
        early = _take_prepacked(cache)
        if early is not None and set(early) == set(jobs):
            _install(found, early.items())
            return
        _install(found, _build_all(layer, jobs, _cache_reader(load_file(cache))))
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

    _install(found, _build_all(layer, jobs, quantize))
    if cache is None:
        return
    cache.parent.mkdir(parents=True, exist_ok=True)
    partial = cache.with_name(f"{cache.name}.{os.getpid()}.partial")  # never a half-written file under the name
    save_file(rows, str(partial))
    os.replace(partial, cache)


def _cache_reader(saved: dict[str, torch.Tensor]) -> Callable[[str], Rows]:
    """A Linear's rows by its name, from the tensors of a cache file."""
    return lambda name: (saved[f"{name}.q"], saved[f"{name}.scale"], saved.get(f"{name}.bias"))


Rows = tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]  # a layer's int8 weights, scales and bias
# Linear layers of one module that read the same input, as Qwen2- and Llama-shaped decoders name them: w8a8 runs
# each group as one layer, one activation quantization and one GEMM instead of three or two (a one-token forward
# of the 1.5B target: 75 ms against 85, the same logits bit for bit, docs/results.md).
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class RowSlice(torch.nn.Module):
    """One Linear's rows of a fused w8a8 layer (FUSED_GROUPS). The runner calls the fused layer once and splits its
    output (runner.layer_parts); code that calls the layers one by one, as transformers' own forward does (the
    quality tools), gets the same values, each slice computing the whole fused layer."""

    def __init__(self, fused: RowInt8Linear, start: int, end: int) -> None:
        super().__init__()
        self.fused, self.start, self.end = fused, start, end
        self.in_features, self.out_features = fused.in_features, end - start

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fused(x)[..., self.start : self.end]


def fused_layer(*layers: torch.nn.Module) -> RowInt8Linear | None:
    """The fused layer that `layers`, in this order, are the whole of; None if they are not."""
    if not all(isinstance(one, RowSlice) for one in layers):
        return None
    slices: list[RowSlice] = list(layers)  # type: ignore[arg-type]
    fused = slices[0].fused
    bounds = [0, *(one.end for one in slices)]
    whole = all(one.fused is fused and one.start == at for one, at in zip(slices, bounds))
    return fused if whole and bounds[-1] == fused.out_features else None


Job = tuple[str, ...]  # the names of the Linears that one w8a8 layer is built from: one, or a FUSED_GROUPS group


def _fused_jobs(names: Iterable[str]) -> list[Job]:
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


def _build_all(
    layer: type[RowInt8Linear], jobs: list[Job], rows: Callable[[str], Rows]
) -> Iterator[tuple[Job, RowInt8Linear]]:
    """Each job's `layer`, built from rows(name) of its Linears on all of torch's threads, yielded in order as they
    are done (so the float layers they replace can go as they come)."""

    def build(job: Job) -> RowInt8Linear:
        parts = [rows(name) for name in job]
        if len(parts) == 1:
            return layer.from_int8(*parts[0])
        bias = None
        if any(b is not None for _, _, b in parts):  # zeros for a layer without one
            bias = torch.cat([b if b is not None else q.new_zeros(len(q), dtype=torch.float32) for q, _, b in parts])
        return layer.from_int8(torch.cat([q for q, _, _ in parts]), torch.cat([s for _, s, _ in parts]), bias)

    with ThreadPoolExecutor(max(1, torch.get_num_threads())) as pool:
        yield from zip(jobs, pool.map(build, jobs))


def _install(
    found: dict[str, tuple[torch.nn.Module, str, torch.nn.Linear]], built: Iterable[tuple[Job, RowInt8Linear]]
) -> None:
    """Each built layer put in place of its Linear; a fused one as a RowSlice in place of each of its Linears."""
    for job, layer in built:
        at = 0
        for name in job:
            parent, child, linear = found[name]
            setattr(parent, child, layer if len(job) == 1 else RowSlice(layer, at, at + linear.out_features))
            at += linear.out_features


# Packing a cached w8a8 target is seconds of C++ work that holds no GIL (fbgemm: ~7 core-s for the 1.5B). Started
# early on a guess of the cache file, it runs beside the start's Python (imports, the page, the model's load).
_prepacked: dict[Path, Future[dict[Job, RowInt8Linear]]] = {}
CACHED_FROM_PARAMS = 100_000_000  # smaller models quantize in moments and keep no cache file


def prepack_cache(name: str, quant: str, dtype: str) -> Path | None:
    """Start packing, on background threads, the int8 cache file that the model `name` in `quant` and `dtype`
    most likely reads: the one used last for that name, format and dtype. Only a guess, made before the model is
    loaded; _w8a8_rows takes its layers only if the model's own key (quantized_cache_path) names this very file, and
    packs afresh otherwise. Returns the file, or None when there is none to guess (or it is already being packed)."""
    if quant not in W8A8_LAYERS:
        return None
    found = list((cache_dir() / "quantized").glob(f"{_safe(name)}-{quant}-{dtype}-*.safetensors"))
    if not found:
        return None
    cache = max(found, key=lambda path: path.stat().st_mtime)
    if cache in _prepacked:
        return None
    layer = W8A8_LAYERS[quant]()
    future: Future[dict[Job, RowInt8Linear]] = Future()

    def pack() -> None:
        try:
            from safetensors.torch import load_file

            saved = load_file(cache)
            names = [key.removesuffix(".q") for key in saved if key.endswith(".q")]
            future.set_result(dict(_build_all(layer, _fused_jobs(names), _cache_reader(saved))))
        except Exception as e:  # a bad file: the load reads (and reports) it as before
            future.set_exception(e)

    _prepacked[cache] = future
    threading.Thread(target=pack, name="w8a8-prepack", daemon=True).start()
    return cache


def _take_prepacked(cache: Path) -> dict[Job, RowInt8Linear] | None:
    """The layers prepack_cache packed from `cache` (waiting for them), or None; every other early packing is
    dropped, as no model will read it."""
    early = _prepacked.pop(cache, None)
    _prepacked.clear()
    try:
        return None if early is None else early.result()
    except Exception:  # read again by the load, which reports what is wrong with the file
        return None


def quantized_cache_path(model: PreTrainedModel, quant: str, name: str) -> Path | None:
    """Where the int8 weights of this model in this w8a8 format are kept, keyed by the weights' own fingerprint, the
    layer, the smoothing and torch's version; None for a model quick to quantize (the tests' tiny ones). The name
    says the dtype too: the same model loads in bfloat16 for the app and float32 for the tests, and prepack_cache
    must not guess the other one's file."""
    params = list(model.state_dict().items())
    if sum(t.numel() for _, t in params) < CACHED_FROM_PARAMS:
        return None
    digest = hashlib.sha256()
    layer = w8a8_layer().__name__ if quant == "w8a8" else quant
    for key in (quant, layer, torch.__version__, CALIBRATION_TEXT, repr(SMOOTHING_ALPHA)):
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
