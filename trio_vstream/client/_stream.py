"""`stream_video`: one session over a real WebSocket, built on `protocol.ClientProtocol`.

The protocol machine does the protocol (pairing metadata with binary messages, telling
a terminal error from an answer to a control message); this module adds the I/O and
what a caller wants from a session: timings, interactions sent at their media time,
stop and abort, and a `StreamResult` handed back whatever way the session ended,
because a partial video is still worth keeping. Protocol slips of the server are
therefore recorded in ``result.problems`` rather than raised.
"""

from __future__ import annotations

import contextlib
import math
from collections.abc import Callable, Iterable
from fractions import Fraction
from typing import Any, Final

import trio
from trio_websocket import (
    ConnectionClosed,
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    WebSocketConnection,
    open_websocket_url,
)

from trio_vstream import protocol
from trio_vstream.client._mp4 import StreamTiming
from trio_vstream.client._results import (
    InteractionRecord,
    ReceivedChunk,
    ScheduledInteraction,
    StreamConnectError,
    StreamOutcome,
    StreamResult,
)
from trio_vstream.client._viewer import PlaybackViewer, check_startup

__all__ = [
    "MAX_MESSAGE_SIZE",
    "ChunkCallback",
    "MessageCallback",
    "stream_video",
    "watch_video",
]

#: trio-websocket's default (1 MiB) closes the connection with 1009 on the first big
#: chunk; lossless or high-resolution chunks easily exceed that.
MAX_MESSAGE_SIZE: Final = 256 * 1024 * 1024

# Bigger reads than trio-websocket's 4 KiB default: chunks are megabytes.
_RECEIVE_BUFFER: Final = 256 * 1024

#: How long to wait for the server's close after its terminal message, before closing
#: ourselves. The server closes right away; this only bounds a misbehaving one.
_CLOSE_WAIT: Final = 2.0

ChunkCallback = Callable[[ReceivedChunk, StreamResult], None]
MessageCallback = Callable[[protocol.ServerMessage, StreamResult], None]


async def stream_video(
    url: str,
    start_fields: dict[str, Any],
    *,
    interactions: Iterable[ScheduledInteraction] = (),
    on_chunk: ChunkCallback | None = None,
    on_message: MessageCallback | None = None,
    stop_event: trio.Event | None = None,
    abort_event: trio.Event | None = None,
    stop_timeout: float = 10.0,
    connect_timeout: float = 10.0,
    max_message_size: int = MAX_MESSAGE_SIZE,
    api_key: str | None = None,
    playback: bool = False,
    startup_seconds: float = 0.0,
) -> StreamResult:
    """Run one session and return what arrived, however it ended.

    ``start_fields`` are the ``session.start`` fields (``prompt`` required), sent as given:
    the server is the one that validates. Setting ``stop_event`` sends ``session.stop``
    and waits up to ``stop_timeout`` for the server's ``session.done`` (before the
    connection is up, it abandons the attempt instead). Setting ``abort_event`` drops the
    connection at once. Callbacks run synchronously in the receive loop, so they must be
    quick. ``api_key`` is sent as ``Authorization: Bearer KEY`` on the upgrade (servers
    started with ``--api-key`` refuse the handshake with 401 without it); it is kept
    nowhere in the result. Raises `StreamConnectError` when no connection could be made,
    with ``status_code`` set when the server refused the handshake.

    ``playback`` watches as a person would: a `PlaybackViewer` (in ``result.viewer``)
    plays what arrives at 1x from the first frame (after ``startup_seconds`` of media
    are buffered), and counts its stalls. When the request opted into vllm-omni's pacing
    (``streaming_buffer_seconds``), its playhead also goes to the server, in
    ``session.playback`` about every 100 ms: the real one, never moved on to hide a
    stall. A startup threshold at or above that window raises `ValueError` (the server
    would stop before the viewer starts, and both would wait for ever).
    """
    fields = dict(start_fields)
    buffer_seconds = fields.get("streaming_buffer_seconds")
    if playback and isinstance(buffer_seconds, int | float):
        check_startup(startup_seconds, float(buffer_seconds))
    elif playback:
        check_startup(startup_seconds, None)
    machine = protocol.ClientProtocol()
    start_text = machine.start(**fields)  # raises ValueError on a malformed request

    result = StreamResult(url=url, request=fields, started_at=trio.current_time())
    result.interactions = [
        InteractionRecord(interaction=item, event_id=item.event_id or f"interaction-{number}")
        for number, item in enumerate(sorted(interactions, key=lambda i: i.at), start=1)
    ]
    session = _StreamRun(
        result,
        machine,
        stop_event=stop_event if stop_event is not None else trio.Event(),
        stop_timeout=stop_timeout,
        on_chunk=on_chunk,
        on_message=on_message,
    )
    if playback:
        session.viewer_startup = startup_seconds
        session.reports = "streaming_buffer_seconds" in fields
    await _connect_and_run(
        session,
        start_text,
        abort_event=abort_event,
        connect_timeout=connect_timeout,
        max_message_size=max_message_size,
        api_key=api_key,
    )
    return result


