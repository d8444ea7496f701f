"""`specvoice corpus`: the draft heads' training corpus, made by the target itself (specdec/corpus.py), resumable.

    specvoice corpus widths      decode tokens/s at each batch width (JSON); the best is what the other stages use
    specvoice corpus requests    the target writes spoken requests; near-duplicates and benchmark overlaps removed
    specvoice corpus answers     the target answers them (greedy, a share sampled), as token ids
    specvoice corpus openings    the answers' first tokens by how their questions begin (specdec/openings.py), a table

Each stage writes shards into --folder (default assets/corpus, committed); a stopped run resumes at the first missing
shard. Never benchmark on these requests: they are training data, and the benchmark prompts are kept out of them.
"""

from __future__ import annotations

import argparse
import ast
import json
import sys
from pathlib import Path

import torch
from tqdm import tqdm

from commands.train_heads import advance
from pipeline.llm import SYSTEM_PROMPT
from specdec import compute
from specdec.bench import read_prompts
from specdec.build import DTYPES, EngineSpec, quantize_target
from specdec.corpus import (
    AnswerRecipe,
    answer_plan,
    answer_shard,
    check_recipe,
    decode_throughput,
    digest,
    generate_many,
    parse_requests,
    read_rows,
    recipe_dict,
    run_shards,
    select_requests,
    writing_jobs,
)
from specdec.cost_grid import cpu_name
from specdec.models import LoadedModel, asset_path, load_model, load_tokenizer, log
from specdec.openings import count_openings, default_openings_path, question_copies
from specdec.quant import TARGET_QUANTS
from specdec.quant_layers import cpu_has_amx
from specdec.runner import BatchRunner
from specdec.tokenizer import words_start

from .options import positive_int

FOLDER = asset_path("corpus")
BENCHMARK_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "prompts" / "voice_prompts.jsonl"
UTTERANCE_TEXTS = Path(__file__).resolve().parents[1] / "scripts" / "utterance_texts.py"
WRITES_PER_SHARD = 64


def add_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineSpec()
    parser.add_argument("stage", choices=["widths", "requests", "answers", "openings"])
    parser.add_argument("--target", default=d.target)
    parser.add_argument("--target-quant", default=d.target_quant, choices=list(TARGET_QUANTS))
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    parser.add_argument("--folder", default=str(FOLDER), help="where the shards go (default: assets/corpus)")
    parser.add_argument("--width", type=int, default=0, help="sequences decoded together (0: the best in widths.json)")
    parser.add_argument("--widths", default="1,8,16,32,48,64", help="widths: the batch widths to time")
    parser.add_argument("--steps", type=positive_int, default=12, help="widths: timed forwards per width")
    parser.add_argument(
        "--writes",
        type=positive_int,
        default=3840,
        help="requests: prompts asking for requests (default: what assets/corpus was made with; fewer rewrite "
        "requests.jsonl from fewer written shards)",
    )
    parser.add_argument("--per-write", type=positive_int, default=10, help="requests: requests asked for per prompt")
    parser.add_argument(
        "--exclude",
        action="append",
        default=[],
        help="requests: JSONL of benchmark prompts to keep out (default: ../shared/prompts/voice_prompts.jsonl "
        "and the recordings' texts in scripts/utterance_texts.py)",
    )
    parser.add_argument(
        "--shards",
        type=int,
        default=0,
        help="requests, answers: make only the first N shards (0: all); requests then selects from those",
    )
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--json", default="", help="widths: also write the report here")
    parser.add_argument(
        "--openings", default="", help="openings: where the table goes (default: assets/heads/<target>.openings.json)"
    )


def utterance_texts(script: Path = UTTERANCE_TEXTS) -> list[str]:
    """The texts the project's recordings speak (QUESTIONS, HELDOUT, PAUSES in scripts/utterance_texts.py), read
    without importing it (scripts/ is not a package on the path)."""
    texts: list[str] = []
    for node in ast.parse(script.read_text()).body:
        if isinstance(node, ast.Assign) and any(
            getattr(t, "id", "") in {"QUESTIONS", "HELDOUT", "PAUSES"} for t in node.targets
        ):
            for value in ast.literal_eval(node.value).values():
                texts.append(value if isinstance(value, str) else " ".join(value))
    if not texts:  # a moved list would let benchmark texts into the training requests, and shift every shard after
        raise ValueError(f"no QUESTIONS, HELDOUT or PAUSES found in {script}")
    return texts


def benchmark_texts(extra: list[str]) -> list[str]:
    paths = extra or ([str(BENCHMARK_PROMPTS)] if BENCHMARK_PROMPTS.exists() else [])
    return [r["prompt"] for p in paths for r in read_prompts(p)] + utterance_texts()


def machine() -> dict:
    return {"cpu": cpu_name(), "amx": cpu_has_amx(), "threads": torch.get_num_threads(), "torch": torch.__version__}


def best_width(folder: Path, asked: int) -> int:
    if asked:
        return asked
    path = folder / "widths.json"
    if not path.exists():
        raise ValueError(f"no {path}: run `specvoice corpus widths` first, or give --width")
    return int(json.loads(path.read_text())["best_width"])


def main(args: argparse.Namespace) -> int:
    if args.stage == "openings":
        return count_corpus_openings(args)
    if args.threads:
        torch.set_num_threads(args.threads)
    target = load_model(args.target, DTYPES[args.dtype])
    quantize_target(target, args.target_quant)
    compute.release_workers()  # loading is done: this thread's OpenMP workers must not slow the compute thread's
    return compute.run(lambda: run_stage(args, target))  # the argmax and sampling too, not only the forwards


