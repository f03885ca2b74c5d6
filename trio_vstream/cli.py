"""Command line: ``python -m trio_vstream [serve] ...``, ``... client ...``, ``... watch ...``."""

from __future__ import annotations

import argparse
import contextlib
import gc
import ipaddress
import logging
import os
import re
import shutil
import signal
import ssl
import sys
from collections.abc import Sequence
from pathlib import Path

import trio

from trio_vstream import access, image_fetch, logsafe, memory, protocol
from trio_vstream.client import (
    add_client_arguments,
    add_replay_arguments,
    add_watch_arguments,
    run_client,
    run_replay,
    run_watch,
)
from trio_vstream.engines import BUILTIN_ENGINES, EngineConfigError, load_engine
from trio_vstream.engines.base import Engine
from trio_vstream.recording import Recorder
from trio_vstream.server import ServerConfig, VideoServer
from trio_vstream.session import SessionConfig
from trio_vstream.watch import WatchConfig

DEFAULT_ENGINE = "shapes"
API_KEY_ENV = "TRIO_VSTREAM_API_KEY"
_COMMANDS = ("serve", "client", "watch", "replay")
RECORDING_CLOSE_TIMEOUT = 120.0
"""Seconds the server waits at exit for ``--record``'s last recordings to be written."""
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


