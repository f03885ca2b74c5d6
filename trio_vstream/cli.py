"""Command line: ``python -m trio_vstream [serve] ...``, ``... client ...``, ``... watch ...``.

Each subcommand imports its own modules only when it runs: ``serve`` the server, the
session and the engines (and behind them prometheus_client, torch, diffusers);
``client``, ``watch`` and ``replay`` the client package, which needs none of those (the
``client`` contract in pyproject.toml). So the client never waits for, nor fails on,
what only serving needs, and tox's client environment is the package as installed;
tests/test_cli_imports.py checks what each subcommand loads. Hence the imports inside
the serve path's functions, `_add_arguments` and `_run`. At the top are only the small
helpers with which this module checks serve's flags (access, connections, image_fetch,
memory, protocol): besides themselves and the standard library, they load nothing the
client does not load anyway.
"""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import os
import re
import shutil
import signal
import ssl
import sys
from collections.abc import Callable, Collection, Iterator, Sequence
from pathlib import Path
from typing import TYPE_CHECKING

import trio

from trio_vstream import __version__, logsafe, protocol
from trio_vstream.media import image_fetch
from trio_vstream.server import access, connections, memory
from trio_vstream.server.last_resort import FAILURE_STATUS as LAST_RESORT_STATUS
from trio_vstream.server.last_resort import MARGIN_SECONDS as LAST_RESORT_MARGIN
from trio_vstream.server.last_resort import SECOND_SIGNAL_SECONDS, LastResort

if TYPE_CHECKING:
    from trio_vstream.engines.contract import Engine
    from trio_vstream.outputs.recording import Recorder
    from trio_vstream.server.app import ServerConfig

DEFAULT_ENGINE = "shapes"
API_KEY_ENV = "TRIO_VSTREAM_API_KEY"
ADMIN_API_KEY_ENV = "TRIO_VSTREAM_ADMIN_API_KEY"
_COMMANDS = ("serve", "client", "watch", "replay")
RECORDING_CLOSE_TIMEOUT = 120.0
"""Seconds the server waits at exit for ``--record``'s last recordings to be written
(less when a signal's hard deadline comes sooner: `trio_vstream.server.last_resort`)."""
_STOP_SIGNALS = (signal.SIGINT, signal.SIGTERM)
"""The first drains the server, a second stops it at once (`_serve_until_signalled`)."""
SUPERVISOR_ENV = ("INVOCATION_ID", "KUBERNETES_SERVICE_HOST")
"""Set by systemd for the processes of a unit, and by Kubernetes in every container:
under either, ``--exit-when-wedged`` is on unless ``--no-exit-when-wedged`` says not."""
RECORD_FREE_SPACE_SHARE = 0.9
"""Without ``--record-max-bytes``, recordings may add this share of the free space (at
start) to what DIR already holds: they stop before the disk is full, which would fail
the rest of the machine, and a full disk would drop whole recordings anyway."""

logger = logsafe.get_logger("trio_vstream")


def _engine_arg(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    return key.strip(), value


def _positive(kind: type[int] | type[float]) -> Callable[[str], int | float]:
    def parse(text: str) -> int | float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        if value <= 0:
            raise argparse.ArgumentTypeError(f"must be > 0, got {text}")
        return value

    return parse


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text}")
    return value


_BYTE_UNITS = {"": 1, "K": 1024, "M": 1024**2, "G": 1024**3, "T": 1024**4}