async def watch_video(
    url: str,
    *,
    on_chunk: ChunkCallback | None = None,
    on_message: MessageCallback | None = None,
    abort_event: trio.Event | None = None,
    connect_timeout: float = 10.0,
    max_message_size: int = MAX_MESSAGE_SIZE,
    api_key: str | None = None,
) -> StreamResult:
    """Watch a running session through its watch link and return what arrived.

    ``url`` is the full ``ws(s)://`` address of a watch link (``video.start``'s
    ``watch_path`` on the owner's server). Nothing is sent to start: the server opens
    with ``watch.start`` (kept in ``result.watch_start``), then the owner's chunks from
    the next keyframe chunk on, the first with the init segment in front, so
    ``result.video`` decodes on its own; then the session's own terminal message.
    A viewer cannot stop the session (the server answers ``read_only``), so there is no
    ``stop_event``: setting ``abort_event`` leaves, keeping what arrived (outcome
    ``aborted``). The ``time_to_*`` figures count from the connection being open.
    A watch link that is wrong or whose session ended gives outcome ``error`` with
    ``watch_not_found``; a viewer that fell too far behind, ``viewer_too_slow``.
    ``api_key`` is for servers started with ``--watch-requires-key``. Raises
    `StreamConnectError` when no connection could be made.
    """
    result = StreamResult(url=url, request={}, started_at=trio.current_time(), watching=True)
    session = _StreamRun(
        result,
        protocol.ClientProtocol(),
        stop_event=trio.Event(),  # never set: only the owner may stop
        stop_timeout=0.0,
        on_chunk=on_chunk,
        on_message=on_message,
    )
    await _connect_and_run(
        session,
        None,
        abort_event=abort_event,
        connect_timeout=connect_timeout,
        max_message_size=max_message_size,
        api_key=api_key,
    )
    return result


async def _connect_and_run(
    session: _StreamRun,
    start_text: str | None,
    *,
    abort_event: trio.Event | None,
    connect_timeout: float,
    max_message_size: int,
    api_key: str | None,
) -> None:
    """Open the WebSocket, run the session on it, and settle ``session.result``.

    Shared by owners (``start_text`` is their ``session.start``) and viewers (None:
    they send nothing to start). Raises `StreamConnectError` only when no connection
    was made; anything later is in the result.
    """
    result = session.result
    url = result.url
    # A malformed key is the caller's ValueError, raised before connecting.
    extra_headers = [] if api_key is None else [(b"authorization", bearer(api_key))]
    async with trio.open_nursery() as nursery:
        abort = abort_event if abort_event is not None else trio.Event()
        nursery.start_soon(session.watch_abort, abort, nursery.cancel_scope)
        try:
            async with open_websocket_url(
                url,
                max_message_size=max_message_size,
                receive_buffer_size=_RECEIVE_BUFFER,
                connect_timeout=connect_timeout,
                disconnect_timeout=_CLOSE_WAIT,
                extra_headers=extra_headers,
            ) as ws:
                await session.run(ws, start_text)
        except HandshakeError as exc:
            # Also raised by a slow close (DisconnectionTimeout); only a failure to
            # connect is fatal, since afterwards the data is in hand.
            if result.start_sent_at is None:
                session.connect_failure = _describe_handshake(exc)
                if isinstance(exc, ConnectionRejected):
                    session.connect_status = exc.status_code
            else:
                result.problems.append(f"closing the connection failed: {exc!r}")
        nursery.cancel_scope.cancel()

    result.ended_at = trio.current_time()
    if result.viewer is not None and not result.viewer.ended:
        result.viewer.end(result.ended_at)  # no terminal message: the connection ended
    if session.connect_failure is not None and not session.aborted:
        raise StreamConnectError(url, session.connect_failure, session.connect_status)
    result.outcome = session.outcome()
    session.explain_unsent()


