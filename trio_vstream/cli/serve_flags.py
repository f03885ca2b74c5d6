"""``serve``'s flags: each one's name, type, default and help, in one parser.

The defaults are read from the values they fill (`ServerConfig`, `SessionConfig`,
`protocol.Limits`, the watch links' and image URLs' configurations), so that ``--help``
says what an unflagged server does. What the parsed flags become is ``serve_config``'s
and ``serve``'s. The server's modules are imported inside `add_serve_arguments`: only
``serve`` loads them (see ``trio_vstream.cli``).
"""

from __future__ import annotations

import argparse
import math
import re
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypeVar

from trio_vstream import protocol
from trio_vstream.cli.serve_config import ADMIN_API_KEY_ENV, API_KEY_ENV
from trio_vstream.media import image_fetch
from trio_vstream.server import access, connections

if TYPE_CHECKING:
    pass

__all__ = ["DEFAULT_ENGINE", "add_serve_arguments"]

DEFAULT_ENGINE = "shapes"


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


_T = TypeVar("_T")


def _checked(parse: Callable[[str], _T]) -> Callable[[str], _T]:
    """``parse``, whose ValueError argparse shows as the message it carries."""

    def checked(text: str) -> _T:
        try:
            return parse(text)
        except ValueError as exc:
            raise argparse.ArgumentTypeError(str(exc)) from None

    checked.__name__ = parse.__name__
    return checked


def _seconds(*, zero: bool) -> Callable[[str], float]:
    """A finite number of seconds: above 0, or from 0 with ``zero``."""

    def parse(text: str) -> float:
        try:
            value = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected seconds, got {text!r}") from None
        if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
            raise argparse.ArgumentTypeError(f"must be {'>=' if zero else '>'} 0, got {text}")
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


def add_serve_arguments(parser: argparse.ArgumentParser) -> None:
    # Not at the top: only serve loads the server and the engines (see trio_vstream.cli).
    from trio_vstream.engines import BUILTIN_ENGINES
    from trio_vstream.outputs.hls import HlsSettings
    from trio_vstream.outputs.watch import WatchConfig
    from trio_vstream.server import fleet
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
        "--close-timeout",
        type=_positive(float),
        default=session.close_timeout,
        help="seconds a session's last message and close may take, and a stopped "
        "engine call to return, before the session is left (default %(default)s)",
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
    hls = HlsSettings()
    parser.add_argument(
        "--no-hls",
        dest="hls",
        action="store_false",
        help="no LL-HLS playlist beside each watch link (video.start's hls_path)",
    )
    parser.add_argument(
        "--hls-segment-seconds",
        type=_seconds(zero=False),
        default=hls.segment_seconds,
        metavar="SECONDS",
        help="the LL-HLS playlists' longest segment, of whole chunks (default %(default)s)",
    )
    parser.add_argument(
        "--hls-linger",
        type=_seconds(zero=True),
        default=hls.linger,
        metavar="SECONDS",
        help="how long a playlist stays after its session ended, then 404 (default %(default)s)",
    )
    parser.add_argument(
        "--hls-part-seconds",
        type=_seconds(zero=False),
        default=watching.hls_part_seconds,
        metavar="SECONDS",
        help="the longest chunk a playlist takes as one part, for an engine that does not say "
        "(default %(default)s; the built-in engines say)",
    )
    parser.add_argument(
        "--node-name",
        type=_checked(fleet.node_name),
        default=None,
        metavar="NAME",
        help="this server's name in a fleet behind one balancer (a DNS label, such as a pod's "
        "name): its watch links carry it, and other servers relay their viewers here",
    )
    parser.add_argument(
        "--peer",
        dest="peers",
        type=_checked(fleet.peer_address),
        action="append",
        default=[],
        metavar="NAME=HOST:PORT",
        help="another server of the fleet, by its --node-name (repeatable): viewers of its "
        "watch links that reach this server are relayed to it",
    )
    parser.add_argument(
        "--peer-domain",
        default=None,
        metavar="DOMAIN",
        help="any other node NAME is at NAME.DOMAIN on this server's --port (a headless "
        "Service in Kubernetes: SERVICE.NAMESPACE.svc.cluster.local)",
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
