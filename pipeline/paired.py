"""Paired speculation-off/on runs, the A/B of the app and of `specvoice bench-voice`: both modes on the same input,
back to back, in alternating order. The statistic over the pairs is app/stats.py's paired_ratio."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

Item = TypeVar("Item")
Run = TypeVar("Run")


def ab_order(index: int) -> tuple[bool, bool]:
    """Speculation off/on order of the index-th paired run: alternating, so neither mode profits from going second."""
    return (False, True) if index % 2 == 0 else (True, False)


@dataclass
class Paired(Generic[Item, Run]):
    item: Item
    off: Run
    on: Run


def paired_runs(
    run: Callable[[Item, bool], Run],
    items: Iterable[Item],
    cancel: threading.Event | None = None,
    order: Callable[[int, Item], int] = lambda index, item: index,
) -> Iterator[Paired[Item, Run]]:
    """run(item, speculation) for each item with speculation off and on, in ab_order(order(index, item)); yields
    each finished pair. Once cancel is set nothing more runs, and the pair it interrupted is left out."""
    for index, item in enumerate(items):
        runs: dict[bool, Run] = {}
        for speculation in ab_order(order(index, item)):
            if cancel is not None and cancel.is_set():
                return
            runs[speculation] = run(item, speculation)
        if cancel is not None and cancel.is_set():  # the second run was cut short: not a fair pair
            return
        yield Paired(item, runs[False], runs[True])
