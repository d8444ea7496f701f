"""End of turn by sound: Pipecat's Smart Turn v3.2, a small model that hears from the last 8 s of a turn whether the
speaker has finished (intonation, a trailing "and …"), without waiting for the words.

Its weights ship as an int8 ONNX file inside the pipecat-ai wheel, pinned once in pyproject.toml's `turn` extra and
installed with --no-deps: its own dependencies are heavy and only the file is used. The pipecat package is never
imported; the file is found through the distribution's metadata. The model is Whisper-tiny's encoder (4 layers,
384 wide, 400 positions), an attention pooling and a small classifier. It runs here in torch, on a thread of its own
kept to one core: onnxruntime took 43–52 ms a call alone on one core of an Intel Xeon with AMX (its int8 matmuls,
8-bit softmax and element-wise ops), torch in bf16 19 ms with the features (alone, measured; docs/results.md).
"""

from __future__ import annotations

import importlib.metadata as md
import re
import sys
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import TypeVar

import numpy as np
import torch
import torch.nn.functional as F

from specdec import compute
from specdec.quant_layers import cpu_has
from specdec.timing import timed

from .onnx_file import Node, OnnxGraph, read_graph

SAMPLE_RATE = 16_000
WINDOW_S = 8.0  # the model was trained on the last 8 s of a turn
WINDOW = int(WINDOW_S * SAMPLE_RATE)
DISTRIBUTION = "pipecat-ai"
MODEL_FILE = "pipecat/audio/turn/smart_turn/data/smart-turn-v3.2-cpu.onnx"
N_MELS = 80
LAYERS, HEADS = 4, 6
ENCODER = "inner.encoder"
T = TypeVar("T")


def window(audio16k: np.ndarray) -> np.ndarray:
    """The model's input audio: the last 8 s, shorter audio zero-padded at the start (as in training, so the
    speech ends where the window ends, right before the pause)."""
    audio = np.asarray(audio16k, dtype=np.float32)
    if audio.ndim != 1:
        raise ValueError(f"Smart Turn takes mono audio (a 1-D array at 16 kHz), got shape {audio.shape}")
    if audio.size == 0:
        raise ValueError("Smart Turn needs some audio, got an empty array")
    audio = audio[-WINDOW:]
    return np.pad(audio, (WINDOW - audio.size, 0))


def bf16_or_float32() -> torch.dtype:
    """bf16 where the CPU multiplies it in hardware (AMX or AVX-512 BF16), else float32."""
    return torch.bfloat16 if cpu_has("avx512_bf16") or cpu_has("amx_bf16") else torch.float32


class SmartTurn:
    """P(the speaker has finished) for the audio of a turn up to its pause."""

    def __init__(self, path: str | Path | None = None) -> None:
        self.path = Path(path) if path is not None else model_path()
        graph = read_graph(self.path)
        self.features = LogMel()
        # Its own thread, one core, beside the pause's ASR pass and the compute thread: on the compute thread its
        # ~45 ms a pause held up the prefill of the user's words and the early answer (docs/results.md). Built there
        # too: a parallel region on the loading thread would start an OpenMP pool beside the compute thread's.
        # float32 matmuls run on MKL too: those go to the compute thread.
        dtype = bf16_or_float32()
        self._thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="smart-turn")
        alone = dtype == torch.bfloat16 and self._thread.submit(compute.single_threaded).result()
        self._run: Callable[[Callable[[], T]], Future[T]] = self._thread.submit if alone else compute.submit
        self.net: SmartTurnNet = self._run(lambda: SmartTurnNet(graph, dtype)).result()

    def probability(self, audio16k: np.ndarray) -> float:
        """P(finished) in [0, 1] for the turn's audio up to the pause (1-D float32 at 16 kHz)."""
        return self.submit(audio16k).result()[0]

    def submit(self, audio16k: np.ndarray) -> Future[tuple[float, float]]:
        """(P(finished), its cost in seconds), computed on Smart Turn's thread: the cost is the model's own work, not
        the wait for its thread."""
        return self._run(lambda: timed(self._probability_here, audio16k))

    def _probability_here(self, audio16k: np.ndarray) -> float:
        return self.net(torch.from_numpy(self.features(audio16k)))


