"""Training data for draft heads, made offline by self-distillation: the target answers training prompts greedily,
and every position's last hidden state (the input of its LM head) is kept with the tokens. Or from the corpus of
answers as token ids (specdec/corpus.py), the features recomputed by a teacher-forced prefill (corpus_dataset),
also those of the layers EAGLE-3 heads fuse.

Written in shards, one per batch of prompts (or per corpus shard), so a stopped run resumes at the first missing one.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from .corpus import check_recipe, digest, fingerprint, read_rows
from .kv import Feed, SequenceCache
from .models import LoadedModel
from .runner import BatchRunner

if TYPE_CHECKING:
    from transformers import PreTrainedModel


@dataclass
class Sequence:
    tokens: list[int]  # prompt + answer (cut after the answer's first EOS), or a passage of text
    answer_start: int  # the first position whose next token is learnt (the first answer token; 1 for text)
    # (len(tokens) - 1, width), bf16: the target's last hidden state at each position (width = hidden), or the
    # states of the layers fused heads read, side by side (HeadsConfig.fuse_layers)
    features: torch.Tensor
    labels: list[int]  # len(tokens) - 1: the target's greedy choice after each position
    # the target's own greedy answer (held out and replayed as such); else a passage of text or a sampled answer,
    # whose labels are the target's greedy choices, not its next tokens
    is_answer: bool = True

    @classmethod
    def from_row(cls, row: dict) -> Sequence:
        tokens = row["tokens"].tolist()
        if "labels" in row:
            return cls(tokens, int(row["answer_start"]), row["features"], row["labels"].tolist(), is_answer=False)
        return cls(tokens, int(row["answer_start"]), row["features"], tokens[1:])  # a greedy answer's own choices

    def to_row(self) -> dict:
        """What a shard stores (from_row reads it back): the labels only where they are not the next tokens."""
        row = {"tokens": torch.tensor(self.tokens), "answer_start": self.answer_start, "features": self.features}
        return row if self.is_answer else {**row, "labels": torch.tensor(self.labels)}


def shard_path(work: Path, index: int, kind: str = "shard") -> Path:
    return work / "data" / f"{kind}_{index:04d}.pt"


def load_shards(work: Path) -> list[Sequence]:
    """Every recorded sequence: the answers (shard_*), then the text passages (text_*)."""
    return read_sequences(sorted((work / "data").glob("shard_*.pt")) + sorted((work / "data").glob("text_*.pt")))


def read_sequences(paths: list[Path]) -> list[Sequence]:
    """Features memory-mapped from the shards: file pages the kernel can drop, not resident memory (a run that read
    EAGLE-3's fused features of 46 corpus shards, 10.6 GB, into memory was ended by the OOM killer)."""
    return [Sequence.from_row(row) for path in paths for row in torch.load(path, weights_only=True, mmap=True)]


def _save_shard(rows: list[dict], path: Path) -> None:
    tmp = path.with_suffix(".partial")
    torch.save(rows, tmp)
    tmp.rename(path)


def _check_recipe(path: Path, recipe: dict) -> None:
    check_recipe(path, recipe, hint="use another --work or delete it")


def _final_norm(model: PreTrainedModel) -> torch.nn.Module:
    """The module whose output is the LM head's input (Qwen2, Llama: model.model.norm)."""
    norm = getattr(model.get_decoder(), "norm", None)
    if norm is None:
        raise ValueError("draft heads need a decoder with a final norm (model.model.norm)")
    return norm


@torch.inference_mode()
def generate_batch(target: LoadedModel, prompts: list[list[int]], max_new_tokens: int, eos: set[int]) -> list[Sequence]:
    """Greedy answers to `prompts` in one left-padded batch, with the features every forward computed."""
    pad = sorted(eos)[0]
    width = max(len(p) for p in prompts)
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    captured: list[torch.Tensor] = []
    handle = _final_norm(target.model).register_forward_hook(
        lambda module, args, out: captured.append(out.detach().to(torch.bfloat16))
    )
    try:
        out = target.model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            eos_token_id=sorted(eos),
            pad_token_id=pad,
        )
    finally:
        handle.remove()
    feats = torch.cat(captured, dim=1)  # (B, width + generated - 1, H): the last token is never fed
    seqs = []
    for b, prompt in enumerate(prompts):
        answer = out[b, width:].tolist()
        ends = [i for i, t in enumerate(answer) if t in eos]
        answer = answer[: ends[0] + 1] if ends else answer
        lead = width - len(prompt)
        tokens = prompt + answer
        seqs.append(Sequence(tokens, len(prompt), feats[b, lead : lead + len(tokens) - 1].clone(), tokens[1:]))
    return seqs