class _StreamRun:
    """One run of `stream_video`: the I/O and bookkeeping around a `ClientProtocol`."""

    def __init__(
        self,
        result: StreamResult,
        machine: protocol.ClientProtocol,
        *,
        stop_event: trio.Event,
        stop_timeout: float,
        on_chunk: ChunkCallback | None,
        on_message: MessageCallback | None,
    ) -> None:
        self.result = result
        self.machine = machine
        self.stop_event = stop_event
        self.stop_timeout = stop_timeout
        self.on_chunk = on_chunk
        self.on_message = on_message
        self.aborted = False
        self.connect_failure: str | None = None
        self.connect_status: int | None = None  # the HTTP status of a refused handshake
        self.finished = trio.Event()  # a terminal message arrived
        self._received = trio.Event()  # set (and replaced) at every message
        self.records = {record.event_id: record for record in result.interactions}
        self.next_interaction = 0  # index into result.interactions (sorted by time)
        self.send_failed = False  # the connection refused an interaction
        self.timing = StreamTiming()
        self.announced_rate: Fraction | None = None  # config.fps, else the requested fps
        self.viewer_startup: float | None = None  # set: simulate a real-time viewer
        self.reports = False  # send the viewer's playhead (the session opted into pacing)

    def outcome(self) -> StreamOutcome:
        result = self.result
        if result.done is not None:
            return StreamOutcome.STOPPED if result.done.stopped else StreamOutcome.COMPLETED
        if result.error is not None:
            return StreamOutcome.ERROR
        if self.aborted:
            return StreamOutcome.ABORTED
        # A normal close right after an error means the server meant it as terminal,
        # even if it was one of the codes that usually are not.
        if result.close_code == 1000 and result.errors:
            result.error = result.errors[-1]
            return StreamOutcome.ERROR
        return StreamOutcome.DISCONNECTED

    def explain_unsent(self) -> None:
        """Say, on each interaction that was never sent, why: the warnings show it.

        Runs once the outcome is known, because that is what decides the reason.
        """
        result = self.result
        media = result.media_time
        reached = "" if media is None else f" at {seconds_text(media)} s"
        if result.rejected:
            reason = "the server rejected the session"
        elif result.video_start is None:
            reason = "the session never started"
        elif media is None:
            reason = (
                "the frame rate is unknown (not readable from the stream, and no fps in "
                "video.start's config or in the request), so media time is unknown"
            )
        elif self.send_failed:
            reason = f"the connection closed{reached}"
        elif result.outcome is StreamOutcome.COMPLETED:
            reason = f"the video ended{reached}"
        elif result.outcome is StreamOutcome.STOPPED:
            reason = f"the session was stopped{reached}"
        elif result.outcome is StreamOutcome.ERROR:
            reason = f"the session ended with an error{reached}"
        elif result.outcome is StreamOutcome.DISCONNECTED:
            reason = f"the connection ended{reached}"
        else:
            reason = f"the client gave up{reached}"
        for record in result.interactions:
            if record.sent_at is None:
                record.not_sent = reason

    async def watch_abort(self, abort_event: trio.Event, scope: trio.CancelScope) -> None:
        """Cancel everything on abort, or on a stop before the session exists."""
        async with trio.open_nursery() as nursery:

            async def abort_on(event: trio.Event, only_before_start: bool) -> None:
                await event.wait()
                if only_before_start and self.result.start_sent_at is not None:
                    return  # the in-session stop task handles it
                self.aborted = True
                scope.cancel()

            nursery.start_soon(abort_on, abort_event, False)
            nursery.start_soon(abort_on, self.stop_event, True)

    async def run(self, ws: WebSocketConnection, start_text: str | None) -> None:
        """``start_text`` None: a viewer, which sends nothing; its times count from now."""
        # If the server spoke first and closed (server_busy, server_shutdown), what it
        # said is still queued for the receive loop.
        if start_text is not None:
            with contextlib.suppress(ConnectionClosed):
                await ws.send_message(start_text)
        self.result.start_sent_at = trio.current_time()
        if self.viewer_startup is not None:
            self.result.viewer = PlaybackViewer(
                self.result.start_sent_at, startup_seconds=self.viewer_startup
            )
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_asked, ws, nursery.cancel_scope)
            if self.reports:
                nursery.start_soon(self._report_playback, ws)
            if self.result.viewer is not None and self.result.interactions:
                nursery.start_soon(self._interact_at_playhead, ws, self.result.viewer)
            await self._receive(ws)
            nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ receiving

    async def _receive(self, ws: WebSocketConnection) -> None:
        try:
            while not self.finished.is_set():
                self._handle(await ws.get_message())
                if self.result.viewer is None:
                    # Here rather than in a task of its own: an interaction is then sent
                    # before the next message is read, exactly at its chunk boundary.
                    await self._send_due_interactions(ws)
            # The server closes after its terminal message; give it the chance, so the
            # close is its normal one and we learn the close code.
            with trio.move_on_after(_CLOSE_WAIT):
                while True:
                    self._handle(await ws.get_message())
        except ConnectionClosed as exc:
            # trio-websocket types the reason optional; it is set before ConnectionClosed.
            self.result.close_code = exc.reason.code if exc.reason is not None else None

    def _handle(self, raw: str | bytes) -> None:
        now = trio.current_time()
        self._received.set()  # after this call: what a waiting sender looks at has moved
        self._received = trio.Event()
        try:
            events = self.machine.receive(raw)
        except protocol.ServerProtocolError as exc:
            # Kept, not raised: what arrived may still be a good video.
            self.result.problems.append(exc.message)
            events = exc.events
            if exc.data is not None:
                self._chunk(None, exc.data, now)
        for event in events:
            if isinstance(event, protocol.ChunkReceived):
                self._chunk(event.metadata, event.data, now)
            else:
                self._message(event, now)
        if self.machine.ended:
            self.finished.set()
            if self.result.viewer is not None:
                self.result.viewer.end(now)  # the stream ends here, not at the close

    def _message(self, event: protocol.Event, now: float) -> None:
        """Record a text message's event; `ChunkReceived` goes to `_chunk` instead."""
        result = self.result
        assert not isinstance(event, protocol.ChunkReceived)
        message = event.message
        result.messages.append(message)
        if isinstance(event, protocol.VideoStarted):
            result.video_start = event.start
            result.video_start_at = now
            echoed = _announced_rate(event.start.config.get("fps"))
            self.announced_rate = echoed or _announced_rate(result.request.get("fps"))
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        elif isinstance(event, protocol.WatchStarted):
            result.watch_start = event.start
            result.video_start_at = now
            self.announced_rate = _announced_rate(event.start.config.get("fps"))
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        elif isinstance(event, protocol.InteractionAccepted):
            record = self.records.get(event.event_id)
            if record is not None and record.queued_at is None:
                record.queued_at = now
        elif isinstance(event, protocol.SessionEnded):
            result.done = event.done
        elif isinstance(event, protocol.ErrorReceived):
            error = event.error
            result.errors.append(error)
            record = self.records.get(error.event_id) if error.event_id else None
            if record is not None:
                record.error = error
            if event.ends_session:
                result.error = error
        if self.on_message is not None:
            self.on_message(message, result)

    def _chunk(self, metadata: protocol.ChunkMetadata | None, data: bytes, now: float) -> None:
        """Record one binary message (``metadata`` None: the server did not announce it)."""
        result = self.result
        chunk = ReceivedChunk(metadata=metadata, size=len(data), received_at=now)
        if self.timing.frame_rate is None:
            self.timing.feed(data)
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        result.binary_messages.append(data)
        result.chunks.append(chunk)
        if result.first_chunk_at is None:
            result.first_chunk_at = now
        if chunk.num_frames:
            result.last_media_at = now
            rate = result.frame_rate
            if result.viewer is not None and rate is not None:
                result.viewer.receive(now, chunk.num_frames * rate.denominator / rate.numerator)
        if metadata is not None:
            for event_id in metadata.started_event_ids:
                record = self.records.get(event_id)
                if record is not None and record.started_in_chunk is None:
                    record.started_in_chunk = metadata.generation_chunk_index
        if self.on_chunk is not None:
            self.on_chunk(chunk, result)

    # -------------------------------------------------------------------- sending

    async def _stop_when_asked(self, ws: WebSocketConnection, scope: trio.CancelScope) -> None:
        await self.stop_event.wait()
        if self.finished.is_set():
            return
        self.result.stop_requested_at = trio.current_time()
        with contextlib.suppress(ConnectionClosed):
            await ws.send_message(self.machine.stop())
        with trio.move_on_after(self.stop_timeout):
            await self.finished.wait()
            return
        self.result.stop_timed_out = True
        self.aborted = True
        scope.cancel()

    async def _report_playback(self, ws: WebSocketConnection) -> None:
        """Send the viewer's playhead whenever it has a report (every 100 ms while it
        plays), until the session stops: a stopping session needs no more pacing."""
        viewer = self.result.viewer
        assert viewer is not None
        while True:
            due = viewer.next_report_at
            # Before the first frame there is no schedule yet: look again a tick later.
            await trio.sleep_until(
                due if due is not None else trio.current_time() + viewer.report_interval
            )
            state = self.machine.state
            if state is not protocol.ClientState.STREAMING:
                if state is protocol.ClientState.STARTING:
                    continue
                return
            position = viewer.report(trio.current_time())
            if position is None:
                continue
            try:
                await ws.send_message(self.machine.playback(position))
            except ConnectionClosed:
                return  # the receive loop learns why
            self.result.playback_sent.append((trio.current_time(), position))

    async def _interact_at_playhead(self, ws: WebSocketConnection, viewer: PlaybackViewer) -> None:
        """A viewer's interactions: each sent when the playhead reaches its time, as a
        person watching presses a key at what they see, not at what has arrived ahead of
        it. Wakes when the playhead gets there, or at each message (more media, the
        end), whichever comes first."""
        records = self.result.interactions
        while True:
            await self._send_due_interactions(ws)
            if (
                self.next_interaction >= len(records)
                or self.send_failed
                or self.stop_event.is_set()
                or self.finished.is_set()
            ):
                return
            # Not yet due (the call above sent all that was): a time is in the future.
            # Before video.start nothing is due (the playhead is at 0 all the same).
            wake = None
            if self.result.video_start_at is not None:
                wake = viewer.reaches_at(records[self.next_interaction].interaction.at)
            received = self._received
            with trio.move_on_at(math.inf if wake is None else wake):
                await received.wait()

    async def _send_due_interactions(self, ws: WebSocketConnection) -> None:
        """Send every interaction whose time the video has reached: the media delivered,
        or for a simulated viewer its playhead."""
        result = self.result
        records = result.interactions
        if (
            self.next_interaction >= len(records)
            or result.video_start_at is None
            or self.send_failed
            or self.stop_event.is_set()
            or self.finished.is_set()
        ):
            return
        media = result.media_time
        if result.viewer is not None:
            result.viewer.advance(trio.current_time())
            media = result.viewer.position
        while media is not None and self.next_interaction < len(records):
            record = records[self.next_interaction]
            item = record.interaction
            if media < item.at:
                return
            message = self.machine.interact(
                item.prompt,
                event_id=record.event_id,
                transition_chunks=item.transition_chunks,
                camera=item.camera,
            )
            try:
                await ws.send_message(message)
            except ConnectionClosed:
                # Keep reading: what the server said before closing is still queued.
                self.send_failed = True
                return
            record.sent_at = trio.current_time()
            record.sent_media_time = media
            self.next_interaction += 1


