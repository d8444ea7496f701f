"""What an ONNX file holds, read without the onnx package: its constant tensors and its nodes.

Smart Turn's weights ship only as an ONNX file (inside the pipecat-ai wheel); this reads them so that torch can run
the model (pipeline/smart_turn.py). ONNX is protobuf; only the few fields read here are decoded (onnx.proto3:
ModelProto.graph = 7; GraphProto.node = 1, .initializer = 5; NodeProto.input = 1, .output = 2, .op_type = 4,
.attribute = 5; AttributeProto.name = 1, .i = 3; TensorProto.dims = 1, .data_type = 2, .float_data = 4,
.int32_data = 5, .int64_data = 7, .name = 8, .raw_data = 9).
"""

from __future__ import annotations

import struct
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

# TensorProto.DataType → numpy
_DTYPES = {1: np.float32, 2: np.uint8, 3: np.int8, 6: np.int32, 7: np.int64}
_VARINT, _FIXED64, _BYTES, _FIXED32 = 0, 1, 2, 5


@dataclass(frozen=True)
class Node:
    op: str
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    ints: dict[str, int]  # its integer attributes (DequantizeLinear's axis)


@dataclass(frozen=True)
class OnnxGraph:
    nodes: tuple[Node, ...]
    tensors: dict[str, np.ndarray]  # the initializers, by name

    def producer(self, name: str) -> Node | None:
        return next((n for n in self.nodes if name in n.outputs), None)

    def consumers(self, name: str) -> list[Node]:
        return [n for n in self.nodes if name in n.inputs]


def read_graph(path: str | Path) -> OnnxGraph:
    """The graph's nodes (in file order) and constant tensors. ValueError on a file that is not ONNX."""
    data = Path(path).read_bytes()
    try:
        graphs = [value for field, value in _fields(data) if field == 7]
        if not graphs:
            raise ValueError("no graph")
        nodes, tensors = [], {}
        for field, value in _fields(graphs[0]):
            if field == 1:
                nodes.append(_node(value))
            elif field == 5:
                name, array = _tensor(value)
                tensors[name] = array
    except (ValueError, IndexError, KeyError, struct.error) as e:
        raise ValueError(f"{path} is not a readable ONNX model ({e})") from e
    return OnnxGraph(tuple(nodes), tensors)


def _node(data: memoryview) -> Node:
    fields = list(_fields(data))
    op = next(bytes(v).decode() for f, v in fields if f == 4)
    inputs = tuple(bytes(v).decode() for f, v in fields if f == 1)
    ints = {}
    for attribute in (v for f, v in fields if f == 5):
        parts = dict(_fields(attribute))
        if isinstance(parts.get(3), int):
            ints[bytes(parts[1]).decode()] = _signed(parts[3])
    return Node(op, inputs, tuple(bytes(v).decode() for f, v in fields if f == 2), ints)


def _tensor(data: memoryview) -> tuple[str, np.ndarray]:
    dims: list[int] = []
    name, dtype, raw = "", 0, None
    typed: list[float | int] = []
    for field, value in _fields(data):
        if field == 1:
            dims.extend([value] if isinstance(value, int) else _packed_varints(value))
        elif field == 2:
            dtype = value
        elif field == 4:  # float_data, packed
            typed.extend(struct.unpack(f"<{len(value) // 4}f", value))
        elif field in (5, 7):  # int32_data (also holds int8/uint8) and int64_data: packed varints
            typed.extend(_signed(v) for v in ([value] if isinstance(value, int) else _packed_varints(value)))
        elif field == 8:
            name = bytes(value).decode()
        elif field == 9:
            raw = bytes(value)
    np_dtype = _DTYPES[dtype]
    array = np.frombuffer(raw, np_dtype).copy() if raw is not None else np.asarray(typed).astype(np_dtype)
    return name, array.reshape(dims)


def _signed(v: int) -> int:
    return v - (1 << 64) if v >= 1 << 63 else v  # negative int32/int64 values are 10-byte two's complement varints


def _varint(data: bytes | memoryview, i: int) -> tuple[int, int]:
    result = shift = 0
    while True:
        byte = data[i]
        i += 1
        result |= (byte & 0x7F) << shift
        shift += 7
        if byte < 0x80:
            return result, i


def _packed_varints(data: memoryview) -> list[int]:
    out, i = [], 0
    while i < len(data):
        v, i = _varint(data, i)
        out.append(v)
    return out


def _fields(data: bytes | memoryview) -> Iterator[tuple[int, Any]]:
    """(field number, value) of a protobuf message: an int for varints, a memoryview of the bytes for the rest."""
    view, i = memoryview(data), 0
    while i < len(data):
        key, i = _varint(data, i)
        field, wire = key >> 3, key & 7
        if wire == _VARINT:
            value, i = _varint(data, i)
            yield field, value
            continue
        size = {_FIXED64: 8, _FIXED32: 4}.get(wire)
        if size is None:
            if wire != _BYTES:
                raise ValueError(f"unknown protobuf wire type {wire}")
            size, i = _varint(data, i)
        if i + size > len(data):
            raise ValueError("truncated message")
        yield field, view[i : i + size]
        i += size
