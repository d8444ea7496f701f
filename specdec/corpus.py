"""The draft heads' training corpus, made here by the target itself and small enough to commit: requests the target
writes (self-instruct), and its own answers to them, as token ids. Features are not stored: training recomputes
them with a teacher-forced prefill, which costs about one decode step per row on an AMX CPU.

Every stage runs in shards written whole (through a rename), so a stopped run resumes at the first missing one, and a
recipe file pins what the shards were made from. Generation is continuously batched on the engine's own forward
(runner.BatchRunner): a finished answer's slot takes the next request at once, so the batch stays full.
"""

from __future__ import annotations

import gzip
import hashlib
import json
import random
import re
import time
import zlib
from collections.abc import Callable, Iterator, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from .kv import Feed, SequenceCache
from .runner import BatchRunner
from .sampling import SamplingParams, logits_to_probs, sample
from .tokenizer import Tokenizer


@dataclass(frozen=True)
class Job:
    """One generation: a prompt's token ids and how to decode it (greedy, or sampled with its own seed)."""

    prompt: list[int]
    temperature: float = 0.0
    seed: int = 0


def generate_many(
    runner: BatchRunner, jobs: Sequence[Job], width: int, max_new_tokens: int, eos: set[int]
) -> Iterator[tuple[int, list[int]]]:
    """(job index, new tokens, cut after the first EOS) for every job, in the order they finish. Up to `width` jobs
    decode together, one token each per forward; a finished job's slot takes the next job, whose prompt is read in
    that same forward."""
    pending = list(range(len(jobs)))[::-1]
    free: list[SequenceCache] = [runner.new_cache() for _ in range(min(width, len(jobs)))]
    active: list[tuple[int, SequenceCache, list[int], torch.Generator]] = []
    while pending or active:
        while pending and free:
            i = pending.pop()
            cache = free.pop()
            cache.reset()
            active.append((i, cache, list(jobs[i].prompt), torch.Generator().manual_seed(jobs[i].seed)))
        logits = runner.extend([Feed(cache, ctx) for _, cache, ctx, _ in active])
        still = []
        for (i, cache, ctx, gen), row in zip(active, logits):
            temp = jobs[i].temperature
            last = row[-1]
            token = int(last.argmax()) if temp == 0 else int(sample(logits_to_probs(last, SamplingParams(temp)), gen))
            ctx.append(token)
            new = len(ctx) - len(jobs[i].prompt)
            if token in eos or new >= max_new_tokens:
                free.append(cache)
                yield i, ctx[len(jobs[i].prompt) :]
            else:
                still.append((i, cache, ctx, gen))
        active = still


def decode_throughput(runner: BatchRunner, prompts: Sequence[list[int]], width: int, steps: int) -> dict:
    """Steady-state decode tokens/s with `width` sequences, each one token a forward: the prompts are read first (not
    timed), then `steps` forwards of `width` rows are timed."""
    caches = [runner.new_cache() for _ in range(width)]
    ctxs = [list(prompts[i % len(prompts)]) for i in range(width)]
    for cache, ctx in zip(caches, ctxs):
        ctx.append(int(runner.extend([Feed(cache, ctx)])[0][-1].argmax()))
    t0 = time.perf_counter()
    for _ in range(steps):
        logits = runner.extend([Feed(c, ctx) for c, ctx in zip(caches, ctxs)])
        for ctx, row in zip(ctxs, logits):
            ctx.append(int(row[-1].argmax()))
    seconds = time.perf_counter() - t0
    return {"width": width, "steps": steps, "seconds": seconds, "tokens_per_s": width * steps / seconds}


# --- shards ---------------------------------------------------------------------------------------------------------


