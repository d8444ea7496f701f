"""Attention over one sequence's KV cache, and the rotary embedding it needs.

Two ways, chosen by what the target needs (BatchRunner's exact_rows):
- causal_attention: one fused SDPA call per sequence with the causal mask offset by the cached length, softmax in
  float32. Fast; a row's last bits may depend on how many rows were fed with it.
- row_attention: one query row at a time, each over exactly the keys it may see. A fused kernel blocks its sums by
  how many rows it is given, so a token verified among K others comes out a last bit different from the same token
  decoded alone; a quantized layer then rounds that bit into a whole int8 step now and then and greedy output
  leaves the target-only path. Row by row, each row's matmuls have the shapes of decoding it alone: bit for bit.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary position embedding in the rotate-half form (Qwen2, Llama) of x [..., rows, dim]."""
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def rotary_cos_sin(positions: torch.Tensor, dim: int, theta: float, dtype: torch.dtype) -> tuple[torch.Tensor, ...]:
    """cos and sin [rows, dim] of the rotary angles at `positions` (rows,), for rotate()."""
    inv_freq = 1.0 / theta ** (torch.arange(0, dim, 2, dtype=torch.float32, device=positions.device) / dim)
    angles = positions.float()[:, None] * inv_freq[None, :]
    angles = torch.cat([angles, angles], -1)
    return angles.cos().to(dtype), angles.sin().to(dtype)


def causal_mask(rows: int, seen: int, device: torch.device) -> torch.Tensor:
    """[rows, seen] True where row i may attend: the keys up to seen − rows + i (the cached ones, the new rows up to
    its own)."""
    return torch.ones(rows, seen, dtype=torch.bool, device=device).tril(seen - rows)


def causal_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, mask: torch.Tensor | None = None
) -> torch.Tensor:
    """q [heads, rows, dim], the last `rows` positions of keys/values [kv_heads, seen, dim] → [rows, heads, dim].
    mask [rows, seen]: what each row sees, when not causal_mask's (a draft tree's rows see their path only)."""
    mask = causal_mask(q.shape[1], keys.shape[1], q.device) if mask is None else mask
    out = F.scaled_dot_product_attention(
        q.float(), keys.float(), values.float(), attn_mask=mask, scale=scale, enable_gqa=True
    )
    return out.to(q.dtype).transpose(0, 1)


# Per query row, the keys it sees: how many leading ones, or (a tree node's path) their indices, in order.
RowKeys = list[int | torch.Tensor]


def row_keys(mask: torch.Tensor) -> RowKeys:
    """mask [rows, seen] as row_attention takes it, read once (row_attention is the CPU's path, where reads are
    free): a row that sees a prefix of the keys by its length, any other by its keys' indices."""
    prefix, counts = mask.long().cumprod(-1).sum(-1).tolist(), mask.sum(-1).tolist()
    return [p if p == c else mask[i].nonzero().flatten() for i, (p, c) in enumerate(zip(prefix, counts))]


def row_attention(
    q: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float, visible: RowKeys | None = None
) -> torch.Tensor:
    """causal_attention's result computed one query row at a time (bit-identical to decoding each row alone).
    visible (row_keys): what each row sees when not causal; a row that sees a tree node's path reads those keys
    gathered, in order: the same values as its path decoded alone."""
    n_heads, rows, dim = q.shape
    kv_heads, seen = keys.shape[0], keys.shape[1]
    grouped = q.view(kv_heads, n_heads // kv_heads, rows, dim)  # query heads grouped by the KV head they share
    out = q.new_empty(rows, n_heads, dim)
    for i in range(rows):
        row = seen - rows + i + 1 if visible is None else visible[i]
        if isinstance(row, int):
            k, v = keys[:, :row], values[:, :row]
        else:
            k, v = keys.index_select(1, row), values.index_select(1, row)
        weights = torch.softmax(torch.matmul(grouped[:, :, i], k.transpose(-1, -2)).float() * scale, dim=-1)
        out[i] = torch.matmul(weights.to(v.dtype), v).reshape(n_heads, dim)  # [kv_heads, group, dim]
    return out
