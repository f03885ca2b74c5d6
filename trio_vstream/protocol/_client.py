"""The client side of one session, as a sans-IO state machine: text and bytes in, events out.

Every client of the protocol (``trio_vstream.client``, the benchmark, the evaluator)
needs the same bookkeeping: pair each ``video.chunk_metadata`` with the binary message
that follows it, check its ``byte_length``, tell an error that ends the session from one
that only answers a bad control message, and notice a server that keeps talking after
its terminal message. `ClientProtocol` does that once, without sockets, clocks or Trio
(the shape of h11's and wsproto's connections), so that each client only wraps it with
its own I/O and every rule is tested as a table of messages in and events out.

API::

    proto = ClientProtocol()
    await ws.send_message(proto.start(prompt="a cat", fps=8))     # -> str
    for event in proto.receive(await ws.get_message()):           # str | bytes
        match event:
            case VideoStarted(start): ...
            case WatchStarted(start): ...                         # a viewer's first message
            case ChunkAnnounced(metadata): ...                    # its bytes come next
            case ChunkReceived(metadata, data): ...               # a paired chunk
            case InteractionAccepted(queued): ...                 # .event_id
            case PongReceived(pong): ...
            case ErrorReceived(error, ends_session): ...
            case SessionEnded(done): ...
    proto.interact("a dog", event_id="e1", transition_chunks=2)   # -> str
    proto.interact(camera=key_velocity([{"w"}]))                  # a camera (key_velocity:
                                                                  # vllm-omni's WASD mapping)
    proto.playback(1.25)                                          # -> str: the playhead,
                                                                  # after opting in with
                                                                  # streaming_buffer_seconds
    proto.ping()                                                  # -> str
    proto.stop()                                                  # -> str

A viewer of a watch link (this project's extension) sends nothing to start: it feeds
what arrives to a fresh `ClientProtocol`, whose ``watch.start`` moves it to streaming
like a ``video.start``; it may ping, and control messages get ``read_only``.

`state` is a `ClientState`; `chunks`, `frames` and `media_bytes` count what arrived.
Sending in the wrong state (an interaction after the end, a second ``start``) raises
`RuntimeError`: that is a bug of the caller, not of the server.

A server that breaks the protocol makes `receive` raise `ServerProtocolError`. The
state is then already consistent, and the exception says what the message still
yielded (``events``, ``data``), so that a lenient client (``stream_video``, which keeps
whatever video arrived) can record the problem and go on, while a strict one (a test, a
conformance check) simply lets it propagate. Reference-server quirks are not
violations: metadata without ``transport_chunk_index`` and errors without ``code``
are understood (see `parse_server_message`).
"""

import enum
import math
from typing import Any, Final, TypeAlias

import attrs

from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._messages import (
    PING_MESSAGE,
    STOP_MESSAGE,
    ChunkMetadata,
    Error,
    InteractionQueued,
    Pong,
    SessionDone,
    VideoStart,
    WatchStart,
    interaction_message,
    parse_server_message,
    playback_message,
    start_message,
)
from trio_vstream.values import Camera

__all__ = [
    "CONTROL_ERROR_CODES",
    "ChunkAnnounced",
    "ChunkReceived",
    "ClientProtocol",
    "ClientState",
    "ErrorReceived",
    "Event",
    "InteractionAccepted",
    "PongReceived",
    "ServerProtocolError",
    "SessionEnded",
    "VideoStarted",
    "WatchStarted",
]

#: Codes of errors that answer a control message: after ``video.start`` the session
#: goes on (before it, every error ends the session).
CONTROL_ERROR_CODES: Final = frozenset(
    {
        ErrorCode.INVALID_JSON,
        ErrorCode.INVALID_MESSAGE,
        ErrorCode.UNKNOWN_TYPE,
        ErrorCode.MESSAGE_TOO_LARGE,
        ErrorCode.EVENT_ID_CONFLICT,
        ErrorCode.INTERACTION_FAILED,
        ErrorCode.READ_ONLY,
        # Not strict, a refused input frame is counted and the session goes on; strict,
        # the session ends with it, and the close that follows says so.
        ErrorCode.INVALID_INPUT_FRAME,
    }
)


class ClientState(enum.Enum):
    """Where the session stands, from the client's side."""

    IDLE = "idle"
    """Nothing sent yet."""
    STARTING = "starting"
    """``session.start`` sent; waiting for ``video.start``."""
    STREAMING = "streaming"
    """``video.start`` received; chunks arrive."""
    STOPPING = "stopping"
    """``session.stop`` sent; waiting for ``session.done``."""
    DONE = "done"
    """``session.done`` received: the session is over."""
    FAILED = "failed"
    """An ``error`` ended the session."""


