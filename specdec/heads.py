"""Draft heads: a drafter that reads the target's own last hidden states instead of running a second model.

A feature f_j is the target's last hidden state at position j (the input of its LM head, which turns it into the
logits for token j + 1). Two kinds, chosen between by measurement (docs/results.md, "Draft heads"):

- eagle (EAGLE-style): one small decoder layer reads slot j = (embedding of token t_j, feature f_{j-1}) and
  predicts f_j; the target's LM head rows for a frequent-token vocabulary turn that into a draft for t_{j+1}. The next
  slot reads (the draft, the predicted feature), so drafting runs autoregressively on a KV cache of its own.
- medusa (Medusa-style): one residual block per future position over the last true feature, all in one step.

The heads never decide what is emitted: the target verifies every draft, so output stays the target's.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from .drafters import Proposal
from .models import asset_path
from .sampling import SamplingParams, logits_to_probs, sample
from .tokenizer import common_prefix_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

HEAD_KINDS = ("eagle", "medusa")
# --draft-min-prob's default for heads, chosen on held-out training answers replayed greedily with the w8a8 target's
# forward costs: for the shipped medusa heads at K 3–4, 0.5 was the fastest of 0, 0.3, 0.5, 0.7 (docs/results.md).
HEADS_MIN_PROB = 0.5


@dataclass(frozen=True)
class HeadsConfig:
    kind: str  # "eagle" or "medusa"
    hidden: int  # the target's hidden size
    vocab_size: int  # the target's full vocabulary
    intermediate: int = 2048  # eagle: the layer's MLP width
    n_heads: int = 12  # eagle: attention heads (of hidden / n_heads dims)
    n_kv_heads: int = 2
    rope_theta: float = 1e6
    rms_eps: float = 1e-6
    n_medusa: int = 4  # medusa: future positions, one block each
    target: str = ""  # the model the heads were trained on

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rotate(x: torch.Tensor, positions: torch.Tensor, theta: float) -> torch.Tensor:
    """Rotary position embedding of x (..., T, d) at `positions` (T,), in the rotate-half layout Qwen uses."""
    d = x.shape[-1]
    inv_freq = 1.0 / theta ** (torch.arange(0, d, 2, dtype=torch.float32, device=x.device) / d)
    angles = positions.float()[:, None] * inv_freq[None, :]
    cos, sin = torch.cat([angles, angles], -1).cos().to(x.dtype), torch.cat([angles, angles], -1).sin().to(x.dtype)
    half = d // 2
    rotated = torch.cat([-x[..., half:], x[..., :half]], dim=-1)
    return x * cos + rotated * sin


KV = tuple[torch.Tensor, torch.Tensor]  # keys, values: (B, kv_heads, slots, head_dim)


class EagleLayer(nn.Module):
    """fc(token embedding ⊕ feature) → one pre-norm decoder layer (GQA attention with RoPE, SwiGLU) → norm."""

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        h, self.head_dim = cfg.hidden, cfg.hidden // cfg.n_heads
        self.cfg = cfg
        self.fc = nn.Linear(2 * h, h, bias=False)
        self.attn_norm = RMSNorm(h, cfg.rms_eps)
        self.q = nn.Linear(h, cfg.n_heads * self.head_dim)
        self.k = nn.Linear(h, cfg.n_kv_heads * self.head_dim)
        self.v = nn.Linear(h, cfg.n_kv_heads * self.head_dim)
        self.o = nn.Linear(cfg.n_heads * self.head_dim, h, bias=False)
        self.mlp_norm = RMSNorm(h, cfg.rms_eps)
        self.gate = nn.Linear(h, cfg.intermediate, bias=False)
        self.up = nn.Linear(h, cfg.intermediate, bias=False)
        self.down = nn.Linear(cfg.intermediate, h, bias=False)
        self.out_norm = RMSNorm(h, cfg.rms_eps)

    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The residual stream x and rotated q, k and v of slots (B, T) at `positions`."""
        x = self.fc(torch.cat([emb, feat], dim=-1))
        a = self.attn_norm(x)
        b, t, _ = a.shape
        q = self.q(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        theta = self.cfg.rope_theta
        return x, rotate(q, positions, theta), rotate(k, positions, theta), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Attention output (B, heads, T, d) → residual, MLP, output norm: the predicted features (B, T, H)."""
        b, _, t, _ = attended.shape
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        m = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(m)) * self.up(m))
        return self.out_norm(x)

    def forward(
        self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, cache: KV | None = None
    ) -> tuple[torch.Tensor, KV]:
        """Predicted features for slots (B, T) that follow `cache` (causal among themselves); the grown cache."""
        x, q, k, v = self.qkv(emb, feat, positions)
        if cache is not None:
            k, v = torch.cat([cache[0], k], dim=2), torch.cat([cache[1], v], dim=2)
        t, s = q.shape[2], k.shape[2]
        mask = torch.ones(t, s, dtype=torch.bool, device=q.device).tril(s - t)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.finish(x, attended), (k, v)


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k begins as the target's own next-token head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


class DraftHeads(nn.Module):
    """The trained part (eagle layer or medusa blocks) plus what it borrows from the target at load time: the token
    embedding table and the LM head rows of `vocab_ids`, the vocabulary drafts are drawn from."""

    vocab_ids: torch.Tensor

    def __init__(self, cfg: HeadsConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.eagle = EagleLayer(cfg) if cfg.kind == "eagle" else None
        self.medusa = nn.ModuleList(ResBlock(cfg.hidden) for _ in range(cfg.n_medusa)) if cfg.kind == "medusa" else None
        self.lm = nn.Linear(cfg.hidden, len(vocab_ids), bias=False).requires_grad_(False)
        # The target's own embedding table, held outside the module tree: not ours to train, move or store.
        self._embed: tuple[nn.Module, ...] = ()

    def trained_state(self) -> dict[str, torch.Tensor]:
        return {k: v for k, v in self.state_dict().items() if not k.startswith("lm.")}

    def attach(self, embed: nn.Module, lm_weight: torch.Tensor) -> None:
        """Borrow the target's embedding table, and copy its LM head rows for vocab_ids (from float weights: call
        before the target is quantized)."""
        self._embed = (embed,)
        with torch.no_grad():
            self.lm.weight.copy_(lm_weight[self.vocab_ids.to(lm_weight.device)].float())

    def embed_tokens(self, tokens: torch.Tensor) -> torch.Tensor:
        assert self._embed, "attach() the target first"
        with torch.no_grad():
            return self._embed[0](tokens).float()

    def full_logits(self, sub_logits: torch.Tensor) -> torch.Tensor:
        """Logits over the whole vocabulary: −inf outside vocab_ids (a draft can never propose those)."""
        full = sub_logits.new_full((*sub_logits.shape[:-1], self.cfg.vocab_size), float("-inf"))
        return full.index_copy_(-1, self.vocab_ids, sub_logits)


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


class HeadsDrafter:
    """Drafts from the target's features (DraftHeads): eagle autoregressively on its own one-layer cache, medusa in
    one step. The engine hands it the target's features of every verified position through observe().

    min_prob: stop drafting at the first position whose top draft probability is lower (as DraftModelDrafter does).
    """

    def __init__(self, heads: DraftHeads, min_prob: float = 0.0) -> None:
        self.kind = "heads"
        self.reads_target_hidden = True
        self.heads = heads
        self.min_prob = min_prob
        self.tokens: list[int] = []  # the conversation the target has verified; features[j] belongs to tokens[j]
        self.device = heads.vocab_ids.device
        self.features = torch.empty(0, heads.cfg.hidden, device=self.device)
        self.kv: KV | None = None  # eagle: slots 1.., each computed from true features
        self.slot_tokens: list[int] = []  # eagle: t_j of each cached slot j (tokens[1:] when all are current)

    def prefill(self, ids: list[int]) -> None:
        pass  # features come with the target's forwards, through observe()

    def rollback(self, length: int) -> None:
        del self.tokens[length:]
        self.features = self.features[:length]
        self._crop_slots(max(0, length - 1))

    def observe(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        """The target now holds `tokens`; `hidden` are its features at positions start … len(tokens) − 1."""
        self.features = torch.cat([self.features[:start], hidden.float().to(self.device)])
        self.tokens = list(tokens)
        self._crop_slots(start)  # slot j reads f_{j−1}: the slots up to `start` read unchanged features

    def _crop_slots(self, n: int) -> None:
        n = min(n, len(self.slot_tokens))
        if self.kv is not None and n < self.kv[0].shape[2]:
            self.kv = (self.kv[0][:, :, :n], self.kv[1][:, :, :n])
        del self.slot_tokens[n:]

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        last = len(context) - 1  # the newest token, t_L: the target has not fed it yet
        if last < 1 or len(self.features) < last or common_prefix_length(self.tokens, context) < last:
            return Proposal([], None, 0)  # no features for this context yet (an answer's first step is the prefill)
        if self.heads.cfg.kind == "medusa":
            sub = self._medusa_logits(last, k)
            return self._pick(sub, params, generator, forwards=1)
        return self._eagle(context, last, k, params, generator)

    def _medusa_logits(self, last: int, k: int) -> torch.Tensor:
        assert self.heads.medusa is not None
        f = self.features[last - 1]  # its own LM head gives t_L; block i gives t_{L+1+i}
        return torch.stack([self.heads.lm(block(f)) for block in list(self.heads.medusa)[:k]])

    def _pick(
        self, sub_logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None, forwards: int
    ) -> Proposal:
        tokens: list[int] = []
        probs = []
        for row in sub_logits:
            tok, q = self._choose(row, params, generator)
            if tok is None:
                break
            tokens.append(tok)
            if q is not None:
                probs.append(q)
        return Proposal(tokens, torch.stack(probs) if probs else None, forwards)

    def _choose(
        self, sub_row: torch.Tensor, params: SamplingParams, generator: torch.Generator | None
    ) -> tuple[int | None, torch.Tensor | None]:
        """The draft token for one position and, when sampling, the q it was drawn from (None: stop drafting)."""
        if params.greedy:
            top_p, local = torch.softmax(sub_row.float(), -1).max(-1)
            return (None if float(top_p) < self.min_prob else int(self.heads.vocab_ids[local])), None
        q = logits_to_probs(self.heads.full_logits(sub_row), params)
        if float(q.max()) < self.min_prob:
            return None, None
        return sample(q, generator), q

    def _eagle(
        self, context: list[int], last: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        heads, layer = self.heads, self.heads.eagle
        assert layer is not None
        self._crop_slots(common_prefix_length(self.slot_tokens, context[1:]))
        first = len(self.slot_tokens) + 1  # the first slot to compute; slots first … last read true features
        ids = torch.tensor([context[first : last + 1]], device=self.device)
        feats = self.features[first - 1 : last].unsqueeze(0)
        positions = torch.arange(first, last + 1, device=self.device)
        out, self.kv = layer(heads.embed_tokens(ids), feats, positions, self.kv)
        self.slot_tokens = context[1 : last + 1]
        pred, kv = out[0, -1], self.kv
        tokens: list[int] = []
        probs = []
        forwards = 1
        for i in range(k):
            tok, q = self._choose(heads.lm(pred), params, generator)
            if tok is None:
                break
            tokens.append(tok)
            if q is not None:
                probs.append(q)
            if i + 1 < k:  # the next slot reads this draft and the feature predicted for its position
                pos = torch.tensor([last + 1 + i], device=self.device)
                emb = heads.embed_tokens(torch.tensor([[tok]], device=self.device))
                out, kv = layer(emb, pred.view(1, 1, -1), pos, kv)
                pred = out[0, -1]
                forwards += 1
        return Proposal(tokens, torch.stack(probs) if probs else None, forwards)
