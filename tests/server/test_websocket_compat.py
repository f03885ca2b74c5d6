"""A client's ping that crosses the server's Close frame (trio-websocket issue #184).

The client is raw wsproto over an in-memory stream, so the test decides exactly
when each frame goes out: the client encodes a Ping while the connection is
open, holds it back, and writes it only after the server's Close has arrived,
just before its own Close reply. The server is therefore in ``LOCAL_CLOSING``
when the ping reaches it, every run. Each test runs twice: "patched" checks
the workaround; "unpatched" checks that the bug is real, so the first variant
can fail.
"""

from __future__ import annotations

import json
import logging
from collections import deque
from collections.abc import Iterator

import pytest
import trio
import trio.testing
from trio_websocket import WebSocketConnection, wrap_server_stream
from wsproto import ConnectionType, WSConnection
from wsproto.connection import ConnectionState
from wsproto.events import (
    AcceptConnection,
    CloseConnection,
    Event,
    Ping,
    Request,
    TextMessage,
)
from wsproto.utilities import LocalProtocolError

from trio_vstream.engines.synthetic import SyntheticEngine
from trio_vstream.server._websocket_compat import (
    has_ping_during_close_bug,
    patch_ping_during_close,
)
from trio_vstream.server.app import VIDEO_PATH, ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

DEADLOCK_GUARD = 60.0
"""Virtual seconds (autojump clock): a hang fails at once, not at pytest's timeout."""

BUG_MESSAGE = r"Pong.*cannot be sent in state ConnectionState\.LOCAL_CLOSING"