def write_rows(path: Path, rows: list[dict]) -> None:
    """A shard, written whole: a reader never sees half of one."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".partial")
    with gzip.open(tmp, "wt", encoding="utf-8") as f:
        for row in rows:
            f.write(json.dumps(row, separators=(",", ":")) + "\n")
    tmp.rename(path)


def read_rows(path: Path) -> list[dict]:
    with gzip.open(path, "rt", encoding="utf-8") as f:
        return [json.loads(line) for line in f if line.strip()]


def check_recipe(path: Path, recipe: dict, hint: str = "use another folder") -> None:
    """Shards are valid only for what they were made from: refuse to mix them with another recipe."""
    if path.exists() and json.loads(path.read_text()) != recipe:
        raise ValueError(f"{path.parent} holds data made from other inputs (another recipe, {path.name}): {hint}")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(recipe, indent=1) + "\n")


def run_shards(
    folder: Path,
    prefix: str,
    keys: list[str],
    make: Callable[[int], list[dict]],
    progress: Callable[[int, int], None] = lambda done, total: None,
) -> list[Path]:
    """Make every missing shard `{prefix}_{i:04d}-{keys[i]}.jsonl.gz` in folder (keys[i]: a digest of shard i's
    inputs, so a shard whose inputs changed is made again, and its stale file goes); the paths of all of them."""
    paths = [folder / f"{prefix}_{i:04d}-{key}.jsonl.gz" for i, key in enumerate(keys)]
    for i, path in enumerate(paths):
        if not path.exists():
            for stale in folder.glob(f"{prefix}_{i:04d}-*.jsonl.gz"):
                stale.unlink()
            write_rows(path, make(i))
        progress(i + 1, len(keys))
    return paths


def fingerprint(obj: object) -> str:
    """A stable fingerprint of JSON-able inputs."""
    return hashlib.sha256(json.dumps(obj).encode()).hexdigest()


def digest(obj: object) -> str:
    """A short fingerprint, for file names."""
    return fingerprint(obj)[:12]


# --- requests the target writes (self-instruct) ---------------------------------------------------------------------

CATEGORIES = {  # the categories of the shipped training prompts, as a request writer is told them
    "factual": "a short factual question with one clear answer",
    "explain": "a 'why' or 'how does it work' question that asks for a short explanation",
    "howto": "a practical how-to request or a question about doing something",
    "structured": "a request for a short list, a comparison or a few tips",
    "code": "a question about programming or using a computer",
    "creative": "a request for a very short story, poem, joke or made-up idea",
    "dialog": "small talk, an opinion question or a personal chat line",
    "math": "a small arithmetic or everyday math question, numbers written in words",
}
SPEAKERS = (
    "a curious child",
    "a busy parent",
    "a student",
    "a retired teacher",
    "someone cooking dinner",
    "someone driving to work",
    "a traveller",
    "a nurse on a break",
    "a gardener",
    "a teenager",
    "an office worker",
    "someone who just moved to a new city",
)
MAX_REQUEST_WORDS = 40


WRITING_TEMPERATURE = 0.8  # 1.0 wandered off topic and into broken words; lower repeats itself across writes


def writing_jobs(
    tokenizer: Tokenizer,
    topics: list[str],
    count: int,
    per_write: int,
    seed: int,
    examples: dict[str, list[str]] | None = None,
) -> list[tuple[str, Job]]:
    """(category, job) for `count` prompts that each ask the target for `per_write` spoken requests: the categories
    in turn, topics and speakers in a seeded mix, two examples of the category's style (from `examples`, when given:
    the shipped training prompts) so the writer keeps to the category. Job i does not depend on `count`."""
    rng = random.Random(seed)
    jobs = []
    names = list(CATEGORIES)
    for i in range(count):
        category, topic, speaker = names[i % len(names)], rng.choice(topics), rng.choice(SPEAKERS)
        pool = (examples or {}).get(category, [])
        shown = rng.sample(pool, 2) if len(pool) >= 2 else pool
        style = f" In the style of: {' / '.join(shown)}" if shown else ""
        text = (
            f"Write {per_write} different things that {speaker} might say out loud to a voice assistant about "
            f"{topic}. Each one is {CATEGORIES[category]}.{style} Use everyday spoken words, one sentence each, "
            "varied wording. Write one per line, with no numbers, no quotes and no answers."
        )
        prompt = tokenizer.chat_ids([{"role": "user", "content": text}])
        jobs.append((category, Job(prompt, WRITING_TEMPERATURE, seed * 1_000_003 + i)))
    return jobs


def parse_requests(text: str) -> list[str]:
    """The request lines of a writer's answer: list marks, numbers and quotes stripped; lines that are no request
    (a preamble ending in ':', too short or long, not ending a sentence) dropped."""
    out = []
    for line in text.splitlines():
        line = re.sub(r"^\s*(?:[-*•]+|\d+[.):]|\(\d+\))\s*", "", line).strip().strip("\"'“”").strip()
        n_words = len(line.split())
        if 3 <= n_words <= MAX_REQUEST_WORDS and line[-1:] in "?.!" and not line.lower().startswith(("sure", "here")):
            out.append(line)
    return out


def words(text: str) -> list[str]:
    return re.findall(r"[a-z0-9']+", text.lower())


def shingles(text: str, n: int = 3) -> set[tuple[str, ...]]:
    """Word n-grams (the whole text as one, when shorter)."""
    w = words(text)
    return {tuple(w[i : i + n]) for i in range(max(1, len(w) - n + 1))}


def jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


def overlaps(text: str, benchmark: list[set[tuple[str, ...]]], threshold: float) -> bool:
    """Whether a request's word 3-grams overlap any benchmark prompt's by `threshold` (Jaccard) or more."""
    own = shingles(text)
    return any(jaccard(own, b) >= threshold for b in benchmark)


def _minhash(grams: set[tuple[str, ...]], seeds: Sequence[int]) -> tuple[int, ...]:
    hashed = [zlib.crc32(" ".join(g).encode()) for g in grams]
    return tuple(min((h ^ s) * 0x9E3779B1 % (1 << 32) for h in hashed) for s in seeds)


def dedupe(texts: list[str], threshold: float = 0.6, bands: int = 8, rows: int = 3) -> list[int]:
    """Indices of texts to keep: the first of each group of near-duplicates (word 3-gram Jaccard ≥ threshold),
    found through MinHash bands, each candidate pair checked exactly; exact duplicates (case and punctuation aside)
    always go."""
    rng = random.Random(0)
    seeds = [rng.getrandbits(32) for _ in range(bands * rows)]
    seen_exact: set[str] = set()
    buckets: dict[tuple, list[int]] = {}
    grams: list[set] = []
    keep = []
    for i, text in enumerate(texts):
        key = " ".join(words(text))
        g = shingles(text)
        grams.append(g)
        if key in seen_exact:
            continue
        sig = _minhash(g, seeds)
        keys = [(b, sig[b * rows : (b + 1) * rows]) for b in range(bands)]
        candidates = {j for k in keys for j in buckets.get(k, ())}
        if any(jaccard(g, grams[j]) >= threshold for j in candidates):
            continue
        seen_exact.add(key)
        keep.append(i)
        for k in keys:
            buckets.setdefault(k, []).append(i)
    return keep


def select_requests(
    shipped: list[dict], written: list[dict], benchmark_texts: list[str], overlap_threshold: float = 0.3
) -> tuple[list[dict], dict]:
    """The requests to answer: the shipped training prompts first, then the written ones in the order they were
    written, near-duplicates (of anything before them) and any that overlaps a benchmark prompt removed. Written
    requests added later only append: what was kept stays kept, at the same index. Returns them and the counts of
    what each rule removed."""
    benchmark = [shingles(t) for t in benchmark_texts]
    clean = [r for r in written if not overlaps(r["prompt"], benchmark, overlap_threshold)]
    both = [{**r, "source": "shipped"} for r in shipped] + [{**r, "source": "written"} for r in clean]
    kept = [both[i] for i in dedupe([r["prompt"] for r in both])]
    counts = {
        "shipped": len(shipped),
        "written": len(written),
        "benchmark_overlap": len(written) - len(clean),
        "near_duplicates": len(both) - len(kept),
        "kept": len(kept),
    }
    return kept, counts


# --- answers --------------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class AnswerRecipe:
    """How the answers are made: half of the requests with the voice agent's system prompt, half with the chat
    template's own; a share sampled at temperatures the page offers (0–1.5), the rest greedy."""

    max_new_tokens: int = 160
    sampled_share: float = 0.25
    temperatures: tuple[float, ...] = (0.3, 0.7, 1.0)
    shard_size: int = 256
    seed: int = 0

    def decoding(self, index: int) -> tuple[float, int]:
        """(temperature, seed) of request `index`: fixed by the index, so a resumed run makes the same jobs."""
        rng = random.Random(self.seed * 1_000_003 + index)
        sampled = rng.random() < self.sampled_share
        return (rng.choice(self.temperatures) if sampled else 0.0), rng.getrandbits(31)


