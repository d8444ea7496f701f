"""An answer's first tokens guessed from how its question begins, so that the answer's first forward verifies drafts.

The first step of an answer had nothing to draft: draft heads read the target's feature at the answer's last token,
and the prompt's last rows are fed by that very step. Yet how a question begins says much about how the target's
answer begins ("What is …" → "The", "How do I …" → "To"). An OpeningTable, counted over the target's own answers in
the corpus (`specvoice corpus openings`), keeps the likeliest first tokens after each question prefix of up to
MAX_PREFIX tokens seen at least MIN_COUNT times; the opening echo (drafters.OpeningEchoDrafter) continues each guess
with the question's words, and the guesses are verified as one draft tree. Tokens are never lost: a wrong guess
only costs its rows in the forward.

A guess may also copy a word of the question: "Why do cats purr?" → "Cats purr to …". The table counts "the answer
begins with the question's j-th content word" (a copy, key −1 − j) beside the tokens, so "Why do …" learns how often
its answers copy, and a question it has never seen gets its own word as the guess (question_copies). And a question
is guessed from every prefix the table knows, not only the longest (guesses). On the corpus's answers to 1 732
questions held out of the count (a 10 % split by question): the right first token among 3 guesses 62.8 % from the
longest prefix, 64.2 % from all of them, 68.9 % with copies (docs/results.md).
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

import torch

from .models import asset_path
from .tokenizer import Tokenizer
from .tree import ROOT, DraftTree, keep_best

MAX_PREFIX = 4  # question tokens a guess may condition on: 4 guessed best of 1–4 on held-out corpus answers
MIN_COUNT = 3  # answers a prefix needs before its counts are kept
KEEP = 4  # guesses kept per prefix
# A prefix seen n times weighs n / (n + LAMBDA) of what the longer ones left: on the split above 1, 3, 10 and 30 gave
# 68.7, 68.9, 68.7 and 67.5 %
LAMBDA = 3.0
COPIES = 3  # the question's first content words a guess may copy: 8.7, 2.8 and 1.6 % of the answers copy each
# The chance a guess's echo continues right once the guess is, for ranking a tree's nodes: a guess's share times this
# per echoed token.
ECHO_KEPT = 0.7
# What an answer does not begin by copying from its question; the question's other words are its content words.
FUNCTION_WORDS = frozenset(
    """a an the and or but so because if than that of to between my your his her their our its this these those in on
    at for from with about like into onto by how what why where when who whom whose which is are was were am be been
    being have has had do does did can could would should will shall may might must i you he she it we they me him us
    them there here not no yes please tell explain give some any much many more most very really just also ever what's
    how's where's who's it's i'm don't doesn't isn't aren't can't""".split()
)


@dataclass(frozen=True)
class Copy:
    """A content word of the question as an answer would begin with it (`ids`: capitalized, no space before it) and
    as the question says it (`spoken`, which the echo continues from)."""

    ids: tuple[int, ...]
    spoken: tuple[int, ...]


def question_copies(question: Sequence[int], tokenizer: Tokenizer) -> list[Copy]:
    """The question's first COPIES content words (not FUNCTION_WORDS), on its first line (the chat template's end
    follows it)."""
    text = tokenizer.decode(list(question)).split("\n", 1)[0]
    words = dict.fromkeys(w for w in re.findall(r"[A-Za-z][A-Za-z'-]*", text) if w.lower() not in FUNCTION_WORDS)
    return [
        Copy(tuple(tokenizer.encode(w[0].upper() + w[1:])), tuple(tokenizer.encode(" " + w)))
        for w in list(words)[:COPIES]
    ]


def opening_key(answer: Sequence[int], copies: Sequence[Copy]) -> int:
    """How an answer begins, as the table counts it: −1 − j if with the question's copy j (the first that matches),
    else its first token."""
    for j, copy in enumerate(copies):
        if copy.ids and tuple(answer[: len(copy.ids)]) == copy.ids:
            return -1 - j
    return answer[0]


@dataclass(frozen=True)
class OpeningTable:
    """For question prefixes (token ids), how the target's answers begin (opening_key) with their shares, best first,
    and how many answers each prefix was seen with."""

    target: str
    firsts: dict[tuple[int, ...], tuple[tuple[int, float], ...]]
    totals: dict[tuple[int, ...], int]
    answers: int = 0  # how many answers it was counted over

    def guesses(
        self, question: Sequence[int], most: int, copies: Sequence[Copy] = ()
    ) -> list[tuple[tuple[int, ...], float]]:
        """Up to `most` (the answer's first tokens, share) for a question: every prefix of it the table knows, the
        longest first, weighs its shares by n / (n + LAMBDA) of the weight the longer ones left (n: its answers); a
        copy's key becomes the question's word (copies). Guesses that begin with the same token are one, the longer
        kept, their shares added."""
        found: dict[int, tuple[tuple[int, ...], float]] = {}
        left = 1.0
        for n in range(min(MAX_PREFIX, len(question)), 0, -1):
            prefix = tuple(question[:n])
            if prefix not in self.firsts:
                continue
            weight = left * self.totals[prefix] / (self.totals[prefix] + LAMBDA)
            left -= weight
            for key, share in self.firsts[prefix]:
                ids = (key,) if key >= 0 else copies[-1 - key].ids if -1 - key < len(copies) else ()
                if ids:
                    kept, total = found.get(ids[0], (ids, 0.0))
                    found[ids[0]] = (max(kept, ids, key=len), total + weight * share)
        return sorted(found.values(), key=lambda guess: (-guess[1], guess[0]))[:most]

    def save(self, path: Path) -> None:
        rows = [
            [list(prefix), self.totals[prefix], [list(g) for g in found]]
            for prefix, found in sorted(self.firsts.items())
        ]
        doc = {"target": self.target, "answers": self.answers, "max_prefix": MAX_PREFIX, "min_count": MIN_COUNT}
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps({**doc, "firsts": rows}, separators=(",", ":")) + "\n")

    @classmethod
    def load(cls, path: Path) -> OpeningTable:
        doc = json.loads(path.read_text())
        if any(len(row) != 3 for row in doc["firsts"]):
            raise ValueError(
                f"{path} is an opening table without answer counts: make it again with `specvoice corpus openings`"
            )
        firsts = {tuple(prefix): tuple((int(t), float(s)) for t, s in found) for prefix, _, found in doc["firsts"]}
        totals = {tuple(prefix): int(total) for prefix, total, _ in doc["firsts"]}
        return cls(doc["target"], firsts, totals, doc.get("answers", 0))


def count_openings(
    examples: Iterable[tuple[Sequence[int], Sequence[int], Sequence[Copy]]], target: str
) -> OpeningTable:
    """The table of (question ids, answer ids, the question's copies): every prefix of 1–MAX_PREFIX tokens seen with
    at least MIN_COUNT answers keeps its KEEP most frequent opening keys (ties: the lower key) and their shares."""
    counts: dict[tuple[int, ...], Counter[int]] = defaultdict(Counter)
    answers = 0
    for question, answer, copies in examples:
        answers += 1
        key = opening_key(answer, copies)
        for n in range(1, min(MAX_PREFIX, len(question)) + 1):
            counts[tuple(question[:n])][key] += 1
    firsts, totals = {}, {}
    for prefix, counter in counts.items():
        total = sum(counter.values())
        if total >= MIN_COUNT:
            best = sorted(counter.items(), key=lambda kc: (-kc[1], kc[0]))[:KEEP]
            firsts[prefix], totals[prefix] = tuple((key, count / total) for key, count in best), total
    return OpeningTable(target, firsts, totals, answers)


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
