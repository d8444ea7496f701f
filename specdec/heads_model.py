"""Draft heads, the model: small blocks that draft from the target's own last hidden states instead of running a
second model.

A feature f_j is the target's last hidden state at position j (the input of its LM head, which turns it into the
logits for token j + 1). Two kinds, chosen between by measurement (docs/results.md, "Draft heads"):

- eagle (EAGLE-style): one small decoder layer reads slot j = (embedding of token t_j, feature f_{j-1}) and
  predicts f_j; the target's LM head rows for a frequent-token vocabulary turn that into a draft for t_{j+1}. The next
  slot reads (the draft, the predicted feature), so drafting runs autoregressively on a KV cache of its own.
  With fuse_layers (EAGLE-3), a true slot's feature is instead the target's low, middle and high layer states fused
  into one (FeatureFusion); a predicted feature stays the layer's own output.
- medusa (Medusa-style): one residual block per future position over the last true feature, all in one step
  (block after block with reads_draft, below).
  With reads_token (as Hydra's heads and EAGLE read it), every block also reads the token that feature chose, t_{j+1}:
  known when drafting (the target just emitted it), and what a block would otherwise have to recompute from f_j.
  With reads_draft (Hydra's sequential heads, the last token only), block k ≥ 1 also reads the drafted token before
  its own, t_{j+1+k}: a block that does not know the draft before it guesses it as well as its own token.
  With block_layers > 1 (as Hydra++ deepens its heads), each block is that many residual layers in a row.

The heads never decide what is emitted: the target verifies every draft, so output stays the target's. The file
format is heads_file.py, drafting heads_drafter.py, the data heads_data.py, the losses heads_loss.py, training
heads_train.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from .attention import causal_mask, rotary_cos_sin, rotate
from .kv import grown

HEAD_KINDS = ("eagle", "medusa")


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
    # eagle: the target states a true slot reads, fused (EAGLE-3), as indices into transformers' hidden_states (i:
    # after i decoder layers, 0 the embeddings, num_hidden_layers the final norm's output); (): that output alone
    fuse_layers: tuple[int, ...] = ()
    reads_token: bool = False  # medusa: the blocks read feature j ⊕ the token after it (DraftHeads.medusa_input)
    reads_draft: bool = False  # medusa with reads_token: block k ≥ 1 also reads the draft before its own (block_input)
    block_layers: int = 1  # medusa: residual layers in each block (medusa_block)

    def __post_init__(self) -> None:
        if self.kind not in HEAD_KINDS:
            raise ValueError(f"heads kind must be one of {', '.join(HEAD_KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "fuse_layers", tuple(self.fuse_layers))  # a file's JSON gives a list
        if self.fuse_layers and self.kind != "eagle":
            raise ValueError("fuse_layers is for eagle heads: medusa reads the final norm's output")
        if self.reads_token and self.kind != "medusa":
            raise ValueError("reads_token is for medusa heads: eagle reads the token it follows anyway")
        if self.reads_draft and not self.reads_token:
            raise ValueError("reads_draft is for medusa heads that read the token (reads_token)")
        if self.block_layers < 1 or (self.block_layers > 1 and self.kind != "medusa"):
            raise ValueError(f"block_layers is medusa's residual layers per block (≥ 1), got {self.block_layers}")
        if any(i < 0 for i in self.fuse_layers):
            raise ValueError(f"fuse_layers are hidden_states indices (≥ 0), got {self.fuse_layers}")

    @property
    def feature_width(self) -> int:
        """The width of the target features the heads read: one hidden state per fused layer, else one."""
        return self.hidden * max(1, len(self.fuse_layers))


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


class FeatureFusion(nn.Module):
    """EAGLE-3's input feature: the target's states at several layers → one Linear(n·H → H). Each state is RMS-normed
    first: a residual stream mid-model carries a few activations orders of magnitude above the rest (which the final
    norm tames), and they would swamp the projection's gradients and its int8 rows."""

    def __init__(self, hidden: int, n_layers: int, eps: float) -> None:
        super().__init__()
        self.hidden = hidden
        self.norms = nn.ModuleList(RMSNorm(hidden, eps) for _ in range(n_layers))
        self.proj = nn.Linear(n_layers * hidden, hidden, bias=False)

    def forward(self, states: torch.Tensor) -> torch.Tensor:
        parts = states.split(self.hidden, dim=-1)
        return self.proj(torch.cat([norm(p) for norm, p in zip(self.norms, parts)], dim=-1))