class LogMel:
    """Whisper's log-mel features (80, 800) of a turn's 8 s window, the waveform normalized as in training.

    faster-whisper's extractor, in numpy: torch's FFT and float32 matmul run on MKL, whose threads ignore Smart Turn's
    one-core setting and started a pool beside the compute thread's in the agent (every LLM forward then ~1.55x
    slower). Equal to transformers' WhisperFeatureExtractor(chunk_length=8), which the model was trained on."""

    def __init__(self) -> None:
        from faster_whisper.feature_extractor import FeatureExtractor  # type: ignore[import-untyped]  # on first use

        self.extractor = FeatureExtractor(feature_size=N_MELS, chunk_length=int(WINDOW_S))

    def __call__(self, audio16k: np.ndarray) -> np.ndarray:
        audio = window(audio16k)
        audio = (audio - audio.mean()) / np.sqrt(audio.var() + 1e-7)
        return self.extractor(audio, padding=0).astype(np.float32)


class SmartTurnNet:
    """Smart Turn v3.2 in torch, from the ONNX file's graph, in dtype (SmartTurn picks bf16_or_float32: a layer in bf16
    ~4 ms on one core of an Intel Xeon with AMX, in float32 ~16 ms). Its int8 weights are dequantized; the file's
    fixed activation scales (onnxruntime rounds every activation, the attention's probabilities included, to 8 bits)
    are not applied, so it computes the float model those weights come from."""

    def __init__(self, graph: OnnxGraph, dtype: torch.dtype) -> None:
        self.dtype = dtype
        weights = _dequantized_weights(graph)
        names = _names(graph)

        def bias(name: str) -> torch.Tensor:
            return _float(graph, f"{name}.bias") if f"{name}.bias" in names else torch.zeros(len(weights[name]))

        def dense(*parts: str) -> Dense:
            """One layer, or several that read the same input fused into one."""
            weight, biases = torch.cat([weights[n] for n in parts]), torch.cat([bias(n) for n in parts])
            return Dense(weight.to(self.dtype), biases.to(self.dtype))

        self.conv1, self.conv2 = dense(f"{ENCODER}.conv1"), dense(f"{ENCODER}.conv2")
        self.positions = _float(graph, f"{ENCODER}.embed_positions.weight").to(self.dtype)
        self.norms = {
            name: (_float(graph, f"{name}.weight").to(self.dtype), _float(graph, f"{name}.bias").to(self.dtype))
            for name in _norm_names()
        }
        layers = [f"{ENCODER}.layers.{i}" for i in range(LAYERS)]
        self.qkv = [dense(*(f"{layer}.self_attn.{p}_proj" for p in "qkv")) for layer in layers]
        self.out = [dense(f"{layer}.self_attn.out_proj") for layer in layers]
        self.mlp = [(dense(f"{layer}.fc1"), dense(f"{layer}.fc2")) for layer in layers]
        self.pool = (dense("inner.pool_attention.0"), dense("inner.pool_attention.2"))
        self.classifier = tuple(dense(f"inner.classifier.{i}") for i in (0, 4, 6))

    @torch.inference_mode()
    def __call__(self, features: torch.Tensor) -> float:
        """P(finished) from the log-mel features (80, 800) of one normalized 8 s window."""
        return self.classify(self.encode(features))

    def encode(self, features: torch.Tensor) -> torch.Tensor:
        """Whisper's encoder: (400, 384), after its final layer norm."""
        x = _conv3(features.to(self.dtype), self.conv1, stride=1)
        x = _conv3(F.gelu(x).T, self.conv2, stride=2)
        h = F.gelu(x) + self.positions
        for i in range(LAYERS):
            q, k, v = self.qkv[i](self._norm(f"{ENCODER}.layers.{i}.self_attn_layer_norm", h)).chunk(3, dim=1)
            q, k, v = (t.reshape(1, len(h), HEADS, -1).transpose(1, 2) for t in (q, k, v))
            attended = F.scaled_dot_product_attention(q, k, v)  # softmax(q kᵀ / √64): the file's two ×64^-¼
            h = h + self.out[i](attended.transpose(1, 2).reshape(len(h), -1))
            fc1, fc2 = self.mlp[i]
            h = h + fc2(F.gelu(fc1(self._norm(f"{ENCODER}.layers.{i}.final_layer_norm", h))))
        return self._norm(f"{ENCODER}.layer_norm", h)

    def classify(self, h: torch.Tensor) -> float:
        """P(finished) from the encoder's states: attention pooling over time, then the classifier."""
        weights = torch.softmax(self.pool[1](torch.tanh(self.pool[0](h))).float(), dim=0)
        x = (h.float() * weights).sum(dim=0, keepdim=True).to(self.dtype)
        first, second, last = self.classifier
        x = F.gelu(second(F.gelu(self._norm("inner.classifier.1", first(x)))))
        return float(torch.sigmoid(last(x).float()))

    def _norm(self, name: str, x: torch.Tensor) -> torch.Tensor:
        weight, bias = self.norms[name]
        return F.layer_norm(x, weight.shape, weight, bias, eps=1e-5)


