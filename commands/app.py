"""`specvoice app`: the browser voice agent (app/server.py), with the server's, the voice agent's and the engine's
options."""

from __future__ import annotations

import argparse

from app.server import ServerOptions, serve
from pipeline.agent import AgentConfig

from .options import add_agent_arguments, add_options, agent_config_from_args, options_from_args


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_options(parser, ServerOptions)
    add_agent_arguments(parser)


def server_setup(args: argparse.Namespace) -> tuple[AgentConfig, ServerOptions]:
    """`specvoice app`'s configuration from its options."""
    return agent_config_from_args(args), options_from_args(ServerOptions, args)


def main(args: argparse.Namespace) -> int:
    return serve(*server_setup(args))
