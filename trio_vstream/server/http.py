"""The plain-HTTP side of the port: the player page, health, models, stats, metrics and
recordings.

trio-websocket's own listener answers every non-WebSocket request with a bare
400, so a load balancer's health check or a benchmark's metrics probe could
not share the port. Instead the server reads each connection's request head
itself, answers plain GETs with h11, and hands WebSocket upgrades to
trio-websocket together with the bytes it already read (``ReplayStream``).
"""

from __future__ import annotations

import base64
import binascii
import importlib.resources
import json
import re
from collections.abc import Mapping
from typing import Any

import attrs
import h11
import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, WebSocketRequest

from trio_vstream import protocol

MAX_HEAD_BYTES = 64 * 1024
"""A request head larger than this is refused (431) rather than buffered."""


LINGER_SECONDS = 1.0
"""How long a closing WebSocket connection reads on after its last write (see below)."""


CONTENT_SECURITY_POLICY = "; ".join(
    (
        "default-src 'none'",
        # The page is its own files: no inline script or style, no eval.
        "script-src 'self'",
        "style-src 'self'",
        # The favicon is "data:," (a saved video's blob: link is a download, not an image).
        "img-src 'self' data:",
        # The video plays from a MediaSource, whose URL is a blob: URL.
        "media-src 'self' blob:",
        # fetch("/v1/models") and the WebSocket, to the page's own host only ('self'
        # matches ws: and wss: on it in CSP Level 3 browsers).
        "connect-src 'self'",
        "frame-ancestors 'none'",
        "base-uri 'none'",
        "form-action 'none'",
    )
)
"""The player page needs nothing beyond its own origin: a script injected into it could
neither load more code nor send what it reads anywhere else, and no other site frames it."""

SECURITY_HEADERS: Mapping[str, str] = {
    "content-security-policy": CONTENT_SECURITY_POLICY,
    "x-content-type-options": "nosniff",
    # frame-ancestors' older spelling, for browsers without CSP Level 2.
    "x-frame-options": "DENY",
    # The page's URL may carry a watch link's token (?watch=...): never pass it on.
    "referrer-policy": "no-referrer",
}
"""On every plain-HTTP response: JSON and text are never sniffed into HTML, nothing of this
server is framed (clickjacking the Start button), and no URL leaks in a Referer."""


class ReplayStream(trio.abc.Stream):
    """A stream that first gives back bytes already read from it, and closes lingering.

    A lingering close (as web servers do): when trio-websocket closes the
    connection, the write side is shut first and what the client still sends
    is read and dropped until it closes too, for at most ``LINGER_SECONDS``.
    Closing with unread bytes would make the kernel answer with a reset, and a
    client still writing (an oversized message the server refused with close
    code 1009) would lose the close frame and see 1006 instead.

    Two tasks use the stream at its close, and they must not collide on the
    socket: trio-websocket's reader closes it as soon as the client's Close
    frame arrives, while the session's ``aclose()`` may be about to send its own
    Close frame (it took its turn before the client's frame was read). Trio
    raises ``BusyResourceError`` at whichever of ``send_all`` and ``send_eof``
    comes second, and trio-websocket lets that escape from ``aclose()``: a
    routine stop-then-close logged a traceback. So, as Trio's own streams do
    with ``aclose``: from the moment a close begins, a send or a receive by
    another task fails with ``ClosedResourceError`` (which trio-websocket takes
    for a closed connection), the shutdown of the write side waits for a send
    under way to finish (never cutting a frame), and a second ``aclose`` waits
    for the first one's linger instead of racing it. A receive under way when the close
    begins (trio-websocket's reader, which goes on reading after it sent 1009) is let
    finish before the linger reads: the socket allows one reader at a time.
    """

    def __init__(self, stream: trio.abc.Stream, prefix: bytes) -> None:
        self._stream = stream
        self._prefix = prefix
        self._send_lock = trio.Lock()
        self._closing = False
        self._closed = trio.Event()
        self._receive_done: trio.Event | None = None

    async def receive_some(self, max_bytes: int | None = None) -> bytes | bytearray:
        if self._closing:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("the connection is being closed")
        if self._prefix:
            size = len(self._prefix) if max_bytes is None else max_bytes
            data, self._prefix = self._prefix[:size], self._prefix[size:]
            await trio.lowlevel.checkpoint()
            return data
        done = self._receive_done = trio.Event()
        try:
            return await self._stream.receive_some(max_bytes)
        finally:
            self._receive_done = None
            done.set()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if self._closing:
            await trio.lowlevel.checkpoint()
            raise trio.ClosedResourceError("the connection is being closed")
        async with self._send_lock:
            await self._stream.send_all(data)

    async def wait_send_all_might_not_block(self) -> None:
        await self._stream.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        if self._closing:  # another task is closing: its linger is bounded
            await self._closed.wait()
            return
        self._closing = True
        stream = self._stream
        try:
            if isinstance(stream, trio.abc.HalfCloseableStream):
                with trio.move_on_after(LINGER_SECONDS):
                    async with self._send_lock:  # a frame being written is finished first
                        await stream.send_eof()
                    # A receive under way (trio-websocket's reader, after it sent 1009)
                    # gets what comes next; only then can this one read. Reading at
                    # once would be refused (BusyResourceError), and closing instead
                    # would reset the connection and lose the Close frame.
                    if (receiving := self._receive_done) is not None:
                        await receiving.wait()
                    while await stream.receive_some(65536):
                        pass
        except (trio.BrokenResourceError, trio.ClosedResourceError, trio.BusyResourceError):
            pass  # gone already, or another task is still reading: just close
        finally:
            try:
                await stream.aclose()
            finally:
                self._closed.set()


