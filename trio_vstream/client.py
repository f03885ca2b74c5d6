"""Client of the ``/v1/realtime/video`` endpoint: ``python -m trio_vstream client``.

Two layers. `stream_video` is the importable part that tools and tests use: it speaks
only the wire protocol (through `trio_vstream.protocol`), so it works against any server
of the protocol, the vllm-omni reference included, and it always hands back what arrived
as a `StreamResult`, whatever way the session ended, because a partial video is still
worth keeping. `run_client` is the command line around it: signals, a progress line,
the output files and the summary.

The received stream is fragmented MP4 (made for Media Source Extensions). Desktop
players and editors cope badly with it (no duration, slow seeking), so `remux_to_mp4`
copies its packets, without re-encoding, into a plain progressive MP4.
"""

from __future__ import annotations

import argparse
import base64
import contextlib
import enum
import io
import json
import math
import mimetypes
import os
import re
import signal
import struct
import sys
from collections.abc import AsyncIterator, Callable, Iterable, Sequence
from fractions import Fraction
from pathlib import Path
from typing import Any, Final, TextIO
from urllib.parse import urlsplit

import attrs
import av
import av.error
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
from trio_vstream.protocol import ErrorCode

__all__ = [
    "API_KEY_ENV",
    "DEFAULT_URL",
    "MAX_MESSAGE_SIZE",
    "InteractionRecord",
    "Outcome",
    "ReceivedChunk",
    "RemuxError",
    "ScheduledInteraction",
    "StreamConnectError",
    "StreamResult",
    "add_client_arguments",
    "remux_to_mp4",
    "run_client",
    "stream_video",
]

DEFAULT_URL: Final = "ws://127.0.0.1:8000/v1/realtime/video"

#: Where ``client`` reads its API key when ``--api-key`` is not given; the server reads
#: the same variable (cli.py), so one exported key serves both on a workstation. The key
#: stays out of ``ps`` output that way.
API_KEY_ENV: Final = "TRIO_VSTREAM_API_KEY"

#: trio-websocket's default (1 MiB) closes the connection with 1009 on the first big
#: chunk; lossless or high-resolution chunks easily exceed that.
MAX_MESSAGE_SIZE: Final = 256 * 1024 * 1024

# Bigger reads than trio-websocket's 4 KiB default: chunks are megabytes.
_RECEIVE_BUFFER: Final = 256 * 1024

#: How long to wait for the server's close after its terminal message, before closing
#: ourselves. The server closes right away; this only bounds a misbehaving one.
_CLOSE_WAIT: Final = 2.0

#: Errors that answer a control message: after ``video.start`` the session goes on.
_CONTROL_ERRORS: Final = frozenset(
    {
        ErrorCode.INVALID_JSON,
        ErrorCode.INVALID_MESSAGE,
        ErrorCode.UNKNOWN_TYPE,
        ErrorCode.MESSAGE_TOO_LARGE,
        ErrorCode.EVENT_ID_CONFLICT,
        ErrorCode.INTERACTION_FAILED,
    }
)

# Exit statuses of `run_client`; documented in the README.
EXIT_OK: Final = 0
EXIT_SERVER_ERROR: Final = 1
EXIT_USAGE: Final = 2
EXIT_CONNECTION: Final = 3
EXIT_OUTPUT: Final = 4
EXIT_INTERRUPTED: Final = 130


# --------------------------------------------------------------------------------------
# Results
# --------------------------------------------------------------------------------------


class Outcome(enum.StrEnum):
    """How a streamed session ended, from the client's side."""

    COMPLETED = "completed"
    """``session.done`` with ``stopped: false``: the whole video arrived."""
    STOPPED = "stopped"
    """``session.done`` with ``stopped: true``: we asked for a stop and it was honoured."""
    ERROR = "error"
    """The server ended the session with an ``error``."""
    DISCONNECTED = "disconnected"
    """The connection ended without a terminal message."""
    ABORTED = "aborted"
    """We gave up: ``abort_event``, or the server did not finish a stop in time."""


class StreamConnectError(Exception):
    """No session could be opened (refused, unreachable, handshake rejected, timeout).

    Raised rather than returned because nothing arrived that a caller could keep.
    ``status_code`` is the HTTP status when the server answered the handshake with one
    (401 no or wrong API key, 403 Origin refused, 503 draining), so a caller can act on
    it (ask for a key, try another server) without parsing the message.
    """

    def __init__(self, url: str, reason: str, status_code: int | None = None) -> None:
        super().__init__(f"cannot connect to {url}: {reason}")
        self.url = url
        self.reason = reason
        self.status_code = status_code


@attrs.frozen(kw_only=True)
class ScheduledInteraction:
    """A prompt change to send once the video has reached ``at`` seconds of media time.

    Media time (frames received / fps), not wall time: a script then means the same
    thing however fast the server generates. Against a server faster than real time a
    wall-clock schedule fired after the video had ended; against a slow one, too early.
    The interaction is sent right after the first media chunk that brings the delivered
    media time to ``at`` or past it (``at=0``: right after ``video.start``), so it lands
    at the next chunk boundary after that point.
    """

    at: float
    prompt: str
    transition_chunks: int | None = None
    event_id: str | None = None
    """None: the client picks ``interaction-N``, so acknowledgements can be matched."""