class EagleLayer(nn.Module):
    """fc(token embedding ⊕ feature) → one pre-norm decoder layer (GQA attention with RoPE, SwiGLU) → norm."""

    def __init__(self, cfg: HeadsConfig) -> None:
        super().__init__()
        h, self.head_dim = cfg.hidden, cfg.hidden // cfg.n_heads
        self.cfg = cfg
        n_fused = len(cfg.fuse_layers)
        self.fuse = FeatureFusion(h, n_fused, cfg.rms_eps) if n_fused else None
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
        # Starts by passing its feature through (fc reads it as is; attention and MLP add nothing), as medusa's blocks
        # start as the identity: a layer started from nothing underfit here (docs/results.md, thirty-third session).
        with torch.no_grad():
            self.fc.weight.zero_()
            self.fc.weight[:, h:].copy_(torch.eye(h))
        nn.init.zeros_(self.o.weight)
        nn.init.zeros_(self.down.weight)

    def true_features(self, target_features: torch.Tensor) -> torch.Tensor:
        """The feature a slot reads after a true position: the target's fused layers (EAGLE-3), or its final norm's
        output as it is. A slot after a drafted position reads the layer's own prediction instead."""
        return target_features if self.fuse is None else self.fuse(target_features)

    def qkv(self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
        """The residual stream x and rotated q, k and v of slots (B, T) at `positions`."""
        x = self.fc(torch.cat([emb, feat], dim=-1))
        a = self.attn_norm(x)
        b, t, _ = a.shape
        q = self.q(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        k = self.k(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        v = self.v(a).view(b, t, -1, self.head_dim).transpose(1, 2)
        cos, sin = rotary_cos_sin(positions, self.head_dim, self.cfg.rope_theta, q.dtype)
        return x, rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(self, x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        """Attention output (B, heads, T, d) → residual, MLP, output norm: the predicted features (B, T, H)."""
        b, _, t, _ = attended.shape
        x = x + self.o(attended.transpose(1, 2).reshape(b, t, -1))
        m = self.mlp_norm(x)
        x = x + self.down(F.silu(self.gate(m)) * self.up(m))
        return self.out_norm(x)

    def forward(
        self, emb: torch.Tensor, feat: torch.Tensor, positions: torch.Tensor, cache: EagleCache | None = None
    ) -> torch.Tensor:
        """Predicted features for slots (B, T) that follow the cache's slots (causal among themselves); the cache, if
        given, keeps their keys and values."""
        x, q, k, v = self.qkv(emb, feat, positions)
        if cache is not None:
            k, v = cache.append(k, v)
        mask = causal_mask(q.shape[2], k.shape[2], q.device)
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        return self.finish(x, attended)


class EagleCache:
    """The eagle layer's keys and values (1, kv_heads, slots, head_dim), preallocated and grown by doubling;
    `length` slots are valid, and moving it back drops the rest."""

    def __init__(self, kv_heads: int, head_dim: int, device: torch.device) -> None:
        self.keys = torch.zeros(1, kv_heads, 0, head_dim, device=device)
        self.values = torch.zeros_like(self.keys)
        self.length = 0

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write slots after `length`; the keys and values of every slot up to them."""
        end = self.length + k.shape[2]
        self.keys, self.values = grown(self.keys, 2, end), grown(self.values, 2, end)
        self.keys[:, :, self.length : end] = k
        self.values[:, :, self.length : end] = v
        self.length = end
        return self.keys[:, :, :end], self.values[:, :, :end]


class ResBlock(nn.Module):
    def __init__(self, hidden: int) -> None:
        super().__init__()
        self.linear = nn.Linear(hidden, hidden)
        nn.init.zeros_(self.linear.weight)  # starts as the identity: head k begins as the target's own next-token head

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x + F.silu(self.linear(x))


def medusa_block(hidden: int, layers: int) -> nn.Module:
    """One medusa block: `layers` residual layers in a row (one: a ResBlock itself, the state-dict keys of files made
    before deeper blocks existed)."""
    return ResBlock(hidden) if layers == 1 else nn.Sequential(*(ResBlock(hidden) for _ in range(layers)))


class DraftHeads(nn.Module):
    """The trained part (eagle layer or medusa blocks) plus what it borrows from the target at load time: the token
    embedding table and the LM head rows of `vocab_ids`, the vocabulary drafts are drawn from."""

    vocab_ids: torch.Tensor

    def __init__(self, cfg: HeadsConfig, vocab_ids: torch.Tensor) -> None:
        super().__init__()
        self.cfg = cfg
        self.register_buffer("vocab_ids", vocab_ids.long(), persistent=False)
        self.eagle = EagleLayer(cfg) if cfg.kind == "eagle" else None
        self.medusa = (
            nn.ModuleList(medusa_block(cfg.hidden, cfg.block_layers) for _ in range(cfg.n_medusa))
            if cfg.kind == "medusa"
            else None
        )
        self.token_in = nn.Linear(cfg.hidden, cfg.hidden, bias=False) if cfg.reads_token else None
        if self.token_in is not None:
            nn.init.zeros_(self.token_in.weight)  # starts as plain medusa
        self.draft_in: nn.ModuleList | None = None
        if cfg.reads_draft:  # block k ≥ 1's view of the draft before its token; starts as reads_token medusa
            linears = [nn.Linear(cfg.hidden, cfg.hidden, bias=False) for _ in range(cfg.n_medusa - 1)]
            for linear in linears:
                nn.init.zeros_(linear.weight)
            self.draft_in = nn.ModuleList(linears)
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

    def medusa_input(self, features: torch.Tensor, next_tokens: torch.Tensor) -> torch.Tensor:
        """What medusa's blocks read at feature j (..., H): f_j, plus with reads_token the token after it, t_{j+1}
        (next_tokens, the same leading shape), embedded and projected."""
        if self.token_in is None:
            return features
        return features + self.token_in(self.embed_tokens(next_tokens))

    def block_input(self, k: int, inputs: torch.Tensor, draft_before: torch.Tensor | None) -> torch.Tensor:
        """What medusa's block k reads: medusa_input's `inputs`, plus with reads_draft for k ≥ 1 the token before the
        one it drafts, t_{j+1+k} (draft_before: token ids, inputs' leading shape or broadcast to it)."""
        if self.draft_in is None or k == 0:
            return inputs
        assert draft_before is not None, "block k ≥ 1 of reads_draft heads reads the draft before its own"
        return inputs + self.draft_in[k - 1](self.embed_tokens(draft_before))
