"""``python -m trio_vstream watch``: the command line around `watch_video`.

A viewer of a watch link sends nothing and steers nothing, so this is the client's
command line less the request and the interactions: where to connect (a full link, the
player page's share link, or a bare ``watch_path`` put on ``--url``'s server), then the
same output files, summary, ``--json`` and exit statuses as ``client`` (`_cli._finish`),
so scripts read both the same way. A refused link (``watch_not_found``,
``server_busy``) is one error line and status 1, like a refused ``session.start``.
"""

from __future__ import annotations

import argparse
import functools
import sys
from pathlib import Path
from typing import TextIO
from urllib.parse import parse_qs, urlsplit, urlunsplit

import trio

from trio_vstream.client._cli import (
    EXIT_USAGE,
    _Progress,
    _Run,
    _run_streaming,
    _stream_to_end,
)
from trio_vstream.client._flags import (
    API_KEY_ENV,
    DEFAULT_URL,
    _api_key,
    _check_outputs,
    _check_url,
    _UsageError,
)
from trio_vstream.client._stream import watch_video

__all__ = ["add_watch_arguments", "run_watch", "watch_link_url"]

#: The player page's share links carry the watch path in this query parameter.
_PAGE_PARAMETER = "watch"


def watch_link_url(link: str, base_url: str = DEFAULT_URL) -> str:
    """The ``ws(s)://`` address of a watch link given the way people pass links around.

    Taken: a full ``ws://`` or ``wss://`` URL (as is); the player page's share link,
    ``http(s)://HOST/?watch=PATH`` (what the page's Copy link button gives, so it can be
    pasted here too; https becomes wss); or a bare path like ``video.start``'s
    ``watch_path``, put on ``base_url``'s scheme and host. Raises `ValueError` otherwise,
    naming what was expected.
    """
    parts = urlsplit(link)
    if parts.scheme in ("ws", "wss"):
        if not parts.hostname:
            raise ValueError(f"no host in {link!r}")
        return link
    if parts.scheme in ("http", "https"):
        paths = parse_qs(parts.query).get(_PAGE_PARAMETER, [])
        if not parts.hostname or len(paths) != 1 or not _is_path(paths[0]):
            raise ValueError(
                f"{link!r} is not a share link of the player page (no ?{_PAGE_PARAMETER}=PATH)"
            )
        scheme = "wss" if parts.scheme == "https" else "ws"
        return urlunsplit((scheme, parts.netloc, paths[0], "", ""))
    if not parts.scheme and _is_path(link):
        base = urlsplit(base_url)
        return urlunsplit((base.scheme, base.netloc, parts.path, parts.query, ""))
    raise ValueError(
        f"expected a ws:// or wss:// URL, a share link, or a path like "
        f"/v1/realtime/video/watch/TOKEN; got {link!r}"
    )


def _is_path(text: str) -> bool:
    """An absolute path on the same server (``//host/x`` would name another server)."""
    return text.startswith("/") and not text.startswith("//")


def add_watch_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``watch`` subcommand's flags; kept here so trio_vstream.cli only wires it in."""
    parser.add_argument(
        "link",
        metavar="URL_OR_PATH",
        help="the watch link: ws(s)://HOST/v1/realtime/video/watch/TOKEN, the player "
        "page's share link, or the path alone (on --url's server)",
    )
    parser.add_argument(
        "-o", "--output", type=Path, metavar="FILE", help="write a progressive MP4 here"
    )
    parser.add_argument(
        "--raw",
        type=Path,
        metavar="FILE",
        help="write the fragmented MP4 bytes exactly as received",
    )
    parser.add_argument(
        "--url",
        default=DEFAULT_URL,
        metavar="URL",
        help="the server a bare path is on (default %(default)s)",
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"send 'Authorization: Bearer KEY', for servers started with "
        f"--watch-requires-key (default: ${API_KEY_ENV})",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--connect-timeout",
        type=float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for the connection (default %(default)s)",
    )


async def _watch_async(
    url: str, api_key: str | None, timeout: float, progress: _Progress, run: _Run
) -> None:
    abort_event = trio.Event()

    def leave(signum: int) -> None:
        abort_event.set()  # a viewer cannot stop the session, only leave: what arrived is kept

    await _stream_to_end(
        run,
        progress,
        leave,
        lambda: watch_video(
            url,
            on_chunk=progress.update,
            on_message=progress.update,
            abort_event=abort_event,
            connect_timeout=timeout,
            api_key=api_key,
        ),
    )


def run_watch(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """The ``watch`` subcommand; returns the exit status (the client's table)."""
    out = stdout or sys.stdout
    err = sys.stderr
    try:
        _check_outputs(args)
        _check_url(args.url)
        try:
            url = watch_link_url(args.link, args.url)
        except ValueError as exc:
            raise _UsageError(str(exc)) from None
        api_key = _api_key(args)
    except _UsageError as exc:
        print(f"python -m trio_vstream watch: error: {exc}", file=err)
        return EXIT_USAGE
    main = functools.partial(_watch_async, url, api_key, args.connect_timeout)
    return _run_streaming(args, main, out, err)
