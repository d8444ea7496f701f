"""A voice client of the app over its WebSocket, as the page is one: it speaks a recording in real time (Int16 mic
frames of one VAD window) and reads what the server answers, its audio packets included. `specvoice bench-users` runs
groups of them at once; the app's tests speak through send_speech and read through recv_until.
"""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import ClientConnection, connect

from app.protocol import FLAG_REPLAY, MIC_FRAME_SAMPLES, WS_PATH, encode_mic_frame, unpack_audio
from pipeline.audio import SAMPLE_RATE
from pipeline.wer import normalize_words

LEAD_S = 0.5  # silence before the question, as a user draws breath: the hands-free gate's pre-roll sees it
READY_TIMEOUT_S = 60.0

# on_admitted(n): every client of a group that started speaking together was admitted or refused; n were admitted
OnAdmitted = Callable[[int], None]


@dataclass
class Utterance:
    name: str
    audio: np.ndarray  # 16 kHz mono float32
    text: str | None = None  # what is said, where the assets say (transcripts.json)
    heard: str | None = None  # its transcript when sent alone (bench-users' warm-up pass)

    def references(self) -> list[str]:
        """What it says, as heard alone and as written; one with no words ("...") says nothing to compare with."""
        return [r for r in (self.heard, self.text) if r and normalize_words(r)]


@dataclass
class ClientTurn:
    """One client's turn as the client saw it."""

    client: int
    utterance: str
    outcome: str = "lost"  # answered, busy, lost, left (disconnected mid-answer on purpose)
    admitted: bool = False  # the server started answering (its 'turn' message)
    transcript: str | None = None  # what the server heard (its 'transcript' message)
    answered_for: str | None = None  # the transcript the answer was generated for (the 'done' data)
    ttfa_ms: float | None = None
    audio_s: float = 0.0  # answer audio the client received: its turn's audio packets before 'done'
    errors: list[str] = field(default_factory=list)
    note: str | None = None  # why a turn was lost
    mixed: bool = False
    early: list[str] = field(default_factory=list)  # the early answers' events on this turn: started, kept, discarded


def recv_until(ws: ClientConnection, want: Callable[[dict], bool], timeout: float = 30) -> tuple[dict, list]:
    """Read a websockets sync client until a JSON message satisfies want; returns it and everything read."""
    seen: list = []
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            raise TimeoutError(f"no matching message; saw {[m if isinstance(m, dict) else len(m) for m in seen]}")
        raw = ws.recv(timeout=left)
        msg = json.loads(raw) if isinstance(raw, str) else raw
        seen.append(msg)
        if isinstance(msg, dict):
            if msg.get("type") == "ping":  # keep the clock estimate fed, like the page does
                ws.send(json.dumps({"type": "pong", "ts": msg["ts"], "tc": time.perf_counter() * 1000}))
            elif want(msg):
                return msg, seen


def send_speech(ws: ClientConnection, audio16k: np.ndarray) -> None:
    """Stream audio as the page does: mic frames of one VAD window, in real time (the server stamps each frame
    with its arrival, so a burst would squeeze the speech)."""
    t0 = time.perf_counter()
    for i in range(0, len(audio16k), MIC_FRAME_SAMPLES):
        time.sleep(max(0.0, t0 + (i + MIC_FRAME_SAMPLES) / SAMPLE_RATE - time.perf_counter()))
        ws.send(encode_mic_frame(audio16k[i : i + MIC_FRAME_SAMPLES]))


def answer_audio_s(messages: Sequence[dict | bytes], turn: int) -> float:
    """Seconds of the answer audio to `turn` among the messages read: its audio packets, replays left out."""
    packets = [unpack_audio(m) for m in messages if isinstance(m, bytes)]
    return sum(len(pcm) / h["rate"] for h, pcm in packets if h["turn"] == turn and not h["flags"] & FLAG_REPLAY)


def ws_url(url: str) -> str:
    """The app's WebSocket address, from the address of its page."""
    return url.replace("http", "ws", 1) + WS_PATH


