"""`specvoice say`: one voice turn from a recording, replayed in real time, with its latency timeline."""

from __future__ import annotations

import argparse
import json
import sys

import numpy as np
import soundfile as sf

from pipeline.agent import Conversation, VoiceAgent
from pipeline.audio import load_audio, to_mono_16k
from pipeline.turn_result import TurnResult
from specdec.metrics import DEFINITIONS

from .options import add_agent_arguments, agent_config_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wav", required=True, help="the user's utterance (any rate, mono or stereo)")
    parser.add_argument(
        "--speculation",
        default="on",
        choices=["on", "off", "both"],
        help="both: the same utterance with speculation off, then on, from the same state",
    )
    parser.add_argument("--out", default=None, help="write the spoken answer here (for both: OUT-off / OUT-on)")
    parser.add_argument("--json", default=None, help="write the turns' metrics here")
    add_agent_arguments(parser)


def run_turn(
    agent: VoiceAgent, conv: Conversation, audio16k: np.ndarray, speculation: bool, paired: bool
) -> TurnResult:
    if paired:
        agent.rewind(conv)
    return agent.turn_from_recording(conv, audio16k, speculation, remember=not paired)


def describe(turn: dict) -> str:
    stages = ", ".join(f"{k} {v:.0f}" for k, v in turn["stages"].items())
    acc = turn["draft_acceptance_rate"]
    return (
        f"speculation {'on ' if turn['speculation'] else 'off'}: TTFA {turn['ttfa_ms']:.0f} ms ({stages}); "
        f"{turn['tokens_per_s']:.1f} tok/s; acceptance {'-' if acc is None else f'{acc:.0%}'}\n"
        f"  you: {turn['transcript']}\n  agent: {turn['answer']}"
    )


def write_wav(path: str, result: TurnResult) -> None:
    audio = np.concatenate(result.audio) if result.audio else np.zeros(0, np.float32)
    sf.write(path, audio, result.sample_rate)


def main(args: argparse.Namespace) -> int:
    samples, rate = load_audio(args.wav)
    audio16k = to_mono_16k(samples, rate)
    agent = VoiceAgent(agent_config_from_args(args))
    print("[specvoice] warming up …", file=sys.stderr)
    agent.warmup()
    conv = agent.new_conversation()
    modes = {"on": [True], "off": [False], "both": [False, True]}[args.speculation]
    results = [run_turn(agent, conv, audio16k, spec, paired=len(modes) > 1) for spec in modes]
    turns = [r.to_dict() for r in results]
    for t in turns:
        print(describe(t))
    out: dict = {"definitions": DEFINITIONS, "turns": turns}
    if len(turns) == 2:
        out["summary"] = {"ttfa_ratio_on_off": turns[1]["ttfa_ms"] / turns[0]["ttfa_ms"]}
        print(f"TTFA ratio on/off: {out['summary']['ttfa_ratio_on_off']:.2f}")
    if args.out:
        if len(results) == 1:
            write_wav(args.out, results[0])
        else:
            stem, dot, ext = args.out.rpartition(".")
            for r in results:
                tag = "on" if r.speculation else "off"
                write_wav(f"{stem}-{tag}.{ext}" if dot else f"{args.out}-{tag}", r)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0
