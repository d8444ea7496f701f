"""`specvoice bench-voice`: paired speculation-off/on TTFA over many recordings, in one process; with the folder's
transcripts.json, whether each was heard right; and whether each turn stayed whole (did not end at a pause)."""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

from app.stats import bootstrap_ci, median_or_none, paired_ratio, spread
from pipeline.agent import Conversation, VoiceAgent
from pipeline.audio import load_audio, to_mono_16k
from pipeline.paired import paired_runs
from pipeline.timeline import STAGES
from pipeline.wer import normalize_words
from specdec.metrics import DEFINITIONS

from .options import add_agent_arguments, agent_config_from_args
from .say import run_turn

WHOLE_MARGIN_S = 0.5  # a turn is whole when its speech ends this close to the recording's end, or closer


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wavs", required=True, help="a directory of .wav utterances (e.g. assets/utterances)")
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--json", required=True)
    add_agent_arguments(parser)


def replayed_turn(agent: VoiceAgent, conv: Conversation, audio: np.ndarray, spec: bool, said: str | None) -> dict:
    """One recording replayed as a turn (paired: from the conversation's shared start), as TurnResult.to_dict() plus
    when its speech ended, whether the turn stayed whole, its early answers, and (given what was said) whether it was
    heard right."""
    started = time.perf_counter()  # the replay's first sample, within a millisecond
    result = run_turn(agent, conv, audio, spec, paired=True)
    turn = result.to_dict()
    turn["speech_end_s"] = result.timeline.marks["speech_end"] - started
    turn["whole"] = turn["speech_end_s"] >= len(audio) / 16000 - WHOLE_MARGIN_S
    turn["early_kept"] = result.timeline.early_start is not None
    turn["early_discarded"] = result.timeline.early_discarded
    if said is not None:
        turn["heard_right"] = normalize_words(turn["transcript"]) == normalize_words(said)
    return turn


def main(args: argparse.Namespace) -> int:
    wavs = sorted(Path(args.wavs).glob("*.wav"))
    if not wavs:
        raise FileNotFoundError(f"no .wav files in {args.wavs}")
    said = Path(args.wavs) / "transcripts.json"
    expected = json.loads(said.read_text()) if said.exists() else {}
    agent = VoiceAgent(agent_config_from_args(args))
    agent.warmup()
    conv = agent.new_conversation()
    audios = {wav: to_mono_16k(*load_audio(wav)) for wav in wavs}

    def run(item: tuple[int, Path], spec: bool) -> dict:
        _, wav = item
        return replayed_turn(agent, conv, audios[wav], spec, expected.get(wav.stem))

    items = [(rep, wav) for rep in range(args.repeats) for wav in wavs]
    pairs = []
    # The order alternates over repeats and over recordings both: (rep + i) % 2, i the recording's index.
    for paired in paired_runs(run, items, order=lambda index, item: item[0] + index % len(wavs)):
        (rep, wav), off, on = paired.item, paired.off, paired.on
        pair = {"wav": wav.name, "repeat": rep, "off": off, "on": on, "ratio_on_off": on["ttfa_ms"] / off["ttfa_ms"]}
        pairs.append(pair)
        print(
            f"[{len(pairs)}/{len(items)}] {wav.name}: off {off['ttfa_ms']:.0f} ms, on {on['ttfa_ms']:.0f} ms "
            f"(×{pair['ratio_on_off']:.2f}), acceptance {on['draft_acceptance_rate'] or 0:.0%}",
            file=sys.stderr,
            flush=True,
        )
    ab = paired_ratio([(p["off"]["ttfa_ms"], p["on"]["ttfa_ms"]) for p in pairs])  # the app's A/B statistic too
    diffs = [p["off"]["ttfa_ms"] - p["on"]["ttfa_ms"] for p in pairs]
    summary = {
        "pairs": len(pairs),
        "ttfa_ms_off": spread([p["off"]["ttfa_ms"] for p in pairs]),
        "ttfa_ms_on": spread([p["on"]["ttfa_ms"] for p in pairs]),
        "ttfa_ratio_on_off_median": ab["ratio_on_off_median"],
        "ttfa_ratio_on_off_ci95": ab["ratio_on_off_ci95"],
        "ttfa_saved_ms_median": statistics.median(diffs),
        "ttfa_saved_ms_ci95": bootstrap_ci(diffs),
        "stages_median_ms": {
            mode: {s: statistics.median(p[mode]["stages"][s] for p in pairs) for s in STAGES} for mode in ("off", "on")
        },
        "first_chunk_tokens_median": {
            m: statistics.median(p[m]["first_chunk_tokens"] for p in pairs) for m in ("off", "on")
        },
        "first_chunk_tokens_per_forward_median": {
            m: statistics.median(p[m]["first_chunk_tokens_per_forward"] or 0 for p in pairs) for m in ("off", "on")
        },
        "chunk_handoff_ms_median": {
            m: median_or_none([p[m]["chunk_handoff_ms"] for p in pairs]) for m in ("off", "on")
        },
        "stall_ms": {m: spread([p[m]["stall_ms"] for p in pairs]) for m in ("off", "on")},
        "turns_with_stalls": sum(p[m]["stall_ms"] > 0 for p in pairs for m in ("off", "on")),
        "draft_acceptance_rate_median": statistics.median(p["on"]["draft_acceptance_rate"] or 0 for p in pairs),
        "turns": 2 * len(pairs),
        "turns_whole": sum(p[m]["whole"] for p in pairs for m in ("off", "on")),
        "turns_heard_right": sum(p[m].get("heard_right", False) for p in pairs for m in ("off", "on")),
        "early_answers_kept": sum(p[m]["early_kept"] for p in pairs for m in ("off", "on")),
        "early_answers_discarded": sum(p[m]["early_discarded"] for p in pairs for m in ("off", "on")),
        "saved_ms_median": {
            name: statistics.median(p[m]["saved_ms"].get(name, 0.0) for p in pairs for m in ("off", "on"))
            for name in ("preemptive", "turn end by words")
        },
        "prefilled_while_speaking_tokens_median": statistics.median(
            p[m]["prefilled_while_speaking_tokens"] for p in pairs for m in ("off", "on")
        ),
        "transcripts_match": sum(p["off"]["transcript"] == p["on"]["transcript"] for p in pairs) / len(pairs),
        "answers_match": sum(p["off"]["answer"] == p["on"]["answer"] for p in pairs) / len(pairs),
    }
    Path(args.json).write_text(json.dumps({"definitions": DEFINITIONS, "summary": summary, "pairs": pairs}, indent=2))
    print(json.dumps(summary, indent=2), file=sys.stderr)
    return 0
