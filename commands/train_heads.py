"""`specvoice train-heads`: draft heads for a target, trained here on its own answers (self-distillation).

1. The target (in the format it will run in) answers the training prompts greedily, batched; every position's
   last hidden state is kept (shards in --work; a stopped run resumes at the first missing shard). With --corpus,
   the corpus's answers (`specvoice corpus`) are read instead, their features recomputed by a teacher-forced
   prefill (shards in --work too), also those of the layers EAGLE-3 heads fuse (--fuse-layers).
2. The heads learn to predict the target's next tokens from those states (checkpointed in --work; resumed).
3. The heads are written to --out (the shipped ones: assets/heads/<target>.safetensors), and replayed on the
   held-out answers: acceptance by draft position, in the log and the --json report.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from dataclasses import asdict
from pathlib import Path

import torch
from tqdm import tqdm

from pipeline.llm import SYSTEM_PROMPT
from specdec import compute
from specdec.bench import read_prompts
from specdec.build import DTYPES, EngineSpec, quantize_target
from specdec.corpus import digest
from specdec.heads_data import (
    Sequence,
    corpus_dataset,
    load_shards,
    make_dataset,
    make_text_dataset,
    read_sequences,
    shipped_text,
)
from specdec.heads_file import default_heads_path, save_heads
from specdec.heads_model import HEAD_KINDS
from specdec.heads_train import (
    VOCAB_SIZES,
    TrainConfig,
    eagle3_layers,
    fit_heads,
    fmt,
    fmt_accs,
    heads_config,
    simulated_acceptance,
    split,
    trained_heads_config,
    vocab_coverage,
)
from specdec.models import LoadedModel, asset_path, cache_dir, load_model, log
from specdec.quant import TARGET_QUANTS

from .options import positive_int

TRAIN_PROMPTS = asset_path("prompts", "train_prompts.jsonl")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d, t = EngineSpec(), TrainConfig()
    parser.add_argument("--target", default=d.target)
    parser.add_argument("--target-quant", default=d.target_quant, choices=list(TARGET_QUANTS))
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    parser.add_argument("--kind", default=t.kind, choices=list(HEAD_KINDS))
    parser.add_argument(
        "--prompts",
        default=str(TRAIN_PROMPTS),
        help="JSONL training requests (default: the 600 shipped ones, kept apart from every benchmark prompt)",
    )
    parser.add_argument("--limit", type=int, default=0, help="use only the first N prompts")
    parser.add_argument(
        "--corpus",
        default="",
        help="train on this corpus's answers (`specvoice corpus`, e.g. assets/corpus) instead of answering --prompts "
        "and reading --text-chars",
    )
    parser.add_argument(
        "--corpus-shards",
        type=int,
        default=0,
        help="with --corpus: only its first N answer shards (0: all), so that a heads file can be made again from the "
        "same data while the corpus grows",
    )
    parser.add_argument(
        "--fuse-layers",
        default="",
        help="eagle with --corpus: the target layers fused into its input (EAGLE-3), as hidden_states indices "
        "'2,14,25', or 'auto' for EAGLE-3's 2, L/2, L-3; '' (default): the final norm's output",
    )
    parser.add_argument(
        "--also-cache",
        default=None,
        metavar="FUSE_LAYERS",
        help="with --corpus: the same prefill also caches the features of heads fusing these layers (as "
        "--fuse-layers takes them; '' for the final norm's output, medusa's), which a later run of the other kind "
        "reads instead of prefilling the corpus again",
    )
    parser.add_argument(
        "--reads-token",
        action="store_true",
        help="medusa: every block also reads the token after its feature (the one the target just emitted)",
    )
    parser.add_argument(
        "--reads-draft",
        action="store_true",
        help="medusa with --reads-token: every block after the first also reads the token drafted before its own",
    )
    parser.add_argument(
        "--block-layers",
        type=positive_int,
        default=t.block_layers,
        help="medusa: residual layers in each block (1: Medusa's own)",
    )
    parser.add_argument(
        "--ttt-steps", type=positive_int, default=t.ttt_steps, help="eagle: draft positions trained at once"
    )
    parser.add_argument(
        "--text-chars",
        type=int,
        default=250_000,
        help="also learn from the target's states over this much shipped text (Python's pydoc topics); 0: none",
    )
    parser.add_argument("--passage-tokens", type=positive_int, default=256, help="text passage length")
    parser.add_argument("--max-new-tokens", type=positive_int, default=96, help="answer length cap")
    parser.add_argument("--batch-size", type=positive_int, default=48, help="prompts answered per batched forward")
    parser.add_argument("--vocab", type=positive_int, default=t.vocab, help="draft vocabulary: most frequent tokens")
    parser.add_argument("--epochs", type=positive_int, default=t.epochs)
    parser.add_argument("--lr", type=float, default=t.lr)
    parser.add_argument("--weight-decay", type=float, default=t.weight_decay, help="AdamW's weight decay")
    parser.add_argument(
        "--feature-noise",
        type=float,
        default=t.feature_noise,
        help="training only: uniform noise of ± this × the features' std on the features the heads read (EAGLE's)",
    )
    parser.add_argument("--work", default="", help="data and checkpoints (default: the cache, per target)")
    parser.add_argument("--out", default="", help="heads file (default: the shipped assets/heads/<target>)")
    parser.add_argument("--json", default="", help="write the training report here")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")


def training_prompts(tokenizer, rows: list[dict]) -> list[list[int]]:
    """Alternately in the voice agent's format (its system prompt) and the bench's (the chat template's own)."""
    out = []
    for i, row in enumerate(rows):
        system = [{"role": "system", "content": SYSTEM_PROMPT}] if i % 2 == 0 else []
        out.append(tokenizer.chat_ids(system + [{"role": "user", "content": row["prompt"]}]))
    return out


def parse_fuse_layers(value: str, n_layers: int) -> tuple[int, ...]:
    """--fuse-layers: '' (none), 'auto' (EAGLE-3's choice for this depth) or comma-separated indices."""
    if value == "auto":
        return eagle3_layers(n_layers)
    return tuple(int(i) for i in value.split(",") if i.strip())


def corpus_shards(folder: Path, target: str, limit: int = 0) -> list[Path]:
    """The corpus's answer shards (the first `limit`; 0: all), made by `target` (their greedy answers are its
    choices, not another model's)."""
    shards = sorted((folder / "answers").glob("answers_*.jsonl.gz"))
    if not shards:
        raise ValueError(f"no answer shards in {folder / 'answers'}: make them with `specvoice corpus answers`")
    if limit:
        if limit > len(shards):
            raise ValueError(f"--corpus-shards {limit}, but {folder / 'answers'} holds {len(shards)} answer shards")
        shards = shards[:limit]
    recipe = folder / "answers" / "recipe.json"
    made_by = json.loads(recipe.read_text()).get("target", target) if recipe.exists() else target
    if made_by != target:
        raise ValueError(f"the corpus in {folder} was answered by {made_by!r}, not {target!r}")
    return shards


def training_data(
    args: argparse.Namespace,
    target: LoadedModel,
    work: Path,
    cfg: TrainConfig,
    shards: list[Path],
    also: tuple[int, ...] | None = None,
) -> tuple[list[Sequence], Path]:
    """The sequences to train on and the checkpoint for them: the corpus's `shards` (corpus_shards), else the
    prompts' answers and text. also: --also-cache's layers (None: not asked for)."""
    # names the checkpoint: no run resumes another's
    kind = cfg.kind + ("-token" if cfg.reads_token else "") + ("-draft" if cfg.reads_draft else "")
    kind += f"-x{cfg.block_layers}" if cfg.block_layers > 1 else ""
    fuse = cfg.fuse_layers
    if args.corpus:
        others = () if also is None else (also,)
        with tqdm(total=len(shards), desc="reading the corpus", unit="shard", file=sys.stderr) as bar:
            paths = corpus_dataset(target, args.target_quant, shards, work, fuse, progress=advance(bar), also=others)
        # A checkpoint per set of feature shards: training on more of the corpus starts over.
        return read_sequences(paths), paths[0].parent / f"{kind}-{digest([p.name for p in paths])}.ckpt"
    if fuse or also is not None:
        raise ValueError(
            "--fuse-layers and --also-cache need --corpus: the prompts' answers keep the final norm's output only"
        )
    with tqdm(total=1, desc="answering", unit="batch", file=sys.stderr) as bar:
        prompts = training_prompts(target.tokenizer, read_prompts(args.prompts, args.limit))
        make_dataset(target, prompts, work, args.max_new_tokens, args.batch_size, advance(bar))
    if args.text_chars:
        with tqdm(total=1, desc="reading text", unit="batch", file=sys.stderr) as bar:
            make_text_dataset(target, shipped_text(args.text_chars), work, args.passage_tokens, 8, advance(bar))
    return load_shards(work), work / f"{kind}.ckpt"


def advance(bar: tqdm) -> Callable[[int, int], None]:
    """A progress callback (done, total) that moves `bar`."""

    def update(done: int, total: int) -> None:
        bar.total = total
        bar.n = done
        bar.refresh()

    return update


def write(message: str) -> None:
    """A log line that leaves the progress bar where it is."""
    tqdm.write(f"[specvoice] {message}", file=sys.stderr)


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    started = time.perf_counter()
    work = Path(args.work) if args.work else cache_dir() / "heads" / f"{args.target}-{args.target_quant}"
    out = Path(args.out) if args.out else default_heads_path(args.target)
    target = load_model(args.target, DTYPES[args.dtype])
    # Float LM head rows for the heads, taken before quantization (load_heads does the same at run time).
    lm_weight = target.model.get_output_embeddings().weight.detach().clone()
    quantize_target(target, args.target_quant)

    fuse = parse_fuse_layers(args.fuse_layers, target.model.config.num_hidden_layers)
    also = (
        None if args.also_cache is None else parse_fuse_layers(args.also_cache, target.model.config.num_hidden_layers)
    )
    cfg = TrainConfig(
        kind=args.kind,
        vocab=args.vocab,
        epochs=args.epochs,
        lr=args.lr,
        weight_decay=args.weight_decay,
        feature_noise=args.feature_noise,
        ttt_steps=args.ttt_steps,
        fuse_layers=fuse,
        reads_token=args.reads_token,
        reads_draft=args.reads_draft,
        block_layers=args.block_layers,
    )
    # A bad --fuse-layers, --reads-token, --reads-draft or --block-layers fails now, not after the data.
    trained_heads_config(cfg, target.model.config, target.name)
    if also:
        heads_config("eagle", target.model.config, target.name, also)  # the layers --also-cache keeps
    compute.release_workers()  # the corpus's prefill runs on the compute thread: this thread's pool must not slow it
    shards = corpus_shards(Path(args.corpus), args.target, args.corpus_shards) if args.corpus else []
    seqs, checkpoint = training_data(args, target, work, cfg, shards, also)
    compute.run(compute.release_workers)  # and training runs here: the compute thread's pool goes in turn
    data_s = time.perf_counter() - started
    with tqdm(total=1, desc=f"training {cfg.kind}", unit="step", file=sys.stderr) as bar:

        def trained(step: int, total: int, info: dict) -> None:
            bar.total = total
            bar.n = step
            bar.set_postfix_str(fmt(info), refresh=True)

        heads, accs, val = fit_heads(seqs, cfg, target, lm_weight, checkpoint, write, trained)
    replay = simulated_acceptance(heads, val, k=4)
    report = {
        "target": args.target,
        "target_quant": args.target_quant,
        "kind": cfg.kind,
        "corpus": args.corpus,
        "corpus_shards": len(shards),  # the shards read, not the option: 0 (all) names no data as the corpus grows
        "fuse_layers": list(cfg.fuse_layers),
        "reads_token": cfg.reads_token,
        "reads_draft": cfg.reads_draft,
        "block_layers": cfg.block_layers,
        "ttt_steps": cfg.ttt_steps,
        "config": asdict(cfg),
        "held_out_answers": len(val),
        "validation_top1_per_head": accs,
        "held_out_replay_k4": replay,
        "held_out_vocab_coverage": vocab_coverage(
            split(seqs, cfg.val_fraction, cfg.seed)[0], val, VOCAB_SIZES, target.tokenizer.eos_token_ids
        ),
        "seconds": {"data": round(data_s, 1), "total": round(time.perf_counter() - started, 1)},
    }
    save_heads(heads, out, extra=report)
    log(f"heads written to {out}; held-out top-1 per head {fmt_accs(accs)}")
    log(
        "held-out greedy replay, K=4: acceptance by position "
        + fmt_accs(replay["acceptance_by_position"])
        + f", {replay['tokens_per_target_forward']:.2f} tokens per target forward"
    )
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2) + "\n")
    return 0
