"""`specvoice bench-turn`: does each turn end where its speaker ended it? Recordings with a mid-sentence pause must stay
whole; finished questions should end after a short wait. Each is replayed in real time through the whole voice path
(VAD, streaming ASR, Smart Turn, the early answer whose first forward reads the target's P(end of message)), with
short answers, since only the turn's end is measured. Each pause's signals, when they came, and the wait chosen are
kept, so `--replay` can try other thresholds on a run's JSON without running the models again.

    specvoice bench-turn --wavs assets/utterances-turns-tune --json turns.json
    specvoice bench-turn --replay turns.json [more.json …] --json sweep.json
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
import sys
from dataclasses import replace
from pathlib import Path

from pipeline.agent import VoiceAgent
from pipeline.audio import load_audio, to_mono_16k
from pipeline.turn_end import PauseSignals, TurnEnd
from pipeline.vad import FRAME_S
from specdec.metrics import DEFINITIONS

from .bench_voice import replayed_turn
from .options import add_agent_arguments, agent_config_from_args

SIGNALS = ("words", "end_of_turn_probability", "end_of_message_probability")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--wavs", help="a directory of .wav turns with turns.json (scripts/make_utterances.py)")
    parser.add_argument(
        "--replay", nargs="+", help="bench-turn JSONs: decide their pauses again, together, over a grid of thresholds"
    )
    parser.add_argument("--json", required=True)
    add_agent_arguments(parser)
    parser.set_defaults(max_new_tokens=8)  # the answer is not measured here


def main(args: argparse.Namespace) -> int:
    if bool(args.wavs) == bool(args.replay):
        raise SystemExit("bench-turn: give --wavs (run) or --replay (decide a run's pauses again), one of them")
    out = replay([json.loads(Path(f).read_text()) for f in args.replay]) if args.replay else run(args)
    Path(args.json).write_text(json.dumps(out, indent=2))
    print(json.dumps(out["summary"], indent=2), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> dict:
    folder = Path(args.wavs)
    info = json.loads((folder / "turns.json").read_text())
    config = agent_config_from_args(args)
    agent = VoiceAgent(config)
    agent.warmup()
    conv = agent.new_conversation()
    turns = []
    for i, (name, meta) in enumerate(sorted(info.items()), start=1):
        heard = replayed_turn(agent, conv, to_mono_16k(*load_audio(folder / f"{name}.wav")), True, meta["text"])
        turn = {
            "name": name,
            **meta,
            **{key: heard[key] for key in ("whole", "heard_right", "transcript", "ttfa_ms")},
            "end_of_turn_wait_ms": heard["stages"]["end_of_turn_wait"],
            "pauses": heard["timeline"]["pauses"],
        }
        turns.append(turn)
        verdict = "whole" if turn["whole"] else "CUT"
        print(f"[{i}/{len(info)}] {name}: {verdict}, {turn['transcript']!r}", file=sys.stderr)
    meta = {"wavs": str(folder), "turn_end": vars(config.turn_end), "status": agent.turn_end_status}
    return {"definitions": DEFINITIONS, "meta": meta, "summary": summarize(turns), "turns": turns}


def summarize(turns: list[dict]) -> dict:
    paused = [t for t in turns if t["pause_ms"]]
    finished = [t for t in turns if not t["pause_ms"]]
    keys = ("smart_turn_ms", "asr_pass_ms", "words_at_ms")
    costs = {key: [p[key] for t in turns for p in t["pauses"] if key in p] for key in keys}
    return {
        "paused_turns": len(paused),
        "paused_turns_whole": sum(t["whole"] for t in paused),
        # whole only because a pause's silence ran out while its answer had nothing to play, and the speaker went on
        "paused_turns_whole_by_holding_open": sum(t["whole"] and any(map(held_over, t["pauses"])) for t in paused),
        "cut": sorted(t["name"] for t in paused if not t["whole"]),
        "finished_turns": len(finished),
        "finished_wait_ms_median": statistics.median(t["end_of_turn_wait_ms"] for t in finished) if finished else None,
        "finished_cut_short": sorted(t["name"] for t in finished if not t["whole"]),
        "heard_right": sum(t["heard_right"] for t in turns),
        **{f"{key}_median": statistics.median(v) if v else None for key, v in costs.items()},
        # the tail: one slow pass leaves a pause without words, so the turn waits the long wait
        **{f"{key}_max": max(costs[key], default=None) for key in ("asr_pass_ms", "words_at_ms")},
        "ttfa_ms_max": max((t["ttfa_ms"] for t in turns), default=None),
    }


def held_over(pause: dict) -> bool:
    """The speaker went on after this pause's silence ran out, while the turn was held open for its answer."""
    return bool(pause.get("held_open")) and not pause["ended_turn"]


