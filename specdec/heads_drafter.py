"""Drafting with draft heads (heads_model.py) from the target's features, which the engine hands over after every
target forward through observe(). Features live in a preallocated buffer, as the eagle layer's keys and values do:
nothing grows by concatenation per step."""

from __future__ import annotations

from dataclasses import replace
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from .drafters import Proposal, choose_drafts, ngram_lookup
from .heads_model import DraftHeads, EagleCache
from .kv import grown
from .sampling import SamplingParams
from .tokenizer import common_prefix_length
from .tree import DraftTree, build_tree, graft

if TYPE_CHECKING:
    from .events import StepEvent
    from .kv import SequenceCache

# --draft-min-prob's default for heads: none. With verification nearly flat (the w8a8 target's 1 … 5-token forwards
# within 15% of each other, docs/results.md, engine core), a draft the gate would drop costs next to nothing:
# bench on the 20 voice prompts gave 1.19× with no gate at K = 3 against 1.02× with the earlier 0.5 (chosen when
# each verified draft cost 10–17% of a forward).
HEADS_MIN_PROB = 0.0

# The shortest match a lookup grafts from. Replaying 287 held-out greedy corpus answers (scripts/lookup_replay.py),
# the continuation's first token was right after 25 % of 1-token matches, 42 % of 2-token and 77 % of 4-token ones.
LOOKUP_MIN_NGRAM = 2


