"""Command-line options shared by every command that runs the voice agent (say, bench-voice, app)."""

from __future__ import annotations

import argparse

from specdec.build import add_engine_arguments, spec_from_args

from .agent import AgentConfig


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    d = AgentConfig()
    parser.add_argument("--asr", default=d.asr_model, help="tiny.en (offline default), base, a directory or hub name")
    parser.add_argument("--tts", default=d.tts, help="hibari (default), piper or coqui")
    parser.add_argument("--hangover-ms", type=float, default=d.hangover_ms,
                        help="silence after the last voiced audio that ends the user's turn")
    parser.add_argument("--first-chunk-words", type=int, default=d.first_chunk_words)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--history-turns", type=int, default=d.history_turns)
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--llm-url", default=None,
                        help="use an OpenAI-compatible server (e.g. vLLM) as the LLM stage instead of the engine")
    parser.add_argument("--llm-url-no-spec", default=None, help="a target-only server for speculation-off turns")


def agent_config_from_args(args: argparse.Namespace) -> AgentConfig:
    return AgentConfig(spec_from_args(args), args.asr, args.tts, args.hangover_ms, args.first_chunk_words,
                       args.max_new_tokens, args.history_turns, temperature=args.temperature, seed=args.seed,
                       llm_url=args.llm_url, llm_url_no_spec=args.llm_url_no_spec)
