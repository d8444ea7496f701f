"""What limits heavy work over all of a server's tabs: answers and ASR passes take a slot without waiting, or not
(the app's AnswerSlots is one)."""

from __future__ import annotations

from typing import Protocol


class Capacity(Protocol):
    def try_acquire(self) -> bool: ...

    def release(self) -> None: ...

    def busy_message(self) -> str: ...


class NoLimit:
    """A Capacity that is never full (one user: say, bench-voice)."""

    def try_acquire(self) -> bool:
        return True

    def release(self) -> None:
        pass

    def busy_message(self) -> str:
        return "Busy."