@attrs.define(kw_only=True)
class InteractionRecord:
    """What happened to one scheduled interaction."""

    interaction: ScheduledInteraction
    event_id: str
    sent_at: float | None = None
    sent_media_time: float | None = None
    """The delivered media time (seconds) when it was sent: ``at`` rounded up to a chunk."""
    not_sent: str | None = None
    """Why it was never sent (set when the session ends), for warnings and ``--json``."""
    queued_at: float | None = None
    error: protocol.Error | None = None
    started_in_chunk: int | None = None
    """``generation_chunk_index`` of the first chunk that lists it in started_event_ids."""


@attrs.frozen(kw_only=True)
class ReceivedChunk:
    """One binary message and the metadata that announced it."""

    metadata: protocol.ChunkMetadata | None
    """None when the server sent binary data without announcing it (a protocol slip)."""
    size: int
    received_at: float

    @property
    def num_frames(self) -> int:
        if self.metadata is None or self.metadata.kind != "media":
            return 0
        return self.metadata.num_frames


@attrs.define(kw_only=True)
class StreamResult:
    """Everything one session delivered, filled in live while it runs.

    Times are ``trio.current_time()`` values; the ``time_to_*`` properties turn them into
    durations. ``video`` is the exact concatenation of the binary messages.
    """

    url: str
    request: dict[str, Any]
    started_at: float
    start_sent_at: float | None = None
    video_start_at: float | None = None
    first_chunk_at: float | None = None
    last_media_at: float | None = None
    stop_requested_at: float | None = None
    ended_at: float | None = None
    video_start: protocol.VideoStart | None = None
    messages: list[protocol.ServerMessage] = attrs.field(factory=list)
    chunks: list[ReceivedChunk] = attrs.field(factory=list)
    binary_messages: list[bytes] = attrs.field(factory=list, repr=False)
    interactions: list[InteractionRecord] = attrs.field(factory=list)
    errors: list[protocol.Error] = attrs.field(factory=list)
    """Every ``error`` received, including ones that did not end the session."""
    error: protocol.Error | None = None
    """The ``error`` that ended the session, if one did."""
    done: protocol.SessionDone | None = None
    outcome: Outcome | None = None
    stop_timed_out: bool = False
    close_code: int | None = None
    problems: list[str] = attrs.field(factory=list)
    """Protocol violations noticed; kept rather than raised, the data may still be good."""
    frame_rate: Fraction | None = None
    """Frames per second that `media_time` uses: the stream's own timing when it can be
    read, else ``video.start``'s ``config.fps``, else the ``fps`` that was requested."""

    @property
    def request_id(self) -> str | None:
        return self.video_start.request_id if self.video_start is not None else None

    @property
    def seed(self) -> int | None:
        """The seed the server reports in ``video.start``'s ``config.seed``.

        Only the server's word counts: the point is to reproduce a video, and a seed the
        server did not confirm (the reference echoes only what the client sent) may not
        be the one it used. None when it was not reported.
        """
        if self.video_start is None:
            return None
        seed = self.video_start.config.get("seed")
        return seed if isinstance(seed, int) and not isinstance(seed, bool) else None

    @property
    def rejected(self) -> bool:
        """The server refused the session: it ended with an error before ``video.start``."""
        return self.outcome is Outcome.ERROR and self.video_start is None

    @property
    def media_time(self) -> float | None:
        """Seconds of video delivered: frames / `frame_rate`; None if the rate is unknown.

        Computed as one division of integers, so it is the correctly rounded value and
        compares equal to a decimal time like ``0.3`` that it exactly reaches.
        """
        frames = self.frames
        if frames == 0:
            return 0.0
        rate = self.frame_rate
        if rate is None:
            return None
        return frames * rate.denominator / rate.numerator

    @property
    def video(self) -> bytes:
        return b"".join(self.binary_messages)

    @property
    def byte_count(self) -> int:
        return sum(chunk.size for chunk in self.chunks)

    @property
    def frames(self) -> int:
        return sum(chunk.num_frames for chunk in self.chunks)

    @property
    def time_to_video_start(self) -> float | None:
        """From sending session.start: the server's latency, not the network handshake."""
        return _since(self.start_sent_at, self.video_start_at)

    @property
    def time_to_first_chunk(self) -> float | None:
        return _since(self.start_sent_at, self.first_chunk_at)

    @property
    def connect_time(self) -> float | None:
        return _since(self.started_at, self.start_sent_at)

    @property
    def elapsed(self) -> float | None:
        return _since(self.started_at, self.ended_at)

    @property
    def delivered_fps(self) -> float | None:
        """Frames per second of wall time between ``video.start`` and the last media chunk.

        Starts at ``video.start`` so that the first chunk's generation time counts: this is
        the rate a viewer would have seen, not the network's burst rate.
        """
        span = _since(self.video_start_at, self.last_media_at)
        if not span or span <= 0:
            return None
        return self.frames / span

    def summary(self) -> dict[str, Any]:
        """The JSON-ready summary that ``--json`` prints."""
        error = self.error
        return {
            "url": self.url,
            "outcome": self.outcome.value if self.outcome is not None else None,
            "request_id": self.request_id,
            "seed": self.seed,
            "stopped": self.done.stopped if self.done is not None else None,
            "error": None if error is None else {"code": str(error.code), "message": error.message},
            "connect_s": _round(self.connect_time),
            "time_to_video_start_s": _round(self.time_to_video_start),
            "time_to_first_chunk_s": _round(self.time_to_first_chunk),
            "elapsed_s": _round(self.elapsed),
            "frames": self.frames,
            "delivered_fps": _round(self.delivered_fps, 2),
            "bytes": self.byte_count,
            "chunks": len(self.chunks),
            "close_code": self.close_code,
            "interactions": [
                {
                    "event_id": record.event_id,
                    "prompt": record.interaction.prompt,
                    "at_s": record.interaction.at,
                    "sent_s": _round(_since(self.video_start_at, record.sent_at)),
                    "sent_media_s": _round(record.sent_media_time),
                    "not_sent": record.not_sent,
                    "queued": record.queued_at is not None,
                    "started_in_chunk": record.started_in_chunk,
                    "error": None
                    if record.error is None
                    else {"code": str(record.error.code), "message": record.error.message},
                }
                for record in self.interactions
            ],
            "problems": list(self.problems),
        }


