"""Assemble an engine from names: load target and draft, check they can pair, pick the drafter and K."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import torch

from . import compute
from .cost_grid import cached_min_feed
from .drafters import Drafter, DraftModelDrafter, NGramDrafter, OpeningEchoDrafter, restrict_vocab
from .engine import SpeculativeEngine
from .fields import option
from .heads_drafter import HEADS_MIN_PROB, HeadsDrafter
from .heads_file import default_heads_path, load_heads
from .kpolicy import AdaptiveK, FixedK, KPolicy
from .models import (
    PRESETS,
    LoadedModel,
    check_memory,
    estimate_pair_bytes,
    load_model,
    log,
    memory_bytes,
    release_free_memory,
)
from .openings import load_openings
from .quant import TARGET_QUANTS, quantize_linears, replace_linears
from .quant_cache import early_packing, quantized_cache_path
from .quant_layers import w8a8_layer
from .quant_smooth import CALIBRATION_TEXT
from .runner import BatchRunner


class IncompatibleDraftError(ValueError):
    pass


DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass(frozen=True)
class DeviceDefaults:
    """What the options marked (device) take on a device where they are left "" or None."""

    cpu_formats: bool  # the CPU weight formats (specdec/quant.py) run there
    target_quant: str
    draft_quant: str
    draft_min_prob: float  # of the drafter asked about


def device_defaults(device: str, drafter: str = "heads") -> DeviceDefaults:
    """The defaults of `device` (its torch device type, so cuda and cuda:1 alike), the one place they are decided.
    On the CPU, the measured fastest there (docs/results.md, bench-target): the w8a8 target, the int8 draft, and the
    drafter's measured confidence gate (its preset's draft_min_prob; HEADS_MIN_PROB for heads, `drafter` "heads" or
    "heads:FILE"). Elsewhere no CPU format and no gate: those were measured here, where each verified draft costs a
    share of a forward."""
    try:
        on_cpu = torch.device(device).type == "cpu"
    except RuntimeError:
        raise ValueError(f"--device must be cpu, cuda or cuda:N, got {device!r}") from None
    if not on_cpu:
        return DeviceDefaults(False, "none", "none", 0.0)
    if drafter == "heads" or drafter.startswith("heads:"):
        gate = HEADS_MIN_PROB
    else:
        preset = PRESETS.get(drafter)
        gate = preset.draft_min_prob if preset else 0.0
    return DeviceDefaults(True, "w8a8", "int8", gate)


def fixed_k(k: str) -> int | None:
    """--k read: its number of drafts per step, or None for "adaptive"."""
    if k == "adaptive":
        return None
    try:
        fixed = int(k)
    except ValueError:
        raise ValueError(f"--k must be an integer or 'adaptive', got {k!r}") from None
    FixedK(fixed)  # validates
    return fixed


@dataclass(kw_only=True)  # many same-typed fields, easily swapped: every caller names them
class EngineSpec:
    """What to build, each field a command-line option (specdec/fields.py). The fields left "" or None take the
    defaults of `device` (device_defaults) and of the target preset when the spec is made, or for the confidence gate,
    of each drafter when it is built; a CPU-only format asked for on another device is refused then, not swapped."""

    target: str = option("qwen-1.5b", help="preset, local directory or hub id")
    # heads: as fast as the 0.5B draft here, 1.1 GB less memory, and no drafting before the first token, so
    # speculation no longer delays it (docs/results.md).
    draft: str = option(
        "",
        help="draft preset/path/hub id, 'heads' (draft heads on the target), 'ngram' or 'none' (default: the target "
        "preset's draft, qwen-0.5b-instruct for qwen-7b; else heads)",
    )
    heads: str = option(
        "", help="--draft heads: a heads file from `specvoice train-heads` (default: the target's shipped heads)"
    )
    k: str = option("adaptive", help="drafts per step: an integer or 'adaptive'")
    k_min: int = option(3)
    k_max: int = option(6)
    dtype: str = option("bfloat16", choices=tuple(DTYPES))
    device: str = option("cpu", help="cpu, cuda or cuda:N; sets the defaults marked (device)")
    target_quant: str = option(
        "",
        choices=TARGET_QUANTS,
        help="the target's Linear weights: none (--dtype), int8 or int4 weight-only, w8a8 (int8 weights and "
        "per-token int8 activations, on oneDNN where the CPU has AMX, else fbgemm; w8a8-onednn / w8a8-fbgemm pick "
        "one); all but none are CPU formats, all keep speculation lossless against that target (device: w8a8 on "
        "cpu, none on cuda)",
    )
    # cheaper draft forwards, lossless: the target verifies every token
    draft_quant: str = option(
        "",
        choices=("int8", "none"),
        help="int8: the target's w8a8 Linear layers for the draft model and the heads, a CPU format (device: int8 "
        "on cpu, none on cuda)",
    )
    draft_vocab: int = option(0, help="draft LM head over the first N token ids (0: whole vocabulary)")
    disable_by_batch_size: int | None = option(
        None,
        flag="--speculative-disable-by-batch-size",
        at_least=1,
        help="vLLM's meaning: no drafting in a step while more sequences than this are decoding (default: never; "
        "the load-aware K already drops drafts where the measured forward costs say they lose)",
    )
    batched: bool = False  # answers go through a BatchScheduler, batched with each other (the app; bench-load)
    # on: a batch's K chosen from measured forward costs and acceptance (specdec/scheduler.py)
    load_aware: bool = option(
        True,
        help="batched conversations keep their own K policy instead of the K chosen from load and acceptance",
    )
    # None: each drafter's default on the device (gate, device_defaults)
    draft_min_prob: float | None = option(
        None,
        help="stop drafting where the draft's top token has a lower probability (0: always K; device: on cpu the "
        "drafter's value measured there, 0.35 for qwen-0.5b; 0 on cuda)",
    )
    # 3: on the 20 voice prompts, 1.36 tokens per target forward against a chain's 1.30 (docs/results.md)
    draft_tree: int = option(
        3,
        at_least=1,
        help="heads: candidates per node of a draft tree whose best K nodes are verified in one forward, "
        "each seeing only its path (1: a chain of K drafts)",
    )
    # 0: on the 20 voice prompts (AMD EPYC, no AMX) 4 gave 1.37 tokens per target forward against 1.36, and 1.12×
    # against 1.16×: voice answers repeat little, and the grafted rows cost more than they bring (docs/results.md)
    draft_lookup: int = option(
        0,
        at_least=0,
        help="heads drafting a tree: up to this many more nodes, the context's own continuation of its last "
        "tokens (prompt lookup) grafted onto the tree (0: none)",
    )
    # off: drafters.OpeningEchoDrafter is left out
    opening_echo: bool = option(
        True, help="heads draft an answer's opening themselves, instead of from the words of the question"
    )
    opening_table: str = option(
        "",
        help="heads with the opening echo: the answer's first forward verifies first tokens guessed from how the "
        "question begins, by a table of the target's answers (`specvoice corpus openings`); default: the target's "
        "shipped table, where it has one; none: no guesses",
    )
    # in BatchRunner
    compile: bool = option(
        False,
        help="torch.compile the target's dense layer halves (off by default: not faster on this CPU, docs/results.md)",
    )
    auto_off: bool = option(
        True,
        help="never let the governor switch speculation off (with a fixed --k, a sampling seed then "
        "reproduces its answer: see SpeculativeEngine)",
    )

    def __post_init__(self) -> None:
        fixed_k(self.k)  # validates
        device = device_defaults(self.device)
        if not self.draft:
            preset = PRESETS.get(self.target)
            self.draft = preset.draft if preset and preset.draft else "heads"
        self.target_quant = self.target_quant or device.target_quant
        self.draft_quant = self.draft_quant or device.draft_quant
        for option_name, value in (("--target-quant", self.target_quant), ("--draft-quant", self.draft_quant)):
            if value != "none" and not device.cpu_formats:
                raise ValueError(
                    f"{option_name} {value} is a CPU format (specdec/quant.py), not for --device {self.device}: leave "
                    f"{option_name} out there (none)"
                )

    def gate(self, drafter: str) -> float:
        """draft_min_prob for `drafter` (a --draft value): the one given, else the device's default for it."""
        return (
            self.draft_min_prob
            if self.draft_min_prob is not None
            else device_defaults(self.device, drafter).draft_min_prob
        )


