"""`specvoice vllm-serve`: the `vllm serve` line (pipeline/vllm_serve.py) for a server that --llm-url can then use
as the LLM stage, serving what the engine options name."""

from __future__ import annotations

import argparse
import shlex

from pipeline.vllm_serve import vllm_serve_command

from .options import add_engine_arguments, spec_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    parser.add_argument("--port", type=int, default=8000, help="the port vLLM listens on")
    parser.add_argument(
        "--max-num-seqs", type=int, default=256, help="the most sequences vLLM batches (with a batch-size limit)"
    )


def main(args: argparse.Namespace) -> int:
    print(shlex.join(vllm_serve_command(spec_from_args(args), args.port, args.max_num_seqs)))
    return 0
