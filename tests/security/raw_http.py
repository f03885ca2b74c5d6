"""Raw HTTP/1.1 requests for the attack tests: every header as the attacker writes it.

Clients such as trio-websocket's or a browser derive ``Host`` and ``Origin`` from the URL
they are given; an attacker's request (a DNS-rebound page, a script with a socket) does
not, so the tests write the request head byte by byte.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs
import trio

UPGRADE_HEADERS = (
    ("Upgrade", "websocket"),
    ("Connection", "Upgrade"),
    ("Sec-WebSocket-Version", "13"),
    ("Sec-WebSocket-Key", "dGhlIHNhbXBsZSBub25jZQ=="),
)
"""What makes a GET a WebSocket upgrade (RFC 6455's sample key)."""


@attrs.frozen
class Response:
    status: int
    headers: dict[str, str]
    """Lower-case names; a repeated header keeps its last value."""
    body: bytes

    def header_names(self) -> list[str]:
        return list(self.headers)


async def request(
    port: int,
    path: str,
    headers: Sequence[tuple[str, str]],
    *,
    method: str = "GET",
    version: str = "HTTP/1.1",
) -> Response:
    """Send one request head exactly as given (no Host is added) and read the response:
    all of it for a plain request, the head only for an upgrade the server accepted (101),
    after which the connection is closed."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    lines = "".join(f"{name}: {value}\r\n" for name, value in headers)
    data = b""
    async with stream:
        await stream.send_all(f"{method} {path} {version}\r\n{lines}\r\n".encode("latin-1"))
        with trio.fail_after(30):
            while chunk := await stream.receive_some(65536):
                data += chunk
                if data.startswith(b"HTTP/1.1 101 ") and b"\r\n\r\n" in data:
                    break
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    fields: dict[str, str] = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        fields[name.strip().lower()] = value.strip()
    return Response(int(status_line.split()[1]), fields, body)


async def upgrade(
    port: int, headers: Sequence[tuple[str, str]], path: str = "/v1/realtime/video"
) -> Response:
    """A WebSocket upgrade with ``headers`` (Host and Origin among them, as the test
    wants them)."""
    return await request(port, path, [*headers, *UPGRADE_HEADERS])
