"""`specvoice bench-users`: many users at once. Starts the app in this process and, for each N in --clients, has
N WebSocket clients (commands/voice_client.py) speak a recorded question each at the same moment, as the page's
microphone would (Int16 frames in real time), then counts per N: turns answered, 'busy' refusals (past
--max-concurrent-answers), turns lost (no answer and no refusal), silent turns (answered, but no answer audio reached
the client), mixed turns (a client heard as, or answered for, another client's question), server errors, and TTFA as
each turn's server timeline reports it (its 'done' message's ttfa_ms).

A warm-up pass first sends each question alone: the server is warm before anything is measured, and the transcript
each question gets then is what the mixed check compares with (beside transcripts.json's text, where there is one).

With --disconnect-one, each N ≥ 2 ends with one more client that leaves after its answer's first token; then as
many fresh clients as there are answer slots speak at once, and every one must be answered: a slot the departed
client kept would turn one of them away.
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Callable, Sequence
from dataclasses import asdict
from pathlib import Path

import numpy as np
from websockets.sync.client import connect

from app.server import AppServer
from pipeline.audio import load_audio, to_mono_16k
from pipeline.wer import word_error_rate
from specdec.metrics import DEFINITIONS
from specdec.models import asset_path

from . import app as app_command
from .bench_heard import free_port, serving
from .voice_client import ClientTurn, OnAdmitted, Utterance, recv_until, run_group, ws_url

TAIL_MARGIN_S = 0.7  # silence after the VAD hang-over, so the end of turn is decided while the mic still sends
DEFINITIONS_USERS = {
    "turns_sent": "clients that spoke their question (one turn each)",
    "turns_answered": "turns whose answer finished ('done')",
    "busy": "turns refused with the 'busy' message: no answer slot free (--max-concurrent-answers)",
    "lost": "turns with neither an answer nor a 'busy' refusal (timeout, dropped connection, nothing heard)",
    "silent": "answered turns whose client received no answer audio (its turn's audio packets before 'done')",
    "mixed": "turns whose transcript is nearer another client's question (word error rate) than the client's own, "
    "or whose answer was generated for another transcript than the one the client was told it said",
    "server_errors": "'error' messages and connections the server dropped, over every client of the run",
    "ttfa_ms": DEFINITIONS["ttfa_ms"] + "; p50/p95 over the answered turns (linear interpolation)",
    "early_kept": "answered turns whose answer was the one started early, at the pause (preemptive generation)",
    "early_discarded": "early answers thrown away (the user went on, or the final words differed), over the turns",
}


def load_utterances(wav_dir: str | Path) -> list[Utterance]:
    """Every .wav in wav_dir (sorted by name) at 16 kHz mono, with its text from transcripts.json where present."""
    folder = Path(wav_dir)
    wavs = sorted(folder.glob("*.wav"))
    if not wavs:
        raise FileNotFoundError(f"no .wav files in {folder}")
    known = folder / "transcripts.json"
    texts = json.loads(known.read_text()) if known.exists() else {}
    return [Utterance(w.stem, to_mono_16k(*load_audio(w)), texts.get(w.stem)) for w in wavs]


def is_mixed(turn: ClientTurn, own: Utterance, group: Sequence[Utterance]) -> bool:
    """The turn belongs to another client: its transcript is strictly nearer another question of the group than its
    own (ties go to its own), or its answer was generated for a transcript it was not told it said."""
    if turn.answered_for is not None and turn.answered_for != turn.transcript:
        return True
    if turn.transcript is None:
        return False  # nothing heard: a lost turn, not a mixed one

    heard = turn.transcript

    def nearest(u: Utterance) -> float:
        return min((word_error_rate(r, heard) for r in u.references()), default=float("inf"))

    mine = nearest(own)
    return any(nearest(u) < mine for u in group if u.name != own.name)


def percentile(values: Sequence[float], q: float) -> float | None:
    """The q-th percentile, linearly interpolated (numpy's default): a few turns never extrapolate. None for none."""
    return float(np.percentile(values, q)) if values else None


def summarize_run(
    clients: int, turns: Sequence[ClientTurn], extra: Sequence[ClientTurn] = (), disconnect: dict | None = None
) -> dict:
    """One N's figures: the counts over its N turns, TTFA percentiles, server errors also over the extra clients
    (the disconnect check's), and each turn."""
    ttfa = [t.ttfa_ms for t in turns if t.outcome == "answered" and t.ttfa_ms is not None]
    return {
        "clients": clients,
        "turns_sent": len(turns),
        "turns_answered": sum(t.outcome == "answered" for t in turns),
        "busy": sum(t.outcome == "busy" for t in turns),
        "lost": sum(t.outcome == "lost" for t in turns),
        "silent": sum(t.outcome == "answered" and not t.audio_s for t in turns),
        "mixed": sum(t.mixed for t in turns),
        "server_errors": sum(len(t.errors) for t in (*turns, *extra)),
        "early_kept": sum(t.outcome == "answered" and "kept" in t.early for t in turns),
        "early_discarded": sum(t.early.count("discarded") for t in turns),
        "ttfa_ms_p50": percentile(ttfa, 50),
        "ttfa_ms_p95": percentile(ttfa, 95),
        "disconnect": disconnect,
        "turns": [asdict(t) for t in turns],
    }


def disconnect_check(
    url: str,
    leaver: tuple[int, Utterance],
    fresh: Sequence[tuple[int, Utterance]],
    timeout_s: float,
    tail_s: float,
    on_admitted: OnAdmitted | None = None,
) -> tuple[dict, list[ClientTurn]]:
    """One client leaves after its answer's first token; then the fresh clients (one per answer slot) speak at once
    and must all be answered. Returns the check's figures and every turn it made."""
    left = run_group(url, [leaver], timeout_s, tail_s, on_admitted, leave_mid_answer=True)
    after = run_group(url, fresh, timeout_s, tail_s, on_admitted)
    answered = sum(t.outcome == "answered" for t in after)
    report = {
        "left_mid_answer": left[0].outcome == "left",
        "fresh_clients": len(after),
        "fresh_answered": answered,
        "fresh_busy": sum(t.outcome == "busy" for t in after),
        "passed": left[0].outcome == "left" and answered == len(after),
    }
    return report, [*left, *after]


def bench_users(
    url: str,
    utterances: Sequence[Utterance],
    clients: Sequence[int],
    *,
    disconnect_one: bool = False,
    timeout_s: float = 120.0,
    tail_s: float = 1.0,
    on_admitted: OnAdmitted | None = None,
    progress: Callable[[str], None] = lambda line: None,
) -> list[dict]:
    """Every N of clients against the app at url (ready, models loaded): a warm-up pass first (each question alone;
    it sets the utterances' heard, which the mixed check compares with), then one summarize_run dict per N.

    Client i speaks utterances[i % len]; with more clients than utterances, mixing between clients that share one
    cannot be seen. on_admitted lets a test hold answers until a whole group was admitted or refused."""
    with connect(ws_url(url), origin=url) as ws:
        capacity = recv_until(ws, lambda m: m["type"] == "hello")[0]["max_concurrent_answers"]
    used = utterances[: max(clients)]
    for u in used:
        (warm,) = run_group(url, [(0, u)], timeout_s, tail_s, on_admitted)
        u.heard = warm.transcript
        ttfa = "-" if warm.ttfa_ms is None else f"{warm.ttfa_ms:.0f}"
        progress(f"warm-up {u.name}: heard {u.heard!r}, TTFA {ttfa} ms ({warm.outcome})")
        if not u.references():
            raise RuntimeError(f"{u.name}: nothing was heard when sent alone, and no transcripts.json gives its text")

    def pick(i: int) -> tuple[int, Utterance]:
        return i, utterances[i % len(utterances)]

    runs = []
    for n in clients:
        picks = [pick(i) for i in range(n)]
        turns = run_group(url, picks, timeout_s, tail_s, on_admitted)
        group = [u for _, u in picks]
        for (_, u), t in zip(picks, turns):
            t.mixed = is_mixed(t, u, group)
        disconnect, extra = None, []
        if disconnect_one and n >= 2:
            fresh = [pick(n + 1 + j) for j in range(capacity)]
            disconnect, extra = disconnect_check(url, pick(n), fresh, timeout_s, tail_s, on_admitted)
        run = summarize_run(n, turns, extra, disconnect)
        runs.append(run)
        progress(describe(run))
    return runs


def describe(run: dict) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v:.0f}"

    line = (
        f"{run['clients']} clients: {run['turns_answered']}/{run['turns_sent']} answered, {run['busy']} busy, "
        f"{run['lost']} lost, {run['silent']} silent, {run['mixed']} mixed, {run['server_errors']} server errors; "
        f"TTFA p50 {ms(run['ttfa_ms_p50'])} ms, p95 {ms(run['ttfa_ms_p95'])} ms; early answers "
        f"{run['early_kept']} kept, {run['early_discarded']} discarded"
    )
    d = run["disconnect"]
    if d is not None:
        line += (
            f"; disconnect mid-answer: {d['fresh_answered']}/{d['fresh_clients']} fresh clients answered "
            f"({'passed' if d['passed'] else 'FAILED'})"
        )
    return line


