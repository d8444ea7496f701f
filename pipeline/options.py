"""Command-line options shared by the commands: the engine's (generate, bench, calibrate and every command that
runs the voice agent) and the voice agent's (say, bench-voice, app)."""

from __future__ import annotations

import argparse
import dataclasses

from specdec.build import DTYPES, EngineSpec
from specdec.quant import TARGET_QUANTS

from .agent import AgentConfig
from .tts import offered_tts, tts_problem
from .turn_end import MODES, TurnEnd


def positive_int(value: str) -> int:
    """argparse type: an integer of at least 1."""
    n = int(value)
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def tts_name(value: str) -> str:
    """argparse type: a TTS engine that can be used here (Coqui only where it can load: pipeline.tts.tts_problem)."""
    problem = tts_problem(value)
    if problem:
        raise argparse.ArgumentTypeError(problem)
    return value.strip().lower()


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    d = EngineSpec()
    parser.add_argument("--target", default=d.target, help="preset, local directory or hub id")
    parser.add_argument(
        "--draft",
        default="",
        help="draft preset/path/hub id, 'heads' (draft heads on the target), 'ngram' or 'none' (default: the target "
        "preset's draft, qwen-0.5b-instruct for qwen-7b; else heads)",
    )
    parser.add_argument(
        "--heads",
        default=d.heads,
        help="--draft heads: a heads file from `specvoice train-heads` (default: the target's shipped heads)",
    )
    parser.add_argument("--k", default=d.k, help="drafts per step: an integer or 'adaptive'")
    parser.add_argument("--k-min", type=int, default=d.k_min)
    parser.add_argument("--k-max", type=int, default=d.k_max)
    parser.add_argument("--dtype", default=d.dtype, choices=list(DTYPES))
    parser.add_argument("--device", default=d.device, help="cpu, cuda or cuda:N; sets the defaults marked (device)")
    parser.add_argument(
        "--target-quant",
        default="",
        choices=list(TARGET_QUANTS),
        help="the target's Linear weights: none (--dtype), int8 or int4 weight-only, w8a8 (int8 weights and "
        "per-token int8 activations, on oneDNN where the CPU has AMX, else fbgemm; w8a8-onednn / w8a8-fbgemm pick "
        "one); all but none are CPU formats, all keep speculation lossless against that target (device: w8a8 on "
        "cpu, none on cuda)",
    )
    parser.add_argument(
        "--draft-quant",
        default="",
        choices=["int8", "none"],
        help="int8: the target's w8a8 Linear layers for the draft model and the heads, a CPU format (device: int8 "
        "on cpu, none on cuda)",
    )
    parser.add_argument(
        "--draft-vocab",
        type=int,
        default=d.draft_vocab,
        help="draft LM head over the first N token ids (0: whole vocabulary)",
    )
    parser.add_argument(
        "--speculative-disable-by-batch-size",
        type=positive_int,
        default=d.disable_by_batch_size,
        help="vLLM's meaning: no drafting in a step while more sequences than this are decoding (default: never; "
        "the load-aware K already drops drafts where the measured forward costs say they lose)",
    )
    parser.add_argument(
        "--no-load-aware",
        dest="load_aware",
        action="store_false",
        help="batched conversations keep their own K policy instead of the K chosen from load and acceptance",
    )
    parser.add_argument(
        "--draft-min-prob",
        type=float,
        default=d.draft_min_prob,
        help="stop drafting where the draft's top token has a lower probability (0: always K; device: on cpu the "
        "drafter's value measured there, 0.35 for qwen-0.5b; 0 on cuda)",
    )
    parser.add_argument(
        "--no-opening-echo",
        dest="opening_echo",
        action="store_false",
        help="heads draft an answer's opening themselves, instead of from the words of the question",
    )
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile the target's dense layer halves (off by default: not faster on this CPU, docs/results.md)",
    )
    parser.add_argument(
        "--no-auto-off",
        dest="auto_off",
        action="store_false",
        help="never let the governor switch speculation off (with a fixed --k, a sampling seed then "
        "reproduces its answer: see SpeculativeEngine)",
    )


