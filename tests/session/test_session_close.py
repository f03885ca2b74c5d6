"""A stop-then-close is a routine end: never a ``BusyResourceError``, never a traceback.

Seen: 3 of 30 quick stop-then-close sessions logged a full traceback from
``ws.aclose()`` in ``Session._finish`` (issue 20, item 7). The cause: the session's
``aclose()`` decides to send its Close frame and waits for trio-websocket's send lock;
meanwhile the reader reads the client's Close, and closes the stream, whose
``send_eof`` is under way when the session's ``send_all`` comes: Trio raises
``BusyResourceError`` at the second of the two, and trio-websocket lets it escape.
Here the interleaving is forced at that very yield, with a stream that keeps Trio's
send contract, so the race is lost every time.
"""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import WebSocketConnection, wrap_client_stream, wrap_server_stream

from tests.session.test_session_edges import (
    START,
    ScriptedSocket,
    make_session,
    session_in_background,
)
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.server.http import ReplayStream
from trio_vstream.session.session import Outcome, SessionSummary

CLOSE_OPCODE = 0x88
"""First byte of a Close frame (FIN and opcode 8)."""


class ContractStream(trio.abc.HalfCloseableStream):
    """A stream that keeps `trio.abc.SendStream`'s contract (``BusyResourceError`` when a
    task sends or sends EOF while another does), as a socket does, and whose
    ``send_eof`` stays inside that section until every other task is blocked: what
    Trio's own ``send_eof`` does for one checkpoint, for as long as the test needs."""

    def __init__(self, inner: trio.abc.HalfCloseableStream, *, hold_eof: bool = True) -> None:
        self.inner = inner
        self.hold_eof = hold_eof
        self._sending = False
        self.eof_started = trio.Event()

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        with self._send_section():
            await self.inner.send_all(data)

    async def send_eof(self) -> None:
        with self._send_section():
            self.eof_started.set()
            if self.hold_eof:
                await trio.testing.wait_all_tasks_blocked()
            await self.inner.send_eof()

    def _send_section(self) -> Any:
        if self._sending:
            raise trio.BusyResourceError("another task is sending on this stream")
        stream = self

        class Section:
            def __enter__(self) -> None:
                stream._sending = True

            def __exit__(self, *exc: object) -> None:
                stream._sending = False

        return Section()

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        return bytes(await self.inner.receive_some(max_bytes))

    async def aclose(self) -> None:
        await self.inner.aclose()


class CloseCrossing(trio.abc.Stream):
    """What trio-websocket writes through. When the server's Close frame is about to go
    out, the task yields (trio-websocket's send lock) until the client's Close, held
    back until then, has made the reader start closing the stream."""

    def __init__(self, inner: trio.abc.Stream, contract: ContractStream) -> None:
        self.inner = inner
        self.contract = contract
        self.client_close = trio.Event()
        self.server_close_sent = False
        self._pending = b""

    async def send_all(self, data: bytes | bytearray | memoryview) -> None:
        if bytes(data[:1]) == bytes([CLOSE_OPCODE]):
            self.server_close_sent = True
            self.client_close.set()
            await self.contract.eof_started.wait()
        await self.inner.send_all(data)

    async def receive_some(self, max_bytes: int | None = None) -> bytes:
        """One client frame at a time (the test's are short), the Close held back."""
        if not self._pending:
            self._pending = bytes(await self.inner.receive_some(max_bytes))
        data = self._pending
        if data[:1] == bytes([CLOSE_OPCODE]):
            await self.client_close.wait()
        length = data[1] & 0x7F if len(data) > 1 else 0
        size = 2 + 4 + length if length < 126 else len(data)
        frame, self._pending = data[:size], data[size:]
        return frame

    async def wait_send_all_might_not_block(self) -> None:
        await self.inner.wait_send_all_might_not_block()

    async def aclose(self) -> None:
        await self.inner.aclose()