def answer_jobs(
    tokenizer: Tokenizer, requests: list[dict], recipe: AnswerRecipe, system_prompt: str, span: tuple[int, int]
) -> list[tuple[dict, Job]]:
    """(row metadata, job) for requests[span[0] : span[1]]; even indices get the system prompt."""
    out = []
    for index in range(*span):
        system = index % 2 == 0
        messages = [{"role": "system", "content": system_prompt}] if system else []
        prompt = tokenizer.chat_ids(messages + [{"role": "user", "content": requests[index]["prompt"]}])
        temperature, seed = recipe.decoding(index)
        meta = {"request": index, "category": requests[index].get("category", ""), "system": system}
        out.append(({**meta, "temperature": temperature}, Job(prompt, temperature, seed)))
    return out


def answer_shard(
    runner: BatchRunner,
    tokenizer: Tokenizer,
    requests: list[dict],
    recipe: AnswerRecipe,
    system_prompt: str,
    span: tuple[int, int],
    width: int,
) -> list[dict]:
    """One shard's rows (its span of requests): the metadata, the prompt's and the answer's token ids, in request
    order."""
    pairs = answer_jobs(tokenizer, requests, recipe, system_prompt, span)
    jobs = [job for _, job in pairs]
    answers = dict(generate_many(runner, jobs, width, recipe.max_new_tokens, tokenizer.eos_token_ids))
    return [{**meta, "prompt_ids": job.prompt, "answer_ids": answers[i]} for i, (meta, job) in enumerate(pairs)]