def _byte_size(text: str) -> int:
    """A size in bytes: a whole number, or with K, M, G or T (binary: 1K = 1024)."""
    match = re.fullmatch(r"\s*([0-9]+)\s*([KMGT]?)(?:i?B)?\s*", text, re.IGNORECASE)
    if match is None:
        raise argparse.ArgumentTypeError(f"expected a size such as 500M or 20G, got {text!r}")
    return int(match.group(1)) * _BYTE_UNITS[match.group(2).upper()]


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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    # Not at the top: only serve loads the server and the engines (the module docstring).
    from trio_vstream.engines import BUILTIN_ENGINES
    from trio_vstream.outputs.watch import WatchConfig
    from trio_vstream.server.app import ServerConfig
    from trio_vstream.session.session import SessionConfig

    defaults = ServerConfig()
    session = SessionConfig()
    limits = protocol.Limits()
    parser.add_argument(
        "--host", default=defaults.host, help="address to bind (default %(default)s)"
    )
    parser.add_argument(
        "--port",
        type=int,
        default=defaults.port,
        help="port (default %(default)s; 0 picks a free one)",
    )
    parser.add_argument(
        "--engine",
        default=DEFAULT_ENGINE,
        help=f"engine: {', '.join(sorted(BUILTIN_ENGINES))}, or package.module:factory "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--engine-arg",
        dest="engine_args",
        type=_engine_arg,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="option for the engine (repeatable)",
    )
    parser.add_argument(
        "--device", default="auto", help="auto, cpu or cuda[:N], for engines that use one"
    )
    parser.add_argument(
        "--model",
        default=None,
        help="served model name checked against session.start.model (default: the engine's name)",
    )
    parser.add_argument(
        "--max-sessions",
        type=_positive(int),
        default=defaults.max_sessions,
        help="concurrent sessions before new ones get server_busy (default %(default)s)",
    )
    parser.add_argument(
        "--max-connections",
        type=_positive(int),
        default=None,
        metavar="N",
        help="connections served at once (sessions, viewers, upgrades waiting for "
        "session.start, plain requests); beyond, a few reserved ones answer /health only and "
        "the rest get 503 (default: the descriptor limit, ulimit -n, less "
        f"{connections.FD_RESERVE + connections.RESERVED_SLOTS} and "
        f"{connections.FDS_PER_SESSION} per --max-sessions)",
    )
    parser.add_argument(
        "--max-connections-per-ip",
        type=_positive(int),
        default=None,
        metavar="N",
        help="connections one client address (an IPv6 /64) may hold at once; more get 429 "
        "(default: no cap; leave it off behind a proxy, where every connection comes from "
        "the proxy)",
    )
    parser.add_argument(
        "--head-timeout",
        type=_positive(float),
        default=defaults.head_timeout,
        help="seconds a connection gets to send its HTTP request head, TLS handshake "
        "included, before it is closed (default %(default)s)",
    )
    parser.add_argument(
        "--start-timeout",
        type=_positive(float),
        default=session.start_timeout,
        help="seconds to wait for session.start (default %(default)s)",
    )
    parser.add_argument(
        "--stall-timeout",
        type=_positive(float),
        default=session.stall_timeout,
        help="seconds without progress before a session is aborted (default %(default)s)",
    )
    parser.add_argument(
        "--encode-concurrency",
        type=_positive(int),
        default=defaults.encode_concurrency,
        help="chunks encoded at once, server-wide (default %(default)s: the cores)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=_positive(float),
        default=defaults.shutdown_grace,
        help="on SIGTERM, seconds running sessions get to finish their videos while no new "
        "ones are admitted (default %(default)s)",
    )
    parser.add_argument(
        "--max-stuck-calls",
        type=_non_negative_int,
        default=defaults.max_stuck_calls,
        metavar="N",
        help="engine calls stuck after their sessions ended at which the engine counts as "
        "wedged: /health answers 503 and new sessions get engine_unavailable until they "
        "return (0: never; default %(default)s)",
    )
    parser.add_argument(
        "--exit-when-wedged",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="once the engine is wedged, drain and exit with status 69, for a supervisor "
        "to restart the process (default: on under systemd or Kubernetes, else off)",
    )
    parser.add_argument(
        "--api-key",
        dest="api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help=f"require this key (repeatable; also ${API_KEY_ENV}): 'Authorization: Bearer KEY', "
        f"or from a browser the WebSocket subprotocol {access.KEY_SUBPROTOCOL_PREFIX}<base64url>",
    )
    parser.add_argument(
        "--api-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="require the keys in this file (one a line; blank lines and # comments ignored)",
    )
    parser.add_argument(
        "--admin-api-key",
        dest="admin_api_keys",
        action="append",
        default=[],
        metavar="KEY",
        help=f"an operator key (repeatable; also ${ADMIN_API_KEY_ENV}): needed for /stats and "
        "/metrics, and good as an API key. Without one, a server with --api-key serves /stats "
        "to nobody and /metrics to any key holder",
    )
    parser.add_argument(
        "--admin-api-key-file",
        type=Path,
        default=None,
        metavar="PATH",
        help="operator keys from this file, as --api-key-file",
    )
    parser.add_argument(
        "--allowed-hosts",
        action="append",
        default=[],
        metavar="HOSTS",
        help="Host names served besides localhost, loopback addresses and the --host address "
        "(any address, for 0.0.0.0 or ::), comma-separated (repeatable; .example.org for it "
        "and its subdomains; '*' for any). Others get 421: a web page whose DNS name points "
        "here (DNS rebinding) is refused",
    )
    parser.add_argument(
        "--allowed-origins",
        action="append",
        default=[],
        metavar="ORIGINS",
        help="browser origins besides the server's own that may open sessions, comma-separated "
        "(repeatable; '*' for any)",
    )
    watching = WatchConfig()
    parser.add_argument(
        "--max-viewers",
        type=_non_negative_int,
        default=watching.max_viewers,
        help="read-only viewers per session through its watch link (video.start's watch_path); "
        "0 turns watching off (default %(default)s)",
    )
    parser.add_argument(
        "--watch-requires-key",
        action="store_true",
        help="with API keys, a watch link needs a key too (by default its token is enough)",
    )
    parser.add_argument(
        "--ssl-certfile", default=None, metavar="PATH", help="serve wss:// and https://"
    )
    parser.add_argument(
        "--ssl-keyfile",
        default=None,
        metavar="PATH",
        help="the certificate's private key (if not in the certificate file)",
    )
    fetching = image_fetch.ImageFetchConfig()
    parser.add_argument(
        "--allow-image-urls",
        dest="image_url_hosts",
        nargs="+",
        action="extend",
        default=[],
        metavar="HOST",
        help="fetch session.start image_reference https:// URLs from these hosts only (exact "
        "names; repeatable), on port 443 unless given as HOST:PORT. Off by default: a server "
        "that fetches URLs its clients name can be made to reach internal services; "
        "non-public addresses are always refused",
    )
    parser.add_argument(
        "--image-url-max-bytes",
        type=_positive(int),
        default=fetching.max_bytes,
        help="largest image fetched from a URL (default %(default)s)",
    )
    parser.add_argument(
        "--image-url-timeout",
        type=_positive(float),
        default=fetching.timeout,
        help="seconds for the whole fetch of an image URL, redirects included "
        "(default %(default)s)",
    )
    parser.add_argument(
        "--image-url-max-redirects",
        type=_non_negative_int,
        default=fetching.max_redirects,
        help="redirects followed, each to an allowed host (default %(default)s)",
    )
    for name, help_text in (
        ("max_width", "largest width accepted"),
        ("max_height", "largest height accepted"),
        ("max_num_frames", "largest frame count accepted"),
        ("max_total_pixels", "largest width*height*frames accepted"),
        ("max_start_bytes", "largest session.start message"),
        ("max_control_bytes", "largest control message"),
    ):
        parser.add_argument(
            "--" + name.replace("_", "-"),
            type=_positive(int),
            default=getattr(limits, name),
            help=f"{help_text} (default %(default)s)",
        )
    parser.add_argument(
        "--record",
        type=Path,
        default=None,
        metavar="DIR",
        help="keep every session as DIR/<request_id>.mp4 and DIR/<request_id>.json (request, "
        "seed, interactions and their chunks, timings, outcome); replay with 'replay'",
    )
    parser.add_argument(
        "--record-max-bytes",
        type=_byte_size,
        default=None,
        metavar="SIZE",
        help="the most the recordings in DIR may take, those already there included (e.g. "
        "20G). Beyond it new sessions are not recorded and a recording under way stops, its "
        "JSON saying so (default: what DIR holds plus 90%% of the free space at start)",
    )
    parser.add_argument(
        "--log-level",
        default="INFO",
        choices=["DEBUG", "INFO", "WARNING", "ERROR"],
        type=str.upper,
        help="(default %(default)s)",
    )


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


def access_policy(args: argparse.Namespace) -> access.AccessPolicy:
    """Keys from the flags, the key files and the environment; origins and hosts from the
    flags. Warns about short keys, naming where each is from (never the key itself).
    Raises ``ValueError`` naming what is wrong (never the key itself)."""
    keys = _keys(args.api_keys, API_KEY_ENV, args.api_key_file, "--api-key")
    admin = _keys(
        args.admin_api_keys, ADMIN_API_KEY_ENV, args.admin_api_key_file, "--admin-api-key"
    )
    for source, key in keys + admin:
        if not key or any(c.isspace() for c in key):
            raise ValueError(f"{source}: a key must be non-empty and without spaces")
        if len(key) < access.SHORT_KEY:
            logger.warning(
                "%s: a key shorter than %d characters can be guessed; use a long random one "
                "(python -c 'import secrets; print(secrets.token_urlsafe(32))')",
                source,
                access.SHORT_KEY,
            )
    if {key for _, key in keys} & {key for _, key in admin}:
        raise ValueError("--admin-api-key: an admin key must not also be given as an API key")
    origins = [o.strip() for group in args.allowed_origins for o in group.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and access.normalise_origin(origin) is None:
            raise ValueError(
                f"--allowed-origins: {origin!r} is not an origin like https://example.org"
            )
    hosts = [h.strip() for group in args.allowed_hosts for h in group.split(",") if h.strip()]
    return access.AccessPolicy(
        api_keys=tuple(dict.fromkeys(key for _, key in keys)),
        admin_keys=tuple(dict.fromkeys(key for _, key in admin)),
        allowed_origins=tuple(origins),
        allowed_hosts=access.normalise_allowed_hosts(hosts),
    )


def _keys(flags: Sequence[str], env: str, path: Path | None, flag: str) -> list[tuple[str, str]]:
    """One kind of key (API or admin) from its flags, its environment variable and its
    file, each with where it came from for messages: ``--api-key 2``, ``$ENV``,
    ``--api-key-file PATH line 3``."""
    keys = [(f"{flag} {n}", key.strip()) for n, key in enumerate(flags, 1)]
    if os.environ.get(env, "").strip():
        keys.append((f"${env}", os.environ[env].strip()))
    if path is not None:
        keys += read_key_file(path, f"{flag}-file")
    return keys


def read_key_file(path: Path, flag: str = "--api-key-file") -> list[tuple[str, str]]:
    """The keys in a key file, one a line, each with its line for messages. Blank lines
    and comments are skipped, indented ones too (``   #old-revoked-key`` is a revoked key
    commented out, not a key). Raises ``ValueError`` if it cannot be read or holds none."""
    try:
        lines = path.read_text().splitlines()
    except OSError as exc:
        raise ValueError(f"{flag}: {exc.strerror}: {path}") from None
    keys = [
        (f"{flag} {path} line {n}", line.strip())
        for n, line in enumerate(lines, 1)
        if line.strip() and not line.strip().startswith("#")
    ]
    if not keys:
        raise ValueError(f"{flag}: no key in {path}")
    return keys


def image_url_config(args: argparse.Namespace) -> image_fetch.ImageFetchConfig:
    """What ``--allow-image-urls`` and its limits ask for; raises ``ValueError`` on an
    entry that is not a bare host name or address, with an optional ``:PORT`` (see
    `image_fetch.allowed_authority`: a scheme, path or wildcard would never match a
    URL, and the operator would wonder why nothing is fetched)."""
    hosts: list[str] = []
    for entry in args.image_url_hosts:
        for host in filter(None, (part.strip() for part in entry.split(","))):
            try:
                hosts.append(image_fetch.allowed_authority(host))
            except ValueError as exc:
                raise ValueError(f"--allow-image-urls: {exc}") from None
    return image_fetch.ImageFetchConfig(
        allowed_hosts=frozenset(hosts),
        max_bytes=args.image_url_max_bytes,
        timeout=args.image_url_timeout,
        max_redirects=args.image_url_max_redirects,
    )


def tls_context(args: argparse.Namespace) -> ssl.SSLContext | None:
    if args.ssl_certfile is None:
        if args.ssl_keyfile is not None:
            raise ValueError("--ssl-keyfile needs --ssl-certfile")
        return None
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    try:
        context.load_cert_chain(args.ssl_certfile, args.ssl_keyfile)
    except (OSError, ssl.SSLError) as exc:
        raise ValueError(f"--ssl-certfile/--ssl-keyfile: cannot load: {exc}") from None
    return context


def run_serve(args: argparse.Namespace) -> int:
    # Not at the top: only serve loads the server and the engines (the module docstring).
    from trio_vstream.engines import EngineConfigError, load_engine
    from trio_vstream.outputs.watch import WatchConfig
    from trio_vstream.server.app import ServerConfig
    from trio_vstream.session.session import SessionConfig

    logging.basicConfig(
        level=args.log_level, format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    logsafe.escape_on_handlers(logging.getLogger().handlers)  # libraries' records too
    try:
        policy = access_policy(args)
        context = tls_context(args)
        image_urls = image_url_config(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    memory.tune_allocator()  # before the engine starts any threads
    try:
        engine = load_engine(args.engine, dict(args.engine_args), device=args.device)
    except EngineConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    limits = protocol.Limits(
        max_width=args.max_width,
        max_height=args.max_height,
        max_num_frames=args.max_num_frames,
        max_total_pixels=args.max_total_pixels,
        max_start_bytes=args.max_start_bytes,
        max_control_bytes=args.max_control_bytes,
    )
    config = ServerConfig(
        host=args.host,
        port=args.port,
        max_sessions=args.max_sessions,
        max_connections=args.max_connections,
        max_connections_per_ip=args.max_connections_per_ip,
        head_timeout=args.head_timeout,
        encode_concurrency=args.encode_concurrency,
        shutdown_grace=args.shutdown_grace,
        max_stuck_calls=args.max_stuck_calls,
        exit_when_wedged=exit_when_wedged(args.exit_when_wedged),
        access=policy,
        ssl_context=context,
        watch=WatchConfig(max_viewers=args.max_viewers, requires_key=args.watch_requires_key),
        session=SessionConfig(
            start_timeout=args.start_timeout,
            stall_timeout=args.stall_timeout,
            limits=limits,
            served_model=args.model or engine.name,
            image_urls=image_urls,
        ),
    )
    try:
        recorder = _recorder(args, engine, config)
    except OSError as exc:
        print(f"error: --record {args.record}: {exc.strerror or exc}", file=sys.stderr)
        engine.close()
        return 2
    # Everything loaded so far lives as long as the process: keep the garbage
    # collector from walking it again and again (a full pass stalls the event loop).
    gc.collect()
    gc.freeze()
    if config.exit_when_wedged:
        logger.info(
            "a wedged engine drains the server, which then exits with status 69 for a restart%s",
            "" if args.exit_when_wedged else " (on under systemd or Kubernetes)",
        )
    last_resort = LastResort()
    try:
        status = trio.run(_serve_until_signalled, engine, config, recorder, last_resort)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        with signals_noted_while_exiting():
            # The last sessions' recordings, remuxed and written; a disk stuck for longer
            # than this would otherwise keep the process from ever exiting, and after a
            # signal, the hard deadline comes first (a second left for the engine).
            timeout = last_resort.allow(RECORDING_CLOSE_TIMEOUT)
            if recorder is not None and not recorder.close(timeout=timeout):
                logger.warning(
                    "recordings still being written after %g s: left unfinished", timeout
                )
            # May block on a wedged device: the last resort, armed by the stop, ends it.
            engine.close()
    # Armed by a signal or a wedge, it stays armed through the interpreter's exit (which
    # joins the engine's non-daemon threads); an in-process caller gets it disarmed.
    if not getattr(args, "whole_process", False):
        last_resort.disarm()
    return status


@contextlib.contextmanager
def signals_noted_while_exiting() -> Iterator[None]:
    """While the server, already stopped, finishes its recordings and frees the engine,
    a SIGINT or SIGTERM is logged and changes nothing.

    Trio puts back the default handlers when its run ends, so without this a signal in
    that window (an operator's second Ctrl-C, a supervisor's SIGTERM after the drain)
    would end the process with -15, or raise KeyboardInterrupt in the middle of freeing
    the engine, instead of the documented status 0. Both steps are bounded already
    (`RECORDING_CLOSE_TIMEOUT`, the engine's own close).
    """

    def note(signum: int, frame: object) -> None:
        logger.warning("%s: already stopping", signal.Signals(signum).name)

    previous = {signum: signal.signal(signum, note) for signum in _STOP_SIGNALS}
    try:
        yield
    finally:
        for signum, handler in previous.items():
            signal.signal(signum, handler)


def _recorder(args: argparse.Namespace, engine: Engine, config: ServerConfig) -> Recorder | None:
    """The ``--record`` recorder (None without it); raises ``OSError`` when the directory
    cannot be made."""
    # Not at the top: only serve loads the engines and the recorder (the module docstring).
    from trio_vstream.engines.interfaces import supports_device
    from trio_vstream.outputs.recording import Recorder

    if args.record is None:
        return None
    device = engine.device if supports_device(engine) else None
    recorder = Recorder(
        args.record,
        engine=engine.name,
        model=config.session.served_model or engine.name,
        device=None if device is None else str(device),
        max_bytes=args.record_max_bytes,
    )
    if recorder.max_bytes is None:
        free = shutil.disk_usage(recorder.directory).free
        recorder.max_bytes = recorder.used + int(free * RECORD_FREE_SPACE_SHARE)
    logger.info(
        "recording every session in %s: recordings may take %d bytes (%s), %d taken now",
        recorder.directory,
        recorder.max_bytes,
        "--record-max-bytes" if args.record_max_bytes is not None else "90% of the free space",
        recorder.used,
    )
    if recorder.used >= recorder.max_bytes:
        logger.warning(
            "%s holds as much as the recordings may take: sessions are not recorded",
            recorder.directory,
        )
    return recorder


def _log_hosts(config: ServerConfig) -> None:
    """Say which Host names are served; on a non-loopback bind without --allowed-hosts, say
    that clients reaching the server by a DNS name (through a proxy, say) need it."""
    hosts = config.access.allowed_hosts
    if hosts:
        logger.info("Host names served besides local ones: %s", ", ".join(hosts))
    elif not access.is_loopback(config.host):
        logger.warning(
            "serving %s: requests must name this server by an IP address or localhost; "
            "a client or proxy that uses a DNS name gets HTTP 421 until the name is given "
            "with --allowed-hosts NAME",
            config.host or "every address",
        )


def exit_when_wedged(flag: bool | None) -> bool:
    """``--exit-when-wedged``: as given, else on under a supervisor (`SUPERVISOR_ENV`)."""
    if flag is not None:
        return flag
    return any(os.environ.get(name) for name in SUPERVISOR_ENV)


async def _serve_until_signalled(
    engine: Engine,
    config: ServerConfig,
    recorder: Recorder | None = None,
    last_resort: LastResort | None = None,
) -> int:
    """Serve; the first SIGINT/SIGTERM shuts down gracefully, a second one at once.
    Returns the exit status (`VideoServer.exit_status`).

    Once a shutdown begins (a signal, or a wedged engine with ``--exit-when-wedged``),
    ``last_resort`` ends the process if it has not exited by the drain's bound plus a
    margin; after a second signal, within a few seconds.
    """
    # Not at the top: only serve loads the server (the module docstring).
    from trio_vstream.server.app import VideoServer

    server = VideoServer(engine, config, taps=recorder)
    if last_resort is None:
        last_resort = LastResort()
    last_resort.stuck = server.abandoned_calls.names
    with trio.open_signal_receiver(*_STOP_SIGNALS) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[VideoServer]) -> None:
                await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # graceful shutdown done: stop watching signals

            async def arm_when_stopping() -> None:
                await server.wait_shutdown_requested()
                last_resort.arm(
                    server.drain_bound + LAST_RESORT_MARGIN,
                    status=server.exit_status or LAST_RESORT_STATUS,
                    why="draining",
                )

            await nursery.start(serve)
            nursery.start_soon(arm_when_stopping)
            print(f"trio_vstream serving {server.url} (engine: {engine.name})", flush=True)
            if config.access.needs_key:
                logger.info("API keys required: %d configured", len(config.access.api_keys))
            if config.access.admin_keys:
                logger.info(
                    "admin keys for /stats and /metrics: %d configured",
                    len(config.access.admin_keys),
                )
            _log_hosts(config)
            if config.session.image_urls.enabled:
                logger.info(
                    "image_reference URLs fetched from: %s",
                    ", ".join(sorted(config.session.image_urls.allowed_hosts)),
                )
            async for signum in signals:
                if server.shutting_down:
                    logger.warning("%s again: stopping now", signal.Signals(signum).name)
                    last_resort.arm(
                        SECOND_SIGNAL_SECONDS,
                        status=server.exit_status or LAST_RESORT_STATUS,
                        why="stopping now",
                    )
                    nursery.cancel_scope.cancel()
                else:
                    logger.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    server.shutdown()
    # Engine calls the stop left mid-step (a second signal does not wait for them) still
    # run in their threads: the engine is not closed, nor the interpreter torn down, under
    # a running step, which kills the process (libtorch's threads: "terminate called
    # without an active exception", SIGABRT). A healthy step returns well within this;
    # a hung one is waited for no longer, and the last resort ends the process.
    with trio.move_on_after(last_resort.allow(config.session.close_timeout)):
        await server.abandoned_calls.wait_left_at_stop()
    return server.exit_status