def _since(start: float | None, end: float | None) -> float | None:
    if start is None or end is None:
        return None
    return end - start


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


# --------------------------------------------------------------------------------------
# Streaming
# --------------------------------------------------------------------------------------

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
    """
    fields = dict(start_fields)
    if "type" in fields:
        raise ValueError("start_fields must not contain 'type'; it is always session.start")
    if not isinstance(fields.get("prompt"), str):
        raise ValueError("start_fields needs a 'prompt' string")
    start_text = protocol.start_message(**fields)
    extra_headers = [] if api_key is None else [(b"authorization", _bearer(api_key))]

    result = StreamResult(url=url, request=fields, started_at=trio.current_time())
    result.interactions = [
        InteractionRecord(interaction=item, event_id=item.event_id or f"interaction-{number}")
        for number, item in enumerate(sorted(interactions, key=lambda i: i.at), start=1)
    ]
    session = _Session(
        result,
        stop_event=stop_event if stop_event is not None else trio.Event(),
        stop_timeout=stop_timeout,
        on_chunk=on_chunk,
        on_message=on_message,
    )
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
    if session.connect_failure is not None and not session.aborted:
        raise StreamConnectError(url, session.connect_failure, session.connect_status)
    result.outcome = session.outcome()
    session.explain_unsent()
    return result


class _Session:
    """The per-connection state machine behind `stream_video`."""

    def __init__(
        self,
        result: StreamResult,
        *,
        stop_event: trio.Event,
        stop_timeout: float,
        on_chunk: ChunkCallback | None,
        on_message: MessageCallback | None,
    ) -> None:
        self.result = result
        self.stop_event = stop_event
        self.stop_timeout = stop_timeout
        self.on_chunk = on_chunk
        self.on_message = on_message
        self.aborted = False
        self.connect_failure: str | None = None
        self.connect_status: int | None = None  # the HTTP status of a refused handshake
        self.finished = trio.Event()  # a terminal message arrived
        self.pending: protocol.ChunkMetadata | None = None
        self.records = {record.event_id: record for record in result.interactions}
        self.next_interaction = 0  # index into result.interactions (sorted by time)
        self.send_failed = False  # the connection refused an interaction
        self.timing = _StreamTiming()
        self.announced_rate: Fraction | None = None  # config.fps, else the requested fps

    def outcome(self) -> Outcome:
        result = self.result
        if result.done is not None:
            return Outcome.STOPPED if result.done.stopped else Outcome.COMPLETED
        if result.error is not None:
            return Outcome.ERROR
        if self.aborted:
            return Outcome.ABORTED
        # A normal close right after an error means the server meant it as terminal,
        # even if it was one of the codes that usually are not.
        if result.close_code == 1000 and result.errors:
            result.error = result.errors[-1]
            return Outcome.ERROR
        return Outcome.DISCONNECTED

    def explain_unsent(self) -> None:
        """Say, on each interaction that was never sent, why: the warnings show it.

        Runs once the outcome is known, because that is what decides the reason.
        """
        result = self.result
        media = result.media_time
        reached = "" if media is None else f" at {_seconds(media)} s"
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
        elif result.outcome is Outcome.COMPLETED:
            reason = f"the video ended{reached}"
        elif result.outcome is Outcome.STOPPED:
            reason = f"the session was stopped{reached}"
        elif result.outcome is Outcome.ERROR:
            reason = f"the session ended with an error{reached}"
        elif result.outcome is Outcome.DISCONNECTED:
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

    async def run(self, ws: WebSocketConnection, start_text: str) -> None:
        # If the server spoke first and closed (server_busy, server_shutdown), what it
        # said is still queued for the receive loop.
        with contextlib.suppress(ConnectionClosed):
            await ws.send_message(start_text)
        self.result.start_sent_at = trio.current_time()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self._stop_when_asked, ws, nursery.cancel_scope)
            await self._receive(ws)
            nursery.cancel_scope.cancel()

    # ------------------------------------------------------------------ receiving

    async def _receive(self, ws: WebSocketConnection) -> None:
        try:
            while not self.finished.is_set():
                self._handle(await ws.get_message())
                # Here rather than in a task of its own: an interaction is then sent
                # before the next message is read, exactly at its chunk boundary.
                await self._send_due_interactions(ws)
            # The server closes after its terminal message; give it the chance, so the
            # close is its normal one and we learn the close code.
            with trio.move_on_after(_CLOSE_WAIT):
                while True:
                    self._handle(await ws.get_message())
        except ConnectionClosed as exc:
            self.result.close_code = exc.reason.code

    def _handle(self, raw: str | bytes) -> None:
        now = trio.current_time()
        result = self.result
        if self.finished.is_set():
            result.problems.append("message after the terminal message ignored")
            return
        if isinstance(raw, bytes):
            self._handle_binary(raw, now)
            return
        try:
            message = protocol.parse_server_message(raw)
        except protocol.ProtocolError as exc:
            result.problems.append(f"unreadable server message ignored: {exc.message}")
            return
        if self.pending is not None:
            result.problems.append("chunk metadata not followed by its binary message")
            self.pending = None
        result.messages.append(message)
        if isinstance(message, protocol.VideoStart):
            result.video_start = message
            result.video_start_at = now
            echoed = _announced_rate(message.config.get("fps"))
            self.announced_rate = echoed or _announced_rate(result.request.get("fps"))
            result.frame_rate = self.timing.frame_rate or self.announced_rate
        elif isinstance(message, protocol.ChunkMetadata):
            self.pending = message
        elif isinstance(message, protocol.InteractionQueued):
            record = self.records.get(message.event_id)
            if record is not None and record.queued_at is None:
                record.queued_at = now
        elif isinstance(message, protocol.SessionDone):
            result.done = message
            self.finished.set()
        elif isinstance(message, protocol.Error):
            result.errors.append(message)
            record = self.records.get(message.event_id) if message.event_id else None
            if record is not None:
                record.error = message
            # After video.start, an answer to a control message leaves the session going.
            if result.video_start_at is None or message.code not in _CONTROL_ERRORS:
                result.error = message
                self.finished.set()
        if self.on_message is not None:
            self.on_message(message, result)

    def _handle_binary(self, data: bytes, now: float) -> None:
        result = self.result
        metadata, self.pending = self.pending, None
        if metadata is None:
            result.problems.append(f"binary message of {len(data)} bytes without metadata")
        elif metadata.byte_length != len(data):
            result.problems.append(
                f"chunk announced {metadata.byte_length} bytes but carried {len(data)}"
            )
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
            await ws.send_message(protocol.STOP_MESSAGE)
        with trio.move_on_after(self.stop_timeout):
            await self.finished.wait()
            return
        self.result.stop_timed_out = True
        self.aborted = True
        scope.cancel()

    async def _send_due_interactions(self, ws: WebSocketConnection) -> None:
        """Send every interaction whose media time the delivered video has reached."""
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
        while media is not None and self.next_interaction < len(records):
            record = records[self.next_interaction]
            item = record.interaction
            if media < item.at:
                return
            message = protocol.interaction_message(
                item.prompt, event_id=record.event_id, transition_chunks=item.transition_chunks
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


def _seconds(value: float) -> str:
    """``2``, ``0.25``, ``1.333``: short, and never ``2.0000000000000004``."""
    return f"{round(value, 3):g}"


class _StreamTiming:
    """The frame rate written in the fragmented MP4 itself: timescale / sample duration.

    Needed because the rate is often nowhere else: a server echoes ``fps`` in
    ``video.start`` only when the client sent one, and its default is not announced.
    Reads the track timescale (``moov/trak/mdia/mdhd``) and the first fragment's sample
    duration (``trun``, else ``tfhd``, else ``moov/mvex/trex``). Only the first track is
    read: servers of this protocol send one video track. Anything unreadable leaves the
    rate unknown rather than raising, since the video itself may still be fine.
    """

    def __init__(self) -> None:
        self.timescale: int | None = None
        self.trex_duration: int | None = None
        self.frame_rate: Fraction | None = None

    def feed(self, data: bytes) -> None:
        """Read one binary message; call until `frame_rate` is known."""
        try:
            for kind, payload in _mp4_boxes(data):
                if kind == b"moov":
                    self._read_moov(payload)
                elif kind == b"moof" and self.timescale:
                    duration = self._fragment_duration(payload) or self.trex_duration
                    if duration:
                        self.frame_rate = Fraction(self.timescale, duration)
                        return
        except (struct.error, ValueError):
            return

    def _read_moov(self, moov: bytes) -> None:
        trak = _mp4_child(moov, b"trak")
        mdia = _mp4_child(trak, b"mdia") if trak is not None else None
        mdhd = _mp4_child(mdia, b"mdhd") if mdia is not None else None
        if mdhd is not None:
            # Full box: version, flags, then creation and modification times (4 bytes
            # each in version 0, 8 in version 1), then the timescale.
            offset = 4 + (16 if mdhd[0] == 1 else 8)
            (self.timescale,) = struct.unpack_from(">I", mdhd, offset)
        mvex = _mp4_child(moov, b"mvex")
        trex = _mp4_child(mvex, b"trex") if mvex is not None else None
        if trex is not None:
            # version/flags, track_ID, default_sample_description_index, default duration
            (self.trex_duration,) = struct.unpack_from(">I", trex, 12)

    @staticmethod
    def _fragment_duration(moof: bytes) -> int | None:
        traf = _mp4_child(moof, b"traf")
        if traf is None:
            return None
        trun = _mp4_child(traf, b"trun")
        if trun is not None:
            flags = int.from_bytes(trun[1:4], "big")
            if flags & 0x100:  # sample-duration-present
                offset = 8 + (4 if flags & 0x01 else 0) + (4 if flags & 0x04 else 0)
                (duration,) = struct.unpack_from(">I", trun, offset)
                return duration
        tfhd = _mp4_child(traf, b"tfhd")
        if tfhd is not None:
            flags = int.from_bytes(tfhd[1:4], "big")
            if flags & 0x08:  # default-sample-duration-present
                offset = 8 + (8 if flags & 0x01 else 0) + (4 if flags & 0x02 else 0)
                (duration,) = struct.unpack_from(">I", tfhd, offset)
                return duration
        return None


def _mp4_boxes(data: bytes) -> Iterable[tuple[bytes, bytes]]:
    """The (type, payload) of each top-level ISO BMFF box; stops at a malformed one."""
    pos = 0
    while pos + 8 <= len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = len(data) - pos
        if size < header or pos + size > len(data):
            return
        yield kind, data[pos + header : pos + size]
        pos += size


def _mp4_child(payload: bytes, kind: bytes) -> bytes | None:
    return next((body for k, body in _mp4_boxes(payload) if k == kind), None)


def _bearer(key: str) -> bytes:
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


# --------------------------------------------------------------------------------------
# Remuxing
# --------------------------------------------------------------------------------------


class RemuxError(Exception):
    """The received bytes hold no video that could be written."""


def remux_to_mp4(fmp4: bytes, path: str | os.PathLike[str]) -> int:
    """Copy the packets of a fragmented MP4 into a progressive one; returns frames written.

    No re-encoding, so it is fast and lossless. ``faststart`` puts the ``moov`` first so
    the file also streams over HTTP. A stream cut short (no trailer, or damaged at the end)
    keeps every packet that demuxes; the file is written to a temporary name and renamed,
    so ``path`` is never left half-written.
    """
    target = Path(path)
    try:
        source = av.open(io.BytesIO(fmp4), mode="r")
    except (av.error.FFmpegError, ValueError, OSError) as exc:
        raise RemuxError(f"the received data is not a readable MP4 stream: {exc}") from exc
    # Not mkstemp: its 0600 mode would survive the rename; this name honours the umask.
    temp_name = str(target.with_name(f".{target.name}.{os.getpid()}.part"))
    frames = 0
    try:
        with source:
            if not source.streams.video:
                raise RemuxError("the received data holds no video stream")
            in_stream = source.streams.video[0]
            with av.open(
                temp_name, mode="w", format="mp4", options={"movflags": "+faststart"}
            ) as output:
                out_stream = _add_stream_like(output, in_stream)
                try:
                    for packet in source.demux(in_stream):
                        if packet.dts is None:  # the demuxer's end-of-stream marker
                            continue
                        packet.stream = out_stream
                        output.mux(packet)
                        frames += 1
                except av.error.FFmpegError as exc:
                    if frames == 0:
                        raise RemuxError(f"the received video is unreadable: {exc}") from exc
                    # Damaged tail: keep what came before it.
                if frames == 0:
                    raise RemuxError("the received data holds no video frames")
        os.replace(temp_name, target)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(temp_name)
        raise
    return frames


def _add_stream_like(output: Any, template: Any) -> Any:
    # PyAV >= 13 has add_stream_from_template; older versions took template= instead.
    if hasattr(output, "add_stream_from_template"):
        return output.add_stream_from_template(template)
    return output.add_stream(template=template)  # pragma: no cover


# --------------------------------------------------------------------------------------
# Command line
# --------------------------------------------------------------------------------------

_SIZE: Final = re.compile(r"[0-9]+x[0-9]+")

#: Flags that fill a session.start field; --param may not set these again.
_FLAG_FIELDS: Final = {
    "size": "size",
    "seconds": "seconds",
    "num_frames": "num_frames",
    "fps": "fps",
    "seed": "seed",
    "steps": "num_inference_steps",
    "guidance_scale": "guidance_scale",
    "negative_prompt": "negative_prompt",
    "model": "model",
}


def _size(text: str) -> str:
    if not _SIZE.fullmatch(text):
        raise argparse.ArgumentTypeError(f"expected WIDTHxHEIGHT like 640x480, got {text!r}")
    return text


def _non_negative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {value}")
    return value


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
    if not math.isfinite(value) or value <= 0:
        raise argparse.ArgumentTypeError(f"must be a number > 0, got {text!r}")
    return value


def _reject_constant(name: str) -> Any:
    raise ValueError(name)


def _param(text: str) -> tuple[str, Any]:
    """``KEY=VALUE``, VALUE as JSON when it is JSON, else the text itself.

    So ``seed=7`` sends a number and ``user=alice`` a string, while ``num_frames='"30"'``
    can still send a string on purpose. NaN and Infinity are not JSON and stay strings.
    """
    key, sep, raw = text.partition("=")
    key = key.strip()
    if not sep or not key:
        raise argparse.ArgumentTypeError(f"expected KEY=VALUE, got {text!r}")
    try:
        value = json.loads(raw, parse_constant=_reject_constant)
    except ValueError:
        value = raw
    return key, value


def _interaction(text: str) -> tuple[float, str]:
    at_text, sep, prompt = text.partition(":")
    try:
        at = float(at_text)
    except ValueError:
        at = math.nan
    if not sep or not math.isfinite(at) or at < 0 or not prompt.strip():
        raise argparse.ArgumentTypeError(
            f"expected SECONDS:PROMPT like '2.5:a green circle', got {text!r}"
        )
    return at, prompt


def add_client_arguments(parser: argparse.ArgumentParser) -> None:
    """The ``client`` subcommand's flags; kept here so cli.py only wires it in."""
    parser.add_argument("prompt", help="what to generate")
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
        "--url", default=DEFAULT_URL, metavar="URL", help="server endpoint (default %(default)s)"
    )
    parser.add_argument(
        "--api-key",
        metavar="KEY",
        help=f"send 'Authorization: Bearer KEY', for servers started with --api-key "
        f"(default: ${API_KEY_ENV}, which keeps the key out of the process list)",
    )
    request = parser.add_argument_group("session.start fields")
    request.add_argument("--size", type=_size, metavar="WxH", help="frame size, like 640x480")
    request.add_argument(
        "--seconds", type=int, metavar="N", help="video length in seconds (times fps)"
    )
    request.add_argument("--num-frames", type=int, metavar="N", help="video length in frames")
    request.add_argument("--fps", type=int, metavar="N", help="frames per second")
    request.add_argument("--seed", type=int, metavar="N")
    request.add_argument("--steps", type=int, metavar="N", help="num_inference_steps")
    request.add_argument("--guidance-scale", type=float, metavar="X")
    request.add_argument("--negative-prompt", metavar="TEXT")
    request.add_argument("--model", metavar="NAME", help="model name the server must be serving")
    request.add_argument(
        "--image", type=Path, metavar="FILE", help="conditioning image, sent as a data: URL"
    )
    request.add_argument(
        "--param",
        dest="params",
        type=_param,
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="any other session.start field; VALUE is parsed as JSON if it can be (repeatable)",
    )
    steering = parser.add_argument_group("interactions")
    steering.add_argument(
        "--interact",
        dest="interactions",
        type=_interaction,
        action="append",
        default=[],
        metavar="SECONDS:PROMPT",
        help="change the prompt once the video reaches SECONDS of media time (repeatable)",
    )
    steering.add_argument(
        "--transition-chunks",
        type=_non_negative_int,
        metavar="N",
        help="chunks to blend over, for every interaction (default: the server's)",
    )
    parser.add_argument("--json", action="store_true", help="print the summary as one JSON object")
    parser.add_argument(
        "--stop-timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for session.done after Ctrl-C (default %(default)s)",
    )
    parser.add_argument(
        "--connect-timeout",
        type=_positive_float,
        metavar="SECONDS",
        default=10.0,
        help="seconds to wait for the connection (default %(default)s)",
    )