def count_corpus_openings(args: argparse.Namespace) -> int:
    """The opening table of every answer in the folder's answer shards (no model: the tokenizer finds where each
    prompt's question begins)."""
    tok = load_tokenizer(args.target)
    heads = {False: [], True: [{"role": "system", "content": SYSTEM_PROMPT}]}
    starts = {system: words_start(tok, head) for system, head in heads.items()}
    paths = sorted((Path(args.folder) / "answers").glob("answers_*.jsonl.gz"))
    if not paths:
        raise ValueError(f"no answer shards in {Path(args.folder) / 'answers'}: run `specvoice corpus answers` first")
    rows = (r for p in paths for r in read_rows(p) if r["answer_ids"])
    questions = ((r["prompt_ids"][starts[r["system"]] :], r["answer_ids"]) for r in rows)
    table = count_openings(((q, answer, question_copies(q, tok)) for q, answer in questions), args.target)
    out = Path(args.openings) if args.openings else default_openings_path(args.target)
    table.save(out)
    log(f"{len(table.firsts)} question beginnings, {table.answers} answers in {len(paths)} shards: written to {out}")
    return 0


def run_stage(args: argparse.Namespace, target: LoadedModel) -> int:
    folder = Path(args.folder)
    runner = BatchRunner(target.model, target.device)  # fused attention: data needs no bit-exact rows
    tok = target.tokenizer
    made_by = {"target": args.target, "target_quant": args.target_quant, "dtype": args.dtype}

    if args.stage == "widths":
        rows = read_prompts(str(asset_path("prompts", "train_prompts.jsonl")), 64)
        prompts = [tok.chat_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]
        runs = []
        for width in (int(w) for w in args.widths.split(",")):
            runs.append(decode_throughput(runner, prompts, width, args.steps))
            log(f"width {width}: {runs[-1]['tokens_per_s']:.1f} tokens/s")
        best = max(runs, key=lambda r: r["tokens_per_s"])
        report = {**made_by, "machine": machine(), "runs": runs, "best_width": best["width"]}
        for path in filter(None, [str(folder / "widths.json"), args.json]):
            Path(path).parent.mkdir(parents=True, exist_ok=True)
            Path(path).write_text(json.dumps(report, indent=2) + "\n")
        log(f"best width {best['width']} ({best['tokens_per_s']:.1f} tokens/s), written to {folder / 'widths.json'}")
        return 0

    width = best_width(folder, args.width)
    if args.stage == "requests":
        topics = [t.strip() for t in (folder / "topics.txt").read_text().splitlines() if t.strip()]
        shipped = read_prompts(str(asset_path("prompts", "train_prompts.jsonl")))
        examples: dict[str, list[str]] = {}
        for row in shipped:
            examples.setdefault(row["category"], []).append(row["prompt"])
        jobs = writing_jobs(tok, topics, args.writes, args.per_write, seed=0, examples=examples)
        written_dir = folder / "written"
        check_recipe(written_dir / "recipe.json", {**made_by, "per_write": args.per_write, "seed": 0})

        def write_shard(i: int) -> list[dict]:
            first = i * WRITES_PER_SHARD
            shard = jobs[first : first + WRITES_PER_SHARD]
            rows = []
            # A write's requests run about 15 tokens each; the cap leaves room for a preamble.
            for j, new in generate_many(
                runner, [job for _, job in shard], width, 24 * args.per_write, tok.eos_token_ids
            ):
                rows += [
                    {"write": first + j, "category": shard[j][0], "prompt": t} for t in parse_requests(tok.decode(new))
                ]
            return sorted(rows, key=lambda r: r["write"])

        keys = [
            digest([(j.prompt, j.temperature) for _, j in jobs[i : i + WRITES_PER_SHARD]])
            for i in range(0, len(jobs), WRITES_PER_SHARD)
        ]
        keys = keys[: args.shards] if args.shards else keys
        with tqdm(total=len(keys), desc="writing requests", unit="shard", file=sys.stderr) as bar:
            paths = run_shards(written_dir, "written", keys, write_shard, advance(bar))
        written = [r for p in paths for r in read_rows(p)]
        kept, counts = select_requests(shipped, written, benchmark_texts(args.exclude))
        (folder / "requests.jsonl").write_text("".join(json.dumps(r) + "\n" for r in kept))
        (folder / "requests-report.json").write_text(json.dumps({**made_by, **counts}, indent=2) + "\n")
        log(f"requests: {counts}; written to {folder / 'requests.jsonl'}")
        return 0

    requests = read_prompts(str(folder / "requests.jsonl"))
    recipe = AnswerRecipe()
    answers_dir = folder / "answers"
    check_recipe(answers_dir / "recipe.json", recipe_dict(recipe, **made_by, system_prompt=SYSTEM_PROMPT))
    plan = answer_plan(answers_dir, requests, recipe)
    keys = [key for _, key in plan]
    n = min(len(keys), args.shards) if args.shards else len(keys)

    def make(i: int) -> list[dict]:
        return answer_shard(runner, tok, requests, recipe, SYSTEM_PROMPT, plan[i][0], width)

    with tqdm(total=n, desc="answering", unit="shard", file=sys.stderr) as bar:
        paths = run_shards(answers_dir, "answers", keys[:n], make, advance(bar))
    positions = sum(len(r["answer_ids"]) for p in paths for r in read_rows(p))
    log(f"{len(paths)} answer shards, {positions} answer positions in {answers_dir}")
    return 0