def ends_at(turn_end: TurnEnd, pause: dict) -> float:
    """When, in ms after the pause's last voiced audio, turn_end would have ended the turn at this pause, its signals
    arriving when they did (the VAD's 32 ms frames left out); inf if it would wait past every signal forever."""
    arrivals = sorted((pause[f"{s}_at_ms"], s) for s in SIGNALS if f"{s}_at_ms" in pause)
    known, since = PauseSignals(), 0.0
    for at, signal in [*arrivals, (math.inf, "")]:
        wait = turn_end.decide(known).ms
        if wait < at:  # the VAD decides at the end of a frame
            return math.ceil(max(wait, since) / 1000 / FRAME_S - 1e-9) * FRAME_S * 1000
        if signal:
            known, since = replace(known, **{signal: pause[signal]}), at
    return math.inf


def closes_at(turn_end: TurnEnd, pause: dict) -> float:
    """When the turn would have closed at this pause (ms after its last voiced audio): where ends_at says, or, held
    open for an early answer on the pause's words, once that answer had audio to play (at most the longest wait)."""
    held = min(pause.get("answer_playable_at_ms", math.inf), turn_end.longest_ms) if pause.get("answer_held") else 0
    return max(ends_at(turn_end, pause), held)


def decide_again(turn_end: TurnEnd, turns: list[dict]) -> dict:
    """A run's turns under other thresholds: a paused turn is cut when a pause before its last would have ended it
    within the silence the speaker left; a finished turn's wait is when its last pause would have ended it."""
    cut, waits = [], []
    for t in turns:
        *before, last = t["pauses"]
        # A run that cut a paused turn saw no later pause: it counts as cut whatever the thresholds.
        if any(closes_at(turn_end, p) < p["silence_ms"] for p in before) or (t["pause_ms"] and not before):
            cut.append(t)
        elif not t["pause_ms"]:
            waits.append(ends_at(turn_end, last))
    paused = sum(bool(t["pause_ms"]) for t in turns)
    return {
        "paused_turns_whole": paused - sum(bool(t["pause_ms"]) for t in cut),
        "paused_turns": paused,
        "finished_wait_ms_median": statistics.median(waits) if waits else None,
        "cut": [t["name"] for t in cut],
    }


def replay(runs: list[dict]) -> dict:
    """Every combination of thresholds and waits over a grid; the summary is its frontier: for each count of paused
    turns whole, the combination with the shortest median wait on finished ones."""
    base = TurnEnd(**runs[0]["meta"]["turn_end"])
    turns = [t for run in runs for t in run["turns"]]
    grid = itertools.product(
        (0.02, 0.05, 0.1, 0.2, 0.3, 0.5, 0.7, 0.9),
        (0.05, 0.1, 0.2, 0.3, 0.5),
        (120, 160, 200),
        (500, 700, 1000),
        (False, True),
    )
    rows = []
    for audio, words, complete, unsure, stands_in in grid:
        turn_end = replace(
            base,
            audio_threshold=audio,
            words_threshold=words,
            complete_ms=complete,
            unsure_ms=unsure,
            transcript_stands_in=stands_in,
        )
        rows.append({"turn_end": vars(turn_end), **decide_again(turn_end, turns)})
    frontier: dict[int, dict] = {}
    for row in rows:
        best = frontier.setdefault(row["paused_turns_whole"], row)
        if (row["finished_wait_ms_median"] or 0) < (best["finished_wait_ms_median"] or 0):
            frontier[row["paused_turns_whole"]] = row
    summary = [frontier[whole] for whole in sorted(frontier, reverse=True)]
    return {"meta": {"replayed": [run["meta"] for run in runs]}, "summary": summary, "grid": rows}