class _UsageError(Exception):
    pass


def _start_fields(args: argparse.Namespace) -> dict[str, Any]:
    fields: dict[str, Any] = {"prompt": args.prompt}
    for attr, name in _FLAG_FIELDS.items():
        value = getattr(args, attr)
        if value is not None:
            fields[name] = str(value) if name == "seconds" else value
    if args.image is not None:
        fields["image_reference"] = {"image_url": _image_data_url(args.image)}
    flagged = dict(fields)
    for key, value in args.params:
        if key == "type":
            raise _UsageError("--param type: the message type is always session.start")
        if key in flagged:
            raise _UsageError(f"--param {key} conflicts with a value given by another flag")
        fields[key] = value
    return fields


_IMAGE_SIGNATURES: Final = (
    (b"\x89PNG\r\n\x1a\n", "image/png"),
    (b"\xff\xd8\xff", "image/jpeg"),
    (b"GIF87a", "image/gif"),
    (b"GIF89a", "image/gif"),
    (b"BM", "image/bmp"),
    (b"II*\x00", "image/tiff"),
    (b"MM\x00*", "image/tiff"),
)


def _image_mime(data: bytes, path: Path) -> str | None:
    """The media type from the file's content; the name is only a fallback."""
    for signature, mime in _IMAGE_SIGNATURES:
        if data.startswith(signature):
            return mime
    if data[:4] == b"RIFF" and data[8:12] == b"WEBP":
        return "image/webp"
    if data[4:8] == b"ftyp" and data[8:12] in (b"avif", b"avis"):
        return "image/avif"
    guessed, _ = mimetypes.guess_type(path.name)
    return guessed if guessed is not None and guessed.startswith("image/") else None