class HeadTooLarge(Exception):
    pass


async def read_head(stream: trio.abc.Stream) -> bytes:
    """Read until the end of the request head; returns everything read (maybe more).

    Returns ``b""`` if the peer closed before sending a full head.
    """
    data = b""
    while b"\r\n\r\n" not in data:
        if len(data) > MAX_HEAD_BYTES:
            raise HeadTooLarge
        chunk = await stream.receive_some(4096)
        if not chunk:
            return b""
        data += chunk
    return data


def parse_head(data: bytes) -> h11.Request | None:
    """The request in a head, or None if it is not valid HTTP/1.1."""
    connection = h11.Connection(h11.SERVER)
    connection.receive_data(data)
    try:
        event = connection.next_event()
    except h11.RemoteProtocolError:
        return None
    return event if isinstance(event, h11.Request) else None


def is_websocket_upgrade(request: h11.Request) -> bool:
    headers = {name.lower(): value.lower() for name, value in request.headers}
    return request.method == b"GET" and b"websocket" in headers.get(b"upgrade", b"")


def handshake_problem(request: h11.Request) -> tuple[int, str, Mapping[str, str]] | None:
    """What is wrong with an upgrade's handshake (RFC 6455 4.2.1), as the status, body and
    headers to answer it with; None when trio-websocket can take it.

    Why here: a handshake wsproto refuses is answered by trio-websocket with a bare
    response, without `SECURITY_HEADERS`. Checked first, every refusal goes out through
    `respond`, and trio-websocket only ever sees handshakes it accepts. The checks are
    wsproto's, plus the key's form (base64 of 16 bytes), which wsproto leaves unchecked.
    """
    fields: dict[bytes, list[bytes]] = {}
    for name, value in request.headers:
        fields.setdefault(name.lower(), []).append(value)

    def one(name: bytes) -> bytes | None:
        values = fields.get(name, [])
        return values[0] if len(values) == 1 else None

    connection = b",".join(fields.get(b"connection", [])).lower()
    if b"upgrade" not in (token.strip() for token in connection.split(b",")):
        return 400, "a WebSocket upgrade needs 'Connection: Upgrade'\n", {}
    if (one(b"upgrade") or b"").strip().lower() != b"websocket":
        return 400, "a WebSocket upgrade needs 'Upgrade: websocket' alone\n", {}
    version = one(b"sec-websocket-version")
    if version is None or version.strip() != b"13":
        # 4.4: a version the server does not speak gets 426 and the one it does.
        status = 426 if version else 400
        return status, "only WebSocket version 13 is spoken here\n", {"sec-websocket-version": "13"}
    key = one(b"sec-websocket-key")
    try:
        raw = base64.b64decode(key.strip(), validate=True) if key else b""
    except binascii.Error:
        raw = b""
    if len(raw) != 16:
        return 400, "Sec-WebSocket-Key must be 16 bytes in base64\n", {}
    return None


