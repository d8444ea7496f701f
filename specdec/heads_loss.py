"""What draft heads are scored on in training: a batch of recorded sequences, and each head's loss and top-1 hits.

eagle is trained for ttt_steps draft positions at once ("training-time test", as EAGLE-3 does): position 1 reads
the target's true feature, position d the feature the layer itself predicted at position d − 1, attending to the
true slots before the draft and to the draft slots up to itself, exactly as drafting does. medusa's block k learns
token j + 2 + k from feature j (and, with reads_token, token j + 1; with reads_draft, token j + 1 + k).
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import torch
import torch.nn.functional as F

from .heads_data import Sequence
from .heads_model import DraftHeads


@dataclass
class Batch:
    tokens: torch.Tensor  # (B, T), padded with 0
    features: torch.Tensor  # (B, T - 1, H) float32: the target's (what eagle's predicted features are scored on)
    labels: torch.Tensor  # (B, T - 1): the target's greedy choice after each position
    lengths: torch.Tensor  # (B,)
    answer_start: torch.Tensor  # (B,)
    inputs: torch.Tensor  # the features the heads read: `features` itself, or noised in training (noised)


def make_batch(seqs: list[Sequence]) -> Batch:
    t = max(len(s.tokens) for s in seqs)
    hidden = seqs[0].features.shape[1]
    tokens = torch.zeros(len(seqs), t, dtype=torch.long)
    labels = torch.zeros(len(seqs), t - 1, dtype=torch.long)
    feats = torch.zeros(len(seqs), t - 1, hidden)
    for b, s in enumerate(seqs):
        tokens[b, : len(s.tokens)] = torch.tensor(s.tokens)
        labels[b, : len(s.labels)] = torch.tensor(s.labels)
        feats[b, : len(s.features)] = s.features.float()
    lengths = torch.tensor([len(s.tokens) for s in seqs])
    return Batch(tokens, feats, labels, lengths, torch.tensor([s.answer_start for s in seqs]), feats)


def noised(batch: Batch, amplitude: float) -> Batch:
    """The batch with uniform noise in ± amplitude on the features the heads read, not on those they are scored
    against: EAGLE's regulariser, so that heads learn from the neighbourhood of the target's features rather than
    memorise each one (ours overfit: 86–88 % top-1 on their training positions against 46 % held out)."""
    noise = (torch.rand_like(batch.features) * 2 - 1) * amplitude
    return replace(batch, inputs=batch.features + noise)


def local_labels(tokens: torch.Tensor, vocab_ids: torch.Tensor) -> torch.Tensor:
    """Each token's index in vocab_ids, or -100 (ignored by the loss) for tokens outside it."""
    lookup = torch.full((int(max(int(tokens.max()), int(vocab_ids.max()))) + 1,), -100, dtype=torch.long)
    lookup[vocab_ids] = torch.arange(len(vocab_ids))
    return lookup[tokens]


def eagle_predictions(heads: DraftHeads, batch: Batch, steps: int) -> list[torch.Tensor]:
    """The features the eagle layer predicts at slots 1 … T − 1 (B, T − 1, H) for draft positions 1 … steps.

    Slot j reads token j; at step 1 the target's feature j − 1 (true_features), at step d ≥ 2 the feature step d − 1
    predicted at slot j − 1 (zeros for slot 1), attending as drafting does (draft_attention).
    """
    layer = heads.eagle
    assert layer is not None
    slots = torch.arange(1, batch.tokens.shape[1])
    emb = heads.embed_tokens(batch.tokens[:, 1:])
    x, q, k, v = layer.qkv(emb, layer.true_features(batch.inputs), slots)
    preds = [layer.finish(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))]
    drafted: list[tuple[torch.Tensor, torch.Tensor]] = []  # keys and values of steps 2 … d
    for _ in range(2, steps + 1):
        shifted = F.pad(preds[-1][:, :-1], (0, 0, 1, 0))
        xd, qd, kd, vd = layer.qkv(emb, shifted, slots)
        drafted.append((kd, vd))
        preds.append(layer.finish(xd, draft_attention(qd, (k, v), drafted)))
    return preds