def _image_data_url(path: Path) -> str:
    try:
        data = path.read_bytes()
    except OSError as exc:
        raise _UsageError(f"--image {path}: {exc.strerror or exc}") from exc
    if not data:
        raise _UsageError(f"--image {path}: the file is empty")
    mime = _image_mime(data, path)
    if mime is None:
        raise _UsageError(f"--image {path}: not a recognised image file")
    return f"data:{mime};base64,{base64.b64encode(data).decode('ascii')}"


def _check_output(path: Path | None, flag: str) -> None:
    """Fail before streaming, not after minutes of generation."""
    if path is None:
        return
    if path.is_dir():
        raise _UsageError(f"{flag} {path}: is a directory")
    parent = path.parent
    if not parent.is_dir():
        raise _UsageError(f"{flag} {path}: directory {parent} does not exist")
    if not os.access(parent, os.W_OK):
        raise _UsageError(f"{flag} {path}: directory {parent} is not writable")


def _api_key(args: argparse.Namespace) -> str | None:
    """``--api-key``, else the environment's key; None when neither is set.

    Checked here rather than by an argparse ``type``, whose error would echo the key.
    """
    key = args.api_key if args.api_key is not None else os.environ.get(API_KEY_ENV)
    if key is None or (args.api_key is None and not key.strip()):
        return None  # an empty variable is an unset one, as the server reads it
    key = key.strip()
    try:
        _bearer(key)
    except ValueError as exc:
        source = "--api-key" if args.api_key is not None else API_KEY_ENV
        raise _UsageError(f"{source}: {exc}") from None
    return key


