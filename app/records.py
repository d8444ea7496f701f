"""One tab's records of its answered turns (the export), and what its page reported hearing of each."""

from __future__ import annotations

import threading

from pipeline.timeline import Timeline

HEARD_KEYS = ("ttfa_heard_ms", "heard_delay_ms", "heard_method", "heard_detail", "clock_rtt_ms")  # copied to records


class TurnRecords:
    """Records (the worker's) and heard delays (the event loop's) meet here, whichever comes first."""

    def __init__(self) -> None:
        self.records: list[dict] = []  # every answered turn, oldest first
        self._by_turn: dict[int, dict] = {}
        self._timelines: dict[int, Timeline] = {}
        self._heard: dict[int, dict] = {}
        self._lock = threading.Lock()

    def timeline(self, turn: int, timeline: Timeline) -> None:
        """turn's timeline, which the heard delay completes."""
        self._timelines[turn] = timeline

    def heard(self, turn: int, server_ms: float, emitted_ms: float, detail: dict, rtt_ms: float | None) -> dict:
        """The page heard turn's first sample at server_ms, the packet having left at emitted_ms: what its record
        gets (now, or once it is made)."""
        with self._lock:
            self._heard[turn] = {
                "heard_server_ms": server_ms,
                "heard_delay_ms": server_ms - emitted_ms,
                "heard_method": detail["method"],
                "heard_detail": detail,
                "clock_rtt_ms": rtt_ms,
            }
            timeline = self._timelines.get(turn)
            ttfa_heard_ms = timeline.heard_at(server_ms) if timeline is not None else None
            if ttfa_heard_ms is not None:
                self._heard[turn]["ttfa_heard_ms"] = ttfa_heard_ms
            return self._apply_heard(turn)

    def add(self, turn: int, data: dict) -> dict:
        """turn's record, with what was heard of it so far."""
        with self._lock:
            self._by_turn[turn] = data
            data.update(self._apply_heard(turn))
            self.records.append(data)
        return data

    def _apply_heard(self, turn: int) -> dict:
        heard = self._heard.get(turn, {})
        update = {key: heard.get(key) for key in HEARD_KEYS}
        record = self._by_turn.get(turn)
        if record is not None and heard:
            record.update(update)
            record["timeline"]["ttfa_heard_ms"] = update["ttfa_heard_ms"]
        return update