def eagle_losses(
    heads: DraftHeads, batch: Batch, feature_scale: float, feature_loss: float, steps: int
) -> list[tuple[torch.Tensor, int, int]]:
    """(loss, correct, counted) for draft positions 1 … steps (eagle_predictions).

    Slot j is scored on token j + 1 (the target's greedy choice) at every step and, reading final-norm features, on
    feature j; only answer slots (j ≥ answer_start) count, as drafting starts after the first answer token, and at
    step d only from j ≥ d, where a true slot precedes the chain of drafts.
    """
    assert heads.eagle is not None
    slots = torch.arange(1, batch.tokens.shape[1])
    labels = local_labels(batch.labels[:, 1:], heads.vocab_ids)  # slot j's label: the choice after j (slots 1 … T − 2)
    counted = (slots[None, :-1] >= batch.answer_start[:, None]) & (slots[None, :-1] + 1 < batch.lengths[:, None])
    labels = labels.masked_fill(~counted, -100)
    regress = heads.eagle.fuse is None  # fused inputs are nothing the layer could predict: EAGLE-3 drops the regression
    true_next = batch.features[:, 1:]  # feature j for slots 1 … T − 2
    out = []
    for d, pred in enumerate(eagle_predictions(heads, batch, steps), start=1):
        position_counted = counted & (slots[None, :-1] >= d)
        logits = heads.lm(pred[:, :-1][position_counted])  # only where scored: the prompt's slots are half
        lab = labels[position_counted]
        loss = F.cross_entropy(logits, lab, ignore_index=-100)
        if regress:
            reg = ((pred[:, :-1] - true_next) / feature_scale).pow(2).mean(-1)[position_counted].mean()
            loss = loss + reg * feature_loss
        valid = lab != -100
        correct = int((logits.argmax(-1)[valid] == lab[valid]).sum())
        out.append((loss, correct, int(position_counted.sum())))
    return out


def draft_attention(
    q: torch.Tensor, true_kv: tuple[torch.Tensor, torch.Tensor], drafted: list[tuple[torch.Tensor, torch.Tensor]]
) -> torch.Tensor:
    """Attention of step d = len(drafted) + 1's queries (B, heads, S, dim), as drafting attends: slot j sees the true
    slots up to j − d + 1 (the last one the target verified) and step s's slot at j − (d − s) for s = 2 … d, its own
    key the last. drafted: steps 2 … d's keys and values (B, kv_heads, S, dim)."""
    k, v = true_kv
    d, n = len(drafted) + 1, q.shape[2]
    rep = q.shape[1] // k.shape[1]
    scale = q.shape[-1] ** -0.5
    earlier = (q @ k.repeat_interleave(rep, dim=1).transpose(-1, -2)) * scale
    scores = [earlier.masked_fill(~torch.ones(n, n, dtype=torch.bool).tril(1 - d), float("-inf"))]
    values = []
    for s, (ks, vs) in enumerate(drafted, start=2):
        lag = d - s  # step s's slot on this query's chain sits `lag` slots back; none before slot 1
        ks, vs = (F.pad(a.repeat_interleave(rep, dim=1), (0, 0, lag, 0))[:, :, :n] for a in (ks, vs))
        own = (q * ks).sum(-1, keepdim=True) * scale
        scores.append(own.masked_fill(torch.arange(n)[:, None] < lag, float("-inf")))
        values.append(vs)
    weights = torch.softmax(torch.cat(scores, dim=-1), dim=-1)
    attended = weights[..., :n] @ v.repeat_interleave(rep, dim=1)
    for i, vs in enumerate(values):
        attended = attended + weights[..., n + i : n + i + 1] * vs
    return attended


def medusa_logits(heads: DraftHeads, batch: Batch, where: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Each block's draft-vocabulary logits (B, T − 1, V) at every feature j, as drafting computes them at j = L − 1
    (reading token j + 1 = t_L with reads_token, and block k token j + 1 + k with reads_draft); or (N, V) at the
    features where `where` (B, T − 1) is true only."""
    assert heads.medusa is not None
    features, tokens = batch.inputs, batch.tokens
    next_tokens = tokens[:, 1:]
    if where is not None:
        features, next_tokens = features[where], next_tokens[where]
    inputs = heads.medusa_input(features, next_tokens)
    out = []
    for k, block in enumerate(heads.medusa):
        before = F.pad(tokens[:, 1 + k :], (0, k))  # t_{j+1+k} at feature j (teacher-forced: the drafts that count)
        x = heads.block_input(k, inputs, before if where is None else before[where])
        out.append(heads.lm(block(x)))
    return out


def medusa_losses(heads: DraftHeads, batch: Batch) -> list[tuple[torch.Tensor, int, int]]:
    """(loss, correct, counted) per block: block k (0-based) at feature j is scored on token j + 2 + k (the choice
    after position j + 1 + k). Logits only at the answer's features: the prompt's are half the positions."""
    t = batch.tokens.shape[1]
    positions = torch.arange(t - 1)
    scored = (positions[None, :] + 1 >= batch.answer_start[:, None]) & (positions[None, :] + 2 < batch.lengths[:, None])
    rows, cols = scored.nonzero(as_tuple=True)  # block 0's scored features; block k's are those with k more to go
    out = []
    for k, logits in enumerate(medusa_logits(heads, batch, scored)):
        counted = cols + 2 + k < batch.lengths[rows]
        after = (cols + 1 + k).clamp(max=t - 2)
        lab = local_labels(batch.labels[rows, after], heads.vocab_ids).masked_fill(~counted, -100)
        ce = F.cross_entropy(logits, lab, ignore_index=-100)
        valid = lab != -100
        out.append((ce, int((logits.argmax(-1)[valid] == lab[valid]).sum()), int(counted.sum())))
    return out