class HeadsDrafter:
    """Drafts from the target's features: eagle autoregressively on its own one-layer cache, medusa in one step (with
    reads_draft, block after block: each reads the draft before its own).

    min_prob: the confidence gate (drafters.confident_count), as for a draft model.
    tree_width: above 1, the K drafts are the best K nodes of a draft tree with this many candidates per node
    (build_tree, EAGLE-2's ranking by path probability), instead of a chain: medusa's from its blocks in one step,
    eagle's grown depth by depth, each node's slot attending to the true slots and its own path.
    lookup: with a tree, up to this many more nodes, no deeper than K: what followed the latest earlier occurrence of
    the context's last LOOKUP_MIN_NGRAM or more tokens (drafters.ngram_lookup), grafted onto the tree (tree.graft).
    Heads guess from one feature; a spoken answer also repeats its question's and its own words, which a lookup
    finds.
    """

    def __init__(self, heads: DraftHeads, min_prob: float = 0.0, tree_width: int = 1, lookup: int = 0) -> None:
        self.kind = "heads"
        self.reads_target_hidden = True
        self.heads = heads
        self.min_prob = min_prob
        self.tree_width = tree_width
        self.lookup = lookup
        self.target_layers = heads.cfg.fuse_layers  # what the target's cache keeps for us (kv.SequenceCache)
        self.tokens: list[int] = []  # the conversation the target has verified; features[j] belongs to tokens[j]
        self.device = heads.vocab_ids.device
        self.features = torch.zeros(0, heads.cfg.feature_width, device=self.device)
        self.eagle: EagleCache | None = None
        if heads.eagle is not None:  # slots 1 …, each computed from true features
            self.eagle = EagleCache(heads.cfg.n_kv_heads, heads.eagle.head_dim, self.device)
        self.slot_tokens: list[int] = []  # eagle: t_j of each cached slot j (tokens[1:] when all are current)

    def prefill(self, ids: list[int]) -> None:
        pass  # features come with the target's forwards, through observe()

    def start(self, prompt_len: int, question_start: int = 0) -> None:
        pass

    def rollback(self, length: int) -> None:
        del self.tokens[length:]
        self._crop_slots(max(0, length - 1))

    def observe(self, event: StepEvent, target: SequenceCache) -> None:
        assert target.hidden is not None, "keep_hidden was off for that forward"
        kept = len(target.tokens) - target.hidden_start
        self.add_features(list(target.tokens), target.hidden_start, target.hidden[:kept])

    def add_features(self, tokens: list[int], start: int, hidden: torch.Tensor) -> None:
        """The target now holds `tokens`; `hidden` are its features at positions start … len(tokens) − 1."""
        end = start + len(hidden)
        self.features = grown(self.features, 0, end)
        self.features[start:end] = hidden.float()
        self.tokens = list(tokens)
        self._crop_slots(start)  # slot j reads f_{j−1}: the slots up to `start` read unchanged features

    def _crop_slots(self, n: int) -> None:
        del self.slot_tokens[n:]
        if self.eagle is not None:
            self.eagle.length = len(self.slot_tokens)

    @torch.inference_mode()
    def propose(
        self, context: list[int], k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        last = len(context) - 1  # the newest token, t_L: the target has not fed it yet
        if last < 1 or len(self.tokens) < last or common_prefix_length(self.tokens, context) < last:
            return Proposal.of([], self.device)  # no features for this context yet (the first step is the prefill)
        if self.tree_width > 1:
            return self._tree(context, last, k)
        if self.heads.medusa is not None:
            f = self._medusa_feature(context, last)
            if self.heads.draft_in is not None:
                return self._medusa_chain(f, k, params, generator)
            sub = torch.stack([self.heads.lm(block(f)) for block in list(self.heads.medusa)[:k]])
            tokens, tops, q = choose_drafts(sub, self.heads.vocab_ids, self.heads.cfg.vocab_size, params, generator)
            return Proposal.gated([tokens], [tops], [] if q is None else [q], self.min_prob, forwards=1)
        return self._eagle(context, last, k, params, generator)

    def _medusa_feature(self, context: list[int], last: int) -> torch.Tensor:
        """What medusa's blocks read for the newest token t_L: the feature its own LM head gave t_L from (block i
        gives t_{L+1+i}), with reads_token t_L itself."""
        f = self.features[last - 1]
        if self.heads.token_in is not None:  # no host-to-device copy a step where nothing reads it
            f = self.heads.medusa_input(f, torch.tensor(context[last], device=self.device))
        return f

    def _tree(self, context: list[int], last: int, k: int) -> Proposal:
        """The best k nodes of the heads' tree (medusa's in one step, eagle's one layer forward a depth), with the
        lookup's chain grafted on."""
        if self.heads.medusa is not None:
            tree, forwards = self._medusa_tree(self._medusa_feature(context, last), k), 1
        else:
            tree, forwards = self._eagle_tree(context, last, k), k
        proposal = Proposal.of_tree(self._with_lookup(tree, context, k), forwards)
        return replace(proposal, confidence=None) if self.lookup else proposal  # a grafted chain has no confidence

    def _medusa_chain(
        self, f: torch.Tensor, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        """reads_draft's chain: block i reads the token block i − 1 drafted (sampled, when sampling: q_i is then
        conditioned on the drafts before it, as rejection sampling needs)."""
        heads, blocks = self.heads, self.heads.medusa
        assert blocks is not None
        drafts, tops, probs = [], [], []
        before: torch.Tensor | None = None
        for i, block in enumerate(list(blocks)[:k]):
            logits = heads.lm(block(heads.block_input(i, f, before)))
            token, top, q = choose_drafts(logits[None], heads.vocab_ids, heads.cfg.vocab_size, params, generator)
            drafts.append(token)
            tops.append(top)
            if q is not None:
                probs.append(q)
            before = token[0]
        return Proposal.gated(drafts, tops, probs, self.min_prob, forwards=1)

    def _medusa_tree(self, f: torch.Tensor, max_nodes: int) -> DraftTree:
        """The best max_nodes nodes of Medusa's tree, ranked by the heads' path probability: block d's top
        tree_width tokens as the children of each node at depth d − 1, the same for every node (plain blocks read
        no path) or, with reads_draft, each node's own (block d reads the node's token). Deterministic: verified as
        one-hot drafts, lossless greedy or sampled."""
        heads, blocks = self.heads, self.heads.medusa
        assert blocks is not None
        depths = min(max_nodes, len(blocks))
        depth = iter(range(depths))
        made: list[torch.Tensor] = []  # the tokens of the nodes made so far, in Expand's numbering

        def expand(frontier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            d = next(depth)
            before = torch.cat(made)[frontier] if d and heads.draft_in is not None else None
            x = heads.block_input(d, f, before)
            logp, ids = heads.lm(blocks[d](x)).float().log_softmax(-1).topk(self.tree_width, -1)
            tokens = heads.vocab_ids[ids].expand(len(frontier), -1)
            made.append(tokens.flatten())
            return tokens, logp.expand(len(frontier), -1)

        return build_tree(expand, self.tree_width, depths, max_nodes, self.device)

    def _with_lookup(self, tree: DraftTree, context: list[int], k: int) -> DraftTree:
        """The tree with the lookup's chain grafted on, at most k deep: a node sits at its depth's position, and k is
        what the answer's budget and context room allow."""
        if not self.lookup:
            return tree
        chain = ngram_lookup(context, min(self.lookup, k), min_ngram=LOOKUP_MIN_NGRAM)
        return graft(tree, torch.tensor(chain, dtype=torch.long, device=self.device))

    def _eagle(
        self, context: list[int], last: int, k: int, params: SamplingParams, generator: torch.Generator | None
    ) -> Proposal:
        heads, layer, cache = self.heads, self.heads.eagle, self.eagle
        assert layer is not None and cache is not None
        pred = self._eagle_true_slots(context, last)
        drafts, tops, probs = [], [], []
        for i in range(k):
            token, top, q = choose_drafts(
                heads.lm(pred)[None], heads.vocab_ids, heads.cfg.vocab_size, params, generator
            )
            drafts.append(token)
            tops.append(top)
            if q is not None:
                probs.append(q)
            if i + 1 < k:  # the next slot reads this draft and the feature predicted for its position
                pos = torch.tensor([last + 1 + i], device=self.device)
                pred = layer(heads.embed_tokens(token.view(1, 1)), pred.view(1, 1, -1), pos, cache)[0, -1]
        cache.length = len(self.slot_tokens)  # the draft slots go: they read predicted features
        return Proposal.gated(drafts, tops, probs, self.min_prob, forwards=k)

    def _eagle_true_slots(self, context: list[int], last: int) -> torch.Tensor:
        """The eagle layer over the slots not yet in its cache, up to `last` (each reads the target's true feature),
        cached; the feature it predicts at `last`, whose LM head rows give the first draft."""
        heads, layer, cache = self.heads, self.heads.eagle, self.eagle
        assert layer is not None and cache is not None
        self._crop_slots(common_prefix_length(self.slot_tokens, context[1:]))
        first = len(self.slot_tokens) + 1  # the first slot to compute; slots first … last read true features
        ids = torch.tensor([context[first : last + 1]], device=self.device)
        feats = layer.true_features(self.features[first - 1 : last].unsqueeze(0))
        positions = torch.arange(first, last + 1, device=self.device)
        pred = layer(heads.embed_tokens(ids), feats, positions, cache)[0, -1]
        self.slot_tokens = context[1 : last + 1]
        return pred

    def _eagle_tree(self, context: list[int], last: int, max_nodes: int) -> DraftTree:
        """The best max_nodes nodes of EAGLE-2's tree: the layer's top tree_width tokens as a node's children, the
        best tree_width nodes of each depth expanded, one layer forward a depth. A node at depth d is the slot
        last + d: it reads its token and its parent's predicted feature and attends to the true slots, its
        ancestors' slots and itself, as drafting its path alone would (_eagle). Deterministic: verified as one-hot
        drafts, lossless greedy or sampled. Everything stays on the device: nodes are found by tensor indices."""
        heads, layer, cache = self.heads, self.heads.eagle, self.eagle
        assert layer is not None and cache is not None
        root = self._eagle_true_slots(context, last)
        true_keys, true_values = cache.keys[:, :, : cache.length], cache.values[:, :, : cache.length]
        width, dev = self.tree_width, self.device
        tokens = torch.zeros(0, dtype=torch.long, device=dev)  # every node made, in Expand's numbering
        reads = torch.zeros(0, root.shape[-1], device=dev)  # the feature each node's slot reads: its parent's
        keys = torch.zeros(0, *true_keys.shape[1::2], device=dev)  # (nodes, kv_heads, head_dim): set once expanded
        values = torch.zeros_like(keys)
        paths = torch.zeros(1, 0, dtype=torch.long, device=dev)  # the newest depth's nodes' ids, root to self
        depth = 0  # of the frontier's nodes

        def expand(frontier: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
            nonlocal tokens, reads, keys, values, paths, depth
            if depth == 0:
                path, pred = paths, root[None]
            else:
                path = paths[frontier - (len(tokens) - len(paths))]  # (F, depth)
                emb = heads.embed_tokens(tokens[frontier])[:, None]
                x, q, k, v = layer.qkv(emb, reads[frontier][:, None], torch.tensor([last + depth], device=dev))
                keys, values = keys.index_copy(0, frontier, k[:, :, 0]), values.index_copy(0, frontier, v[:, :, 0])
                ks = torch.cat([true_keys.expand(len(frontier), -1, -1, -1), keys[path].transpose(1, 2)], dim=2)
                vs = torch.cat([true_values.expand(len(frontier), -1, -1, -1), values[path].transpose(1, 2)], dim=2)
                pred = layer.finish(x, F.scaled_dot_product_attention(q, ks, vs, enable_gqa=True))[:, 0]
            logp, ids = heads.lm(pred).float().log_softmax(-1).topk(width, -1)
            made = torch.arange(len(tokens), len(tokens) + ids.numel(), device=dev)
            tokens = torch.cat([tokens, heads.vocab_ids[ids].flatten()])
            reads = torch.cat([reads, pred.repeat_interleave(width, 0)])
            keys = torch.cat([keys, keys.new_zeros(ids.numel(), *keys.shape[1:])])
            values = torch.cat([values, values.new_zeros(ids.numel(), *values.shape[1:])])
            paths = torch.cat([path.repeat_interleave(width, 0), made[:, None]], dim=1)
            depth += 1
            return heads.vocab_ids[ids], logp

        return build_tree(expand, width, max_nodes, max_nodes, dev)
