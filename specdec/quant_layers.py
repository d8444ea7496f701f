"""The quantized Linear layers (CPU): weight-only int8 and int4, and w8a8 with rows independent on two kernels.

Lossless needs every row of a forward computed on its own: a token verified among K others must get the logits
it gets decoded alone. The weight-only kernels multiply each row separately; w8a8 quantizes each row with its own
scale (OneDNNW8A8Linear with AMX, FbgemmW8A8Linear without); attention.row_attention does the same for attention.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from pathlib import Path

import torch

INT4_GROUP = 32  # inputs per int4 scale; the GGUF source is Q4_K_M, quantized in groups of 32 too
INT4_INNER_K_TILES = 2


def int8_rows(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric int8 per output row: (q int8 [out, in], scale float32 [out]) with weight ≈ q · scale."""
    w = weight.detach().float()
    scale = w.abs().amax(dim=1).clamp(min=1e-8) / 127.0
    return torch.round(w / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


class Int8WeightOnlyLinear(torch.nn.Module):
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


class Int4WeightOnlyLinear(torch.nn.Module):
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


class RowW8A8LinearBase(torch.nn.Module):
    """The base of the w8a8 layers, each a kernel's (_pack, forward): int8 weights with a scale per output row, and
    each input row quantized with its own scale. Built from a Linear, or from int8 weights already computed (the
    cache of a quantized target)."""

    def __init__(self, linear: torch.nn.Linear) -> None:
        super().__init__()
        self._build(*int8_rows(linear.weight), linear.bias)

    @classmethod
    def from_int8(cls, qweight: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None) -> RowW8A8LinearBase:
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

    @staticmethod
    def _rows_scaled(flat: torch.Tensor, levels: float) -> tuple[torch.Tensor, torch.Tensor]:
        """(each row's scale, the rows divided by it): a row's max |x| becomes `levels`. Both layers scale rows here,
        so their 8-bit rows are the same numbers."""
        row_scale = flat.abs().amax(dim=1, keepdim=True).clamp(min=1e-8) / levels
        return row_scale, flat / row_scale


class OneDNNW8A8Linear(RowW8A8LinearBase):
    """W8A8 on oneDNN's prepacked int8 matmul, rows independent: the layer for CPUs with AMX.

    Each row is quantized with its own scale (max |x| ÷ 127), so the kernel sees one fixed activation scale and
    zero point for every call: int8 products summed in int32 are exact in any order, so a row's result is the same
    whether it is fed alone or among others (what losslessness needs of a verifying forward). With AMX tiles its
    cost stays nearly flat up to 16 rows (measured on an AMX VM, issue 20); without AMX it runs on VNNI and was
    measured slower than fbgemm at every row count up to 9 (docs/results.md), hence FbgemmW8A8Linear there.
    """

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self._packed = torch.ops.onednn.qlinear_prepack(qweight, None)
        self._scale = scale.to(torch.float32, copy=True)  # its own memory: see _build
        self._zero = torch.zeros(len(qweight), dtype=torch.long)
        self.packed_weight_bytes = qweight.numel() + 12 * len(qweight)  # int8, a float32 scale and a zero point a row

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        flat = x.reshape(-1, self.in_features).float()
        row_scale, scaled = self._rows_scaled(flat, 127.0)
        # symmetric int8 stored as uint8 around zero point 128, which the kernel takes for activations
        q = scaled.round_().add_(128).to(torch.uint8)
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


class FbgemmW8A8Linear(RowW8A8LinearBase):
    """W8A8 on fbgemm's dynamic int8 GEMM, made row-independent: the layer for CPUs without AMX.

    fbgemm quantizes activations with one scale for the whole tensor, taken from its min and max, so a row's
    result would depend on the other rows fed with it. Here each row is divided by its own scale first and two
    constant inputs (against zero weight columns, so they add nothing) pin the tensor's range: every call quantizes
    with the same scale and zero point, each row at its own resolution, and int32 sums are exact in any order. The
    row's scale is multiplied back afterwards.

    With AVX-512 VNNI, fbgemm sums int8 products straight into int32, so activations keep 8 bits: rows are divided
    by max |x| / 127 and the pins, +127 and -128, make fbgemm's scale exactly 1 and its zero point 128. That is
    OneDNNW8A8Linear's quantization, the same outputs bit for bit: the target's Linear layers compute the same on a
    CPU with AMX and on one without (the heads were trained on AMX's). Without VNNI, fbgemm's 16-bit pair sums
    could saturate at 8 bits: activations keep 7 bits there (reduce_range; rows ÷ max |x|, pins ±1).

    A layer of more than PACK_ROWS output rows (an LM head) is packed in slices of at most that many: fbgemm's
    packing time grows faster than its size (the 1.5B's 151936-row head: 6.1 s whole, 0.4 s for each quarter), and
    each output column is computed alone, so the slices give the same logits bit for bit. The price is ~0.5 ms on
    each forward's 8.5 ms head (measured, docs/results.md).
    """

    PACK_ROWS = 40_000

    def _pack(self, qweight: torch.Tensor, scale: torch.Tensor) -> None:
        self.eight_bits = cpu_has("avx512_vnni")
        self._levels = 127.0 if self.eight_bits else 1.0  # a row's max |x| becomes this
        self._pins = torch.tensor([[127.0, -128.0]] if self.eight_bits else [[1.0, -1.0]])
        pinned = torch.cat([qweight, qweight.new_zeros(len(qweight), self._pins.shape[1])], dim=1)
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
        row_scale, scaled = self._rows_scaled(flat, self._levels)
        if self.eight_bits:  # rounded here, as oneDNN's layer does: fbgemm adds its zero point first, in float32,
            scaled = scaled.round_()  # which moves values a float step from .5 onto it
        pinned = torch.cat([scaled, self._pins.expand(len(flat), -1)], dim=1)
        y = flat.new_empty(len(flat), self.out_features)
        reduce_range = not self.eight_bits
        for start, end, packed in self._packed:
            torch.mul(torch.ops.quantized.linear_dynamic(pinned, packed, reduce_range), row_scale, out=y[:, start:end])
        if self.bias is not None:
            y = y + self.bias
        return y.reshape(*x.shape[:-1], self.out_features).to(x.dtype)


def kernel_format(linear: torch.nn.Module) -> str:
    """A Linear's kernel, as a forward's time depends on it: its class, and "/8-bit" for fbgemm's w8a8 at 8-bit
    activations (where the CPU has VNNI), whose forwards cost a little more than the 7-bit ones timed before it."""
    return type(linear).__name__ + ("/8-bit" if isinstance(linear, FbgemmW8A8Linear) and linear.eight_bits else "")


def cpu_has(flag: str) -> bool:
    """Whether this CPU has a feature, by its name in Linux's CPU flags (amx_int8, avx512_bf16); elsewhere assumed
    not."""
    try:
        lines = Path("/proc/cpuinfo").read_text().splitlines()
    except OSError:
        return False
    return any(flag in line.split() for line in lines if line.startswith("flags"))


def cpu_has_amx() -> bool:
    """Whether this CPU has AMX int8 tiles."""
    return cpu_has("amx_int8")


def w8a8_layer() -> type[RowW8A8LinearBase]:
    """The w8a8 layer measured faster on this kind of CPU: oneDNN with AMX, fbgemm without (docs/results.md)."""
    return OneDNNW8A8Linear if cpu_has_amx() else FbgemmW8A8Linear


# the w8a8 --target-quant values and the layer each builds
W8A8_LAYERS: dict[str, Callable[[], type[RowW8A8LinearBase]]] = {
    "w8a8": w8a8_layer,
    "w8a8-onednn": lambda: OneDNNW8A8Linear,
    "w8a8-fbgemm": lambda: FbgemmW8A8Linear,
}
