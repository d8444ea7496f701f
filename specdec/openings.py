"""An answer's first tokens guessed from how its question begins, so that the answer's first forward verifies drafts.

The first step of an answer had nothing to draft: draft heads read the target's feature at the answer's last token,
and the prompt's last rows are fed by that very step. Yet how a question begins says much about how the target's
answer begins ("What is …" → "The", "How do I …" → "To"). An OpeningTable, counted over the target's own answers in
the corpus (`specvoice corpus openings`), keeps the likeliest first tokens after each question prefix of up to
MAX_PREFIX tokens seen at least MIN_COUNT times; the opening echo (drafters.OpeningEchoDrafter) continues each guess
with the question's words, and the guesses are verified as one draft tree. Tokens are never lost: a wrong guess
only costs its rows in the forward.
"""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import asset_path
from .tree import ROOT, DraftTree, keep_best

MAX_PREFIX = 4  # question tokens a guess may condition on: 4 guessed best of 1–4 on held-out corpus answers
MIN_COUNT = 3  # answers a prefix needs before its counts are trusted; a shorter prefix answers otherwise
KEEP = 3  # guesses kept per prefix
# The chance a guess's echo continues right once the guess is, for ranking a tree's nodes: a guess's share times this
# per echoed token.
ECHO_KEPT = 0.7


@dataclass(frozen=True)
class OpeningTable:
    """For question prefixes (token ids), the target's likeliest first answer tokens with their shares, best first."""

    target: str
    firsts: dict[tuple[int, ...], tuple[tuple[int, float], ...]]
    answers: int = 0  # how many answers it was counted over

    def guesses(self, question: Sequence[int], most: int) -> list[tuple[int, float]]:
        """Up to `most` (first token, share) after the longest prefix of the question that the table knows."""
        for n in range(min(MAX_PREFIX, len(question)), 0, -1):
            if found := self.firsts.get(tuple(question[:n])):
                return list(found[:most])
        return []

    def save(self, path: Path) -> None:
        rows = [[list(prefix), [list(g) for g in found]] for prefix, found in sorted(self.firsts.items())]
        doc = {"target": self.target, "answers": self.answers, "max_prefix": MAX_PREFIX, "min_count": MIN_COUNT}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**doc, "firsts": rows}, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path) -> OpeningTable:
        doc = json.loads(path.read_text())
        firsts = {tuple(prefix): tuple((int(t), float(s)) for t, s in found) for prefix, found in doc["firsts"]}
        return cls(doc["target"], firsts, doc.get("answers", 0))


def count_openings(examples: Iterable[tuple[Sequence[int], int]], target: str) -> OpeningTable:
    """The table of (question ids, the answer's first token) pairs: every prefix of 1–MAX_PREFIX tokens seen with at
    least MIN_COUNT answers keeps its KEEP most frequent first tokens (ties: the lower id) and their shares."""
    counts: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    answers = 0
    for question, first in examples:
        answers += 1
        for n in range(1, min(MAX_PREFIX, len(question)) + 1):
            counts[tuple(question[:n])][first] += 1
    firsts = {}
    for prefix, counter in counts.items():
        total = sum(counter.values())
        if total >= MIN_COUNT:
            best = sorted(counter.items(), key=lambda tc: (-tc[1], tc[0]))[:KEEP]
            firsts[prefix] = tuple((token, count / total) for token, count in best)
    return OpeningTable(target, firsts, answers)


def opening_tree(chains: Sequence[tuple[Sequence[int], float]], max_nodes: int, device: torch.device) -> DraftTree:
    """Guessed openings (each a guess and its echo, with the guess's share) as one draft tree, each chain a branch
    from the root, scored log(share × ECHO_KEPT^(depth − 1)); tree.keep_best keeps its max_nodes best nodes."""
    depth = max(len(tokens) for tokens, _ in chains)
    nodes = [(c, d) for d in range(depth) for c, (tokens, _) in enumerate(chains) if d < len(tokens)]  # depth by depth
    index = {node: i for i, node in enumerate(nodes)}
    tree = DraftTree(
        torch.tensor([chains[c][0][d] for c, d in nodes], dtype=torch.long, device=device),
        torch.tensor([ROOT if d == 0 else index[c, d - 1] for c, d in nodes], dtype=torch.long, device=device),
        torch.tensor([d + 1 for _, d in nodes], dtype=torch.long, device=device),
        scores=torch.tensor([chains[c][1] * ECHO_KEPT**d for c, d in nodes], device=device).log(),
    )
    return keep_best(tree, max_nodes)


def default_openings_path(target: str) -> Path:
    """The shipped table for a target preset: assets/heads/<target>.openings.json."""
    return asset_path("heads", f"{target}.openings.json")


def openings_file(choice: str, target: str) -> Path | None:
    """--opening-table read: None for "none", and for "" where the target ships no table; else the table's file."""
    if choice == "none":
        return None
    path = Path(choice) if choice else default_openings_path(target)
    return path if choice or path.exists() else None


def load_openings(choice: str, target: str) -> OpeningTable | None:
    """The table --opening-table names (openings_file), which must count the target's answers; None for none."""
    path = openings_file(choice, target)
    if path is None:
        return None
    if not path.exists():
        raise FileNotFoundError(f"no opening table at {path}: `specvoice corpus openings --openings {path}` makes one")
    table = OpeningTable.load(path)
    if table.target != target:
        raise ValueError(f"the opening table {path} counts {table.target!r}'s answers, not {target!r}'s")
    return table