def _check_url(url: str) -> None:
    parts = urlsplit(url)
    if parts.scheme not in ("ws", "wss") or not parts.hostname:
        raise _UsageError(f"--url must be a ws:// or wss:// URL, got {url!r}")


class _Progress:
    """The ``\\r``-updated status line; silent unless stderr is a terminal."""

    def __init__(self, stream: TextIO, enabled: bool) -> None:
        self.stream = stream
        self.enabled = enabled
        self.result: StreamResult | None = None
        self.started = 0.0  # set inside trio.run, where the Trio clock exists
        self.stopping = False
        self._shown = False
        self._drawn_at = -math.inf

    def update(self, _event: object, result: StreamResult) -> None:
        """Fits both `stream_video` callbacks; redraws at most ten times a second."""
        self.result = result
        if self.enabled and trio.current_time() - self._drawn_at >= 0.1:
            self.draw()

    def draw(self) -> None:
        if not self.enabled:
            return
        now = trio.current_time()
        result = self.result
        chunks = frames = 0
        fps = 0.0
        phase = "connecting"
        if result is not None:
            chunks, frames = len(result.chunks), result.frames
            phase = "streaming" if result.video_start_at is not None else "starting"
            if result.video_start_at is not None and frames:
                span = (result.last_media_at or now) - result.video_start_at
                fps = frames / span if span > 0 else 0.0
        if self.stopping:
            phase = "stopping"
        line = (
            f"{phase}: {chunks} chunks, {frames} frames, {fps:.1f} fps, {now - self.started:.1f} s"
        )
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()
        self._shown = True
        self._drawn_at = now

    def note(self, text: str) -> None:
        """A message on its own line, without tearing the status line."""
        if not self.enabled:
            return
        self.clear()
        self.stream.write(text + "\n")
        self.stream.flush()
        self.draw()

    def clear(self) -> None:
        if self._shown:
            self.stream.write("\r\x1b[K")
            self.stream.flush()
            self._shown = False

    async def run(self) -> None:
        """Redraw while the stream runs, so elapsed time moves even between chunks."""
        while True:
            self.draw()
            await trio.sleep(0.25)