# ------------------------------------------------------------------------------------------- CLI


def client_counts(value: str) -> list[int]:
    """argparse type: "1,2,4" → [1, 2, 4], each at least 1."""
    try:
        counts = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {value!r}") from None
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"client counts must be at least 1, got {value!r}")
    return counts


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--clients", type=client_counts, default=[1, 2, 4], help="client counts to run, e.g. 1,2,4")
    parser.add_argument(
        "--wavs", default=str(asset_path("utterances")), help="a directory of .wav questions (+ transcripts.json)"
    )
    parser.add_argument("--disconnect-one", action="store_true", help="check that a client leaving frees its slot")
    parser.add_argument("--turn-timeout-s", type=float, default=120.0, help="a turn with no answer by then is lost")
    parser.add_argument("--json", default=None, help="write the runs and the options here")
    app_command.add_arguments(parser)  # the same server, model and pipeline options as `specvoice app`
    parser.set_defaults(port=0)  # 0: a free port


def main(args: argparse.Namespace) -> int:
    logging.basicConfig(level=logging.WARNING, format="[specvoice] %(message)s")
    logging.getLogger("specvoice.app").setLevel(logging.INFO)  # loading progress: real models take a while
    utterances = load_utterances(args.wavs)
    config, options = app_command.server_setup(args)
    options.port = options.port or free_port()
    # every simulated client connects from this machine's one address
    options.max_sessions_per_client = max(options.max_sessions_per_client, *args.clients)
    options.max_sessions = max(options.max_sessions, *args.clients)
    limit = options.max_concurrent_answers
    server = AppServer(config, options)
    tail_s = config.turn_end.longest_ms / 1000 + TAIL_MARGIN_S

    with serving(server) as url:
        server.loader.finished.wait()
        if server.loader.error:
            raise RuntimeError(f"the models did not load: {server.loader.error}")
        runs = bench_users(
            url,
            utterances,
            args.clients,
            disconnect_one=args.disconnect_one,
            timeout_s=args.turn_timeout_s,
            tail_s=tail_s,
            progress=lambda line: print(line, flush=True),
        )
    if args.json:
        result = {
            "runs": runs,
            "definitions": DEFINITIONS_USERS,
            "options": {
                "clients": args.clients,
                "wavs": args.wavs,
                "utterances": [u.name for u in utterances],
                "max_concurrent_answers": limit,
                "max_turn_s": args.max_turn_s,
                "disconnect_one": args.disconnect_one,
                "turn_timeout_s": args.turn_timeout_s,
                "tail_s": tail_s,
                "agent": asdict(config),
            },
        }
        Path(args.json).write_text(json.dumps(result, indent=2, default=float))
        print(f"wrote {args.json}")
    # Busy refusals are the capacity limit working; anything else that went wrong fails the command.
    failures = ("lost", "silent", "mixed", "server_errors")
    failed = [r for r in runs if any(r[f] for f in failures) or not (r["disconnect"] or {}).get("passed", True)]
    return 1 if failed else 0
