"""The command-line options are the configurations' fields (specdec/fields.py, commands/options.py): each field
declared once gives exactly one flag, and the flags give the configuration back."""

from __future__ import annotations

import argparse
import dataclasses

import pytest

from app.server import ServerOptions
from commands import app as app_command
from commands.options import (
    Flag,
    add_options,
    agent_config_from_args,
    argv_for,
    declared_fields,
    flags,
    option_defaults,
    options_from_args,
)
from pipeline.agent import AgentConfig
from pipeline.turn_end import TurnEnd
from specdec.build import TINY_ENGINE, EngineSpec
from specdec.fields import declared, option

NOT_FLAGS = {"batched"}  # EngineSpec's fields that no flag sets: the voice commands batch, the others do not
# A value other than the default for the str options whose values are checked when the spec is made.
STR_VALUES = {"k": "5", "device": "cuda:0"}


def parser_for(cls: type) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_options(parser, cls)
    return parser


def undeclared(cls: type) -> list[str]:
    """cls's fields that are no option, but for NOT_FLAGS."""
    return [f.name for f in dataclasses.fields(cls) if declared(f) is None and f.name not in NOT_FLAGS]


def other_value(flag: Flag) -> object:
    """A value of the flag's type other than its default."""
    if flag.option.choices is not None:
        return next(c for c in flag.option.choices if c not in (flag.default, "w8a8", "int8"))  # none of the CPU's
    if flag.kind is str:
        return STR_VALUES.get(flag.field, f"x-{flag.field}")
    if flag.kind is int:
        return 2 if flag.default is None else flag.default + 2
    if flag.kind is float:
        return 0.25 if flag.default is None else flag.default + 0.5
    raise AssertionError(f"no other value for {flag.kind}")


def test_every_engine_field_has_exactly_one_flag():
    assert undeclared(EngineSpec) == []
    names = [flag.name for flag in flags(EngineSpec)]
    assert len(names) == len(set(names)) == len(dataclasses.fields(EngineSpec)) - len(NOT_FLAGS)
    assert sorted(flag.field for flag in flags(EngineSpec)) == sorted(
        f.name for f in dataclasses.fields(EngineSpec) if f.name not in NOT_FLAGS
    )
    # the flags the README, the docs and the tests name
    assert {"--k", "--speculative-disable-by-batch-size", "--no-load-aware", "--compile", "--draft-min-prob"} <= set(
        names
    )


def test_the_check_finds_a_field_without_a_flag():
    """Teeth: a field added to the spec without option() is reported; one with it gets its flag."""

    @dataclasses.dataclass(kw_only=True)
    class Grown(EngineSpec):
        forgotten: int = 3
        declared_one: int = option(3, help="a new option")

    assert undeclared(Grown) == ["forgotten"]
    assert "--declared-one" in [flag.name for flag in flags(Grown)]
    assert options_from_args(Grown, parser_for(Grown).parse_args(["--declared-one", "5"])).declared_one == 5


@pytest.mark.parametrize("cls", [EngineSpec, TurnEnd, ServerOptions])
def test_no_flags_give_the_defaults(cls):
    assert options_from_args(cls, parser_for(cls).parse_args([])) == cls()


def test_no_flags_give_the_agents_defaults_batched():
    parser = argparse.ArgumentParser()
    add_options(parser, AgentConfig)
    config = agent_config_from_args(parser.parse_args([]))
    assert config == AgentConfig(engine=EngineSpec(batched=True))
    remote = agent_config_from_args(parser.parse_args(["--llm-url", "http://gpu:8000/v1"]))
    assert not remote.engine.batched and remote.llm_url == "http://gpu:8000/v1"


@pytest.mark.parametrize("flag", list(flags(EngineSpec)), ids=lambda flag: flag.name)
def test_each_engine_flag_sets_its_field(flag):
    parser = parser_for(EngineSpec)
    if flag.kind is bool:
        argv, want = [flag.name], not flag.default
    else:
        want = other_value(flag)
        argv = [flag.name, str(want)]
    spec = options_from_args(EngineSpec, parser.parse_args(argv))
    assert getattr(spec, flag.field) == want
    assert spec == EngineSpec(**{flag.field: want})
    assert options_from_args(EngineSpec, parser.parse_args(argv_for(spec))) == spec  # and back


def test_a_spec_round_trips_through_its_flags():
    parser = parser_for(EngineSpec)
    spec = dataclasses.replace(TINY_ENGINE, k="adaptive", k_max=8, draft_min_prob=0.3, auto_off=False, compile=True)
    assert options_from_args(EngineSpec, parser.parse_args(argv_for(spec))) == spec
    assert argv_for(TurnEnd()) == argv_for(ServerOptions()) == []  # the defaults need no flag
    # what the spec resolved when it was made is said, and gives the same spec
    assert argv_for(EngineSpec()) == ["--draft", "heads", "--target-quant", "w8a8", "--draft-quant", "int8"]


def test_the_nested_and_special_options():
    """TurnEnd's options among the agent's, --asr-window-s 0 for None, positive ints, repeated flags."""
    args = app_command_parser().parse_args(
        [
            "--end-of-turn",
            "words",
            "--hangover-unsure-ms",
            "500",
            "--asr-window-s",
            "0",
            "--allowed-origin",
            "https://a.example.com",
            "--allowed-origin",
            "https://b.example.com",
            "--max-prompt-tokens",
            "512",
        ]
    )
    config, options = app_command.server_setup(args)
    assert config.turn_end == TurnEnd("words", unsure_ms=500)
    assert config.asr_window_s is None and config.prompt_tokens == 512
    assert options.allowed_origins == ("https://a.example.com", "https://b.example.com")
    for argv in (["--max-concurrent-answers", "0"], ["--max-prompt-tokens", "0"], ["--end-of-turn", "vibes"]):
        with pytest.raises(SystemExit):
            app_command_parser().parse_args(argv)


def test_a_configuration_becomes_the_flags_defaults():
    """bench-heard and bench-server default to the tiny engine: its values as the flags' defaults."""
    parser = argparse.ArgumentParser()
    add_options(parser, AgentConfig)
    tiny = AgentConfig(engine=dataclasses.replace(TINY_ENGINE, batched=True), history_turns=1)
    parser.set_defaults(**option_defaults(tiny))
    assert agent_config_from_args(parser.parse_args([])) == tiny


def test_a_nested_configuration_is_declared_by_its_class():
    @dataclasses.dataclass
    class Holder:
        turn_end: TurnEnd = option(factory=lambda: TurnEnd("words"))

    with pytest.raises(TypeError, match="option\\(factory=TurnEnd\\)"):
        list(declared_fields(Holder))


def app_command_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    app_command.add_arguments(parser)
    return parser