@attrs.define
class _Run:
    """What the async part hands back to `run_client` (also after a late Ctrl-C)."""

    result: StreamResult | None = None
    connect_error: StreamConnectError | None = None


async def _run_async(
    args: argparse.Namespace,
    api_key: str | None,
    fields: dict[str, Any],
    interactions: Sequence[ScheduledInteraction],
    progress: _Progress,
    run: _Run,
) -> None:
    stop_event, abort_event = trio.Event(), trio.Event()
    progress.started = trio.current_time()

    async def watch_signals(signals: AsyncIterator[int]) -> None:
        # First signal: stop cleanly and keep what arrives; second: give up now.
        async for signum in signals:
            if not stop_event.is_set():
                stop_event.set()
                progress.stopping = True
                progress.note(
                    f"{signal.Signals(signum).name}: stopping (sent session.stop); "
                    "press Ctrl-C again to quit now"
                )
            else:
                abort_event.set()

    with trio.open_signal_receiver(signal.SIGINT, signal.SIGTERM) as signals:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(watch_signals, signals)
            if progress.enabled:
                nursery.start_soon(progress.run)
            try:
                run.result = await stream_video(
                    args.url,
                    fields,
                    interactions=interactions,
                    on_chunk=progress.update,
                    on_message=progress.update,
                    stop_event=stop_event,
                    abort_event=abort_event,
                    stop_timeout=args.stop_timeout,
                    connect_timeout=args.connect_timeout,
                    api_key=api_key,
                )
            except StreamConnectError as exc:
                run.connect_error = exc
            nursery.cancel_scope.cancel()


def run_client(args: argparse.Namespace, *, stdout: TextIO | None = None) -> int:
    """The ``client`` subcommand; returns the exit status (see the README's table)."""
    out = stdout or sys.stdout
    err = sys.stderr
    try:
        if args.output is None and args.raw is None:
            raise _UsageError("nothing to write: give -o/--output FILE.mp4 and/or --raw FILE")
        _check_url(args.url)
        _check_output(args.output, "--output")
        _check_output(args.raw, "--raw")
        fields = _start_fields(args)
        api_key = _api_key(args)
    except _UsageError as exc:
        print(f"python -m trio_vstream client: error: {exc}", file=err)
        return EXIT_USAGE
    interactions = [
        ScheduledInteraction(at=at, prompt=prompt, transition_chunks=args.transition_chunks)
        for at, prompt in args.interactions
    ]

    run = _Run()
    progress = _Progress(err, enabled=err.isatty())
    try:
        trio.run(_run_async, args, api_key, fields, interactions, progress, run)
    except KeyboardInterrupt:
        # A signal outside the receiver's lifetime: before it was installed (nothing
        # received yet) or just after the stream ended (the result is in `run`).
        if run.result is None:
            print("interrupted", file=err)
            return EXIT_INTERRUPTED
    finally:
        progress.clear()
    if run.connect_error is not None:
        print(f"error: {_connect_error_line(run.connect_error)}", file=err)
        return EXIT_CONNECTION
    result = run.result
    assert result is not None
    return _finish(args, result, out, err)