@dataclass(frozen=True)
class Dense:
    weight: torch.Tensor  # (out, in)
    bias: torch.Tensor

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def _conv3(x: torch.Tensor, layer: Dense, stride: int) -> torch.Tensor:
    """A kernel-3, padding-1 Conv1d over x (channels, time) as one matmul: (time', out), with the weight in its
    (out, in·3) layout."""
    windows = F.pad(x, (1, 1)).unfold(1, 3, stride)  # (in, time', 3)
    return layer(windows.permute(1, 0, 2).reshape(windows.shape[1], -1))


def _norm_names() -> list[str]:
    layers = [f"{ENCODER}.layers.{i}.{n}" for i in range(LAYERS) for n in ("self_attn_layer_norm", "final_layer_norm")]
    return [*layers, f"{ENCODER}.layer_norm", "inner.classifier.1"]


def _names(graph: OnnxGraph) -> set[str]:
    """Every tensor name the graph holds or computes from constants alone (a dequantized weight or bias)."""
    return set(graph.tensors) | {n.outputs[0] for n in graph.nodes if n.op == "DequantizeLinear"}


def _float(graph: OnnxGraph, name: str) -> torch.Tensor:
    """A constant as float32: as stored, or dequantized from its int8/int32 form ((q − zero) · scale)."""
    if name in graph.tensors:
        return torch.from_numpy(graph.tensors[name].astype(np.float32))
    node = graph.producer(name)
    if node is None or node.op != "DequantizeLinear":
        raise ValueError(f"Smart Turn's file has no tensor {name!r}")
    q, scale, zero = (graph.tensors[i] for i in node.inputs)
    if scale.ndim == 1 and q.ndim > 1:  # one scale per channel, along the node's axis (ONNX's default: 1)
        shape = [1] * q.ndim
        shape[node.ints.get("axis", 1)] = len(scale)
        scale, zero = scale.reshape(shape), zero.reshape(shape)
    return torch.from_numpy((q.astype(np.float32) - zero.astype(np.float32)) * scale)


def _dequantized_weights(graph: OnnxGraph) -> dict[str, torch.Tensor]:
    """Every weight by its layer's name, (out, in) in float32 (a convolution's as (out, in·kernel)). MatMul weights
    are stored (in, out) under generated names (val_25): a layer is named by the bias added to its output, and the
    key projection, which has none, by the layer norm it reads."""
    named = {}
    for node in graph.nodes:
        if node.op not in ("MatMul", "Gemm", "Conv"):
            continue
        source = graph.producer(node.inputs[1])
        if source is None or source.op != "DequantizeLinear" or source.inputs[0] not in graph.tensors:
            continue  # attention's two matmuls multiply activations
        weight = _float(graph, node.inputs[1])
        if node.op == "MatMul":
            weight, name = weight.T, _matmul_name(graph, node)
        else:  # Gemm (transB) and Conv hold (out, in[, kernel]) under their layer's name
            name = node.inputs[1].removesuffix("_DequantizeLinear_Output").removesuffix(".weight")
        named[name] = weight.reshape(len(weight), -1).contiguous()
    return named


