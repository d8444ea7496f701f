"""Command-line options shared by the commands, made from the configurations' own fields (specdec/fields.py): the
engine's (EngineSpec: generate, bench, calibrate and every command that runs the voice agent), the voice agent's
(AgentConfig, with its LLMConfig and TurnEnd: say, bench-voice, app) and the server's (ServerOptions: app).

Each option is declared once, on its field; add_options makes its flag and options_from_args the configuration from
the parsed flags, both by the same walk over the fields (flags)."""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from pipeline.agent import AgentConfig
from specdec.build import EngineSpec
from specdec.fields import Option, declared


def int_at_least(least: int) -> Callable[[str], int]:
    """argparse type: an integer of at least `least`."""

    def at_least(value: str) -> int:
        n = int(value)
        if n < least:
            raise argparse.ArgumentTypeError(f"must be at least {least}, got {n}")
        return n

    at_least.__name__ = "positive_int" if least == 1 else f"int_at_least_{least}"  # argparse's "invalid NAME value"
    return at_least


positive_int = int_at_least(1)


def checked(parse: Callable[[str], Any]) -> Callable[[str], Any]:
    """argparse type from a declared parse: its ValueError's words are the error argparse shows."""

    def check(value: str) -> Any:
        try:
            return parse(value)
        except ValueError as e:
            raise argparse.ArgumentTypeError(str(e)) from None

    check.__name__ = parse.__name__
    return check


@dataclass(frozen=True)
class Flag:
    """One declared field as a flag: where its value goes and how argparse reads it."""

    field: str  # the field's name in its dataclass
    option: Option
    kind: type  # str, int, float, bool or tuple (of str)
    default: Any  # the field's own default

    @property
    def name(self) -> str:
        if self.option.flag:
            return self.option.flag
        dashed = self.field.replace("_", "-")
        return f"--no-{dashed}" if self.kind is bool and self.default else f"--{dashed}"

    @property
    def dest(self) -> str:
        """The parsed args' attribute: argparse's own for the flag (for --no-NAME, NAME)."""
        return self.name.removeprefix("--").removeprefix("no-").replace("-", "_")

    def add_to(self, parser: argparse.ArgumentParser) -> None:
        o = self.option
        help_text = (o.help() if callable(o.help) else o.help) or None
        if self.kind is bool:
            action = "store_false" if self.default else "store_true"
            parser.add_argument(self.name, dest=self.dest, action=action, help=help_text)
            return
        kwargs: dict[str, Any] = {"default": self.default, "help": help_text}
        if o.parse is not None:
            kwargs["type"] = checked(o.parse)
        elif o.at_least is not None:
            kwargs["type"] = int_at_least(o.at_least)
        elif self.kind not in (str, tuple):
            kwargs["type"] = self.kind
        if self.kind is tuple:  # given again and again, each one more
            kwargs.update(action="append", default=list(self.default))
        if o.choices is not None:
            kwargs["choices"] = list(o.choices)
        if o.metavar is not None:
            kwargs["metavar"] = o.metavar
        parser.add_argument(self.name, dest=self.dest, **kwargs)

    def value(self, args: argparse.Namespace) -> Any:
        value = getattr(args, self.dest)
        return tuple(value) if self.kind is tuple else value

    def argv(self, value: Any) -> list[str]:
        """The flags that give `value`: none for the default."""
        if value == self.default:
            return []
        if self.kind is bool:
            return [self.name]
        if value is None:
            raise ValueError(f"{self.name}: None is only its default")
        return [text for v in (value if self.kind is tuple else [value]) for text in (self.name, str(v))]


def _kind(hint: Any) -> type:
    """The flag's type from a field's annotation: X | None reads as X, Literal[...] as str."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType) and len(args) == 1:
        return _kind(args[0])
    if origin is typing.Literal:
        return str
    if origin is tuple and args[0] is str:
        return tuple
    if hint in (str, int, float, bool):
        return hint
    raise TypeError(f"no flag for a field of type {hint!r}")


def declared_fields(cls: type) -> Iterator[tuple[dataclasses.Field, Flag | type]]:
    """cls's options in field order (its plain fields make no flag): each field with its Flag, or with the
    configuration class it holds (option(factory=ThatClass)), whose options are flags among these."""
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        option, hint = declared(f), hints[f.name]
        if option is None:
            continue
        if isinstance(hint, type) and dataclasses.is_dataclass(hint):
            if f.default_factory is not hint:
                raise TypeError(f"{cls.__name__}.{f.name}: a nested configuration is option(factory={hint.__name__})")
            yield f, hint
        elif f.default is dataclasses.MISSING:
            raise TypeError(f"{cls.__name__}.{f.name}: an option needs a default")
        else:
            yield f, Flag(f.name, option, _kind(hint), f.default)


def flags(cls: type) -> Iterator[Flag]:
    """The flags of cls's options, a nested configuration's in its place."""
    for _, flag in declared_fields(cls):
        if isinstance(flag, Flag):
            yield flag
        else:
            yield from flags(flag)


def add_options(parser: argparse.ArgumentParser, cls: type) -> None:
    """A flag for each option of cls (and of the configurations it holds)."""
    for flag in flags(cls):
        flag.add_to(parser)


def options_from_args(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """cls from the flags add_options made, parsed; its plain fields keep their defaults. given: fields set here
    instead (e.g. a nested configuration made apart)."""
    values = dict(given)
    for f, flag in declared_fields(cls):
        if f.name not in values:
            values[f.name] = flag.value(args) if isinstance(flag, Flag) else options_from_args(flag, args)
    return cls(**values)


def argv_for(config: Any) -> list[str]:
    """The flags that give config's option values, its defaults left out: options_from_args gives it back."""
    argv = []
    for f, flag in declared_fields(type(config)):
        value = getattr(config, f.name)
        argv += flag.argv(value) if isinstance(flag, Flag) else argv_for(value)
    return argv


def option_defaults(config: Any) -> dict[str, Any]:
    """config's option values by their flags' dests: parser.set_defaults(**these) makes them the defaults of the flags
    add_options made for its class."""
    defaults: dict[str, Any] = {}
    for f, flag in declared_fields(type(config)):
        value = getattr(config, f.name)
        if isinstance(flag, Flag):
            defaults[flag.dest] = list(value) if flag.kind is tuple else value
        else:
            defaults.update(option_defaults(value))
    return defaults


# ------------------------------------------------------------------------------------------- the shared sets


def add_engine_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, EngineSpec)


def spec_from_args(args: argparse.Namespace) -> EngineSpec:
    return options_from_args(EngineSpec, args)


def add_agent_arguments(parser: argparse.ArgumentParser) -> None:
    """The voice agent's options, the engine's among them."""
    add_options(parser, AgentConfig)


def agent_config_from_args(args: argparse.Namespace) -> AgentConfig:
    """The voice agent's configuration. Its in-process engine batches the conversations' steps (the app's many
    users, load-aware K), and every voice command (app, say, bench-voice, bench-heard) runs and measures that path."""
    engine = options_from_args(EngineSpec, args, batched=not args.llm_url)
    return options_from_args(AgentConfig, args, engine=engine)
