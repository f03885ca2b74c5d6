"""`stream_video`: one session over a real WebSocket, built on `protocol.ClientProtocol`.

The protocol machine does the protocol (pairing metadata with binary messages, telling
a terminal error from an answer to a control message); this module adds the I/O and
what a caller wants from a session: timings, interactions sent at their media time,
stop and abort, and a `StreamResult` handed back whatever way the session ended,
because a partial video is still worth keeping. Protocol slips of the server are
therefore recorded in ``result.problems`` rather than raised.

This module opens the connection (the key, the sizes, the timeouts) and settles the
result once it closes; what happens on it, message by message, is `StreamRun`'s
(``_stream_run``). A connection that could not be made is the one failure raised, as a
`StreamConnectError` that says why in a person's words (a refused handshake's status,
"Connection refused" rather than trio's list of attempts).
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Final

import trio
from trio_websocket import (
    ConnectionRejected,
    ConnectionTimeout,
    HandshakeError,
    open_websocket_url,
)

from trio_vstream import protocol
from trio_vstream.client._input_video import InputSource, VideoFile, input_request, probe_video
from trio_vstream.client._results import (
    InteractionRecord,
    ScheduledInteraction,
    StreamConnectError,
    StreamResult,
)
from trio_vstream.client._stream_run import CLOSE_WAIT, ChunkCallback, MessageCallback, StreamRun
from trio_vstream.client._viewer import check_startup

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
    input_video: str | os.PathLike[str] | None = None,
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
    with ``status_code`` set when the server refused the handshake; but a refusal that
    says why with an ``error`` message (a full server's HTTP 503 carries ``server_busy``)
    is returned as the session's outcome ``error``, as if the server had said it on the
    connection.

    ``playback`` watches as a person would: a `PlaybackViewer` (in ``result.viewer``)
    plays what arrives at 1x from the first frame (after ``startup_seconds`` of media
    are buffered), and counts its stalls. When the request opted into vllm-omni's pacing
    (``streaming_buffer_seconds``), its playhead also goes to the server, in
    ``session.playback`` about every 100 ms: the real one, never moved on to hide a
    stall. A startup threshold at or above that window raises `ValueError` (the server
    would stop before the viewer starts, and both would wait for ever).

    ``input_video``, a video file's path, makes the session follow it (for engines that
    take video input): ``session.start`` gets an ``input_video`` block, the caller's own
    in ``start_fields`` (``strength``, ``on_end``, ...) completed with the format (JPEG),
    the file's frame rate (rounded, 1..60) and a size (the output's when ``start_fields``
    give it, else the file's within the default limits). After ``video.start`` the file's
    frames go one binary message each, read lazily, resampled to that rate, paced to
    stay about a second ahead of what the chunks report using (``input_frames``) and no
    faster than the rate; then ``input_video.end``. A stop ends the sending. The file
    is opened before connecting: one that is not a video raises `ValueError`.
    ``result.input_frames_sent`` and ``result.input_frames`` count what went and what
    the chunks made of it.
    """
    fields = dict(start_fields)
    source = None
    if input_video is not None:
        video = await trio.to_thread.run_sync(_probe, input_video)
        fields["input_video"] = block = input_request(fields, video)
        source = InputSource(
            video=video, fps=block["fps"], width=block["width"], height=block["height"]
        )
    buffer_seconds = fields.get("streaming_buffer_seconds")
    if playback and isinstance(buffer_seconds, int | float):
        check_startup(startup_seconds, float(buffer_seconds))
    elif playback:
        check_startup(startup_seconds, None)
    machine = protocol.ClientProtocol()
    start_text = machine.start(**fields)  # raises ValueError on a malformed request

    result = StreamResult(url=url, request=fields, started_at=trio.current_time())
    if source is not None:
        result.input_frames_sent = 0
    result.interactions = [
        InteractionRecord(interaction=item, event_id=item.event_id or f"interaction-{number}")
        for number, item in enumerate(sorted(interactions, key=lambda i: i.at), start=1)
    ]
    session = StreamRun(
        result,
        machine,
        stop_event=stop_event if stop_event is not None else trio.Event(),
        stop_timeout=stop_timeout,
        on_chunk=on_chunk,
        on_message=on_message,
    )
    session.input = source
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
    session = StreamRun(
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
    session: StreamRun,
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
                disconnect_timeout=CLOSE_WAIT,
                extra_headers=extra_headers,
            ) as ws:
                await session.run(ws, start_text)
        except HandshakeError as exc:
            # Also raised by a slow close (DisconnectionTimeout); only a failure to
            # connect is fatal, since afterwards the data is in hand.
            if result.start_sent_at is None:
                rejected = exc if isinstance(exc, ConnectionRejected) else None
                # A refusal that says why in an error message is the session's outcome.
                if rejected is None or not session.refused(rejected.body):
                    session.connect_failure = _describe_handshake(exc)
                    session.connect_status = rejected.status_code if rejected else None
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


def _probe(path: str | os.PathLike[str]) -> VideoFile:
    """`probe_video`, its `ValueError` naming the file (the caller may have several)."""
    try:
        return probe_video(path)
    except ValueError as exc:
        raise ValueError(f"input video {os.fspath(path)}: {exc}") from None


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
    503: "the server is unavailable (draining, wedged, or at its connection cap); try "
    "again or another server",
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