def _positive(kind: type[int] | type[float]):  # type: ignore[no-untyped-def]
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


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m trio_vstream",
        description="Stream generated video over WebSockets (/v1/realtime/video).",
    )
    commands = parser.add_subparsers(dest="command")
    serve = commands.add_parser("serve", help="run the server (the default command)")
    add_serve_arguments(serve)
    client = commands.add_parser(
        "client",
        help="stream a video from a server into an MP4 file",
        description="Connect to a /v1/realtime/video server, stream one video and write it "
        "as a progressive MP4 (exit status: 0 done, 1 server error, 2 usage, 3 connection, "
        "4 output not written, 130 interrupted).",
    )
    add_client_arguments(client)
    watch = commands.add_parser(
        "watch",
        help="watch a running session through its watch link, into an MP4 file",
        description="Connect to a session's watch link (video.start's watch_path), receive "
        "its video from the next keyframe chunk to the end, read-only, and write it as a "
        "progressive MP4 (exit status: 0 done, 1 server error such as watch_not_found or "
        "viewer_too_slow, 2 usage, 3 connection, 4 output not written, 130 interrupted).",
    )
    add_watch_arguments(watch)
    replay = commands.add_parser(
        "replay",
        help="repeat a recorded session (--record) against a server, and compare",
        description="Send a recording's request, seed and interactions (each before the "
        "generation chunk it started in) to a server, and check that the interactions start "
        "at the same chunks and the frames equal the recorded video's (exit status: 0 "
        "identical, 1 refused, 2 usage or unreadable recording, 3 connection, 4 output not "
        "written, 5 differs).",
    )
    add_replay_arguments(replay)
    return parser


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
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
        help="chunks encoded at once, server-wide (default %(default)s: cores - 1)",
    )
    parser.add_argument(
        "--shutdown-grace",
        type=_positive(float),
        default=defaults.shutdown_grace,
        help="on SIGTERM, seconds running sessions get to finish their videos while no new "
        "ones are admitted (default %(default)s)",
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
        "names; repeatable). Off by default: a server that fetches URLs its clients name can be "
        "made to reach internal services; non-public addresses are always refused",
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


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    if not args_list or args_list[0] not in (*_COMMANDS, "-h", "--help"):
        args_list.insert(0, "serve")
    args = build_parser().parse_args(args_list)
    if args.command is None:
        build_parser().print_help()
        return 0
    if args.command == "client":
        return run_client(args)
    if args.command == "watch":
        return run_watch(args)
    if args.command == "replay":
        return run_replay(args)
    return run_serve(args)


def access_policy(args: argparse.Namespace) -> access.AccessPolicy:
    """Keys from the flags, the key file and the environment; origins from the flags.
    Raises ``ValueError`` naming what is wrong (never the key itself)."""
    keys = [key.strip() for key in args.api_keys]
    if os.environ.get(API_KEY_ENV, "").strip():
        keys.append(os.environ[API_KEY_ENV].strip())
    if args.api_key_file is not None:
        try:
            lines = args.api_key_file.read_text().splitlines()
        except OSError as exc:
            raise ValueError(f"--api-key-file: {exc.strerror}: {args.api_key_file}") from None
        keys += [line.strip() for line in lines if line.strip() and not line.startswith("#")]
        if not any(line.strip() and not line.startswith("#") for line in lines):
            raise ValueError(f"--api-key-file: no key in {args.api_key_file}")
    if any(not key or any(c.isspace() for c in key) for key in keys):
        raise ValueError("--api-key: a key must be non-empty and without spaces")
    origins = [o.strip() for group in args.allowed_origins for o in group.split(",") if o.strip()]
    for origin in origins:
        if origin != "*" and access.normalise_origin(origin) is None:
            raise ValueError(
                f"--allowed-origins: {origin!r} is not an origin like https://example.org"
            )
    return access.AccessPolicy(api_keys=tuple(dict.fromkeys(keys)), allowed_origins=tuple(origins))


def image_url_config(args: argparse.Namespace) -> image_fetch.ImageFetchConfig:
    """What ``--allow-image-urls`` and its limits ask for; raises ``ValueError`` on a host
    that is not a bare name or address (a scheme, port, path or wildcard would never match
    a URL's host, and the operator would wonder why nothing is fetched)."""
    hosts: list[str] = []
    for entry in args.image_url_hosts:
        for host in filter(None, (part.strip() for part in entry.split(","))):
            with contextlib.suppress(ValueError):  # an IP address, brackets optional for v6
                hosts.append(str(ipaddress.ip_address(host.removeprefix("[").removesuffix("]"))))
                continue
            try:
                parsed = protocol.ImageURL.parse(f"https://{host}/")
            except ValueError:
                parsed = None
            if parsed is None or not re.fullmatch(r"[A-Za-z0-9._-]+", host):
                raise ValueError(
                    f"--allow-image-urls: {host!r} is not a host name like images.example.org"
                )
            hosts.append(parsed.host)
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
        encode_concurrency=args.encode_concurrency,
        shutdown_grace=args.shutdown_grace,
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
    try:
        trio.run(_serve_until_signalled, engine, config, recorder)
    except OSError as exc:
        print(f"error: cannot serve on {args.host}:{args.port}: {exc}", file=sys.stderr)
        return 1
    finally:
        # The last sessions' recordings, remuxed and written; a disk stuck for longer
        # than this would otherwise keep the process from ever exiting.
        if recorder is not None and not recorder.close(timeout=RECORDING_CLOSE_TIMEOUT):
            logger.warning(
                "recordings still being written after %g s: left unfinished",
                RECORDING_CLOSE_TIMEOUT,
            )
        engine.close()
    return 0


def _recorder(args: argparse.Namespace, engine: Engine, config: ServerConfig) -> Recorder | None:
    """The ``--record`` recorder (None without it); raises ``OSError`` when the directory
    cannot be made."""
    if args.record is None:
        return None
    device = getattr(engine, "device", None)
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


async def _serve_until_signalled(
    engine: Engine, config: ServerConfig, recorder: Recorder | None = None
) -> None:
    """Serve; the first SIGINT/SIGTERM shuts down gracefully, a second one at once."""
    server = VideoServer(engine, config, taps=recorder)
    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:

            async def serve(task_status: trio.TaskStatus[None]) -> None:
                await server.run(task_status=task_status)
                nursery.cancel_scope.cancel()  # graceful shutdown done: stop watching signals

            await nursery.start(serve)
            print(f"trio_vstream serving {server.url} (engine: {engine.name})", flush=True)
            if config.access.needs_key:
                logger.info("API keys required: %d configured", len(config.access.api_keys))
            if config.session.image_urls.enabled:
                logger.info(
                    "image_reference URLs fetched from: %s",
                    ", ".join(sorted(config.session.image_urls.allowed_hosts)),
                )
            async for signum in signals:
                if server.shutting_down:
                    logger.warning("%s again: stopping now", signal.Signals(signum).name)
                    nursery.cancel_scope.cancel()
                else:
                    logger.info("%s: shutting down gracefully", signal.Signals(signum).name)
                    server.shutdown()
