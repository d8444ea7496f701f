"""The draft heads file: safetensors with the trained weights, the draft vocabulary and the config, and the checks
that it fits the target it is loaded for."""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .heads_model import DraftHeads, HeadsConfig
from .models import asset_path

if TYPE_CHECKING:
    from transformers import PreTrainedModel


def save_heads(heads: DraftHeads, path: Path, extra: dict | None = None) -> None:
    from safetensors.torch import save_file

    tensors = {k: v.detach().to(torch.bfloat16).contiguous() for k, v in heads.trained_state().items()}
    tensors["vocab_ids"] = heads.vocab_ids.to(torch.int32).cpu()
    meta = {"config": json.dumps(asdict(heads.cfg)), "extra": json.dumps(extra or {})}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".partial")
    save_file(tensors, str(tmp), metadata=meta)
    tmp.rename(path)


def read_heads(path: Path) -> tuple[DraftHeads, dict]:
    """Heads from a file written by save_heads (not yet attached to a target), and the training facts it records."""
    from safetensors import safe_open

    if not path.exists():
        raise FileNotFoundError(f"no draft heads at {path}: train them with `specvoice train-heads`")
    try:
        with safe_open(str(path), framework="pt") as f:
            meta = f.metadata() or {}
            tensors = {k: f.get_tensor(k) for k in f.keys()}
        cfg = HeadsConfig(**json.loads(meta["config"]))
        heads = DraftHeads(cfg, tensors.pop("vocab_ids").long())
        result = heads.load_state_dict({k: v.float() for k, v in tensors.items()}, strict=False)
        extra = json.loads(meta.get("extra", "{}"))
    except Exception as e:  # safetensors' own errors, a missing key, a bad config: one clear message
        raise ValueError(f"{path} is not a draft heads file from `specvoice train-heads`: {e}") from e
    if result.unexpected_keys or set(result.missing_keys) != {"lm.weight"}:  # lm comes from the target
        missing = sorted(set(result.missing_keys) - {"lm.weight"})
        raise ValueError(f"{path} does not match its config: missing {missing}, unexpected {result.unexpected_keys}")
    return heads.eval(), extra


def default_heads_path(target: str) -> Path:
    """The shipped heads for a target preset: assets/heads/<target>.safetensors."""
    return asset_path("heads", f"{target}.safetensors")


def load_heads(path: Path, target_model: PreTrainedModel, target_name: str) -> DraftHeads:
    heads, _ = read_heads(path)
    if heads.cfg.target and heads.cfg.target != target_name:
        raise ValueError(
            f"the draft heads in {path} were trained for {heads.cfg.target!r}, not {target_name!r}: they read that "
            "model's hidden states. Train heads for this target with `specvoice train-heads --target ...`."
        )
    head = target_model.get_output_embeddings()
    if head.weight.shape != (heads.cfg.vocab_size, heads.cfg.hidden):
        raise ValueError(f"the draft heads in {path} do not fit this target's LM head {tuple(head.weight.shape)}")
    heads.attach(target_model.get_input_embeddings(), head.weight)
    return heads