def _connect_error_line(exc: StreamConnectError) -> str:
    """The one line for a failed connection; a 401 also names the two ways to give the
    key, since that is the whole fix (and never shows the key that was refused)."""
    hint = f" (--api-key or {API_KEY_ENV})" if exc.status_code == 401 else ""
    return f"{exc}{hint}"


def _finish(args: argparse.Namespace, result: StreamResult, out: TextIO, err: TextIO) -> int:
    """Report errors, write the files, print the summary, pick the exit status.

    A rejected session (an error before ``video.start``) gets only the server's error:
    there is no video, no interaction could have been sent, and a summary of dashes
    would only bury the one line that matters. ``--json`` still prints its object, for
    the programs that read it.
    """
    answered = [record.error for record in result.interactions if record.error is not None]
    for error in result.errors:
        if error is not result.error and any(error is e for e in answered):
            continue  # reported below, with the interaction it refused
        where = f" (event {error.event_id})" if error.event_id else ""
        label = "error" if error is result.error else "warning"
        print(f"{label}: server error {error.code}{where}: {error.message}", file=err)
    if not result.rejected:
        for record in result.interactions:
            what = (
                f"{record.event_id} {json.dumps(record.interaction.prompt, ensure_ascii=False)}"
                f" (at {_seconds(record.interaction.at)} s)"
            )
            if record.error is result.error and record.error is not None:
                continue  # the error line above names its event already
            if record.error is not None:
                print(
                    f"warning: {what} rejected by the server: "
                    f"{record.error.code}: {record.error.message}",
                    file=err,
                )
            elif record.not_sent is not None:
                print(f"warning: {what} not sent: {record.not_sent}", file=err)
    for problem in result.problems:
        print(f"warning: {problem}", file=err)
    if result.outcome is Outcome.DISCONNECTED:
        print(
            f"error: the connection to {result.url} ended before the session did"
            + (f" (close code {result.close_code})" if result.close_code is not None else ""),
            file=err,
        )
    elif result.outcome is Outcome.ABORTED:
        reason = (
            f"no session.done within {args.stop_timeout:g} s of session.stop"
            if result.stop_timed_out
            else "interrupted"
        )
        print(f"error: gave up: {reason}", file=err)

    written: dict[str, Any] = {"output": None, "output_frames": None, "raw": None}
    output_failed = False
    try:
        if args.raw is not None:
            with open(args.raw, "wb") as raw_file:
                for data in result.binary_messages:
                    raw_file.write(data)
            written["raw"] = str(args.raw)
        if args.output is not None:
            if not result.binary_messages:
                if not result.rejected:
                    print(f"warning: no video arrived; {args.output} not written", file=err)
            else:
                try:
                    written["output_frames"] = remux_to_mp4(result.video, args.output)
                    written["output"] = str(args.output)
                except RemuxError as exc:
                    print(f"warning: {args.output} not written: {exc}", file=err)
    except OSError as exc:
        print(f"error: cannot write output: {exc}", file=err)
        output_failed = True
    except KeyboardInterrupt:
        print("interrupted while writing the output", file=err)
        return EXIT_INTERRUPTED

    summary = result.summary()
    summary.update(written)
    try:
        if args.json:
            print(json.dumps(summary), file=out)
        elif not result.rejected:
            _print_summary(summary, out)
        out.flush()
    except BrokenPipeError:
        # `... --json | head`: the reader left; the files are written, so carry on quietly
        # (and keep Python from complaining again when it flushes stdout at exit).
        with contextlib.suppress(OSError):
            os.dup2(os.open(os.devnull, os.O_WRONLY), out.fileno())

    if result.outcome is Outcome.ERROR:
        return EXIT_SERVER_ERROR
    if result.outcome is Outcome.DISCONNECTED:
        return EXIT_CONNECTION
    if result.outcome is Outcome.ABORTED:
        return EXIT_INTERRUPTED
    return EXIT_OUTPUT if output_failed else EXIT_OK


def _print_summary(summary: dict[str, Any], out: TextIO) -> None:
    def seconds(value: float | None) -> str:
        return "-" if value is None else f"{value:.3f} s"

    outcome = summary["outcome"]
    if summary["error"] is not None:
        outcome += f" ({summary['error']['code']})"
    fps = summary["delivered_fps"]
    rows = [
        ("outcome", outcome),
        ("request id", summary["request_id"] or "-"),
        ("seed", "unknown" if summary["seed"] is None else str(summary["seed"])),
        ("time to video.start", seconds(summary["time_to_video_start_s"])),
        ("time to first chunk", seconds(summary["time_to_first_chunk_s"])),
        ("frames", str(summary["frames"])),
        ("delivered fps", "-" if fps is None else f"{fps:.2f}"),
        ("bytes", str(summary["bytes"])),
        ("chunks", str(summary["chunks"])),
    ]
    if summary["interactions"]:
        sent = sum(1 for i in summary["interactions"] if i["sent_s"] is not None)
        queued = sum(1 for i in summary["interactions"] if i["queued"])
        rows.append(
            (
                "interactions",
                f"{len(summary['interactions'])} planned, {sent} sent, {queued} queued",
            )
        )
    if summary["output"] is not None:
        rows.append(("wrote", f"{summary['output']} ({summary['output_frames']} frames)"))
    if summary["raw"] is not None:
        rows.append(("wrote", f"{summary['raw']} (raw fragmented MP4)"))
    width = max(len(name) for name, _ in rows)
    for name, value in rows:
        print(f"{name:<{width}}  {value}", file=out)
