"""A batched target forward of our own: several sequences' new tokens packed into one forward, each sequence with
its own KV cache, positions and causal attention.

transformers' caches hold one length for the whole batch, so sequences that join, leave and roll back drafts at
different lengths would need padding and masks; packing needs neither. Every Linear layer (the forward's cost) runs
once over all rows of all sequences; attention runs per sequence, row by row (quant.row_attention), so a row's
result does not depend on what else was fed with it: a sequence batched with others gets the logits it gets alone
(bit for bit with the w8a8 target, whose Linear rows are independent too). For Qwen2- and Llama-shaped models.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from .quant import row_attention
from .tokenizer import common_prefix_length

if TYPE_CHECKING:
    from transformers import PreTrainedModel

MIN_CAPACITY = 256  # KV positions a sequence first allocates; doubled as it grows


class SequenceCache:
    """One sequence's KV cache in a BatchRunner, with PrefixCache's interface, so an EngineSession can hold either.
    Invariant: the cache holds exactly `tokens`."""

    def __init__(self, runner: BatchRunner) -> None:
        self.runner = runner
        self.tokens: list[int] = []
        self.kv: list[tuple[torch.Tensor, torch.Tensor]] = []  # per layer: keys, values [kv_heads, capacity, dim]
        self.keep_hidden = False
        self.hidden: torch.Tensor | None = None
        self.hidden_start = 0

    def reset(self) -> None:
        self.tokens = []

    def rollback(self, length: int) -> None:
        """Keep only the first `length` cached tokens (after a rejection)."""
        del self.tokens[length:]

    def common_prefix(self, tokens: list[int]) -> int:
        return common_prefix_length(self.tokens, tokens)

    def extend(self, tokens: list[int], n_logits: int = 1) -> torch.Tensor:
        """PrefixCache.extend for this sequence alone."""
        return self.runner.extend([Feed(self, tokens, n_logits)])[0]

    def _reserve(self, length: int) -> None:
        capacity = self.kv[0][0].shape[1] if self.kv else 0
        if length <= capacity:
            return
        new_capacity = max(MIN_CAPACITY, capacity)
        while new_capacity < length:
            new_capacity *= 2
        r = self.runner
        shape = (r.kv_heads, new_capacity, r.head_dim)
        grown = []
        for layer in range(r.n_layers):
            k, v = (torch.zeros(shape, dtype=r.dtype, device=r.device) for _ in range(2))
            if self.kv:
                k[:, :capacity], v[:, :capacity] = self.kv[layer]
            grown.append((k, v))
        self.kv = grown


@dataclass
class Feed:
    """What one sequence asks of a batched forward: make its cache hold `tokens`, return logits of the last
    n_logits positions (PrefixCache.extend's contract)."""

    cache: SequenceCache
    tokens: list[int]
    n_logits: int = 1


class BatchRunner:
    def __init__(self, model: PreTrainedModel, device: torch.device) -> None:
        self.model = model
        self.device = device
        decoder = model.get_decoder()
        self.layers = list(decoder.layers)
        attn = self.layers[0].self_attn
        cfg = model.config
        self.n_layers = len(self.layers)
        self.head_dim = attn.head_dim
        self.n_heads = cfg.num_attention_heads
        self.kv_heads = cfg.num_key_value_heads
        self.scaling = attn.scaling
        self.dtype = decoder.norm.weight.dtype  # what the model's remainder computes in (float32 once quantized)

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self)

    @torch.inference_mode()
    def extend(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over every feed's new tokens; per feed, logits (n, V) as PrefixCache.extend returns them."""
        starts, news = [], []
        for f in feeds:
            keep = max(0, min(f.cache.common_prefix(f.tokens), len(f.tokens) - f.n_logits))
            f.cache.rollback(keep)
            f.cache._reserve(len(f.tokens))
            starts.append(keep)
            news.append(f.tokens[keep:])
        try:
            hidden = self._forward(feeds, starts, news)
        except BaseException:
            for f in feeds:  # a forward that failed half-way may have written some layers' caches: start over
                f.cache.reset()
            raise
        rows: list[int] = []
        logits_rows, offset = [], 0
        for f, start, new in zip(feeds, starts, news):
            n = min(f.n_logits, len(new))
            logits_rows.append((len(rows), n))
            rows.extend(range(offset + len(new) - n, offset + len(new)))
            f.cache.tokens = list(f.tokens)
            if f.cache.keep_hidden:
                f.cache.hidden, f.cache.hidden_start = hidden[offset : offset + len(new)], start
            offset += len(new)
        logits = self.model.get_output_embeddings()(hidden[rows])
        return [logits[a : a + n] for a, n in logits_rows]

    def _forward(self, feeds: list[Feed], starts: list[int], news: list[list[int]]) -> torch.Tensor:
        """The decoder over all new tokens, packed as one batch of rows; returns the final-norm hidden states."""
        decoder = self.model.get_decoder()
        ids = torch.tensor([t for new in news for t in new], device=self.device)
        positions = [p for s, new in zip(starts, news) for p in range(s, s + len(new))]
        x = decoder.embed_tokens(ids[None])  # [1, rows, hidden]
        cos, sin = decoder.rotary_emb(x, torch.tensor([positions], device=self.device))
        spans = [(s, len(new)) for s, new in zip(starts, news)]
        for i, layer in enumerate(self.layers):
            h = layer.input_layernorm(x)
            x = x + self._attention(layer.self_attn, h, cos, sin, feeds, spans, i)
            x = x + layer.mlp(layer.post_attention_layernorm(x))
        return decoder.norm(x)[0]

    def _attention(
        self,
        attn: Any,  # the layer's attention module: its projections and scaling
        h: torch.Tensor,
        cos: torch.Tensor,
        sin: torch.Tensor,
        feeds: list[Feed],
        spans: list[tuple[int, int]],
        layer: int,
    ) -> torch.Tensor:
        rows = h.shape[1]
        q = attn.q_proj(h).view(rows, self.n_heads, self.head_dim).transpose(0, 1)  # [heads, rows, dim]
        k = attn.k_proj(h).view(rows, self.kv_heads, self.head_dim).transpose(0, 1)
        v = attn.v_proj(h).view(rows, self.kv_heads, self.head_dim).transpose(0, 1)
        q, k = rotate(q, cos[0], sin[0]), rotate(k, cos[0], sin[0])
        out = []
        offset = 0
        for f, (start, n) in zip(feeds, spans):
            keys, values = f.cache.kv[layer]
            keys[:, start : start + n] = k[:, offset : offset + n]
            values[:, start : start + n] = v[:, offset : offset + n]
            seen = start + n
            o, _ = row_attention(
                attn, q[None, :, offset : offset + n], keys[None, :, :seen], values[None, :, :seen], None, self.scaling
            )
            out.append(o[0])  # [n, heads, dim]
            offset += n
        return attn.o_proj(torch.cat(out).reshape(1, rows, -1))


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding (rotate-half form, as Qwen2 and Llama apply it) of x [heads, rows, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin
