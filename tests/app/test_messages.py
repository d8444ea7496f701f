"""Client messages parsed strictly (app/messages.py): every malformed one is a BadMessage naming its field, never
another exception; well-formed ones come back typed and in range."""

from __future__ import annotations

import json

import pytest

from app.messages import BadMessage, MessageLimits, parse_message
from app.protocol import decode_mic_frame
from specdec.sampling import SamplingParams

LIMITS = MessageLimits(max_text_chars=20, max_ab_repeats=5, max_background=16)

# Issue 23, item 5: each crashed the socket (OverflowError) or poisoned the tab's answers (NaN).
ISSUE_23_EXAMPLES = [
    ('{"type":"hello","sample_rate":Infinity}', "hello.sample_rate"),
    ('{"type":"settings","background":Infinity}', "settings.background"),
    ('{"type":"ab","repeats":Infinity}', "ab.repeats"),
    ('{"type":"play","turn":Infinity}', "play.turn"),
    ('{"type":"heard","turn":Infinity,"t":1}', "heard.turn"),
    ('{"type":"settings","temperature":NaN}', "settings.temperature"),
]

MALFORMED = [
    ("{not json", "not JSON"),
    ("[" * 100_000, "not JSON"),  # deeper than the parser recurses
    ("[1, 2]", "JSON object"),
    ('"hello"', "JSON object"),
    ("null", "JSON object"),
    ('{"sample_rate": 48000}', "unknown message type"),
    ('{"type":"shout"}', "unknown message type"),
    ('{"type":["hello"]}', "unknown message type"),
    ('{"type":"pong","ts":1}', "pong.tc is required"),
    ('{"type":"play"}', "play.turn is required"),
    ('{"type":"play","turn":null}', "play.turn is required"),
    ('{"type":"heard","turn":1}', "heard.t is required"),
    ('{"type":"hello","sample_rate":192000}', "hello.sample_rate"),
    ('{"type":"hello","sample_rate":7999}', "hello.sample_rate"),
    ('{"type":"hello","sample_rate":44100.5}', "hello.sample_rate"),
    ('{"type":"settings","background":17}', "0..16"),
    ('{"type":"settings","speculation":"yes"}', "settings.speculation"),
    ('{"type":"settings","drafter":"oracle"}', "settings.drafter"),
    ('{"type":"settings","k":"0"}', "settings.k"),
    ('{"type":"settings","k":"17"}', "settings.k"),
    ('{"type":"settings","k":"²"}', "settings.k"),
    ('{"type":"settings","k":4.5}', "settings.k"),
    ('{"type":"mic","active":1}', "mic.active"),
    ('{"type":"mic","mode":"shout"}', "mic.mode"),
    ('{"type":"text","text":42}', "text.text"),
    ('{"type":"text","text":"%s"}' % ("x" * 21), "at most 20"),
    ('{"type":"ab","text":"%s"}' % ("x" * 21), "at most 20"),
    ('{"type":"text","text":"\\ud800"}', "not valid Unicode"),
    ('{"type":"heard","turn":1,"t":1,"method":"%s"}' % ("m" * 65), "heard.method"),
    ('{"type":"heard","turn":1,"t":1,"output_timestamp":[1,2]}', "heard.output_timestamp"),
    ('{"type":"heard","turn":1,"t":1,"output_timestamp":{"contextTime":1}}', "output_timestamp.performanceTime"),
    ('{"type":"play","turn":0}', "play.turn"),
    ('{"type":"play","turn":true}', "play.turn"),
    ('{"type":"play","turn":%s}' % ("9" * 4400), "not JSON"),  # past Python's int digit limit
]


@pytest.mark.parametrize("text, says", ISSUE_23_EXAMPLES + MALFORMED)
def test_malformed_messages_are_refused_with_a_clear_error(text, says):
    with pytest.raises(BadMessage, match=says.replace(".", r"\.")):
        parse_message(text, LIMITS)