# The tiny random pair (float32, whole draft, no int8): instant to load, gibberish answers. For tests and for
# benchmarks of the plumbing (bench-heard) that need no real model.
TINY_ENGINE = EngineSpec(
    target="tiny-random-target",
    draft="tiny-random-draft",
    k="3",
    dtype="float32",
    target_quant="none",
    draft_quant="none",
    draft_vocab=0,
)


def k_policy_factory(k: str, k_min: int = 3, k_max: int = 6) -> Callable[[], KPolicy]:
    """--k read once: what makes each answer's K policy (a new one per answer, AdaptiveK learns within one)."""
    fixed = fixed_k(k)
    if fixed is None:
        return lambda: AdaptiveK(k_min, k_max)
    return lambda: FixedK(fixed)


def check_pair(target: LoadedModel, draft: LoadedModel) -> None:
    """Token-level drafting needs the same ids for the same strings."""
    if target.tokenizer.vocab_fingerprint() != draft.tokenizer.vocab_fingerprint():
        raise IncompatibleDraftError(
            f"draft {draft.name!r} uses a different tokenizer than target {target.name!r}: its token ids "
            "mean other strings, so its drafts cannot be verified token by token. Pick a draft from the "
            "target's family (e.g. qwen-0.5b for qwen-1.5b) or use --draft ngram."
        )