async def test_a_stop_then_close_that_crosses_the_close_frame_is_routine(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_vstream")
    summaries: list[SessionSummary] = []
    ended = trio.Event()

    def on_end(summary: SessionSummary) -> None:
        summaries.append(summary)
        ended.set()

    server = VideoServer(
        SyntheticEngine(SyntheticSettings(chunk_frames=4, step_delay=0.01)),
        ServerConfig(),
        on_session_end=on_end,
    )
    failures: list[BaseException] = []
    client_stream, server_stream = trio.testing.memory_stream_pair()
    contract = ContractStream(server_stream)
    replay = ReplayStream(contract, b"")
    crossing = CloseCrossing(replay, contract)

    async def serve() -> None:
        try:
            async with trio.open_nursery() as connection:
                request = await wrap_server_stream(connection, crossing)
                await server.serve_websocket(request)
                connection.cancel_scope.cancel()
        except Exception as exc:  # what the router would log as a failure
            failures.append(exc)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(serve)
        client: WebSocketConnection = await wrap_client_stream(
            nursery,
            client_stream,  # type: ignore[arg-type]
            "test",
            "/v1/realtime/video",
        )
        await client.send_message(json.dumps({**START, "num_frames": 400}))
        while not isinstance(await client.get_message(), bytes):
            pass  # video.start, then the first chunk
        await client.send_message(json.dumps({"type": "session.stop"}))
        nursery.start_soon(client.aclose)  # at once: before the session's last message
        with trio.fail_after(10):
            await ended.wait()
        nursery.cancel_scope.cancel()
    assert crossing.server_close_sent, "the race was not played"
    assert failures == []
    assert summaries[0].outcome is Outcome.STOPPED
    assert [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []


async def test_a_send_while_the_stream_closes_is_a_close_not_a_busy_error() -> None:
    client, server = trio.testing.memory_stream_pair()
    contract = ContractStream(server)
    replay = ReplayStream(contract, b"")
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replay.aclose)  # the reader, after the client's Close
        await contract.eof_started.wait()
        with pytest.raises(trio.ClosedResourceError):  # trio-websocket: ConnectionClosed
            await replay.send_all(b"\x88\x02\x03\xe8")
        with pytest.raises(trio.ClosedResourceError):
            await replay.receive_some(10)
        await client.aclose()


async def test_the_write_side_shuts_after_a_frame_under_way() -> None:
    """A close that begins while a frame is being written lets it finish: EOF never
    cuts a frame (a lockstep stream: the write lasts until the client has read it)."""
    client, server = trio.testing.lockstep_stream_pair()
    contract = ContractStream(server, hold_eof=False)
    replay = ReplayStream(contract, b"")
    frame = b"x" * 100_000
    async with trio.open_nursery() as nursery:
        nursery.start_soon(replay.send_all, frame)
        await trio.testing.wait_all_tasks_blocked()  # the write waits for the reader
        nursery.start_soon(replay.aclose)
        await trio.testing.wait_all_tasks_blocked()
        received = b""
        while chunk := await client.receive_some():
            received += chunk
        await client.aclose()
    assert received == frame
    assert contract.eof_started.is_set()


async def test_a_close_while_another_task_reads_still_lingers() -> None:
    """trio-websocket's reader goes on reading after it sent Close 1009 for an oversized
    message, while the client may still be writing it. The close must still linger (read
    until the client closes), not close at once with bytes unread: a socket would answer
    with a reset and the client would lose the Close frame (1006, not 1009)."""
    client, server = trio.testing.memory_stream_pair()
    replay = ReplayStream(ContractStream(server, hold_eof=False), b"")
    read: list[bytes] = []
    closed = trio.Event()

    async def reader() -> None:
        read.append(bytes(await replay.receive_some()))
        with pytest.raises(trio.ClosedResourceError):  # the close has begun
            await replay.receive_some()

    async def close() -> None:
        await replay.aclose()
        closed.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(reader)
        await trio.testing.wait_all_tasks_blocked()  # its receive is under way
        nursery.start_soon(close)
        await trio.testing.wait_all_tasks_blocked()
        assert not closed.is_set(), "closed at once, with the client still writing"
        assert await client.receive_some() == b""  # the server's EOF
        await client.send_all(b"the rest of the oversized message")
        await trio.testing.wait_all_tasks_blocked()
        assert not closed.is_set()
        await client.send_all(b"and more")
        await client.aclose()
    assert read == [b"the rest of the oversized message"]
    assert closed.is_set()


async def test_a_second_close_waits_for_the_first() -> None:
    client, server = trio.testing.memory_stream_pair()
    replay = ReplayStream(ContractStream(server, hold_eof=False), b"")
    closed: list[str] = []

    async def close(who: str) -> None:
        await replay.aclose()
        closed.append(who)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(close, "first")
        await trio.testing.wait_all_tasks_blocked()  # lingering: the client has not closed
        nursery.start_soon(close, "second")
        await trio.testing.wait_all_tasks_blocked()
        assert closed == []
        assert await client.receive_some() == b""  # the server's EOF
        await client.aclose()
    assert sorted(closed) == ["first", "second"]


async def test_a_close_that_races_the_peer_is_one_quiet_line(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Whatever the transport raises at the close (here the BusyResourceError that
    trio-websocket let escape): the session ended as it did, and the log says so in
    one line, without a traceback."""
    caplog.set_level(logging.DEBUG, logger="trio_vstream")

    class RacingSocket(ScriptedSocket):
        async def aclose(self) -> None:
            await super().aclose()
            raise trio.BusyResourceError("another task is currently sending data")

    ws = RacingSocket()
    # Slow enough (40 ms a chunk, 100 chunks) that the stop comes long before the end.
    session, _ = make_session(
        ws, SyntheticEngine(SyntheticSettings(chunk_frames=4, step_delay=0.01))
    )
    ws.feed({**START, "num_frames": 400})
    async with session_in_background(session) as summaries:
        await ws.wait_until(lambda sent: any(isinstance(m, bytes) for m in sent))
        ws.feed({"type": "session.stop"})
    assert summaries[0].outcome is Outcome.STOPPED
    assert ws.close_calls == 1
    assert [r for r in caplog.records if r.levelno >= logging.WARNING or r.exc_info] == []
    assert [r.levelno for r in caplog.records if "close:" in r.getMessage()] == [logging.DEBUG]