async def reject_upgrade(
    request: WebSocketRequest,
    status: int,
    body: str | protocol.Error,
    *,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Refuse a handshake already handed to trio-websocket, with `SECURITY_HEADERS`.

    A `protocol.Error` goes as JSON, the very ``error`` message a session would have
    got, so that a client reads why by its code (``server_busy``), as it would in a
    session. (A browser's page sees neither the body nor the status.)
    """
    if isinstance(body, protocol.Error):
        payload, kind = body.to_json().encode() + b"\n", "application/json"
    else:
        payload, kind = body.encode(), "text/plain; charset=utf-8"
    fields = {**SECURITY_HEADERS, "content-type": kind, **(headers or {})}
    await request.reject(
        status,
        extra_headers=[(name.encode(), value.encode()) for name, value in fields.items()],
        body=payload,
    )


_STATIC_TYPES: Mapping[str, str] = {
    ".html": "text/html; charset=utf-8",
    ".js": "text/javascript; charset=utf-8",
    ".css": "text/css; charset=utf-8",
    ".svg": "image/svg+xml",
    ".png": "image/png",
    ".ico": "image/x-icon",
}
_STATIC_NAME = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9_.-]*")


def static_file(name: str) -> tuple[bytes, str] | None:
    """A file of the player page shipped in the package, and its content type.

    Only plain names in ``trio_vstream/static/`` (no folders, no dot files), so a
    request can never reach another file of the machine.
    """
    suffix = "." + name.rpartition(".")[2] if "." in name else ""
    if not _STATIC_NAME.fullmatch(name) or suffix not in _STATIC_TYPES:
        return None
    resource = importlib.resources.files("trio_vstream") / "static" / name
    try:
        return resource.read_bytes(), _STATIC_TYPES[suffix]
    except (FileNotFoundError, IsADirectoryError, NotADirectoryError):
        return None


@attrs.frozen
class Answer:
    """A plain-HTTP answer made away from the socket (`respond` sends it)."""

    status: int
    body: bytes | str
    content_type: str | None = None
    headers: Mapping[str, str] | None = None


async def respond(
    stream: trio.abc.Stream,
    status: int,
    body: bytes | str | Mapping[str, Any],
    *,
    content_type: str | None = None,
    headers: Mapping[str, str] | None = None,
) -> None:
    """Send one complete HTTP/1.1 response and close the connection."""
    if isinstance(body, Mapping):
        payload = (json.dumps(body, indent=2) + "\n").encode()
        kind = "application/json"
    else:
        payload = body.encode() if isinstance(body, str) else body
        kind = "text/plain; charset=utf-8"
    if content_type is not None:
        kind = content_type
    connection = h11.Connection(h11.SERVER)
    # h11 needs to have seen a request before it will serialise a response.
    connection.receive_data(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
    connection.next_event()
    fields = [(b"content-type", kind.encode())]
    # A 304 has no content, and its Content-Length would be the 200's (RFC 9110 8.6).
    if status != 304:
        fields.append((b"content-length", str(len(payload)).encode()))
    fields.append((b"connection", b"close"))
    # ``no-cache`` unless ``headers`` say otherwise (a recording's segments are immutable).
    given = {name.lower(): value for name, value in (headers or {}).items()}
    extra = {"cache-control": "no-cache", **SECURITY_HEADERS, **given}
    fields += [(name.encode(), value.encode()) for name, value in extra.items()]
    data = connection.send(h11.Response(status_code=status, headers=fields))
    if status != 304:
        data += connection.send(h11.Data(data=payload))
    data += connection.send(h11.EndOfMessage())
    try:
        await stream.send_all(data)
    finally:
        await stream.aclose()


async def refuse_websocket(
    ws: WebSocketConnection, refusal: protocol.Error, timeout: float
) -> None:
    """Send an accepted WebSocket its one error message and close it; a client that
    does not read holds the task ``timeout`` seconds at most."""
    with trio.move_on_after(timeout):
        try:
            await ws.send_message(refusal.to_json())
            await ws.aclose()
        except ConnectionClosed:
            pass
