"""Training draft heads on self-distilled data (heads_data.py): resumable, with loss and top-1 accuracy per head
(the losses: heads_loss.py)."""

from __future__ import annotations

import math
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .heads_data import Sequence
from .heads_drafter import HeadsDrafter
from .heads_loss import Batch, eagle_losses, make_batch, medusa_losses, noised
from .heads_model import DraftHeads, HeadsConfig
from .models import LoadedModel
from .sampling import SamplingParams


@dataclass(frozen=True)
class TrainConfig:
    kind: str = "medusa"  # measured faster here than eagle with the data this machine can make (docs/results.md)
    vocab: int = 8192  # drafts come from the most frequent answer tokens (and EOS)
    epochs: int = 8
    lr: float = 1e-3
    weight_decay: float = 0.0  # AdamW's, on the heads' own weights
    feature_noise: float = 0.0  # training only: uniform noise of ± this × the features' std on what heads read
    batch_sequences: int = 16
    val_fraction: float = 0.1
    feature_loss: float = 0.5  # weight of the feature regression next to the token loss (eagle on the final norm)
    ttt_steps: int = 3  # eagle: draft positions trained at once, each after the layer's own predicted features
    fuse_layers: tuple[int, ...] = ()  # eagle: the target layers fused into a true slot's feature (HeadsConfig)
    reads_token: bool = False  # medusa: the blocks also read the token after their feature (HeadsConfig)
    reads_draft: bool = False  # medusa with reads_token: block k ≥ 1 also reads the draft before its own (HeadsConfig)
    block_layers: int = 1  # medusa: residual layers per block (HeadsConfig)
    seed: int = 0
    checkpoint_every_s: float = 120.0
    bf16: bool = True  # autocast the training steps to bf16 (2.4× faster on this CPU; evaluation stays float32)


def choose_vocab(seqs: list[Sequence], size: int, eos: set[int]) -> torch.Tensor:
    """The `size` most frequent greedy choices, EOS always among them, in id order."""
    counts = Counter(t for s in seqs for t in s.labels[s.answer_start - 1 :])
    ids = set(sorted(eos)) | {t for t, _ in counts.most_common(size)}
    return torch.tensor(sorted(ids)[: max(size, len(eos))])


VOCAB_SIZES = (8192, 16384, 32768)  # the draft vocabularies whose coverage train-heads reports (FR-Spec's sizes)


def vocab_coverage(train: list[Sequence], held: list[Sequence], sizes: tuple[int, ...], eos: set[int]) -> dict:
    """For each draft vocabulary size, the share of the held-out answers' tokens (the target's choices) that the
    vocabulary chosen on the training answers contains: a token outside it can never be drafted."""
    wanted = [t for s in held for t in s.labels[s.answer_start - 1 :]]
    out = {}
    for size in sizes:
        vocab = set(choose_vocab(train, size, eos).tolist())
        out[size] = sum(t in vocab for t in wanted) / max(len(wanted), 1)
    return out


def split(seqs: list[Sequence], val_fraction: float, seed: int) -> tuple[list[Sequence], list[Sequence]]:
    """(training, held out): a fraction of the answers is held out; text passages all train."""
    answers = [s for s in seqs if s.is_answer]
    order = list(range(len(answers)))
    random.Random(seed).shuffle(order)
    n_val = max(1, int(len(answers) * val_fraction))
    held = set(order[:n_val])
    train = [s for i, s in enumerate(answers) if i not in held] + [s for s in seqs if not s.is_answer]
    return train, [answers[i] for i in order[:n_val]]


def head_losses(
    heads: DraftHeads, batch: Batch, feature_scale: float, cfg: TrainConfig
) -> list[tuple[torch.Tensor, int, int]]:
    if heads.cfg.kind == "eagle":
        return eagle_losses(heads, batch, feature_scale, cfg.feature_loss, cfg.ttt_steps)
    return medusa_losses(heads, batch)


def cosine_lr(step: int, total: int, peak: float, warmup: int) -> float:
    """Linear warm-up to `peak`, then cosine decay to a tenth of it."""
    if step < warmup:
        return peak * (step + 1) / warmup
    progress = min(1.0, (step - warmup) / max(1, total - warmup))
    return peak * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress)))


def batches(seqs: list[Sequence], size: int, seed: int) -> list[list[Sequence]]:
    """Sequences of similar length together (little padding), batches in a seeded random order."""
    ordered = sorted(seqs, key=lambda s: len(s.tokens))
    groups = [ordered[i : i + size] for i in range(0, len(ordered), size)]
    random.Random(seed).shuffle(groups)
    return groups


