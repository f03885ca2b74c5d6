"""The harness's side of a session: a WebSocket client that records every message with a
monotonic timestamp, and helpers to run sessions side by side.

The protocol itself (pairing each ``video.chunk_metadata`` with its binary, checking its
``byte_length``, noticing a message after the terminal one) is
`trio_vstream.protocol.ClientProtocol`'s, as for the CLI client; what is the harness's own
is the I/O and the clock. It owns the TCP stream, so that it can also vanish without a
closing handshake (the abort scenario), which a ready-made client would not let it do.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Final

import trio
from trio_websocket import ConnectionClosed, WebSocketConnection, wrap_client_stream

from bench._output import now, progress
from bench._server import Endpoint
from trio_vstream import protocol

CLIENT_MAX_MESSAGE: Final = 256 * 1024 * 1024
"""Chunks of large videos are big; the client must never be the one to refuse them."""
RECEIVE_BUFFER: Final = 256 * 1024
"""trio-websocket reads 4 KiB at a time by default, which at hundreds of frames per second
would make the client, not the server, the bottleneck."""


class SessionClient:
    """One WebSocket session, recorded message by message with monotonic timestamps.

    The harness owns the TCP stream (``wrap_client_stream``), so that it can cut it
    without a closing handshake, to measure what a vanished client costs the server.
    """

    def __init__(self, endpoint: Endpoint, start: str | None) -> None:
        self.endpoint = endpoint
        self.start = start
        self.t_connect: float | None = None
        self.t_connected: float | None = None
        self.t_start_sent: float | None = None
        self.t_video_start: float | None = None
        self.t_stop_sent: float | None = None
        self.t_disconnect: float | None = None
        self.t_terminal: float | None = None
        self.request_id: str | None = None
        self.arrivals: list[tuple[float, int, int]] = []
        """(time, frames, bytes) per media chunk."""
        self.terminal: str | None = None
        self.stopped: bool | None = None
        self.error: str | None = None
        self.failure: str | None = None
        self.protocol_problems: list[str] = []
        self.pings: list[tuple[float, float]] = []
        """(sent at, round trip) per answered ping."""
        self.pings_sent = 0
        self._ping_sent: deque[float] = deque()
        self.interactions_sent: dict[str, float] = {}
        """event_id -> when its ``session.interaction`` was sent."""
        self.interactions_queued: dict[str, float] = {}
        """event_id -> when ``session.interaction.queued`` arrived for it."""
        self.events_started: dict[str, float] = {}
        """event_id -> arrival of the first media chunk listing it in ``started_event_ids``:
        the first delivered frames generated under it."""
        self.control_errors: list[str] = []
        """Errors that answered an interaction and left the session going."""
        self.on_media: Callable[[float, int], None] | None = None
        """Called with (arrival time, frames) for each media chunk as it is recorded:
        a simulated viewer fed live (the streaming scenario)."""
        self.playback_reports = 0
        self._chunk_arrived = trio.Event()
        self.connected = trio.Event()
        self.first_chunk = trio.Event()
        self.finished = trio.Event()
        self._ws: WebSocketConnection | None = None
        self._stream: trio.abc.Stream | None = None
        self._send_lock = trio.Lock()
        self._protocol = protocol.ClientProtocol()

    @property
    def frames(self) -> int:
        return sum(frames for _, frames, _ in self.arrivals)

    @property
    def problem(self) -> str | None:
        """What went wrong, if anything, in one line."""
        problems = [p for p in (self.failure, self.error) if p] + self.protocol_problems[:3]
        return "; ".join(problems) or None

    async def run(self) -> None:
        """Connect, send the start, and read until the server closes. A server or network
        problem does not raise: it is recorded in ``failure`` for the scenario to report."""
        try:
            async with trio.open_nursery() as nursery:
                self.t_connect = now()
                self._stream = await self.endpoint.open_stream()
                self._ws = await wrap_client_stream(
                    nursery,
                    self._stream,
                    self.endpoint.host_header,
                    self.endpoint.resource,
                    max_message_size=CLIENT_MAX_MESSAGE,
                    receive_buffer_size=RECEIVE_BUFFER,
                )
                self.t_connected = now()
                self.connected.set()
                if self.start is not None:
                    self.t_start_sent = now()
                    await self._send(self.start)
                await self._read(self._ws)
                # Let trio-websocket's reader finish the closing handshake, bounded.
                nursery.cancel_scope.deadline = trio.current_time() + 5
        except ConnectionClosed:
            pass
        except (OSError, trio.BrokenResourceError, trio.ClosedResourceError) as exc:
            if self.t_disconnect is None:
                self.failure = f"{type(exc).__name__}: {exc}"
        except Exception as exc:  # a refused handshake, a protocol violation, ...
            self.failure = f"{type(exc).__name__}: {exc}"
        finally:
            if self._stream is not None:
                with trio.CancelScope(shield=True):
                    await self._stream.aclose()
            for event in (self.connected, self.first_chunk, self.finished, self._chunk_arrived):
                event.set()

    async def _read(self, ws: WebSocketConnection) -> None:
        """Feed every message to the session's `protocol.ClientProtocol`, which pairs each
        ``video.chunk_metadata`` with its binary and checks it, and time what it yields.

        A message that breaks the protocol is recorded, not raised: the harness measures
        servers, and one that misbehaves should show in the report, with the figures of
        its other sessions. A chunk that broke it (no metadata, a wrong ``byte_length``)
        is not counted as delivered.
        """
        while True:
            try:
                raw = await ws.get_message()
            except ConnectionClosed:
                return
            t = now()
            try:
                events = self._protocol.receive(raw)
            except protocol.ServerProtocolError as exc:
                self.protocol_problems.append(exc.message)
                events = [e for e in exc.events if not isinstance(e, protocol.ChunkReceived)]
            for event in events:
                self._record(t, event)

    def _record(self, t: float, event: protocol.Event) -> None:
        if isinstance(event, protocol.ChunkReceived):
            if event.metadata.kind == "media":
                self.arrivals.append((t, event.metadata.num_frames, len(event.data)))
                if self.on_media is not None:
                    self.on_media(t, event.metadata.num_frames)
                for event_id in event.metadata.started_event_ids:
                    self.events_started.setdefault(event_id, t)
                self.first_chunk.set()
                self._chunk_arrived.set()
                self._chunk_arrived = trio.Event()
        elif isinstance(event, protocol.InteractionAccepted):
            self.interactions_queued.setdefault(event.event_id, t)
        elif isinstance(event, protocol.PongReceived):
            if self._ping_sent:
                sent = self._ping_sent.popleft()
                self.pings.append((sent, t - sent))
        elif isinstance(event, protocol.VideoStarted):
            self.t_video_start = t
            self.request_id = event.start.request_id
        elif isinstance(event, protocol.SessionEnded):
            self._terminal(t, "session.done")
            self.stopped = event.done.stopped
        elif isinstance(event, protocol.ErrorReceived):
            error = event.error
            if self.interactions_sent and not event.ends_session:
                # An interaction the server refused (an engine may refuse one, with a
                # reason): the session goes on, and the scenario reports the refusal.
                self.control_errors.append(f"error {error.code}: {error.message}")
                return
            self.error = f"error {error.code}: {error.message}"
            self.request_id = self.request_id or error.request_id
            # The harness sends no malformed control message, so any error it gets is
            # its session's terminal message, whether or not the protocol ends it.
            self._terminal(t, "error")

    def _terminal(self, t: float, kind: str) -> None:
        if self.terminal is None:
            self.terminal = kind
            self.t_terminal = t

    async def _send(self, message: str) -> None:
        async with self._send_lock:
            if self._ws is None:
                raise ConnectionClosed(None)
            await self._ws.send_message(message)

    async def stop(self) -> None:
        self.t_stop_sent = now()
        try:
            await self._send(protocol.STOP_MESSAGE)
        except ConnectionClosed:
            self.failure = self.failure or "connection closed before session.stop"

    async def interact(
        self, event_id: str, camera: protocol.Camera, transition_chunks: int = 0
    ) -> bool:
        """Send a camera ``session.interaction``; False when the connection is gone."""
        message = protocol.interaction_message(
            None, event_id=event_id, transition_chunks=transition_chunks, camera=camera
        )
        self.interactions_sent[event_id] = now()
        try:
            await self._send(message)
        except ConnectionClosed:
            return False
        return True

    async def playback(self, position_seconds: float) -> bool:
        """Send a ``session.playback`` (the playhead, for a session that opted into
        pacing); False when the connection is gone."""
        try:
            await self._send(protocol.playback_message(position_seconds))
        except ConnectionClosed:
            return False
        self.playback_reports += 1
        return True

    async def wait_started(self, event_id: str, timeout: float) -> float | None:
        """When the first chunk generated under ``event_id`` arrived; None when none came
        within ``timeout`` seconds or the session ended first."""
        with trio.move_on_after(timeout):
            while event_id not in self.events_started and not self.finished.is_set():
                await self._chunk_arrived.wait()
        return self.events_started.get(event_id)

    async def wait_chunk_since(self, since: float) -> None:
        """Until a chunk arrives at or after ``since`` (or the session ends)."""
        while not self.finished.is_set() and not any(t >= since for t, _, _ in self.arrivals):
            await self._chunk_arrived.wait()

    async def disconnect(self) -> None:
        """Cut the TCP connection without a WebSocket close, as a vanished client does."""
        self.t_disconnect = now()
        if self._stream is not None:
            await self._stream.aclose()

    async def close(self) -> None:
        """Hang up politely, with a close frame."""
        if self._ws is not None:
            with trio.move_on_after(5):
                await self._ws.aclose()

    async def ping_every(self, interval: float, until: trio.Event) -> None:
        """session.ping at a fixed cadence; pongs are matched to pings in FIFO order."""
        deadline = trio.current_time()
        while not until.is_set() and self.terminal is None and not self.finished.is_set():
            self._ping_sent.append(now())
            self.pings_sent += 1
            try:
                await self._send(protocol.PING_MESSAGE)
            except ConnectionClosed:
                return
            deadline = max(deadline + interval, trio.current_time())
            with trio.move_on_at(deadline):
                await until.wait()


async def wait_for(event: trio.Event, timeout: float) -> bool:
    with trio.move_on_after(timeout):
        await event.wait()
        return True
    return False


async def lag_monitor(samples: list[float], until: trio.Event, period: float = 0.01) -> None:
    """How late the harness's own event loop wakes up: when this is large, the round trips
    the harness measures include its own delay (on a small machine, CPU contention)."""
    while not until.is_set():
        before = trio.current_time()
        await trio.sleep(period)
        samples.append(max(0.0, trio.current_time() - before - period) * 1000)


async def run_clients(
    clients: Sequence[SessionClient], body: Callable[[], Awaitable[None]], timeout: float
) -> None:
    """Run sessions concurrently while ``body`` drives them; then wait for all to end."""
    async with trio.open_nursery() as nursery:
        for client in clients:
            nursery.start_soon(client.run)
        await body()
        with trio.move_on_after(timeout):
            for client in clients:
                await client.finished.wait()
        nursery.cancel_scope.cancel()


async def run_one(
    client: SessionClient, timeout: float, act: Callable[[], Awaitable[None]]
) -> None:
    """Run one session; ``act`` drives it once its first chunk is in."""

    async def body() -> None:
        if await wait_for(client.first_chunk, timeout) and client.terminal is None:
            await act()

    await run_clients([client], body, timeout)
    if not client.finished.is_set():
        client.failure = client.failure or "timed out"


def seconds_between(earlier: float | None, later: float | None) -> float:
    """``later - earlier``: two of a client's times, which the caller's filter of its
    clients says were taken (the times are None until then)."""
    assert earlier is not None and later is not None
    return later - earlier


def report_failures(clients: Iterable[SessionClient], context: str) -> int:
    count = 0
    for client in clients:
        if client.problem:
            count += 1
            progress(f"  !! {context}: {client.problem}")
    return count
