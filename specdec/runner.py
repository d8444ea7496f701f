"""Our own target forward: several sequences' new tokens packed into one forward, each sequence with its own KV cache
(kv.SequenceCache), positions and causal attention. Used for one sequence and for a batch alike.

transformers' caches hold one length for the whole batch, so sequences that join, leave and roll back drafts at
different lengths would need padding and masks; packing needs neither. Every Linear layer (the forward's cost) runs
once over all rows of all sequences; attention runs per sequence (attention.py). With exact_rows, attention runs row
by row, so a row's result does not depend on what else was fed with it: a sequence batched with others, or a token
verified among drafts, gets the logits it gets decoded alone (bit for bit with the quantized targets, whose Linear
rows are independent too). For Qwen2- and Llama-shaped models.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from . import compute
from .attention import causal_attention, rotate, row_attention, row_keys
from .kv import PENDING, Feed, SequenceCache
from .quant_fuse import fused_layer
from .quant_layers import keep_int8_matmul_eager
from .timing import median_seconds
from .tree import tree_feed_mask, tree_positions

if TYPE_CHECKING:
    from transformers import PreTrainedModel


class BatchRunner:
    """exact_rows: attention row by row (what a lossless quantized target needs); else one fused call per sequence.
    min_feed: a forward feeds at least this many rows, padding with copies of the last token (its KV slots are past
    the sequence's length, so nothing keeps them): a one-row bf16 matmul is slower than a two-row one on some CPUs.
    compile: torch.compile each layer's dense halves (layer_parts); attention and the caches stay eager."""

    def __init__(
        self,
        model: PreTrainedModel,
        device: torch.device,
        exact_rows: bool = False,
        min_feed: int = 1,
        compile: bool = False,
    ) -> None:
        self.model = model
        self.device = device
        self.exact_rows = exact_rows
        self.min_feed = min_feed
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
        self.parts = [layer_parts(layer, self.n_heads, self.kv_heads, self.head_dim) for layer in self.layers]
        self.fused = fused_layer(attn.q_proj, attn.k_proj, attn.v_proj) is not None  # w8a8's fused layers
        self.new_step: Callable[[], None] = lambda: None  # CUDA graphs: a forward's replays start a new step
        if compile:  # dynamic: one graph for every number of rows; CUDA graphs per shape on a GPU
            keep_int8_matmul_eager()
            graphs = device.type == "cuda"
            mode = "reduce-overhead" if graphs else "default"
            self.parts = [
                (torch.compile(project, dynamic=True, mode=mode), torch.compile(finish, dynamic=True, mode=mode))
                for project, finish in self.parts
            ]
            if graphs:  # every layer replays one graph, whose output buffer the next layer overwrites: copy it out
                self.new_step = torch.compiler.cudagraph_mark_step_begin
                self.parts = [(project, outside_the_graph(finish)) for project, finish in self.parts]

    def new_cache(self) -> SequenceCache:
        return SequenceCache(self)

    def extend(self, feeds: list[Feed]) -> list[torch.Tensor]:
        """One forward over every feed's new tokens; per feed, logits (n_logits, V). Run on the compute thread."""
        return compute.run(lambda: self._extend(feeds))

    @torch.inference_mode()
    def _extend(self, feeds: list[Feed]) -> list[torch.Tensor]:
        starts: list[int] = []
        pieces: list[tuple[int, int]] = []
        ids: list[int] = []
        positions: list[int] = []
        for f in feeds:
            keep = max(0, min(f.cache.common_prefix(f.tokens), f.length - f.n_logits))
            f.cache.rollback(keep)
            starts.append(keep)
            host = f.tokens[keep:]
            ids += host
            positions += range(keep, f.length)
            n_drafts = 0 if f.drafts is None else len(f.drafts)
            pieces.append((len(host), n_drafts))
        pad = max(0, self.min_feed - len(positions))
        feeds[-1].cache.reserve(feeds[-1].length + pad)
        for f in feeds[:-1]:
            f.cache.reserve(f.length)
        token_ids = self._ids(feeds, ids, pieces, pad)
        positions += range(positions[-1] + 1, positions[-1] + 1 + pad)
        spans = [(s, f.length - s) for s, f in zip(starts, feeds)]
        spans[-1] = (spans[-1][0], spans[-1][1] + pad)
        at_positions = torch.tensor(positions, device=self.device)
        masks: list[Any] = [None] * len(feeds)  # per feed, what its attention takes when it is a tree's
        offset = 0
        for i, (f, (start, n)) in enumerate(zip(feeds, spans)):
            if f.tree is not None and len(f.tree):  # its nodes sit at their depth's position and see their path
                before, nodes = len(f.tokens) - start, len(f.tree)
                at_positions[offset + before : offset + before + nodes] = tree_positions(f.tree.depths, len(f.tokens))
                mask = tree_feed_mask(f.tree.parents, start, before, n - before - nodes)
                masks[i] = row_keys(mask) if self.exact_rows else mask  # read once, not in every layer
            offset += n
        try:
            states = self._forward(feeds, spans, token_ids, at_positions, masks)
        except BaseException:
            for f in feeds:  # a forward that failed half-way may have written some layers' caches: start over
                f.cache.reset()
            raise
        rows: list[int] = []
        offset = 0
        for f, (start, n) in zip(feeds, spans):
            real = f.length - start
            rows += range(offset + real - f.n_logits, offset + real)
            f.cache.tokens = f.tokens + [PENDING] * (f.length - len(f.tokens))
            if f.cache.keep_hidden:
                layers = f.cache.keep_layers or (self.n_layers,)
                f.cache.hidden = kept_rows(states, layers, slice(offset, offset + real))
                f.cache.hidden_start = start
            offset += n
        hidden = states[self.n_layers]
        logits = self.model.get_output_embeddings()(hidden[torch.tensor(rows, device=self.device)])
        return list(logits.split([f.n_logits for f in feeds]))

    def _ids(self, feeds: list[Feed], host: list[int], pieces: list[tuple[int, int]], pad: int) -> torch.Tensor:
        """The fed ids in order, the host tokens copied to the device once, the drafts spliced in from the device."""
        host_ids = torch.tensor(host, dtype=torch.long, device=self.device)
        if all(n == 0 for _, n in pieces) and not pad:
            return host_ids
        parts, at = [], 0
        for f, (n_host, n_drafts) in zip(feeds, pieces):
            parts.append(host_ids[at : at + n_host])
            at += n_host
            if n_drafts:
                assert f.drafts is not None
                parts.append(f.drafts.to(torch.long))
        ids = torch.cat(parts)
        return torch.cat([ids, ids[-1:].expand(pad)]) if pad else ids

    def _forward(
        self,
        feeds: list[Feed],
        spans: list[tuple[int, int]],
        ids: torch.Tensor,
        positions: torch.Tensor,
        masks: list[Any],
    ) -> dict[int, torch.Tensor]:
        """The decoder over all new tokens, packed as one batch of rows; returns hidden states [rows, hidden] by
        transformers' hidden_states index: n_layers, the final norm's output, and those a feed's cache keeps."""
        decoder = self.model.get_decoder()
        self.new_step()
        x = decoder.embed_tokens(ids[None])  # [1, rows, hidden]
        cos, sin = decoder.rotary_emb(x, positions[None])
        attend = row_attention if self.exact_rows else causal_attention
        wanted = {i for f in feeds if f.cache.keep_hidden for i in f.cache.keep_layers}
        states: dict[int, torch.Tensor] = {}
        for layer, (project, finish) in enumerate(self.parts):
            if layer in wanted:  # the state after `layer` layers: this layer's input
                states[layer] = x[0]
            q, k, v = project(x, cos[0], sin[0])  # [heads, rows, dim]
            out, offset = [], 0
            for f, (start, n), mask in zip(feeds, spans, masks):  # each sequence over its own cache
                keys, values = f.cache.keys[layer], f.cache.values[layer]
                keys[:, start : start + n] = k[:, offset : offset + n]
                values[:, start : start + n] = v[:, offset : offset + n]
                seen = start + n
                out.append(attend(q[:, offset : offset + n], keys[:, :seen], values[:, :seen], self.scaling, mask))
                offset += n
            x = finish(x, torch.cat(out))
        states[self.n_layers] = decoder.norm(x)[0]
        return states


def outside_the_graph(fn: Callable[..., torch.Tensor]) -> Callable[..., torch.Tensor]:
    """fn's output copied out of its CUDA graph's static buffer, which fn's next replay overwrites."""

    def copied(*args: torch.Tensor) -> torch.Tensor:
        return fn(*args).clone()

    return copied


def kept_rows(states: dict[int, torch.Tensor], layers: tuple[int, ...], rows: slice) -> torch.Tensor:
    """Some rows of the states at `layers`, side by side (one layer's: a view, no copy)."""
    parts = [states[i][rows] for i in layers]
    return parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)