def recipe_dict(recipe: AnswerRecipe, **more: object) -> dict:
    return {**asdict(recipe), "temperatures": list(recipe.temperatures), **more}


def made_sizes(folder: Path, prefix: str) -> list[int]:
    """The row counts of the shards made so far in folder, in order, up to the first missing one."""
    sizes: list[int] = []
    while made := sorted(folder.glob(f"{prefix}_{len(sizes):04d}-*.jsonl.gz")):
        sizes.append(len(read_rows(made[0])))
    return sizes


def answer_plan(folder: Path, requests: list[dict], recipe: AnswerRecipe) -> list[tuple[tuple[int, int], str]]:
    """(span of requests, key) of every answer shard in folder, the made ones first (answer_spans, span_key)."""
    spans = answer_spans(len(requests), recipe, made_sizes(folder, "answers"))
    return [(span, span_key(requests, span)) for span in spans]


def answer_spans(n_requests: int, recipe: AnswerRecipe, made: list[int]) -> list[tuple[int, int]]:
    """Each answer shard's span of requests. A made shard keeps its span, a short last one too: requests appended
    later start a new shard, so a shard never changes once made and `train-heads --corpus-shards N` keeps naming the
    same answers."""
    spans: list[tuple[int, int]] = []
    start = 0
    for size in made:
        if start + size > n_requests:
            break
        spans.append((start, start + size))
        start += size
    while start < n_requests:
        spans.append((start, min(start + recipe.shard_size, n_requests)))
        start = spans[-1][1]
    return spans


def span_key(requests: list[dict], span: tuple[int, int]) -> str:
    """An answer shard's digest: its requests' texts, so a shard whose requests changed is made again."""
    return digest([r["prompt"] for r in requests[span[0] : span[1]]])