# Every numeric field, with where it sits in an otherwise valid message.
NUMERIC_FIELDS = [
    ({"type": "hello"}, "sample_rate"),
    ({"type": "pong", "tc": 1.0}, "ts"),
    ({"type": "pong", "ts": 1.0}, "tc"),
    ({"type": "settings"}, "temperature"),
    ({"type": "settings"}, "background"),
    ({"type": "settings"}, "k"),
    ({"type": "ab"}, "repeats"),
    ({"type": "heard", "t": 1.0}, "turn"),
    ({"type": "heard", "turn": 1}, "t"),
    ({"type": "heard", "turn": 1, "t": 1.0}, "received_t"),
    ({"type": "heard", "turn": 1, "t": 1.0}, "output_latency_ms"),
    ({"type": "heard", "turn": 1, "t": 1.0}, "base_latency_ms"),
    ({"type": "play"}, "turn"),
]
BAD_NUMBERS = ["NaN", "Infinity", "-Infinity", "1e999", "-1e999", '"x"', "[]", "{}", "true"]


@pytest.mark.parametrize("base, field", NUMERIC_FIELDS)
def test_every_numeric_field_refuses_what_is_not_a_finite_number(base, field):
    for bad in BAD_NUMBERS + ["null"]:
        text = json.dumps(base)[:-1] + f', "{field}": {bad}}}'
        try:
            parsed = parse_message(text, LIMITS)
        except BadMessage as e:
            assert field in str(e), (bad, str(e))
            continue
        # Only an optional field may be null (absent); the parser never lets a bad value through.
        assert bad == "null" and parsed.get(field) in (None, 48000, 3), (bad, parsed)


def test_well_formed_messages_come_back_typed_with_defaults():
    def parse(message: dict) -> dict:
        return parse_message(json.dumps(message), LIMITS)

    assert parse({"type": "hello"}) == {"type": "hello", "sample_rate": 48000}
    assert parse({"type": "hello", "sample_rate": 44100.0})["sample_rate"] == 44100
    assert parse({"type": "pong", "ts": 1, "tc": 2.5}) == {"type": "pong", "ts": 1.0, "tc": 2.5}
    # settings: only what changes; k as the LLM stage takes it; temperature clamped as before
    page = {"type": "settings", "speculation": True, "k": "2"}  # what the page sends
    assert parse(page) == page
    changed = parse({"type": "settings", "k": 4, "temperature": 9, "drafter": None, "future": 1})
    assert changed == {"type": "settings", "k": "4", "temperature": 2.0}
    assert parse({"type": "settings", "k": "adaptive", "temperature": -1})["temperature"] == 0.0
    assert parse({"type": "settings", "background": 0})["background"] == 0
    assert parse({"type": "text", "text": "  hi  "}) == {"type": "text", "text": "hi"}
    assert parse({"type": "text"}) == {"type": "text", "text": ""}
    assert parse({"type": "mic"}) == {"type": "mic", "active": False, "mode": "handsfree"}
    assert parse({"type": "ab", "repeats": 1e300, "text": None}) == {"type": "ab", "text": "", "repeats": 5}
    assert parse({"type": "ab", "repeats": 0})["repeats"] == 1
    assert parse({"type": "ab"})["repeats"] == 3
    heard = parse({"type": "heard", "turn": 3, "t": 5, "output_timestamp": {"contextTime": 1, "performanceTime": 2}})
    assert heard["turn"] == 3 and heard["t"] == 5.0 and heard["method"] is None
    assert heard["output_timestamp"] == {"contextTime": 1.0, "performanceTime": 2.0}
    assert parse({"type": "play", "turn": 7}) == {"type": "play", "turn": 7}
    assert parse({"type": "stop"}) == {"type": "stop"}


def test_limits_are_the_servers():
    text = json.dumps({"type": "text", "text": "x" * 100})
    with pytest.raises(BadMessage, match="at most 20"):
        parse_message(text, LIMITS)
    assert parse_message(text, MessageLimits(max_text_chars=100))["text"] == "x" * 100
    background = json.dumps({"type": "settings", "background": 3})
    with pytest.raises(BadMessage, match="0..2"):
        parse_message(background, MessageLimits(max_background=2))


def test_sampling_refuses_a_temperature_or_top_p_that_is_not_finite():
    for bad in (float("nan"), float("inf")):
        with pytest.raises(ValueError, match="temperature must be a finite number"):
            SamplingParams(temperature=bad)
        with pytest.raises(ValueError, match="top_p"):
            SamplingParams(temperature=1.0, top_p=bad)


def test_an_oversized_mic_frame_is_refused_with_its_size():
    with pytest.raises(ValueError, match=r"1\.\.16000 Int16 samples, got 64000 bytes"):
        decode_mic_frame(b"\x00" * 64000)