def _announced_rate(value: object) -> Fraction | None:
    """An fps from JSON (``config.fps`` or the request), if it is a usable number."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    if not math.isfinite(value) or value <= 0:
        return None
    return Fraction(value)


def seconds_text(value: float) -> str:
    """``2``, ``0.25``, ``1.333``: short, and never ``2.0000000000000004``."""
    return f"{round(value, 3):g}"


def bearer(key: str) -> bytes:
    """The Authorization value; refuses a key that would break or forge header lines.

    The message never contains the key: it may end up in logs.
    """
    if not key or any(c.isspace() or not c.isprintable() for c in key):
        raise ValueError("the API key must be non-empty, without spaces or control characters")
    try:
        return b"Bearer " + key.encode("ascii")
    except UnicodeEncodeError:
        raise ValueError("the API key must be ASCII (it travels in an HTTP header)") from None


#: What a refused handshake means, for the statuses our servers use to refuse one.
_REFUSALS: Final = {
    401: "a valid API key is required",
    403: "forbidden (the server's Origin check, or a proxy's rule)",
    503: "the server is draining; try again or another server",
}


def _describe_handshake(exc: HandshakeError) -> str:
    if isinstance(exc, ConnectionRejected):
        meaning = _REFUSALS.get(exc.status_code)
        if meaning is not None:
            return f"the server refused the request: {exc.status_code} \u2014 {meaning}"
        return f"the server rejected the WebSocket handshake with HTTP {exc.status_code}"
    if isinstance(exc, ConnectionTimeout):
        return "timed out"
    cause = exc.__cause__
    if isinstance(cause, OSError):
        return _os_reason(cause)
    return str(exc) or type(exc).__name__


def _os_reason(exc: OSError) -> str:
    """ "Connection refused" rather than trio's "all attempts to connect ... failed"."""
    attempts = exc.__cause__
    if isinstance(attempts, BaseExceptionGroup):
        reasons = sorted(
            {
                leaf.strerror
                for leaf in _leaves(attempts)
                if isinstance(leaf, OSError) and leaf.strerror
            }
        )
        if reasons:
            return "; ".join(reasons)
    return exc.strerror or str(exc) or type(exc).__name__


def _leaves(group: BaseExceptionGroup[BaseException]) -> Iterable[BaseException]:
    for exc in group.exceptions:
        if isinstance(exc, BaseExceptionGroup):
            yield from _leaves(exc)
        else:
            yield exc
