"""What a tab may say: each client JSON message (app/protocol.py lists them) parsed strictly into typed, in-range
fields, so the session's handlers act on values they can trust.

A message that fails raises BadMessage (a ValueError) whose text names the field and what it must be. Nothing else
escapes: non-finite numbers (NaN, Infinity, 1e999), wrong types, unknown types, missing fields, non-objects,
over-long or invalid text. Unknown fields are ignored (dropped from the result), so the page may grow new ones.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from dataclasses import dataclass

from specdec.session import DRAFTER_KINDS

from .protocol import DEFAULT_PLAYBACK_RATE

MIN_SAMPLE_RATE, MAX_SAMPLE_RATE = 8000, 96000  # the page's AudioContext rate: what answers are resampled to
MAX_TURN = 2**32 - 1  # a turn number, as an audio packet's header carries it (uint32)
MAX_K = 16
MAX_TEMPERATURE = 2.0
MAX_LABEL_CHARS = 64  # a short label the page reports (heard.method)
MIC_MODES = ("handsfree", "ptt")


class BadMessage(ValueError):
    """A client message that cannot be acted on; its text says which field is wrong and why."""


@dataclass(frozen=True)
class MessageLimits:
    """The limits that are the server's options (ServerOptions), not the protocol's."""

    max_text_chars: int = 1000
    max_ab_repeats: int = 10
    max_background: int = 16


_MISSING = object()


def _shown(value: object) -> str:
    """A value as the client wrote it (NaN, Infinity, true, null), cut short."""
    try:
        text = json.dumps(value)
    except (TypeError, ValueError, RecursionError):
        text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."


class _Fields:
    """Typed reads of one message's fields; every failure is a BadMessage naming kind.field."""

    def __init__(self, kind: str, message: dict) -> None:
        self.kind, self.message = kind, message

    def bad(self, name: str, what: str, value: object) -> BadMessage:
        return BadMessage(f"{self.kind}.{name} must be {what}, got {_shown(value)}")

    def get(self, name: str, default: object = _MISSING) -> object:
        """The raw value, or default when it is absent or null (BadMessage when there is no default)."""
        value = self.message.get(name)
        if value is None:
            if default is _MISSING:
                raise BadMessage(f"{self.kind}.{name} is required")
            return default
        return value

    def number(self, name: str, default: object = _MISSING) -> float | None:
        value = self.get(name, default)
        return None if value is None else self.finite(name, value)

    def finite(self, name: str, value: object, what: str = "a finite number") -> float:
        if isinstance(value, bool) or not isinstance(value, int | float):
            raise self.bad(name, what, value)
        if isinstance(value, float) and not math.isfinite(value):
            raise self.bad(name, what, value)
        return float(value)

    def whole(self, name: str, lo: int, hi: int, default: object = _MISSING, clamp: bool = False) -> int | None:
        """A whole number in lo..hi; clamp: one outside is moved to the nearest end instead."""
        value = self.get(name, default)
        return None if value is None else self.whole_value(name, value, lo, hi, clamp)

    def whole_value(self, name: str, value: object, lo: int, hi: int, clamp: bool = False, what: str = "") -> int:
        what = what or ("a whole number" if clamp else f"a whole number in {lo}..{hi}")
        self.finite(name, value, what)  # checked first, so int() never meets NaN or infinity
        assert isinstance(value, int | float)
        if isinstance(value, float) and not value.is_integer():
            raise self.bad(name, what, value)
        n = int(value)
        if clamp:
            return min(max(n, lo), hi)
        if not lo <= n <= hi:
            raise self.bad(name, what, value)
        return n

    def flag(self, name: str, default: object = _MISSING) -> bool | None:
        value = self.get(name, default)
        if value is not None and not isinstance(value, bool):
            raise self.bad(name, "true or false", value)
        return value  # type: ignore[return-value]

    def string(self, name: str, max_chars: int, default: object = _MISSING, strip: bool = False) -> str | None:
        value = self.get(name, default)
        if value is None:
            return None
        if not isinstance(value, str):
            raise self.bad(name, "a string", value)
        if strip:
            value = value.strip()
        if len(value) > max_chars:
            raise BadMessage(f"{self.kind}.{name} is {len(value)} characters long; at most {max_chars} are allowed")
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:  # a lone surrogate (\ud800): no tokenizer or report could take it
            raise BadMessage(f"{self.kind}.{name} is not valid Unicode text") from None
        return value

    def choice(self, name: str, choices: tuple[str, ...], default: object = _MISSING) -> str | None:
        value = self.get(name, default)
        if value is not None and value not in choices:
            raise self.bad(name, "one of " + ", ".join(choices), value)
        return value  # type: ignore[return-value]