def prepare_draft_model(draft: LoadedModel, spec: EngineSpec, target: LoadedModel) -> Callable[[], Drafter]:
    """Apply the cost levers once; each answer then gets a drafter with its own KV cache."""
    model = draft.model
    # The draft's q spans the target's p even where the draft's head is narrower: the same tokenizer, but Qwen2.5-7B
    # pads its head to 152064 rows and the 0.5B to 151936. The rows it lacks are never drafted.
    vocab, rows = target.model.config.vocab_size, model.get_output_embeddings().out_features
    keep_ids = None
    if 0 < spec.draft_vocab < rows:
        ids = set(range(spec.draft_vocab)) | target.tokenizer.eos_token_ids
        keep_ids = torch.tensor(sorted(ids), device=draft.device)
        restrict_vocab(model, keep_ids)
    elif rows < vocab:
        keep_ids = torch.arange(rows, device=draft.device)
    if spec.draft_quant == "int8":
        quantize_linears(model, "w8a8")  # the target's w8a8 layers, without its smoothing
    elif spec.draft_quant != "none":
        raise ValueError(f"--draft-quant must be int8 or none, got {spec.draft_quant!r}")
    runner = BatchRunner(model, draft.device)
    runner.min_feed = cached_min_feed(runner, draft.name)
    min_prob = spec.gate(draft.name)
    return lambda: DraftModelDrafter(runner, keep_ids, vocab, min_prob)


def quantize_target(target: LoadedModel, quant: str) -> None:
    """The target's Linear layers in `quant` (specdec/quant.py), in place."""
    if quant == "none":
        return
    calibration = torch.tensor([target.tokenizer.encode(CALIBRATION_TEXT)], device=target.device)
    quantize_linears(target.model, quant, calibration, quantized_cache_path(target.model, quant, target.name))
    target.dtype = torch.float32  # what the unquantized rest computes in now


def heads_drafter_factory(spec: EngineSpec, target: LoadedModel, path: Path) -> Callable[[], Drafter]:
    """Draft heads for the target (call before it is quantized: they copy float rows of its LM head), int8 on the CPU
    with --draft-quant int8 (the same row-wise w8a8 layers as the target's)."""
    heads = load_heads(path, target.model, spec.target).to(target.device)
    if spec.draft_quant == "int8":
        replace_linears(heads, w8a8_layer())
    min_prob = spec.gate("heads")
    log(f"draft heads: {heads.cfg.kind}, {len(heads.vocab_ids)}-token vocabulary, {spec.draft_quant}, from {path}")

    def heads_drafter() -> HeadsDrafter:
        return HeadsDrafter(heads, min_prob, spec.draft_tree, spec.draft_lookup)

    if not spec.opening_echo:
        return heads_drafter
    openings = load_openings(spec.opening_table, spec.target)
    if openings is not None:
        log(f"opening guesses: {len(openings.firsts)} question beginnings, counted over {openings.answers} answers")
    return lambda: OpeningEchoDrafter(heads_drafter(), target.tokenizer, target.device, openings, spec.draft_tree)


