"""Options declared once, on their dataclass field: the default, the help, and how a command line gives the value.
The commands make their flags from these declarations and their configurations from the parsed flags
(commands/options.py); nothing here reads a command line.

A field declared with `option` is a flag; a plain field is not (the commands leave it at its default). The flag's type
comes from the field's annotation: str, int, float (X | None: the same, None its default only), bool (a switch:
--no-NAME for a field that defaults to True, --NAME for one that defaults to False), tuple[str, ...] (the flag may be
given again, each adding one) and a dataclass (its own options, flattened among these: option(factory=ThatClass)).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import MISSING, Field, dataclass, field
from typing import Any

OPTION = "option"  # the key of a field's metadata that holds its Option


@dataclass(frozen=True)
class Option:
    # "%(default)s" in it reads the default; a callable: help made when the flags are (what this machine offers)
    help: str | Callable[[], str] = ""
    flag: str = ""  # "": --NAME, the field's name with dashes (--no-NAME for a bool that defaults to True)
    choices: Sequence[str] | None = None
    at_least: int | None = None  # an int flag's least value
    parse: Callable[[str], Any] | None = None  # the value from the flag's text, instead of the type's; ValueError(why)
    metavar: str | None = None


def option(default: Any = MISSING, *, factory: Any = MISSING, **declared: Any) -> Any:
    """A dataclass field that is a command-line option: field(default=...) with its Option (the keywords above)."""
    return field(default=default, default_factory=factory, metadata={OPTION: Option(**declared)})


def declared(f: Field) -> Option | None:
    """The field's Option; None for a plain field, which no flag sets."""
    return f.metadata.get(OPTION)