# ---- one parser per message type: fields → the dict its handler reads


def _hello(f: _Fields, limits: MessageLimits) -> dict:
    return {"sample_rate": f.whole("sample_rate", MIN_SAMPLE_RATE, MAX_SAMPLE_RATE, DEFAULT_PLAYBACK_RATE)}


def _pong(f: _Fields, limits: MessageLimits) -> dict:
    return {"ts": f.number("ts"), "tc": f.number("tc")}


def _settings(f: _Fields, limits: MessageLimits) -> dict:
    """Only the settings to change: a field that is absent or null keeps its value."""
    temperature = f.number("temperature", None)
    changes = {
        "speculation": f.flag("speculation", None),
        "drafter": f.choice("drafter", DRAFTER_KINDS, None),
        "k": _k(f),
        "temperature": None if temperature is None else min(max(temperature, 0.0), MAX_TEMPERATURE),
        "load_aware": f.flag("load_aware", None),
        "background": f.whole("background", 0, limits.max_background, None),
    }
    return {name: value for name, value in changes.items() if value is not None}


def _k(f: _Fields) -> str | None:
    """K as the LLM stage takes it: "adaptive" or a whole number 1..16 as a string (the page sends "4")."""
    value = f.get("k", None)
    if value is None or value == "adaptive":
        return value
    if isinstance(value, str) and value.isascii() and value.isdigit() and len(value) <= 2:
        value = int(value)
    return str(f.whole_value("k", value, 1, MAX_K, what=f"'adaptive' or a whole number in 1..{MAX_K}"))


def _text(f: _Fields, limits: MessageLimits) -> dict:
    return {"text": f.string("text", limits.max_text_chars, "", strip=True)}


def _mic(f: _Fields, limits: MessageLimits) -> dict:
    return {"active": f.flag("active", False), "mode": f.choice("mode", MIC_MODES, "handsfree")}


def _ab(f: _Fields, limits: MessageLimits) -> dict:
    return {
        "text": f.string("text", limits.max_text_chars, "", strip=True),  # empty: the last utterance
        "repeats": f.whole("repeats", 1, limits.max_ab_repeats, 3, clamp=True),
    }


def _heard(f: _Fields, limits: MessageLimits) -> dict:
    stamp = f.get("output_timestamp", None)
    if stamp is not None:
        if not isinstance(stamp, dict):
            raise f.bad("output_timestamp", "an object {contextTime, performanceTime}", stamp)
        stamp = {key: f.finite(f"output_timestamp.{key}", stamp.get(key)) for key in ("contextTime", "performanceTime")}
    return {
        "turn": f.whole("turn", 1, MAX_TURN),
        "t": f.number("t"),
        "received_t": f.number("received_t", None),
        "method": f.string("method", MAX_LABEL_CHARS, None),
        "output_latency_ms": f.number("output_latency_ms", None),
        "base_latency_ms": f.number("base_latency_ms", None),
        "output_timestamp": stamp,
    }


def _play(f: _Fields, limits: MessageLimits) -> dict:
    return {"turn": f.whole("turn", 1, MAX_TURN)}


def _stop(f: _Fields, limits: MessageLimits) -> dict:
    return {}


PARSERS: dict[str, Callable[[_Fields, MessageLimits], dict]] = {
    "hello": _hello,
    "pong": _pong,
    "settings": _settings,
    "text": _text,
    "mic": _mic,
    "ab": _ab,
    "heard": _heard,
    "play": _play,
    "stop": _stop,
}


def parse_message(text: str, limits: MessageLimits | None = None) -> dict:
    """One client message → {"type": ..., its fields typed and in range}; BadMessage for anything else.

    Optional fields come back with their defaults (settings: only the fields given, as changes)."""
    try:
        message = json.loads(text)
    except (ValueError, RecursionError) as e:  # RecursionError: [[[[...]]]] nested deeper than the parser goes
        raise BadMessage(f"not JSON: {e}") from None
    if not isinstance(message, dict):
        raise BadMessage(f"a message must be a JSON object, got {_shown(message)}")
    kind = message.get("type")
    parse = PARSERS.get(kind) if isinstance(kind, str) else None
    if parse is None:
        raise BadMessage(f"unknown message type {_shown(kind)}; known: {', '.join(PARSERS)}")
    return {"type": kind, **parse(_Fields(kind, message), limits or MessageLimits())}