def _matmul_name(graph: OnnxGraph, node: Node) -> str:
    out = _through_quantization(graph, node.outputs[0], forward=True)
    for user in graph.consumers(out):
        bias = next((i for i in user.inputs if i.endswith(".bias")), None)
        if user.op == "Add" and bias is not None:
            return bias.removesuffix(".bias")
    norm = graph.producer(_through_quantization(graph, node.inputs[0], forward=False))
    if norm is None or norm.op != "LayerNormalization" or not norm.inputs[1].endswith(".self_attn_layer_norm.weight"):
        raise ValueError(f"Smart Turn's file: cannot name the matmul that computes {node.outputs[0]}")
    return norm.inputs[1].removesuffix("self_attn_layer_norm.weight") + "self_attn.k_proj"


def _through_quantization(graph: OnnxGraph, name: str, forward: bool) -> str:
    """The tensor a fake-quantization pair (QuantizeLinear → DequantizeLinear) passes name on as, or came from."""
    for _ in range(2):
        if forward:
            nodes = [n for n in graph.consumers(name) if n.op in ("QuantizeLinear", "DequantizeLinear")]
            if len(nodes) != 1:
                return name
            name = nodes[0].outputs[0]
        else:
            node = graph.producer(name)
            if node is None or node.op not in ("QuantizeLinear", "DequantizeLinear"):
                return name
            name = node.inputs[0]
    return name


def model_path() -> Path:
    """The ONNX file inside the installed pipecat-ai (PackageNotFoundError when it is not installed)."""
    return Path(str(md.distribution(DISTRIBUTION).locate_file(MODEL_FILE)))


def pin() -> str:
    """The `turn` extra's requirement, from pyproject.toml in a checkout, else from specvoice's installed metadata."""
    if sys.version_info >= (3, 11):  # tomllib, like pipecat-ai itself, needs 3.11
        import tomllib

        try:
            pyproject = tomllib.loads((Path(__file__).resolve().parents[1] / "pyproject.toml").read_text())
            return str(pyproject["project"]["optional-dependencies"]["turn"][0])
        except (OSError, KeyError, IndexError, tomllib.TOMLDecodeError):
            pass
    try:
        extra = re.compile(r"""extra\s*==\s*["']turn["']""")
        found = [r.split(";")[0].strip() for r in md.requires("specvoice") or [] if extra.search(r)]
        return found[0] if found else DISTRIBUTION
    except md.PackageNotFoundError:
        return DISTRIBUTION


def load_smart_turn(path: str | Path | None = None) -> tuple[SmartTurn | None, str]:
    """The model and a status line; never raises, as the words rule is the fallback for any failure."""
    fallback = "using the words rule"
    try:
        if path is None:
            version = md.version(DISTRIBUTION)
            source = f"pipecat-ai {version}"
            file = model_path()
        else:
            source, file = str(path), Path(path)
    except md.PackageNotFoundError:
        how = f"pip install --no-deps {pin()}, as scripts/setup.sh does"
        return None, f"end of turn: Smart Turn not loaded (pipecat-ai is not installed: {how}): {fallback}"
    if not file.is_file():
        return None, f"end of turn: Smart Turn not loaded (no model file at {file}): {fallback}"
    try:
        model = SmartTurn(file)
    except Exception as e:  # the reader, a misnamed weight or torch: any failure falls back
        reason = f"{file} fails to load: {type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
        return None, f"end of turn: Smart Turn not loaded ({reason}): {fallback}"
    return model, f"end of turn: Smart Turn v3.2 ({source}) loaded"