def layer_parts(layer: Any, n_heads: int, kv_heads: int, head_dim: int) -> tuple[Callable, Callable]:
    """A decoder layer's dense halves around attention, each of fixed shape for a given number of rows (what
    torch.compile can take): norm → q, k, v projections → rotary; and o_proj → residual → norm → MLP → residual.
    Layers fused by w8a8 (quant_fuse.FUSED_GROUPS) run once, their output split."""
    attn, mlp = layer.self_attn, layer.mlp
    qkv = fused_layer(attn.q_proj, attn.k_proj, attn.v_proj)
    gate_up = fused_layer(mlp.gate_proj, mlp.up_proj)
    widths = [attn.q_proj.out_features, attn.k_proj.out_features, attn.v_proj.out_features]

    def project(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> tuple[torch.Tensor, ...]:
        h = layer.input_layernorm(x)
        rows = h.shape[1]
        q, k, v = qkv(h).split(widths, dim=-1) if qkv is not None else (attn.q_proj(h), attn.k_proj(h), attn.v_proj(h))
        q = q.view(rows, n_heads, head_dim).transpose(0, 1)
        k = k.view(rows, kv_heads, head_dim).transpose(0, 1)
        v = v.view(rows, kv_heads, head_dim).transpose(0, 1)
        return rotate(q, cos, sin), rotate(k, cos, sin), v

    def finish(x: torch.Tensor, attended: torch.Tensor) -> torch.Tensor:
        x = x + attn.o_proj(attended.reshape(1, attended.shape[0], -1))
        h = layer.post_attention_layernorm(x)
        if gate_up is None:
            return x + mlp(h)
        gate, up = gate_up(h).split([mlp.gate_proj.out_features, mlp.up_proj.out_features], dim=-1)
        return x + mlp.down_proj(mlp.act_fn(gate) * up)

    return project, finish


def fastest_min_feed(runner: BatchRunner, trials: int = 3) -> int:
    """1 or 2: which of a one-token and a padded two-token decode step is faster for this model here, timed on a
    short cached prefix (bf16 on this 2-core CPU: 243 vs 190 ms for the 1.5B target; int8 is fastest at one).
    On a GPU one row never costs more than two: 1 without timing."""
    if runner.device.type != "cpu":
        return 1
    cache = runner.new_cache()
    prefix = list(range(100, 116))
    cache.extend(prefix)
    times = {}
    for width in (1, 2):
        runner.min_feed = width

        def step() -> None:
            cache.extend(prefix + [116])
            cache.rollback(len(prefix))

        times[width] = median_seconds(step, runner.device, repeats=trials)
    runner.min_feed = 1
    return min(times, key=lambda w: times[w])
