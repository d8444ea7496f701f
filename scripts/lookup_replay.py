"""How often the context's own n-gram continuation (drafters.ngram_lookup, what --draft-lookup grafts onto the heads'
tree) guesses the target's next tokens: a replay of the committed corpus's greedy answers, no model.

    .venv/bin/python scripts/lookup_replay.py [--corpus assets/corpus] [--k 4] [--held-out-every 10]

At each step of an answer (its prompt and the answer so far as the context) the longest suffix match of 4 … 1 tokens
proposes up to k tokens; the step then moves past the tokens that match the answer and one more, as a greedy
speculative step does. Prints, per match length, the steps, the share whose first token was right and the tokens
accepted per step; and the tokens per step of the lookup alone. Answers of requests whose index is a multiple of
--held-out-every, the heads' usual held-out share, so the figures compare with their held-out ones.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from specdec.corpus import read_rows  # noqa: E402
from specdec.drafters import ngram_lookup  # noqa: E402


def longest_match(context: list[int], k: int) -> tuple[int, list[int]]:
    for n in range(4, 0, -1):
        chain = ngram_lookup(context, k, max_ngram=n, min_ngram=n)
        if chain:
            return n, chain
    return 0, []


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--corpus", default="assets/corpus")
    parser.add_argument("--k", type=int, default=4)
    parser.add_argument("--held-out-every", type=int, default=10)
    args = parser.parse_args()
    rows = [r for path in sorted(Path(args.corpus, "answers").glob("*.jsonl.gz")) for r in read_rows(path)]
    held = [r for r in rows if r["request"] % args.held_out_every == 0 and r["temperature"] == 0.0]
    by_n: dict[int, list[int]] = defaultdict(lambda: [0, 0, 0])  # steps, first right, tokens accepted
    steps = tokens = 0
    for row in held:
        prompt, answer, at = row["prompt_ids"], row["answer_ids"], 0
        while at < len(answer):
            n, chain = longest_match(prompt + answer[:at], args.k)
            right = next((i for i, t in enumerate(chain) if at + i >= len(answer) or t != answer[at + i]), len(chain))
            by_n[n][0] += 1
            by_n[n][1] += right > 0
            by_n[n][2] += right
            at += right + 1
            steps += 1
        tokens += len(answer)
    report = {
        "answers": len(held),
        "tokens_per_step": tokens / steps,
        "by_match_length": {
            n: {"steps": s, "first_right": f / s, "accepted_per_step": a / s} for n, (s, f, a) in sorted(by_n.items())
        },
    }
    print(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