class VoiceClient:
    """One client speaking one question hands-free, on a thread (run), and what came of its turn (turn)."""

    def __init__(self, turn: ClientTurn, utterance: Utterance, tail_s: float, leave_mid_answer: bool) -> None:
        self.turn = turn
        self.audio = np.concatenate(
            [np.zeros(int(LEAD_S * SAMPLE_RATE), np.float32), utterance.audio, np.zeros(int(tail_s * SAMPLE_RATE))]
        ).astype(np.float32)
        self.leave_mid_answer = leave_mid_answer
        self.decided = threading.Event()  # admitted, refused or failed

    def _kind(self, m: dict) -> str:
        """Note what a message tells about the turn; its type."""
        kind = m["type"]
        if kind == "error":
            self.turn.errors.append(m["message"])
        elif kind == "transcript":
            self.turn.transcript = m["text"]
        elif kind == "early":
            self.turn.early.append(m["event"])
        elif kind == "info" and m["message"].startswith("Not answered"):
            self.turn.note = m["message"]  # the mic heard nothing it could answer
        return kind

    def run(self, address: str, origin: str, start: threading.Barrier, timeout_s: float) -> None:
        turn = self.turn
        try:
            with connect(address, origin=origin, max_size=None, open_timeout=READY_TIMEOUT_S) as ws:
                recv_until(ws, lambda m: self._kind(m) == "status" and m["ready"], READY_TIMEOUT_S)
                ws.send(json.dumps({"type": "mic", "active": True, "mode": "handsfree"}))
                start.wait(READY_TIMEOUT_S)  # every client of the group speaks at the same moment
                send_speech(ws, self.audio)
                decision, _ = recv_until(
                    ws, lambda m: self._kind(m) in ("turn", "busy", "error") or turn.note is not None, timeout_s
                )
                if decision["type"] == "busy":
                    turn.outcome = "busy"
                if decision["type"] != "turn":
                    return
                turn.admitted = True
                self.decided.set()
                want = ("token", "done", "error") if self.leave_mid_answer else ("done", "error")
                end, seen = recv_until(ws, lambda m: self._kind(m) in want, timeout_s)
                if end["type"] == "token":
                    turn.outcome = "left"  # closing the socket here is the disconnect mid-answer
                elif end["type"] == "done":
                    data = end["data"]
                    turn.outcome, turn.answered_for, turn.ttfa_ms = "answered", data["transcript"], data["ttfa_ms"]
                    turn.audio_s = answer_audio_s(seen, decision["turn"])
                    if data["cancelled"]:
                        turn.note = "the answer was cancelled"
        except TimeoutError as e:
            turn.note = f"timed out: {e}"
        except ConnectionClosed as e:
            turn.errors.append(f"the server closed the connection: {e}")
            turn.note = "connection closed"
        except ValueError as e:  # a message neither JSON nor an audio packet
            turn.errors.append(f"the server sent a malformed message: {e}")
        except (OSError, threading.BrokenBarrierError) as e:
            turn.note = f"{type(e).__name__}: {e}"
            start.abort()  # the others must not wait for a client that never comes
        finally:
            self.decided.set()


def run_group(
    url: str,
    picks: Sequence[tuple[int, Utterance]],
    timeout_s: float,
    tail_s: float,
    on_admitted: OnAdmitted | None = None,
    leave_mid_answer: bool = False,
) -> list[ClientTurn]:
    """(client, utterance) pairs speak at once, each over its own socket; their turns once all are over."""
    start = threading.Barrier(len(picks))
    clients = [VoiceClient(ClientTurn(c, u.name), u, tail_s, leave_mid_answer) for c, u in picks]
    threads = [
        threading.Thread(target=c.run, args=(ws_url(url), url, start, timeout_s), name=f"client-{c.turn.client}")
        for c in clients
    ]
    for t in threads:
        t.start()
    longest = max(len(c.audio) for c in clients) / SAMPLE_RATE
    for c in clients:
        c.decided.wait(READY_TIMEOUT_S + longest + timeout_s)
    if on_admitted is not None:
        on_admitted(sum(c.turn.admitted for c in clients))
    for t in threads:
        t.join()
    return [c.turn for c in clients]