# --------------------------------------------------------------------------------------
# Events
# --------------------------------------------------------------------------------------


@attrs.frozen
class VideoStarted:
    """``video.start``: the server accepted the session."""

    start: VideoStart

    @property
    def message(self) -> VideoStart:
        return self.start


@attrs.frozen
class WatchStarted:
    """``watch.start``: a viewer of a watch link is in; the session's chunks follow."""

    start: WatchStart

    @property
    def message(self) -> WatchStart:
        return self.start


@attrs.frozen
class ChunkAnnounced:
    """``video.chunk_metadata``: the next message is its binary (then `ChunkReceived`)."""

    metadata: ChunkMetadata

    @property
    def message(self) -> ChunkMetadata:
        return self.metadata


@attrs.frozen
class ChunkReceived:
    """A binary message, paired with the metadata that announced it."""

    metadata: ChunkMetadata
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")

    @property
    def num_frames(self) -> int:
        """Video frames in the chunk: 0 for the trailer."""
        return self.metadata.num_frames if self.metadata.kind == "media" else 0


@attrs.frozen
class InteractionAccepted:
    """``session.interaction.queued``: the engine took the prompt change."""

    queued: InteractionQueued

    @property
    def message(self) -> InteractionQueued:
        return self.queued

    @property
    def event_id(self) -> str:
        return self.queued.event_id


@attrs.frozen
class PongReceived:
    """``session.pong``: the answer to `ClientProtocol.ping`."""

    pong: Pong

    @property
    def message(self) -> Pong:
        return self.pong


@attrs.frozen
class ErrorReceived:
    """An ``error``; ``ends_session`` says whether the session is over because of it."""

    error: Error
    ends_session: bool

    @property
    def message(self) -> Error:
        return self.error


@attrs.frozen
class SessionEnded:
    """``session.done``: the last message of a session not ended by an error."""

    done: SessionDone

    @property
    def message(self) -> SessionDone:
        return self.done


Event: TypeAlias = (
    VideoStarted
    | WatchStarted
    | ChunkAnnounced
    | ChunkReceived
    | InteractionAccepted
    | PongReceived
    | ErrorReceived
    | SessionEnded
)


class ServerProtocolError(ProtocolError):
    """The server broke the protocol; the message says how.

    ``events`` are what the offending message still yielded once the slip was set aside
    (already applied to the state); ``data`` is a binary message that nothing announced,
    handed back so that a lenient caller can keep it.
    """

    def __init__(
        self,
        message: str,
        *,
        code: ErrorCode = ErrorCode.INVALID_MESSAGE,
        events: list[Event] | None = None,
        data: bytes | None = None,
    ) -> None:
        super().__init__(code, message)
        self.events: list[Event] = events if events is not None else []
        self.data = data


_ENDED: Final = frozenset({ClientState.DONE, ClientState.FAILED})


