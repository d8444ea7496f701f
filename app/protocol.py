"""The browser ↔ server wire protocol: audio packets, mic frames, the clock sync, and the constants both ends share.

One WebSocket per tab (WS_PATH) carries everything; JSON text unless noted:
  browser → server: binary Int16 LE mono 16 kHz mic frames; hello {sample_rate}; pong {ts, tc}; settings {...};
    text {text}; mic {active, mode}; ab {repeats, text}; heard {turn, t, ...}; play {turn}; stop
  server → browser: binary audio packets (pack_audio); hello; status; ping {ts}; vad; partial; transcript; turn;
    token; done; heard; flush; busy; error; info; ab_start; ab_progress; ab_result

The page's scripts import PAGE_CONSTANTS as the module protocol.js (page_module), so no number is written twice.
"""

from __future__ import annotations

import json
import struct
from collections import deque

import numpy as np

from pipeline.audio import SAMPLE_RATE
from pipeline.vad import FRAME

WS_PATH = "/specvoice/ws"
AUDIO_MAGIC = b"SVA1"
# An audio packet's header, field → struct code, little-endian and unpadded; Int16 LE PCM follows it.
# server_ms is the time the packet left, on the server's time.perf_counter clock.
AUDIO_HEADER_FIELDS = {"magic": "4s", "turn": "I", "seq": "I", "rate": "I", "flags": "I", "server_ms": "d"}
AUDIO_HEADER = struct.Struct("<" + "".join(AUDIO_HEADER_FIELDS.values()))
FLAG_REPLAY = 1  # a replayed answer: the page must not report it as heard
MIC_FRAME_SAMPLES = FRAME  # what the page's capture worklet sends at a time: one VAD window
MAX_MIC_FRAME_SAMPLES = SAMPLE_RATE  # one second per message at most
DEFAULT_PLAYBACK_RATE = 48000  # the page's audio rate until its hello says otherwise


def _header_offsets() -> dict[str, int]:
    codes = list(AUDIO_HEADER_FIELDS.values())
    return {name: struct.calcsize("<" + "".join(codes[:i])) for i, name in enumerate(AUDIO_HEADER_FIELDS)}


PAGE_CONSTANTS = {
    "WS_PATH": WS_PATH,
    "AUDIO_MAGIC": AUDIO_MAGIC.decode("ascii"),
    "HEADER_BYTES": AUDIO_HEADER.size,
    "HEADER_OFFSETS": _header_offsets(),
    "FLAG_REPLAY": FLAG_REPLAY,
    "MIC_RATE": SAMPLE_RATE,
    "MIC_FRAME_SAMPLES": MIC_FRAME_SAMPLES,
    "DEFAULT_PLAYBACK_RATE": DEFAULT_PLAYBACK_RATE,
}


def page_module() -> str:
    """protocol.js: PAGE_CONSTANTS as an ES module, served next to the page's static scripts."""
    lines = [f"export const {name} = {json.dumps(value)};" for name, value in PAGE_CONSTANTS.items()]
    return (
        "// Written by app/protocol.py (page_module): the wire constants shared with the server.\n"
        + "\n".join(lines)
        + "\n"
    )


def _int16(samples: np.ndarray) -> bytes:
    """Float samples as Int16 LE, clipped to ±1 and rounded, as the page's capture worklet writes them."""
    return np.round(np.clip(np.asarray(samples, np.float32), -1.0, 1.0) * 32767).astype("<i2").tobytes()


def pack_audio(samples: np.ndarray, turn: int, seq: int, rate: int, server_ms: float, flags: int = 0) -> bytes:
    return AUDIO_HEADER.pack(AUDIO_MAGIC, turn, seq, rate, flags, server_ms) + _int16(samples)


def unpack_audio(data: bytes) -> tuple[dict, np.ndarray]:
    """An audio packet → its header (without the magic) and its samples as float32; ValueError for anything else."""
    if len(data) < AUDIO_HEADER.size or not data.startswith(AUDIO_MAGIC) or (len(data) - AUDIO_HEADER.size) % 2:
        raise ValueError("not an audio packet")
    header = dict(zip(AUDIO_HEADER_FIELDS, AUDIO_HEADER.unpack_from(data)))
    del header["magic"]
    pcm = np.frombuffer(data, "<i2", offset=AUDIO_HEADER.size).astype(np.float32) / 32767
    return header, pcm


def encode_mic_frame(samples: np.ndarray) -> bytes:
    """A mic frame as the page sends it: 16 kHz mono float samples (at most MAX_MIC_FRAME_SAMPLES) → Int16 LE."""
    return _int16(samples)


def decode_mic_frame(data: bytes) -> np.ndarray:
    """A browser mic frame (Int16 LE, 16 kHz mono) → float32; ValueError for anything else."""
    if len(data) % 2 or not 0 < len(data) <= 2 * MAX_MIC_FRAME_SAMPLES:
        raise ValueError(f"mic frames are 1..{MAX_MIC_FRAME_SAMPLES} Int16 samples, got {len(data)} bytes")
    return np.frombuffer(data, "<i2").astype(np.float32) / 32768


class ClockSync:
    """The page's performance.now() ↔ the server's perf_counter, both in ms, from ping/pong round trips.

    Each round trip gives offset = client − midpoint of send and receive; its error is at most half the round
    trip, so the estimate is the offset of the fastest recent trip (NTP's minimum-delay filter)."""

    def __init__(self, keep: int = 32) -> None:
        self._samples: deque[tuple[float, float]] = deque(maxlen=keep)

    def add(self, sent_ms: float, client_ms: float, received_ms: float) -> None:
        rtt = received_ms - sent_ms
        if rtt >= 0:
            self._samples.append((rtt, client_ms - (sent_ms + received_ms) / 2))

    @property
    def offset_ms(self) -> float | None:
        return min(self._samples)[1] if self._samples else None

    @property
    def rtt_ms(self) -> float | None:
        return min(self._samples)[0] if self._samples else None

    def to_server_ms(self, client_ms: float) -> float | None:
        offset = self.offset_ms
        return None if offset is None else client_ms - offset