@torch.no_grad()
def evaluate(heads: DraftHeads, seqs: list[Sequence], feature_scale: float, cfg: TrainConfig) -> list[float]:
    """Top-1 accuracy per head (eagle: per draft position 1 … ttt_steps) over `seqs`."""
    heads.eval()
    correct: list[int] = []
    counted: list[int] = []
    for group in batches(seqs, 16, 0):
        for i, (_, c, n) in enumerate(head_losses(heads, make_batch(group), feature_scale, cfg)):
            if i >= len(correct):
                correct.append(0)
                counted.append(0)
            correct[i] += c
            counted[i] += n
    heads.train()
    return [c / max(n, 1) for c, n in zip(correct, counted)]


def feature_std(seqs: list[Sequence]) -> float:
    sample = torch.cat([s.features[:: max(1, len(s.features) // 8)].float() for s in seqs[:64]])
    return float(sample.std())


def train_heads(
    heads: DraftHeads,
    train: list[Sequence],
    val: list[Sequence],
    cfg: TrainConfig,
    checkpoint: Path,
    log: Callable[[str], None],
    progress: Callable[[int, int, dict], None] = lambda step, total, info: None,
) -> list[float]:
    """Train in place, resuming from `checkpoint` when it holds this configuration's state; returns the validation
    accuracy per head."""
    torch.manual_seed(cfg.seed)
    params = [p for p in heads.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=cfg.weight_decay)
    per_epoch = len(batches(train, cfg.batch_sequences, 0))
    total = per_epoch * cfg.epochs
    step = 0
    if checkpoint.exists():
        state = torch.load(checkpoint, weights_only=False)
        if state["config"] == asdict(cfg) and state["heads"] == asdict(heads.cfg):
            heads.load_state_dict(state["model"], strict=False)
            opt.load_state_dict(state["optimizer"])
            torch.set_rng_state(state["rng"])  # the noise goes on as if never stopped
            step = state["step"]
            log(f"resumed from {checkpoint} at step {step}/{total}")
        else:
            log(f"{checkpoint} is from another configuration: starting over")
    scale = feature_std(train)
    heads.train()
    last_save = time.monotonic()
    window: list[list[float]] = []
    while step < total:
        epoch, index = divmod(step, per_epoch)
        batch = make_batch(batches(train, cfg.batch_sequences, cfg.seed + epoch)[index])
        if cfg.feature_noise:
            batch = noised(batch, cfg.feature_noise * scale)
        for group in opt.param_groups:
            group["lr"] = cosine_lr(step, total, cfg.lr, warmup=max(1, total // 20))
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=cfg.bf16 and batch.features.device.type == "cpu"):
            results = head_losses(heads, batch, scale, cfg)
            loss = torch.stack([r[0] for r in results]).sum()
        opt.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        opt.step()
        step += 1
        window.append([float(loss.detach())] + [c / max(n, 1) for _, c, n in results])
        window = window[-20:]
        info = {"loss": sum(w[0] for w in window) / len(window)}
        for i in range(len(results)):
            info[f"top1_head{i + 1}"] = sum(w[i + 1] for w in window) / len(window)
        progress(step, total, info)
        if step % per_epoch == 0:
            accs = evaluate(heads, val, scale, cfg)
            epoch_done = step // per_epoch
            log(f"epoch {epoch_done}/{cfg.epochs}: train {fmt(info)}; validation top-1 per head {fmt_accs(accs)}")
        if time.monotonic() - last_save > cfg.checkpoint_every_s or step == total:
            save_checkpoint(heads, opt, cfg, step, checkpoint)
            last_save = time.monotonic()
    return evaluate(heads, val, scale, cfg)


def save_checkpoint(heads: DraftHeads, opt: torch.optim.Optimizer, cfg: TrainConfig, step: int, path: Path) -> None:
    state = {
        "config": asdict(cfg),
        "heads": asdict(heads.cfg),
        "model": heads.trained_state(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "step": step,
    }
    tmp = path.with_suffix(".partial")
    torch.save(state, tmp)
    tmp.rename(path)


def fmt(info: dict) -> str:
    return ", ".join(f"{k} {v:.3f}" for k, v in info.items())


def fmt_accs(accs: list[float]) -> str:
    return " ".join(f"{a:.1%}" for a in accs)


@torch.no_grad()
def simulated_acceptance(heads: DraftHeads, seqs: list[Sequence], k: int) -> dict:
    """Greedy drafting replayed on recorded answers: at every answer position after the first, the drafter gets the
    true features so far and proposes k tokens; a draft counts as accepted while it matches the answer (which is the
    target's greedy choice). Returns acceptance by draft position and the mean tokens per target forward."""
    drafter = HeadsDrafter(heads.eval())
    accepted_at = [0] * k
    steps = 0
    emitted = 0
    for s in seqs:
        pos = s.answer_start + 1  # context = tokens[:pos]; the target has verified tokens[:pos - 1]
        drafter.rollback(0)
        while pos < len(s.tokens):
            held = len(drafter.tokens)
            drafter.add_features(s.tokens[: pos - 1], held, s.features[held : pos - 1])
            drafts = drafter.propose(s.tokens[:pos], k, SamplingParams(), None).tokens.tolist()
            n = 0
            while n < len(drafts) and pos + n < len(s.tokens) and drafts[n] == s.tokens[pos + n]:
                accepted_at[n] += 1
                n += 1
            steps += 1
            emitted += n + 1
            pos += n + 1
    return {
        "steps": steps,
        "acceptance_by_position": [a / max(steps, 1) for a in accepted_at],
        "tokens_per_target_forward": emitted / max(steps, 1),
    }


def eagle3_layers(n_layers: int) -> tuple[int, ...]:
    """EAGLE-3's choice of target layers to fuse: the states after layers 2, L/2 and L − 3 (low, middle, high)."""
    if n_layers < 8:
        raise ValueError(f"EAGLE-3's layers (2, L/2, L − 3) need 8 decoder layers or more, the target has {n_layers}")
    return (2, n_layers // 2, n_layers - 3)


def heads_config(
    kind: str,
    model_config,
    target: str,
    fuse_layers: tuple[int, ...] = (),
    reads_token: bool = False,
    reads_draft: bool = False,
    block_layers: int = 1,
) -> HeadsConfig:
    """Heads shaped after the target: its widths, attention heads and RoPE; an MLP a quarter of the target's."""
    c = model_config
    if any(i > c.num_hidden_layers for i in fuse_layers):
        raise ValueError(f"fuse_layers {fuse_layers}: the target's hidden_states go to {c.num_hidden_layers}")
    rope = getattr(c, "rope_parameters", None) or {}
    return HeadsConfig(
        kind=kind,
        hidden=c.hidden_size,
        vocab_size=c.vocab_size,
        intermediate=max(c.hidden_size, c.intermediate_size // 4),
        n_heads=c.num_attention_heads,
        n_kv_heads=c.num_key_value_heads,
        rope_theta=float(rope.get("rope_theta", getattr(c, "rope_theta", 10000.0))),
        rms_eps=float(getattr(c, "rms_norm_eps", 1e-6)),
        target=target,
        fuse_layers=fuse_layers,
        reads_token=reads_token,
        reads_draft=reads_draft,
        block_layers=block_layers,
    )


def trained_heads_config(cfg: TrainConfig, model_config, target: str) -> HeadsConfig:
    """The heads `cfg` trains for the target: heads_config with the training's choices of kind and inputs."""
    return heads_config(
        cfg.kind, model_config, target, cfg.fuse_layers, cfg.reads_token, cfg.reads_draft, cfg.block_layers
    )


def fit_heads(
    seqs: list[Sequence],
    cfg: TrainConfig,
    target: LoadedModel,
    lm_weight: torch.Tensor,
    checkpoint: Path,
    log: Callable[[str], None],
    progress: Callable[[int, int, dict], None] = lambda step, total, info: None,
) -> tuple[DraftHeads, list[float], list[Sequence]]:
    """Heads for `target` trained on `seqs` (resuming from `checkpoint`): the heads, their validation top-1 accuracy
    per head, and the held-out sequences. lm_weight: the target's LM head in float (before any quantization)."""
    train, val = split(seqs, cfg.val_fraction, cfg.seed)
    vocab_ids = choose_vocab(train, cfg.vocab, target.tokenizer.eos_token_ids)
    shape = trained_heads_config(cfg, target.model.config, target.name)
    heads = DraftHeads(shape, vocab_ids)
    if seqs[0].features.shape[1] != heads.cfg.feature_width:
        raise ValueError(
            f"the data's features are {seqs[0].features.shape[1]} wide; heads with fuse_layers {cfg.fuse_layers} "
            f"read {heads.cfg.feature_width}: make the data with the same fuse_layers"
        )
    heads.attach(target.model.get_input_embeddings(), lm_weight)
    coverage = vocab_coverage(train, val, VOCAB_SIZES, target.tokenizer.eos_token_ids)
    log(
        f"{len(train)} training and {len(val)} held-out answers ({sum(len(s.tokens) for s in train)} tokens); "
        f"draft vocabulary {len(vocab_ids)}; held-out tokens it would cover by size: "
        + ", ".join(f"{n}: {c:.1%}" for n, c in coverage.items())
    )
    accs = train_heads(heads, train, val, cfg, checkpoint, log, progress)
    return heads.eval(), accs, val
