"""What one tab's session may ask of the server that hosts it, and nothing more: the session's modules import this,
never app/server.py (AppServer is the host), so the two do not import each other."""

from __future__ import annotations

import threading
from typing import Protocol

from pipeline.agent import VoiceAgent


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
    """At most `limit` answers at once over all tabs; a turn that finds none free is told so, never queued."""

    def __init__(self, limit: int) -> None:
        if limit < 1:
            raise ValueError(f"--max-concurrent-answers must be ≥ 1, got {limit}")
        self.limit = limit
        self._sem = threading.BoundedSemaphore(limit)

    def try_acquire(self) -> bool:
        return self._sem.acquire(blocking=False)

    def release(self) -> None:
        self._sem.release()

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