def spec_from_args(args: argparse.Namespace) -> EngineSpec:
    return EngineSpec(
        target=args.target,
        draft=args.draft,
        heads=args.heads,
        k=args.k,
        k_min=args.k_min,
        k_max=args.k_max,
        dtype=args.dtype,
        device=args.device,
        target_quant=args.target_quant,
        draft_quant=args.draft_quant,
        draft_vocab=args.draft_vocab,
        disable_by_batch_size=args.speculative_disable_by_batch_size,
        load_aware=args.load_aware,
        draft_min_prob=args.draft_min_prob,
        auto_off=args.auto_off,
        opening_echo=args.opening_echo,
        compile=args.compile,
    )


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    add_engine_arguments(parser)
    d = AgentConfig()
    parser.add_argument("--asr", default=d.asr_model, help="tiny.en (offline default), base, a directory or hub name")
    parser.add_argument("--asr-beam", type=int, default=d.asr_beam_size, help="ASR beam size (1: greedy)")
    parser.add_argument(
        "--asr-window-s",
        type=float,
        default=d.asr_window_s,
        help="seconds of audio the ASR encoder sees for a short turn (0: Whisper's full 30 s; 10 measured best)",
    )
    offered = offered_tts()
    coqui = "" if "coqui" in offered else f"; not coqui here: {tts_problem('coqui')}"
    parser.add_argument("--tts", default=d.tts, type=tts_name, help=f"{', '.join(offered)} (default {d.tts}){coqui}")
    t = d.turn_end
    parser.add_argument(
        "--end-of-turn",
        choices=list(MODES),
        default=t.mode,
        help="smart: Smart Turn's audio model and the target's words vote at each pause (falls back to words when "
        "the model is missing); words: the silence depends on whether the transcript looks finished; "
        "silence: always --hangover-ms",
    )
    for name, default, what in (
        ("audio", t.audio_threshold, "Smart Turn's P(finished)"),
        ("words", t.words_threshold, "the target's P(end of message)"),
    ):
        parser.add_argument(
            f"--turn-{name}-threshold",
            type=float,
            default=default,
            help=f"--end-of-turn smart: {what} at or above this votes finished",
        )
    parser.add_argument(
        "--hangover-ms", type=float, default=t.silence_ms, help="--end-of-turn silence: the silence that ends a turn"
    )
    for name, default, after in (
        ("complete", t.complete_ms, "words that look finished"),
        ("unsure", t.unsure_ms, "words that may or may not go on (… in?, … have?)"),
        ("incomplete", t.incomplete_ms, "words that trail off (… of, and …), or not yet transcribed"),
    ):
        help_text = f"--end-of-turn smart or words: the silence after {after}"
        parser.add_argument(f"--hangover-{name}-ms", type=float, default=default, help=help_text)
    parser.add_argument(
        "--no-preemptive",
        dest="preemptive",
        action="store_false",
        help="start the answer only once the turn has ended (default: at the pause, held until it ends)",
    )
    parser.add_argument(
        "--no-prefill-while-speaking",
        dest="prefill_while_speaking",
        action="store_false",
        help="prefill the user's words only once the answer starts (default: from the partial transcripts)",
    )
    parser.add_argument("--first-chunk-words", type=int, default=d.first_chunk_words)
    parser.add_argument("--max-new-tokens", type=int, default=d.max_new_tokens)
    parser.add_argument("--history-turns", type=int, default=d.history_turns)
    parser.add_argument(
        "--max-prompt-tokens",
        type=positive_int,
        default=d.prompt_tokens,
        help="the whole prompt (system, history, the user's turn) in tokens; the oldest exchanges go first",
    )
    parser.add_argument(
        "--prefill-chunk",
        type=positive_int,
        default=d.prefill_chunk,
        help="a long prompt is read this many tokens per batched step, so one user cannot stall the others",
    )
    parser.add_argument("--temperature", type=float, default=d.temperature)
    parser.add_argument(
        "--seed",
        type=int,
        default=d.seed,
        help="sampling seed: the same seed gives the same answer with a fixed --k and --no-auto-off "
        "(AdaptiveK and the governor decide from measured times)",
    )
    parser.add_argument(
        "--llm-url",
        default=None,
        help="use an OpenAI-compatible server (e.g. vLLM) as the LLM stage instead of the engine",
    )
    parser.add_argument("--llm-url-no-spec", default=None, help="a target-only server for speculation-off turns")


def agent_config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The voice agent's configuration. Its in-process engine batches the conversations' steps (the app's many
    users, load-aware K), and every voice command (app, say, bench-voice, bench-heard) runs and measures that path."""
    engine = spec_from_args(args)
    return AgentConfig(
        engine=engine if args.llm_url else dataclasses.replace(engine, batched=True),
        asr_model=args.asr,
        asr_beam_size=args.asr_beam,
        asr_window_s=args.asr_window_s or None,
        tts=args.tts,
        turn_end=TurnEnd(
            args.end_of_turn,
            args.hangover_ms,
            args.hangover_complete_ms,
            args.hangover_unsure_ms,
            args.hangover_incomplete_ms,
            args.turn_audio_threshold,
            args.turn_words_threshold,
        ),
        preemptive=args.preemptive,
        prefill_while_speaking=args.prefill_while_speaking,
        first_chunk_words=args.first_chunk_words,
        max_new_tokens=args.max_new_tokens,
        history_turns=args.history_turns,
        prompt_tokens=args.max_prompt_tokens,
        prefill_chunk=args.prefill_chunk,
        temperature=args.temperature,
        seed=args.seed,
        llm_url=args.llm_url,
        llm_url_no_spec=args.llm_url_no_spec,
    )
