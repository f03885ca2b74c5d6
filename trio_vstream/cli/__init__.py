"""Command line: ``python -m trio_vstream [serve] ...``, ``... client ...``, ``... watch ...``.

Each subcommand imports its own modules only when it runs: ``serve`` the server, the
session and the engines (and behind them prometheus_client, torch, diffusers);
``client``, ``watch`` and ``replay`` the client package, which needs none of those (the
``client`` contract in pyproject.toml). So the client never waits for, nor fails on,
what only serving needs, and tox's client environment is the package as installed;
tests/server/test_cli_imports.py checks what each subcommand loads. Hence the imports
inside the serve path's functions, `_add_arguments` and `_run`. At the top of each
module are only the small helpers with which ``serve``'s flags are checked (access,
connections, image_fetch, memory, protocol, last_resort): besides themselves and the
standard library, they load nothing the client does not load anyway.

This module is the command line itself: the parser's subcommands, `main`, and which
subcommand runs. ``serve`` is three modules beside it: ``serve_flags`` defines its
flags, ``serve_config`` turns them into what the server is given (keys, TLS, image
URLs, the wedge exit), and ``serve`` runs the server as a process (signals, recordings,
exit status). The client's subcommands are the client package's (`trio_vstream.client`).
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Collection, Sequence

from trio_vstream import __version__
from trio_vstream.cli.serve import run_serve, signals_noted_while_exiting
from trio_vstream.cli.serve_config import (
    ADMIN_API_KEY_ENV,
    API_KEY_ENV,
    access_policy,
    image_url_config,
    read_key_file,
    tls_context,
)
from trio_vstream.cli.serve_flags import add_serve_arguments

__all__ = [
    "ADMIN_API_KEY_ENV",
    "API_KEY_ENV",
    "access_policy",
    "build_parser",
    "image_url_config",
    "main",
    "read_key_file",
    "run_serve",
    "signals_noted_while_exiting",
    "tls_context",
]

_COMMANDS = ("serve", "client", "watch", "replay")


def build_parser(commands: Collection[str] = _COMMANDS) -> argparse.ArgumentParser:
    """The command line's parser. Every subcommand is listed, but only those in
    ``commands`` get their arguments, and so import their modules (see the module
    docstring): `main` passes the one it runs."""
    parser = argparse.ArgumentParser(
        prog="python -m trio_vstream",
        description="Stream generated video over WebSockets (/v1/realtime/video).",
    )
    parser.add_argument("--version", action="version", version=f"trio_vstream {__version__}")
    subcommands = parser.add_subparsers(dest="command")
    subcommands.add_parser("serve", help="run the server (the default command)")
    subcommands.add_parser(
        "client",
        help="stream a video from a server into an MP4 file",
        description="Connect to a /v1/realtime/video server, stream one video and write it "
        "as a progressive MP4 (exit status: 0 done, 1 server error, 2 usage, 3 connection, "
        "4 output not written, 130 interrupted).",
    )
    subcommands.add_parser(
        "watch",
        help="watch a running session through its watch link, into an MP4 file",
        description="Connect to a session's watch link (video.start's watch_path), receive "
        "its video from the next keyframe chunk to the end, read-only, and write it as a "
        "progressive MP4 (exit status: 0 done, 1 server error such as watch_not_found or "
        "viewer_too_slow, 2 usage, 3 connection, 4 output not written, 130 interrupted).",
    )
    subcommands.add_parser(
        "replay",
        help="repeat a recorded session (--record) against a server, and compare",
        description="Send a recording's request, seed and interactions (each before the "
        "generation chunk it started in) to a server, and check that the interactions start "
        "at the same chunks and the frames equal the recorded video's (exit status: 0 "
        "identical, 1 refused, 2 usage or unreadable recording, 3 connection, 4 output not "
        "written, 5 differs).",
    )
    for command, subparser in subcommands.choices.items():
        if command in commands:
            _add_arguments(command, subparser)
    return parser


def _add_arguments(command: str, parser: argparse.ArgumentParser) -> None:
    """One subcommand's arguments; this imports the subcommand's modules."""
    if command == "serve":
        add_serve_arguments(parser)
        return
    # Not at the top: only client, watch and replay load the client (the module docstring).
    from trio_vstream import client

    adders = {
        "client": client.add_client_arguments,
        "watch": client.add_watch_arguments,
        "replay": client.add_replay_arguments,
    }
    adders[command](parser)


def _run(args: argparse.Namespace) -> int:
    """Run the parsed subcommand."""
    if args.command == "serve":
        return run_serve(args)
    # Not at the top: only client, watch and replay load the client (the module docstring).
    from trio_vstream import client

    runners = {"client": client.run_client, "watch": client.run_watch, "replay": client.run_replay}
    return runners[args.command](args)


def main(argv: Sequence[str] | None = None, *, whole_process: bool = False) -> int:
    """The command line; returns the exit status.

    ``whole_process``: this call is the process (``python -m trio_vstream``), which exits
    once it returns. A server's stop then keeps its hard deadline armed until the
    interpreter is gone (`trio_vstream.server.last_resort`); an in-process caller gets it
    disarmed before this returns.
    """
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in (*_COMMANDS, "-h", "--help", "--version"):
        args_list.insert(0, "serve")
    # The arguments, and so the modules, of the subcommand that runs alone (of none, for
    # the top-level --help and --version).
    args = build_parser(args_list[:1]).parse_args(args_list)
    if args.command is None:
        build_parser(()).print_help()
        return 0
    args.whole_process = whole_process
    return _run(args)