def make_dataset(
    target: LoadedModel,
    prompts: list[list[int]],
    work: Path,
    max_new_tokens: int,
    batch_size: int,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Answer every prompt (sorted by length, so batches pad little), one shard per batch; existing shards are
    kept, so a stopped run resumes where it was."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    n_batches = math.ceil(len(order) / batch_size)
    recipe = {"prompts": fingerprint(prompts), "max_new_tokens": max_new_tokens, "batch_size": batch_size}
    _check_recipe(work / "data" / "recipe.json", recipe)
    eos = target.tokenizer.eos_token_ids
    for index in range(n_batches):
        path = shard_path(work, index)
        if not path.exists():
            batch = [prompts[i] for i in order[index * batch_size : (index + 1) * batch_size]]
            _save_shard([s.to_row() for s in generate_batch(target, batch, max_new_tokens, eos)], path)
        progress(index + 1, n_batches)


@torch.inference_mode()
def text_batch(target: LoadedModel, passages: list[list[int]]) -> list[dict]:
    """Teacher-forced over equal-length passages: features and the target's greedy choice at every position."""
    ids = torch.tensor(passages, device=target.device)
    hidden = target.model.get_decoder()(input_ids=ids).last_hidden_state[:, :-1]
    head = target.model.get_output_embeddings()
    labels = torch.stack([head(h).argmax(-1) for h in hidden])  # one passage at a time: its logits are 150 MB
    return [
        {"tokens": ids[b].cpu(), "answer_start": 1, "features": hidden[b].to(torch.bfloat16).cpu(), "labels": labels[b]}
        for b in range(len(passages))
    ]


def make_text_dataset(
    target: LoadedModel,
    text: str,
    work: Path,
    passage_tokens: int,
    batch_size: int,
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> None:
    """Features and greedy choices of the target over `text`, cut into passages: more to learn from than its
    answers alone (EAGLE trains on fixed text with the target's own features too). Resumable like make_dataset."""
    ids = target.tokenizer.encode(text)
    passages = [ids[i : i + passage_tokens] for i in range(0, len(ids) - passage_tokens + 1, passage_tokens)]
    _check_recipe(work / "data" / "text_recipe.json", {"text": fingerprint(text), "passage_tokens": passage_tokens})
    n_batches = math.ceil(len(passages) / batch_size)
    for index in range(n_batches):
        path = shard_path(work, index, "text")
        if not path.exists():
            _save_shard(text_batch(target, passages[index * batch_size : (index + 1) * batch_size]), path)
        progress(index + 1, n_batches)


def shipped_text(limit_chars: int) -> str:
    """English prose every Python installation ships: the language reference topics behind help() (pydoc_data)."""
    from pydoc_data.topics import topics

    return "\n\n".join(topics[name] for name in sorted(topics))[:limit_chars]


@torch.inference_mode()
def teacher_forced(
    target: LoadedModel,
    rows: list[dict],
    layer_sets: tuple[tuple[int, ...], ...] = ((),),
    batch_tokens: int = 4096,
) -> Iterator[list[Sequence]]:
    """Sequences from corpus rows (prompt_ids + answer_ids, specdec/corpus.py) with the target's features recomputed
    by a teacher-forced prefill: rows packed into forwards of up to batch_tokens positions (runner.BatchRunner: no
    padding; on an AMX CPU a forward of many rows costs little more than one). For each row, one sequence per set of
    layer_sets, whose features are the final norm's output (()) or those layers' states side by side: one prefill
    serves heads of every kind."""
    runner = BatchRunner(target.model, target.device)  # fused attention: training data needs no bit-exact rows
    fused = sorted({i for layers in layer_sets for i in layers})
    keep = (*fused, runner.n_layers)  # and the final norm's output: a sampled answer's labels come from it
    heads = _PromptHeads(runner, keep)
    for group in _packed(rows, batch_tokens):
        started = [heads.cache_for(row["prompt_ids"]) for row in group]
        runner.extend([Feed(c, row["prompt_ids"] + row["answer_ids"][:-1]) for row, (c, _) in zip(group, started)])
        for row, (cache, head) in zip(group, started):
            yield _forced_sequences(target, row, _PromptHeads.hidden(cache, head), keep, layer_sets)


class _PromptHeads:
    """Prompts that begin alike (a chat template's system turn: about 30 % of a corpus row's tokens) computed once:
    a row's cache starts with the keys and values of the longest head it shares with an earlier prompt, and only the
    rest is fed. The first prompts (up to `most`) that share too little with those before become the ones shared."""

    def __init__(self, runner: BatchRunner, keep: tuple[int, ...], shortest: int = 8, most: int = 4) -> None:
        self.runner, self.keep, self.shortest, self.most = runner, keep, shortest, most
        self.prompts: list[SequenceCache] = []  # whole prompts, fed alone: hidden holds each position's states

    def _new_cache(self) -> SequenceCache:
        cache = self.runner.new_cache()
        cache.keep_hidden, cache.keep_layers = True, self.keep
        return cache

    def cache_for(self, prompt: list[int]) -> tuple[SequenceCache, torch.Tensor | None]:
        """A cache holding the longest head of `prompt` computed before (if long enough to share), and that head's
        kept states (None: nothing shared)."""
        n, best = max(((p.common_prefix(prompt), p) for p in self.prompts), key=lambda x: x[0], default=(0, None))
        if n < self.shortest and len(self.prompts) < self.most:
            best = self._new_cache()
            self.runner.extend([Feed(best, prompt)])
            n = len(prompt)
            self.prompts.append(best)
        cache = self._new_cache()
        if best is None or n < self.shortest:
            return cache, None
        assert best.hidden is not None
        cache.copy_prefix(best, n)
        return cache, best.hidden[:n]

    @staticmethod
    def hidden(cache: SequenceCache, head: torch.Tensor | None) -> torch.Tensor:
        """The kept states of every position the cache holds but the last: its shared head's, then what was fed."""
        assert cache.hidden is not None
        return cache.hidden if head is None else torch.cat([head[: cache.hidden_start], cache.hidden])


def _packed(rows: list[dict], budget: int) -> Iterator[list[dict]]:
    """Consecutive rows, as many as `budget` fed positions hold (one at least)."""
    group: list[dict] = []
    size = 0
    for row in rows:
        n = len(row["prompt_ids"]) + len(row["answer_ids"]) - 1
        if group and size + n > budget:
            yield group
            group, size = [], 0
        group.append(row)
        size += n
    if group:
        yield group


def _forced_sequences(
    target: LoadedModel, row: dict, hidden: torch.Tensor, keep: tuple[int, ...], layer_sets: tuple[tuple[int, ...], ...]
) -> list[Sequence]:
    """hidden: the states of the layers `keep` side by side (the final norm's output last) at every position but
    the last; one sequence per set of layer_sets."""
    tokens = row["prompt_ids"] + row["answer_ids"]
    start = len(row["prompt_ids"])
    states = hidden.split(target.model.config.hidden_size, dim=-1)  # one per kept layer
    final = states[-1]
    is_answer = row["temperature"] == 0
    labels = tokens[1:]
    if not is_answer:  # a sampled answer: the heads learn the target's greedy choice after each of its positions
        head = target.model.get_output_embeddings()
        labels = tokens[1:start] + [int(t) for chunk in final[start - 1 :].split(256) for t in head(chunk).argmax(-1)]
    return [
        Sequence(
            tokens,
            start,
            (torch.cat([states[keep.index(i)] for i in layers], -1) if layers else final).to(torch.bfloat16).cpu(),
            labels,
            is_answer=is_answer,
        )
        for layers in layer_sets
    ]


def corpus_dataset(
    target: LoadedModel,
    quant: str,
    shards: list[Path],
    work: Path,
    fuse_layers: tuple[int, ...] = (),
    batch_tokens: int = 4096,
    progress: Callable[[int, int], None] = lambda done, total: None,
    also: tuple[tuple[int, ...], ...] = (),
) -> list[Path]:
    """The features of the corpus's answer shards, by teacher_forced: one feature shard per answer shard, in a folder
    of work/corpus/ per recipe (target, quant, dtype, fuse_layers), named by the answer shard's content, so a stopped
    run resumes at the first missing one and a remade answer shard is read anew. also: other sets of fused layers
    ((): the final norm's output) whose features the same prefill caches in their recipes' folders, for heads of
    another kind later. Returns the feature shards' paths for fuse_layers (read_sequences reads them)."""
    layer_sets = (fuse_layers, *dict.fromkeys(layers for layers in also if layers != fuse_layers))
    folders = []
    for layers in layer_sets:
        recipe = {"target": target.name, "quant": quant, "dtype": str(target.dtype), "fuse_layers": list(layers)}
        folders.append(work / "corpus" / digest(recipe))
        _check_recipe(folders[-1] / "recipe.json", recipe)
    paths = []
    for i, shard in enumerate(shards):
        content = hashlib.sha256(shard.read_bytes()).hexdigest()[:12]
        name = f"{shard.name.split('.')[0]}-{content}.pt"
        missing = [
            (layers, folder / name) for layers, folder in zip(layer_sets, folders) if not (folder / name).exists()
        ]
        if missing:
            made: list[list[dict]] = [[] for _ in missing]
            for seqs in teacher_forced(target, read_rows(shard), tuple(layers for layers, _ in missing), batch_tokens):
                for rows, seq in zip(made, seqs):
                    rows.append(seq.to_row())
            for rows, (_, path) in zip(made, missing):
                _save_shard(rows, path)
        paths.append(folders[0] / name)
        progress(i + 1, len(shards))
    return paths