class ClientProtocol:
    """One session's client side; see the module docstring for the API."""

    def __init__(self) -> None:
        self.state = ClientState.IDLE
        self.video_start: VideoStart | None = None
        self.watch_start: WatchStart | None = None
        """Set instead of ``video_start`` for a viewer of a watch link."""
        self.chunks = 0
        """Binary messages received (media chunks and the trailer)."""
        self.frames = 0
        """Video frames in the media chunks received."""
        self.media_bytes = 0
        """Bytes of the fragmented MP4 stream received: all binary messages together."""
        self._pending: ChunkMetadata | None = None

    @property
    def ended(self) -> bool:
        """A terminal message (``session.done``, or an error that ends it) arrived."""
        return self.state in _ENDED

    # -------------------------------------------------------------------- sending

    def start(self, **fields: Any) -> str:
        """The ``session.start`` text; fields go as given, the server validates them."""
        if "type" in fields:
            raise ValueError("start_fields must not contain 'type'; it is always session.start")
        prompt = fields.pop("prompt", None)
        if not isinstance(prompt, str):
            raise ValueError("start_fields needs a 'prompt' string")
        self._require("start", ClientState.IDLE)
        self.state = ClientState.STARTING
        return start_message(prompt, **fields)

    def interact(
        self,
        prompt: str | None = None,
        event_id: str | None = None,
        transition_chunks: int | None = None,
        *,
        camera: Camera | None = None,
    ) -> str:
        """A ``session.interaction`` text: a new prompt, a camera, or both.

        No event_id: the server picks one. Neither a prompt nor a camera raises
        `ValueError` (a message every server refuses is a caller bug, like a second
        ``start``); a camera is sent as given, in ``event.multi_modal_data.camera``.
        """
        if prompt is None and camera is None:
            raise ValueError("an interaction needs a prompt, a camera, or both")
        self._require("interact", ClientState.STARTING, ClientState.STREAMING)
        return interaction_message(
            prompt, event_id=event_id, transition_chunks=transition_chunks, camera=camera
        )

    def playback(self, position_seconds: float) -> str:
        """A ``session.playback`` text: the playhead shown, for a session that opted in
        with ``streaming_buffer_seconds`` (the server paces generation to it).

        Only while streaming: before ``video.start`` nothing has been shown, and after a
        stop the session ends at once, paused or not. A position that is negative or
        not finite raises `ValueError`: the server refuses it, so sending one is a bug
        of the caller (build one with `playback_message` to test the refusal).
        """
        if not math.isfinite(position_seconds) or position_seconds < 0:
            raise ValueError(f"a playback position must be finite and >= 0, got {position_seconds}")
        self._require("report playback", ClientState.STREAMING)
        return playback_message(position_seconds)

    def ping(self) -> str:
        """A ``session.ping`` text; keeps a quiet session from hitting the stall timeout."""
        self._require("ping", ClientState.STARTING, ClientState.STREAMING, ClientState.STOPPING)
        return PING_MESSAGE

    def stop(self) -> str:
        """A ``session.stop`` text; the session then ends with ``session.done``."""
        self._require("stop", ClientState.STARTING, ClientState.STREAMING)
        self.state = ClientState.STOPPING
        return STOP_MESSAGE

    def _require(self, action: str, *states: ClientState) -> None:
        if self.state not in states:
            raise RuntimeError(f"cannot {action} in state {self.state.value}")

    # ------------------------------------------------------------------ receiving

    def receive(self, message: str | bytes) -> list[Event]:
        """Feed one WebSocket message; returns its events, or raises `ServerProtocolError`."""
        if self.ended:
            raise ServerProtocolError("message after the terminal message ignored")
        if isinstance(message, bytes | bytearray | memoryview):
            return self._receive_binary(bytes(message))
        try:
            parsed = parse_server_message(message)
        except ProtocolError as exc:
            raise ServerProtocolError(
                f"unreadable server message ignored: {exc.message}", code=exc.code
            ) from None
        # A text message where a binary was announced: the announced chunk never came.
        stale, self._pending = self._pending is not None, None
        events = [self._receive_message(parsed)]
        if stale:
            raise ServerProtocolError(
                "chunk metadata not followed by its binary message", events=events
            )
        return events

    def _receive_message(self, message: Any) -> Event:
        if isinstance(message, ChunkMetadata):
            self._pending = message
            return ChunkAnnounced(message)
        if isinstance(message, VideoStart):
            self.video_start = message
            if self.state in (ClientState.IDLE, ClientState.STARTING):
                self.state = ClientState.STREAMING
            return VideoStarted(message)
        if isinstance(message, WatchStart):
            self.watch_start = message
            if self.state in (ClientState.IDLE, ClientState.STARTING):
                self.state = ClientState.STREAMING
            return WatchStarted(message)
        if isinstance(message, InteractionQueued):
            return InteractionAccepted(message)
        if isinstance(message, Pong):
            return PongReceived(message)
        if isinstance(message, SessionDone):
            self.state = ClientState.DONE
            return SessionEnded(message)
        assert isinstance(message, Error)
        started = self.video_start is not None or self.watch_start is not None
        ends = not started or message.code not in CONTROL_ERROR_CODES
        if ends:
            self.state = ClientState.FAILED
        return ErrorReceived(message, ends_session=ends)

    def _receive_binary(self, data: bytes) -> list[Event]:
        metadata, self._pending = self._pending, None
        if metadata is None:
            raise ServerProtocolError(
                f"binary message of {len(data)} bytes without metadata", data=data
            )
        chunk = ChunkReceived(metadata, data)
        self.chunks += 1
        self.frames += chunk.num_frames
        self.media_bytes += len(data)
        if metadata.byte_length != len(data):
            raise ServerProtocolError(
                f"chunk announced {metadata.byte_length} bytes but carried {len(data)}",
                events=[chunk],
            )
        return [chunk]
