"""Preemptive generation: an answer started at the user's pause, on the words heard so far, before the turn ends.

The answer runs (prefill, decode, TTS) while the end-of-turn silence is still being waited for, but nothing of it
leaves until the turn is confirmed with the same words. If the user speaks again, or the final words differ, it is
discarded: it stops, and what it would have sent, played or remembered never is.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Literal, TypeVar

HoldState = Literal["held", "confirmed", "discarded"]
T = TypeVar("T")


class ChildCancel(threading.Event):
    """A cancel event of its own that also reads as set when its parent is: an early answer stops when it is
    discarded (this one) or when the whole turn is interrupted (the parent), and discarding it touches nothing else."""

    def __init__(self, parent: threading.Event) -> None:
        super().__init__()
        self.parent = parent

    def is_set(self) -> bool:
        return super().is_set() or self.parent.is_set()


class Hold:
    """What an early answer sends waits here until the turn is confirmed (then it goes out, in order) or discarded
    (then it never does, and the answer's cancel events are set)."""

    def __init__(self, words: str, on_signal: Callable[[], None] | None = None) -> None:
        self.words = words  # the transcript the answer was started on
        self.state: HoldState = "held"
        # the answer's first forward reads it for the end-of-turn decision (metrics.DEFINITIONS); not held back
        self.end_of_message_probability: float | None = None
        # the answer has audio to play, or ended with none: its turn need not stay open for it (pipeline/listener.py)
        self.playable = False
        self._on_signal = on_signal  # called on vote() and can_play(), on the answer's thread
        self._cond = threading.Condition()
        self._queued: list[Callable[[], None]] = []
        self._cancels: list[threading.Event] = []
        self._watchers: list[Callable[[], None]] = []

    def vote(self, end_of_message_probability: float) -> None:
        """The answer's first forward read the target's P(end of message): on_signal, so that the turn's listener
        reads it now, not at the next audio frame."""
        self.end_of_message_probability = end_of_message_probability
        if self._on_signal is not None:
            self._on_signal()

    def can_play(self) -> None:
        """The answer's first audio is ready (held here until the turn is confirmed), or the answer ended without
        any: on_signal, so that a turn held open until its answer could be heard ends now."""
        if not self.playable:
            self.playable = True
            if self._on_signal is not None:
                self._on_signal()

    def post(self, action: Callable[[], None]) -> None:
        """Run action now if the turn is confirmed, once it is if still held, never if discarded."""
        with self._cond:  # under the lock, so a confirm() flushing the queue cannot be overtaken
            if self.state == "held":
                self._queued.append(action)
            elif self.state == "confirmed":
                action()

    def wrap(self, sink: Callable[[T], None]) -> Callable[[T], None]:
        """An event sink whose events are held like post()'s actions."""
        return lambda event: self.post(lambda: sink(event))

    def link(self, cancel: threading.Event) -> None:
        """Set cancel when the answer is discarded (at once if it already was)."""
        with self._cond:
            self._cancels.append(cancel)
            if self.state == "discarded":
                cancel.set()

    def on_decided(self, watcher: Callable[[], None]) -> None:
        """Call watcher once the turn is confirmed or discarded (at once if it already is), outside the hold's lock:
        one waiting elsewhere for something else as well (an answer slot) rechecks the state then."""
        with self._cond:
            if self.state == "held":
                self._watchers.append(watcher)
                return
        watcher()

    def confirm(self) -> None:
        with self._cond:
            if self.state != "held":
                return
            self.state = "confirmed"
            for action in self._queued:
                action()
            self._queued.clear()
            self._cond.notify_all()
        self._tell_watchers()

    def discard(self) -> None:
        with self._cond:
            if self.state != "held":
                return
            self.state = "discarded"
            self._queued.clear()
            for cancel in self._cancels:
                cancel.set()
            self._cond.notify_all()
        self._tell_watchers()

    def _tell_watchers(self) -> None:
        watchers, self._watchers = self._watchers, []
        for watcher in watchers:
            watcher()

    def wait(self) -> bool:
        """Block while the turn is undecided; True when it was confirmed."""
        with self._cond:
            while self.state == "held":
                self._cond.wait()
            return self.state == "confirmed"
