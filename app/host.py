"""What one tab's session may ask of the server that hosts it, and nothing more: the session's modules import this,
never app/server.py (AppServer is the host), so the two do not import each other."""

from __future__ import annotations

import threading
from typing import Protocol

from pipeline.agent import VoiceAgent
from pipeline.preemptive import Hold


class SessionLimits(Protocol):
    """The server's options that bound one tab (ServerOptions has them)."""

    @property
    def max_turn_s(self) -> float: ...
    @property
    def max_text_chars(self) -> int: ...
    @property
    def max_text_tokens(self) -> int: ...
    @property
    def max_ab_repeats(self) -> int: ...
    @property
    def kept_audio_turns(self) -> int: ...
    @property
    def max_outbox_bytes(self) -> int: ...
    @property
    def max_background(self) -> int: ...


class Models(Protocol):
    """The shared models as they load (ModelLoader)."""

    @property
    def agent(self) -> VoiceAgent | None: ...
    @property
    def ready(self) -> bool: ...
    @property
    def loading(self) -> bool: ...
    def stage(self) -> str: ...
    def failed_message(self) -> str: ...
    def describe(self) -> dict: ...


class AnswerSlots:
    """At most `limit` answers at once over all tabs; a turn that finds none free is told so, never queued. An early
    answer waits for one while its turn is undecided (acquire_for)."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"--max-concurrent-answers must be ≥ 1, got {limit}")
        self.limit = limit
        self._free = limit
        self._cond = threading.Condition()

    @property
    def free(self) -> int:
        """Slots free now (a snapshot)."""
        return self._free

    def try_acquire(self) -> bool:
        with self._cond:
            if not self._free:
                return False
            self._free -= 1
            return True

    def acquire_for(self, hold: Hold | None) -> bool:
        """A slot now; for an early answer (hold), the first one freed while its turn is undecided, as the pass at
        the pause may hold the last one while the answer started on the pass before it asks. False when none is
        free once the turn is confirmed, or when it was discarded."""
        if hold is None:
            return self.try_acquire()
        hold.on_decided(self._wake)
        with self._cond:
            while hold.state != "discarded":
                if self._free:
                    self._free -= 1
                    return True
                if hold.state != "held":
                    return False
                self._cond.wait()
            return False

    def release(self) -> None:
        with self._cond:
            if self._free >= self.limit:
                raise ValueError("an answer slot released more often than taken")
            self._free += 1
            self._cond.notify_all()

    def _wake(self) -> None:
        with self._cond:
            self._cond.notify_all()

    def busy_message(self) -> str:
        who = "another conversation" if self.limit == 1 else f"{self.limit} other conversations"
        return (
            f"Busy: the server is answering {who} (--max-concurrent-answers {self.limit}). "
            "Your turn was not answered; try again in a moment."
        )


class SessionHost(Protocol):
    """The server, as a session sees it."""

    @property
    def options(self) -> SessionLimits: ...
    @property
    def slots(self) -> AnswerSlots: ...
    @property
    def loader(self) -> Models: ...

    def count_tokens(self, text: str) -> int | None:
        """text's length in the loaded LLM's tokens (characters / 4 where it has no tokenizer here, a remote LLM);
        None while the models load."""
        ...

    def set_background(self, n: int, owner: str) -> None:
        """The load control: n simulated conversations for the whole server, set by the tab named owner."""
        ...

    def release_background(self, owner: str) -> None:
        """The tab named owner closed: the load it set ends with it."""
        ...