def handler_variant(
    variant: str, handler_name: str, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    """Run with the workaround in place, or with trio-websocket's own ``handler_name``."""
    if variant == "patched":
        undo = patch_ping_during_close()
        yield "patched"
        undo()
        return
    if not has_ping_during_close_bug():
        pytest.skip("this trio-websocket release is not affected")
    # Whoever patched (the server at import, another test), the original is __wrapped__;
    # monkeypatch puts back exactly what was there.
    handler = getattr(WebSocketConnection, handler_name)
    monkeypatch.setattr(WebSocketConnection, handler_name, getattr(handler, "__wrapped__", handler))
    yield "unpatched"


@pytest.fixture(params=["patched", "unpatched"])
def ping_handling(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    yield from handler_variant(request.param, "_handle_ping_event", monkeypatch)


@pytest.fixture(params=["patched", "unpatched"])
def message_handling(
    request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch
) -> Iterator[str]:
    yield from handler_variant(request.param, "_handle_message_event", monkeypatch)


class RawClient:
    """A WebSocket client on raw wsproto: every frame goes out when the test says."""

    def __init__(self, stream: trio.abc.Stream) -> None:
        self.stream = stream
        self.ws = WSConnection(ConnectionType.CLIENT)
        self._pending: deque[Event] = deque()

    async def send(self, event: Event) -> None:
        await self.stream.send_all(self.ws.send(event))

    async def next_event(self) -> Event:
        while not self._pending:
            data = await self.stream.receive_some()
            assert data, "the server closed the stream before the expected event"
            self.ws.receive_data(data)
            self._pending.extend(self.ws.events())
        return self._pending.popleft()

    async def open(self, target: str) -> None:
        await self.send(Request(host="localhost", target=target))
        assert isinstance(await self.next_event(), AcceptConnection)

    async def cross_close_with_ping(self) -> CloseConnection:
        """Receive the server's Close with a ping in flight, reply, then read to EOF.

        Returns the server's Close. What the server sends after it (a Pong
        would be a protocol violation) fails the test.
        """
        ping = self.ws.send(Ping(b"crossing"))  # encoded while open, written later
        while not isinstance(event := await self.next_event(), CloseConnection):
            pass
        assert not self._pending
        await self.stream.send_all(ping)
        await self.send(event.response())
        assert self.ws.state is ConnectionState.CLOSED
        assert await self.stream.receive_some() == b"", "the server sent frames after its Close"
        return event


async def test_ping_crossing_close_is_not_answered(
    ping_handling: str, autojump_clock: trio.testing.MockClock
) -> None:
    """trio-websocket alone: the server closes, the client's ping crosses the Close."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = RawClient(client_stream)
    server_closed: list[WebSocketConnection] = []

    async def serve_and_close(nursery: trio.Nursery) -> None:
        request = await wrap_server_stream(nursery, server_stream)
        ws = await request.accept()
        await ws.aclose()
        server_closed.append(ws)

    async def run() -> CloseConnection:
        with trio.fail_after(DEADLOCK_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_and_close, nursery)
                await client.open("/")
                return await client.cross_close_with_ping()

    if ping_handling == "unpatched":
        # The bug: the reader task answers the ping in LOCAL_CLOSING, wsproto refuses,
        # and the exception tears down the connection's nursery mid-handshake.
        with pytest.RaisesGroup(pytest.RaisesExc(LocalProtocolError, match=BUG_MESSAGE)):
            await run()
        assert server_closed == []  # aclose() never finished
        return

    close = await run()  # nothing escapes the server's tasks
    assert close.code == 1000
    [ws] = server_closed  # aclose() completed
    assert ws.closed is not None
    assert ws.closed.code == 1000


async def test_server_start_timeout_close_survives_client_ping(
    ping_handling: str,
    autojump_clock: trio.testing.MockClock,
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The real server path: a client that pings while the server closes for start_timeout."""
    server = VideoServer(SyntheticEngine(), ServerConfig(session=SessionConfig(start_timeout=2.0)))
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = RawClient(client_stream)
    caplog.set_level(logging.ERROR, logger="trio_vstream.server.routing")

    async def client_side() -> tuple[list[Event], CloseConnection | None]:
        await client.open(VIDEO_PATH)
        ping = client.ws.send(Ping(b"keepalive"))  # in flight when the server closes
        received: list[Event] = []
        while not isinstance(event := await client.next_event(), CloseConnection):
            received.append(event)
        await client_stream.send_all(ping)
        try:
            await client.send(event.response())
        except trio.BrokenResourceError:  # unpatched: the server may be gone already
            return received, None
        return received, event

    with trio.fail_after(DEADLOCK_GUARD):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(server.router.handle, server_stream)
            received, close = await client_side()
            leftover = await client_stream.receive_some()

    assert all(isinstance(e, TextMessage) for e in received)
    assert [json.loads(e.data) for e in received if isinstance(e, TextMessage)] == [
        {"type": "error", "code": "start_timeout", "message": "Timeout waiting for session.start"}
    ]
    failures = [r for r in caplog.records if r.getMessage() == "connection handler failed"]
    if ping_handling == "unpatched":
        [failure] = failures
        assert failure.exc_info is not None
        group = failure.exc_info[1]
        assert isinstance(group, BaseExceptionGroup)
        assert group.subgroup(LocalProtocolError) is not None
        return

    assert close is not None
    assert close.code == 1000
    assert leftover == b"", "the server sent frames after its Close"
    assert failures == []
    assert [r for r in caplog.records if r.levelno >= logging.ERROR] == []


def test_version_gate() -> None:
    assert has_ping_during_close_bug("0.11.1")
    assert has_ping_during_close_bug("0.12.2")
    assert has_ping_during_close_bug("0.12.2.post1")
    assert has_ping_during_close_bug("0.12.2rc1")
    assert not has_ping_during_close_bug("0.12.3")
    assert not has_ping_during_close_bug("0.13.0")
    assert not has_ping_during_close_bug("1.0")


def test_patch_is_idempotent_and_reversible() -> None:
    if not has_ping_during_close_bug():
        pytest.skip("this trio-websocket release needs no patch")
    before = WebSocketConnection.__dict__["_handle_ping_event"]
    original = getattr(before, "__wrapped__", before)
    first = patch_ping_during_close()
    patched = WebSocketConnection.__dict__["_handle_ping_event"]
    assert patched is not original
    assert patched.__wrapped__ is original
    second = patch_ping_during_close()
    assert WebSocketConnection.__dict__["_handle_ping_event"] is patched  # not wrapped twice
    second()
    second()  # each undo counts once
    assert WebSocketConnection.__dict__["_handle_ping_event"] is patched
    first()
    # Back to what it was: the original, or still patched if the server patched at import.
    assert WebSocketConnection.__dict__["_handle_ping_event"] is before


async def test_an_oversized_message_crossing_close_is_dropped(
    message_handling: str, autojump_clock: trio.testing.MockClock
) -> None:
    """The server closes while the client's too-large message is on its way: no second
    Close (1009) is attempted, and the close handshake completes."""
    client_stream, server_stream = trio.testing.memory_stream_pair()
    client = RawClient(client_stream)
    server_closed: list[WebSocketConnection] = []

    async def serve_and_close(nursery: trio.Nursery) -> None:
        request = await wrap_server_stream(nursery, server_stream, max_message_size=16)
        ws = await request.accept()
        await ws.aclose()
        server_closed.append(ws)

    async def run() -> CloseConnection:
        with trio.fail_after(DEADLOCK_GUARD):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(serve_and_close, nursery)
                await client.open("/")
                oversized = client.ws.send(TextMessage("x" * 64))  # encoded while open
                while not isinstance(event := await client.next_event(), CloseConnection):
                    pass
                await client.stream.send_all(oversized)
                await client.send(event.response())
                assert await client.stream.receive_some() == b""
                return event

    if message_handling == "unpatched":
        with pytest.RaisesGroup(
            pytest.RaisesExc(LocalProtocolError, match=r"CloseConnection.*LOCAL_CLOSING")
        ):
            await run()
        return
    close = await run()
    assert close.code == 1000
    [ws] = server_closed
    assert ws.closed is not None and ws.closed.code == 1000
