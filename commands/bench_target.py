"""`specvoice bench-target`: the target's weight formats side by side in one run: forward cost by tokens fed,
memory, target-only tok/s, and drift from the unquantized target (top-1 agreement and log-likelihood of its
greedy answers, and whole answers that stay identical)."""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch

from specdec.bench import read_prompts, run_engine
from specdec.build import EngineSpec, build_engine
from specdec.calibrate import measured_forward_seconds
from specdec.engine import GenerationConfig
from specdec.metrics import DEFINITIONS
from specdec.models import release_free_memory, resident_bytes
from specdec.quant import TARGET_QUANTS
from specdec.runner import BatchRunner


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--target", default=EngineSpec().target)
    parser.add_argument(
        "--quants",
        default="none,int8,w8a8-onednn,w8a8-fbgemm,int4",
        help=f"comma-separated, of {', '.join(TARGET_QUANTS)}; the first is the reference",
    )
    parser.add_argument("--prompts", default="../shared/prompts/voice_prompts.jsonl")
    parser.add_argument("--limit", type=int, default=12)
    parser.add_argument("--max-new-tokens", type=int, default=48)
    parser.add_argument(
        "--token-counts", default="1,2,5,9,16,32", help="tokens per timed forward (32: a user turn's prefill)"
    )
    parser.add_argument("--repeats", type=int, default=5, help="timed forwards per point (median)")
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: leave as is)")
    parser.add_argument("--compile", action="store_true", help="also time the forward with torch.compile (--compile)")
    parser.add_argument("--json", required=True)


def weight_bytes(model: torch.nn.Module) -> int:
    tensors = {id(t): t for t in [*model.parameters(), *model.buffers()]}  # tied weights once
    packed = sum(getattr(m, "packed_weight_bytes", 0) for m in model.modules())  # fbgemm's, outside any tensor
    return packed + sum(t.numel() * t.element_size() for t in tensors.values())


@torch.inference_mode()
def drift(model: torch.nn.Module, prompts: list[list[int]], answers: list[list[int]]) -> dict:
    """Teacher-forced over the reference answers: how often this model's top token is the reference's, and the
    mean log-probability it gives the reference's tokens."""
    agree = total = 0
    logprob = 0.0
    for prompt, answer in zip(prompts, answers, strict=True):
        if not answer:
            continue
        ids = torch.tensor([prompt + answer], device=model.device)
        logits = model(input_ids=ids, logits_to_keep=len(answer) + 1).logits[0, :-1].float()
        target = torch.tensor(answer, device=model.device)
        agree += int((logits.argmax(-1) == target).sum())
        logprob += float(logits.log_softmax(-1).gather(1, target[:, None]).sum())
        total += len(answer)
    return {"top1_agreement": agree / total, "mean_logprob": logprob / total, "tokens": total}


def main(args: argparse.Namespace) -> int:
    if args.threads:
        torch.set_num_threads(args.threads)
    quants = args.quants.split(",")
    counts = [int(n) for n in args.token_counts.split(",")]
    rows = read_prompts(args.prompts, args.limit)
    config = GenerationConfig(args.max_new_tokens, speculate=False)
    reference: list[list[int]] = []
    prompts: list[list[int]] = []
    runs = []
    for quant in quants:
        rss_before = resident_bytes()
        t0 = time.perf_counter()
        engine, target = build_engine(EngineSpec(target=args.target, draft="none", target_quant=quant))
        load_s = time.perf_counter() - t0
        if not prompts:
            prompts = [target.tokenizer.chat_ids([{"role": "user", "content": r["prompt"]}]) for r in rows]
        # The engine's attention (row by row for a quantized target) and the other one, on the same weights.
        runners = {engine.runner.exact_rows: engine.runner}
        runners[not engine.runner.exact_rows] = BatchRunner(target.model, target.device, not engine.runner.exact_rows)
        by_attention = {
            "row" if exact else "fused": {
                n: 1e3 * measured_forward_seconds(runner, n, repeats=args.repeats) for n in counts
            }
            for exact, runner in runners.items()
        }
        forward_ms = by_attention["row" if engine.runner.exact_rows else "fused"]
        if args.compile:  # the engine's attention, its layers' dense halves compiled (the first calls compile)
            compiled = BatchRunner(target.model, target.device, engine.runner.exact_rows, compile=True)
            t0 = time.perf_counter()
            measured_forward_seconds(compiled, counts[0], repeats=1)
            compile_s = time.perf_counter() - t0
            compiled_ms = {n: 1e3 * measured_forward_seconds(compiled, n, repeats=args.repeats) for n in counts}
        run_engine(engine, prompts[0], GenerationConfig(4, speculate=False))  # warm
        answers, rates = [], []
        for prompt in prompts:
            t0 = time.perf_counter()
            answers.append(run_engine(engine, prompt, config))
            rates.append(len(answers[-1]) / (time.perf_counter() - t0))
        if not reference:
            reference = answers
        run = {
            "target_quant": quant,
            "load_and_quantize_s": load_s,
            "forward_ms": forward_ms,
            "attention": "row" if engine.runner.exact_rows else "fused",
            "forward_ms_by_attention": by_attention,
            "verify_cost_ratio": {n: forward_ms[n] / forward_ms[counts[0]] for n in counts},
            **({"forward_ms_compiled": compiled_ms, "compile_s": compile_s} if args.compile else {}),
            "weight_bytes": weight_bytes(target.model),
            "resident_bytes_added": resident_bytes() - rss_before,
            "target_only_tokens_per_s_median": statistics.median(rates),
            "min_feed": engine.runner.min_feed,
            "identical_answers": sum(a == r for a, r in zip(answers, reference, strict=True)),
            "answers": len(answers),
            **drift(target.model, prompts, reference),
        }
        runs.append(run)
        print(
            f"{quant:5s} forward ms {forward_ms}  {run['target_only_tokens_per_s_median']:.2f} tok/s  "
            f"weights {run['weight_bytes'] / 2**20:.0f} MiB  top-1 {run['top1_agreement']:.1%}  "
            f"logprob {run['mean_logprob']:.3f}  identical {run['identical_answers']}/{len(answers)}",
            file=sys.stderr,
            flush=True,
        )
        del engine, target
        gc.collect()
        release_free_memory()
    out = {
        "definitions": {
            k: DEFINITIONS[k]
            for k in ("top1_agreement", "mean_logprob", "forward_ms", "verify_cost_ratio", "target_only_tokens_per_s")
        },
        "reference": quants[0],
        "config": {**vars(args), "threads": torch.get_num_threads()},
        "runs": runs,
    }
    Path(args.json).write_text(json.dumps(out, indent=2))
    return 0
