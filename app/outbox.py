"""What one tab is sent: messages queued from any thread, drained to its WebSocket on the event loop, bounded in bytes.

A tab that stops reading (a hung page, a hostile client) must not grow the server's memory: once more than
max_bytes wait unsent, the outbox gives up on the tab (everything queued is dropped, nothing more is taken) and
the session closes it with a reason.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import json
import threading
import time
from collections import Counter, deque

CLOSE_SLOW_READER = 1008  # policy violation: the page did not read what it was sent


class Outbox:
    def __init__(self, loop: asyncio.AbstractEventLoop, max_bytes: int) -> None:
        self.loop = loop
        self.max_bytes = max_bytes
        self.queued_bytes = 0  # taken and not yet handed to the socket, the one in flight included
        self.overflow: str | None = None  # why the tab was given up on, once it was
        self._items: deque[tuple[str | bytes, int, str | None]] = deque()  # (data, bytes, tag)
        self._tags: Counter[str | None] = Counter()
        self._lock = threading.Lock()
        self._wake = asyncio.Event()
        self.ended = asyncio.Event()  # closed, or given up on: set at once, even while a send is held up
        self._closed = False

    def put(self, message: dict | bytes, tag: str | None = None) -> bool:
        """Queue a message (any thread); False when it was not taken (closed, or over the cap, which closes it).
        tag names a kind of message whose queued count queued() tells."""
        # Encoded here, on the sender's thread: the loop only writes, and the cap counts what will be written.
        # ASCII JSON (json.dumps' default), so its length is its size in bytes.
        data = message if isinstance(message, bytes) else json.dumps(message, default=float)
        size = len(data)
        with self._lock:
            if self._closed:
                return False
            if self.queued_bytes + size > self.max_bytes:
                self.overflow = f"too slow: over {self.max_bytes / 2**20:.3g} MiB of messages waited unread"
                self._close()
            else:
                self._items.append((data, size, tag))
                self.queued_bytes += size
                self._tags[tag] += 1
        self._signal(self._wake)
        return self.overflow is None

    def queued(self, tag: str) -> int:
        """How many messages tagged tag wait unsent (or are being sent)."""
        with self._lock:
            return self._tags[tag]

    def close(self) -> None:
        """Nothing more is sent: what waits is dropped and pump() returns (any thread)."""
        with self._lock:
            self._close()

    def _close(self) -> None:
        self._closed = True
        self._items.clear()
        self._tags.clear()
        self.queued_bytes = 0
        self._signal(self._wake)
        self._signal(self.ended)

    def _signal(self, event: asyncio.Event) -> None:
        with contextlib.suppress(RuntimeError):  # the loop is gone: the server is shutting down
            self.loop.call_soon_threadsafe(event.set)

    async def pump(self, ws) -> None:
        """Send what is queued, in order, until the outbox is closed (or over its cap)."""
        while True:
            await self._wake.wait()
            self._wake.clear()  # before draining: a put from now on wakes the next wait
            while True:
                with self._lock:
                    if self._closed:
                        return
                    if not self._items:
                        break
                    data, size, tag = self._items[0]
                if isinstance(data, bytes):
                    await ws.send_bytes(data)
                else:
                    await ws.send_text(data)
                with self._lock:
                    if self._closed:
                        return
                    self._items.popleft()
                    self.queued_bytes -= size
                    self._tags[tag] -= 1

    async def pinger(self) -> None:
        """Ping quickly at first (the first answer needs the clock offset, and the page is busy rendering while
        it loads, which slows some round trips), then every couple of seconds to catch a faster trip."""
        for i in itertools.count():
            self.put({"type": "ping", "ts": time.perf_counter() * 1000})
            await asyncio.sleep(0.1 if i < 20 else 2.0)