NOT_MODELS = ("none", "ngram", "heads")  # --draft values that load no draft model


def heads_path(name: str, spec: EngineSpec) -> Path | None:
    """The heads file a drafter name asks for: "heads" (--heads, else the target's shipped ones) or "heads:FILE"
    (bench compares several); None for other drafters."""
    if name == "heads":
        return Path(spec.heads) if spec.heads else default_heads_path(spec.target)
    return Path(name.removeprefix("heads:")) if name.startswith("heads:") else None


def build_engine(spec: EngineSpec) -> tuple[SpeculativeEngine, LoadedModel]:
    engines, target, _ = build_engines(spec, [spec.draft])
    return engines[spec.draft], target


def build_engines(
    spec: EngineSpec, drafts: list[str]
) -> tuple[dict[str, SpeculativeEngine], LoadedModel, dict[str, int]]:
    """One target and an engine for each --draft value in `drafts`, all sharing that target (spec.draft is not
    read); and the memory each drafter added while it was made (memory_bytes: on the target's device), which bench
    compares."""
    dtype = DTYPES.get(spec.dtype)
    if dtype is None:
        raise ValueError(f"--dtype must be one of {', '.join(DTYPES)}, got {spec.dtype!r}")
    heads = {name: path for name in drafts if (path := heads_path(name, spec)) is not None}
    models = [d for d in drafts if d not in NOT_MODELS and d not in heads]
    # packs while transformers imports and the model loads
    early_packing.start(spec.target, spec.target_quant, spec.dtype)
    check_memory(estimate_pair_bytes([spec.target, *models], dtype), torch.device(spec.device))
    target = load_model(spec.target, dtype, spec.device)
    factories: dict[str, Callable[[], Drafter] | None] = {"none": None, "ngram": lambda: NGramDrafter(target.device)}
    added = {"none": 0, "ngram": 0}

    # What a drafter adds, not what the load was still doing: the early packing's layers would count as the first
    # drafter's, and so would the target's memory-mapped LM head, whose rows the heads copy (171 MB of its pages,
    # docs/results.md) and which the target's first forward reads whole anyway.
    early_packing.wait()
    if target.device.type == "cpu":
        target.model.get_output_embeddings().weight.sum()

    def make(name: str, build: Callable[[], Callable[[], Drafter]]) -> None:
        release_free_memory()
        before = memory_bytes(target.device)
        factories[name] = build()
        release_free_memory()
        added[name] = memory_bytes(target.device) - before

    for name, path in heads.items():  # before the target is quantized: the heads copy float rows of its LM head

        def load(path: Path = path) -> Callable[[], Drafter]:
            return heads_drafter_factory(spec, target, path)

        make(name, load)
    quantize_target(target, spec.target_quant)
    for name in models:

        def load_draft(name: str = name) -> Callable[[], Drafter]:
            draft = load_model(name, dtype, spec.device)
            check_pair(target, draft)
            return prepare_draft_model(draft, spec, target)

        make(name, load_draft)
    # The target's first forward comes after the draft is ready: its memory-mapped weights are paged in only then,
    # so the draft's load-time temporaries never add to them (the app's peak RSS was 6.7 GiB, now its steady 5.0).
    # A quantized target's rows must not depend on each other (lossless verification): row-by-row attention.
    runner = BatchRunner(target.model, target.device, exact_rows=spec.target_quant != "none", compile=spec.compile)
    runner.min_feed = cached_min_feed(runner, target.name)
    if runner.min_feed > 1:
        log(f"{target.name}: one-token steps are fed as two (a one-row matmul is slower here)")
    k_policy = k_policy_factory(spec.k, spec.k_min, spec.k_max)
    engines = {
        name: SpeculativeEngine(target, runner, factories[name], k_policy, spec.disable_by_batch_size, spec.auto_off)
        for name in drafts
    }
    compute.release_workers()  # this thread's loading is done: its OpenMP workers must not slow the forwards
    return engines, target, {name: added[name] for name in drafts}
