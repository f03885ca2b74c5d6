"""Every message after ``session.start``, both ways, and the one converter that writes them.

Client to server: `Stop`, `Ping`, `Interaction`, `Playback` (parsed by
`_control.parse_control`, built by `start_message` / `interaction_message` /
`playback_message` or ``to_json``). Server to client: `VideoStart`, `ChunkMetadata`,
`InteractionQueued`, `SessionDone`, `Pong`, `Error` (built by ``to_json``, parsed by
`parse_server_message`, ours or the reference's), and to a viewer of a watch link, this
project's `WatchStart` first.

No message writes its own JSON: ``to_json`` is one method that hands the object to
`_WIRE`, a cattrs converter whose hooks put ``type`` first and leave out the optional
keys the reference leaves out. That keeps the wire text, byte for byte, a property of
the converter rather than of six hand-written functions that drift apart.
"""

from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Literal, TypeAlias

import attrs
import cattrs
from cattrs.gen import make_dict_unstructure_fn

from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._wire import (
    LENIENT_CONVERTER,
    Invalid,
    dump_json,
    load_json,
    show,
    validation_problems,
)
from trio_vstream.values import Camera

__all__ = [
    "AUDIO_CODEC",
    "DEFAULT_TRANSITION_CHUNKS",
    "INPUT_END_MESSAGE",
    "PING_MESSAGE",
    "STOP_MESSAGE",
    "ChunkMetadata",
    "ControlMessage",
    "Error",
    "InputEnd",
    "InputFrameCounts",
    "Interaction",
    "InteractionQueued",
    "Ping",
    "Playback",
    "Pong",
    "ServerMessage",
    "SessionDone",
    "Stop",
    "VideoStart",
    "WatchStart",
    "audio_config",
    "interaction_message",
    "parse_server_message",
    "playback_message",
    "start_message",
]


class _Message:
    """Base of every message class: the ``to_json`` they share, through `_WIRE`."""

    TYPE: ClassVar[str]

    def to_json(self) -> str:
        """The compact text frame, exactly as the wire wants it."""
        return dump_json(_WIRE.unstructure(self))


# --------------------------------------------------------------------------------------
# Client -> server control messages
# --------------------------------------------------------------------------------------


@attrs.frozen
class Stop(_Message):
    """``session.stop``: end the session after the chunk in flight."""

    TYPE: ClassVar[str] = "session.stop"


@attrs.frozen
class Ping(_Message):
    """``session.ping``: keeps the stall clock from running out; answered by `Pong`."""

    TYPE: ClassVar[str] = "session.ping"


@attrs.frozen
class Interaction(_Message):
    """``session.interaction``: steer the running generation: a new prompt, a camera, or both.

    ``event_id`` is None when the client chose none: the server mints one (in the
    session's receive loop), so that this module stays free of randomness and its
    results stay comparable.
    At least one of ``prompt`` and ``camera`` is set (the parser refuses neither); the
    camera travels in vllm-omni's ``event.multi_modal_data.camera`` shape. ``camera``
    comes last, with a default, so that prompt-only code builds one as it always did.
    """

    TYPE: ClassVar[str] = "session.interaction"
    event_id: str | None
    prompt: str | None
    transition_chunks: int | None = None
    camera: Camera | None = None


@attrs.frozen
class Playback(_Message):
    """``session.playback``: where the client's displayed playhead is, in seconds of media.

    vllm-omni's playback feedback, for a session that set ``streaming_buffer_seconds``:
    generation waits at chunk boundaries while the media made is that far ahead of the
    last position reported (`trio_vstream.session.pacing.PlaybackGate`). A finite number >= 0;
    the parser refuses anything else. A session that did not ask for the buffer ignores
    it.
    """

    TYPE: ClassVar[str] = "session.playback"
    position_seconds: float


#: The engine's default for `Interaction.transition_chunks` (not applied here: ``None``
#: on the wire means "let the engine decide").
DEFAULT_TRANSITION_CHUNKS: Final = 3


@attrs.frozen
class InputEnd(_Message):
    """``input_video.end`` (this project's extension): the client has sent its last input
    frame. What follows is the session's ``input_video.on_end``: ``hold`` goes on from
    the last frame, ``end`` completes the video once its output reaches the input's end."""

    TYPE: ClassVar[str] = "input_video.end"


ControlMessage: TypeAlias = Stop | Ping | Interaction | Playback | InputEnd

STOP_MESSAGE: Final = '{"type":"session.stop"}'
INPUT_END_MESSAGE: Final = '{"type":"input_video.end"}'
PING_MESSAGE: Final = '{"type":"session.ping"}'


# The wire shape of an interaction is nested ({"interaction": {"event": {...}}}); these
# two classes describe it, so that the converters (`_WIRE` here, `_control`'s to parse
# it), not hand-written code, walk it. No
# field has a default: cattrs checks fields with defaults after the others, and the
# reference's order of checks is the order declared here (absent keys become null).


@attrs.frozen(kw_only=True)
class InteractionEvent:
    prompt: str | None
    negative_prompt: None
    multi_modal_data: Camera | None
    """Only a camera is known in ``multi_modal_data``, so it structures straight to one."""


@attrs.frozen(kw_only=True)
class InteractionBody:
    event_id: str | None
    event: InteractionEvent
    transition_chunks: int | None


def start_message(prompt: str, **fields: Any) -> str:
    """Build a ``session.start`` for a client; fields go in as given (no validation)."""
    return dump_json({"type": "session.start", "prompt": prompt, **fields})


def interaction_message(
    prompt: str | None,
    event_id: str | None = None,
    transition_chunks: int | None = None,
    *,
    camera: Camera | None = None,
) -> str:
    """Build a ``session.interaction``; a missing event_id lets the server pick one.

    ``prompt`` may be None when a ``camera`` is given (no validation here: a client may
    build a message the server refuses, to test it).
    """
    return Interaction(event_id, prompt, transition_chunks, camera).to_json()


def playback_message(position_seconds: float) -> str:
    """Build a ``session.playback``: the playhead the client has shown, in media seconds.

    vllm-omni's feedback for a session that opted in with ``streaming_buffer_seconds``
    (about every 100 ms as the playhead advances). Sent as given, like `start_message`:
    a client may build a negative one the server refuses, to test it. A NaN or an
    infinity raises `ValueError`: JSON has no way to write one.
    """
    return Playback(position_seconds).to_json()


# --------------------------------------------------------------------------------------
# Server -> client messages
# --------------------------------------------------------------------------------------


@attrs.frozen
class VideoStart(_Message):
    """Accepts the session; ``config`` echoes the request so clients see what is used."""

    TYPE: ClassVar[str] = "video.start"
    request_id: str
    format: str
    config: dict[str, Any]
    watch_path: str | None = None
    """This project's extension: where viewers watch the session (omitted when off)."""
    hls_path: str | None = None
    """This project's extension: the session's Low-Latency HLS playlist, for plain HTTP
    players and caches (``<watch_path>/hls/index.m3u8``; omitted when off)."""
    recording: dict[str, str] | None = None
    """This project's extension, with ``--record``: the recording's ``file`` (its
    request id, ``.mp4``) and, in a fleet, the ``node`` whose ``--record`` directory
    has it (omitted when not recording)."""


@attrs.frozen
class WatchStart(_Message):
    """This project's extension: the first message a viewer of a watch link gets.

    The session's ``request_id`` and ``format``, and its ``config`` as ``video.start``
    echoed it, less what is not the viewers' business (see `trio_vstream.outputs.watch`). Then
    come the same chunks and terminal message as the owner's, from where the viewer
    joined.
    """

    TYPE: ClassVar[str] = "watch.start"
    request_id: str
    format: str
    config: dict[str, Any]


@attrs.frozen(kw_only=True)
class InputFrameCounts:
    """What a chunk made of the input video: ``video.chunk_metadata``'s ``input_frames``.

    Every input frame the client sent is in at most one chunk's ``used`` or ``dropped``
    (a frame refused with ``invalid_input_frame`` counts as dropped too), and in exactly
    one once the video has ended with its input (``on_end: "end"``); frames still waiting
    when a video ends at its ``num_frames`` are in none, since no chunk was made from
    them. ``reused`` counts output frames that had no input of their own in time and were
    made from the last frame before them.
    """

    used: int
    """Input frames this chunk was made from, first used here."""
    dropped: int
    """Input frames that will never be used, noticed while gathering this chunk: too late
    (their output frames were already made), between output frames (an input faster than
    the output), over the buffer or the decode rate, or malformed."""
    reused: int
    """Output frames of this chunk made from an earlier input frame because theirs had not
    arrived within ``max_wait_ms`` (or the input has ended)."""
    first: int | None
    """The index of the first input frame in this chunk's window (None: none yet)."""
    last: int | None
    """The index of the input frame its last output frame was made from (None: none yet):
    a client keeping its input a few frames ahead of this paces itself to the engine."""


@attrs.frozen
class ChunkMetadata(_Message):
    """Describes the binary message that immediately follows it."""

    TYPE: ClassVar[str] = "video.chunk_metadata"
    request_id: str
    kind: Literal["media", "trailer"]
    num_frames: int
    byte_length: int
    generation_chunk_index: int | None
    started_event_ids: tuple[str, ...]
    active_event_ids: tuple[str, ...]
    completed_event_ids: tuple[str, ...]
    #: -1 when parsed from a server that did not send it (older reference versions).
    transport_chunk_index: int
    num_audio_samples: int | None = None
    """A stream with sound only (vllm-omni's name): the PCM samples this chunk's frames
    cover, exactly their duration (a trailer: 0). The AAC in the bytes may lag by an AAC
    frame or two, their timestamps say where each belongs. Left out without sound."""
    audio_sample_rate: int | None = None
    """A stream with sound only (vllm-omni's name): its samples per second."""
    input_frames: InputFrameCounts | None = None
    """A session that follows an input video only (this project's extension): what became
    of the input frames for this chunk. Left out otherwise, and on a trailer."""


AUDIO_CODEC: Final = "mp4a.40.2"
"""The codec of a stream's audio track, as MSE names it: AAC-LC."""


def audio_config(sample_rate: int, channels: int) -> dict[str, Any]:
    """What ``video.start``'s ``config`` says of a stream with sound, under ``"audio"``:
    its sample rate, channels and codec (so a page can ask MSE for both tracks before
    the first chunk arrives). A stream without sound has no ``"audio"`` key."""
    return {"sample_rate": sample_rate, "channels": channels, "codec": AUDIO_CODEC}


@attrs.frozen
class InteractionQueued(_Message):
    """The interaction was handed to the engine; it applies at the next chunk boundary."""

    TYPE: ClassVar[str] = "session.interaction.queued"
    request_id: str
    event_id: str


@attrs.frozen
class SessionDone(_Message):
    """Last message of a session that was not ended by an error."""

    TYPE: ClassVar[str] = "session.done"
    request_id: str
    chunks: int
    stopped: bool


@attrs.frozen
class Pong(_Message):
    """Reply to `Ping`."""

    TYPE: ClassVar[str] = "session.pong"


@attrs.frozen
class Error(_Message):
    """An ``error`` message; keys whose value is ``None`` are left out, as in the reference."""

    TYPE: ClassVar[str] = "error"
    code: ErrorCode | str
    message: str
    request_id: str | None = None
    event_id: str | None = None

    @classmethod
    def from_protocol_error(cls, exc: ProtocolError, request_id: str | None = None) -> "Error":
        """The ``error`` message that answers ``exc``, so callers need not copy fields by
        hand. Here, not on `ProtocolError`: errors sit below messages and import none."""
        return cls(exc.code, exc.message, request_id=request_id, event_id=exc.event_id)


ServerMessage: TypeAlias = (
    VideoStart | WatchStart | ChunkMetadata | InteractionQueued | SessionDone | Pong | Error
)

_SERVER_TYPES: Final[Mapping[str, type[ServerMessage]]] = {
    cls.TYPE: cls
    for cls in (VideoStart, WatchStart, ChunkMetadata, InteractionQueued, SessionDone, Pong, Error)
}


# --------------------------------------------------------------------------------------
# Unstructuring: the wire text of every message
# --------------------------------------------------------------------------------------

#: Keys that go first, in this order, where a message's fields are declared otherwise.
#: The reference writes an error's message before its code.
_KEY_ORDER: Final[Mapping[type, tuple[str, ...]]] = {Error: ("type", "message", "code")}


def _make_wire_converter() -> cattrs.Converter:
    converter = cattrs.Converter()
    # Error codes go out as their strings, known or not.
    converter.register_unstructure_hook(ErrorCode | str, str)

    def factory(cls: type) -> Callable[[Any], dict[str, Any]]:
        if cls is Interaction:
            return _unstructure_interaction(converter)
        attrs.resolve_types(cls)
        # Optional fields (default None) are left out when None, like the reference's
        # ``exclude_none``; a required None (a trailer's generation_chunk_index) is
        # still written as null.
        fields: Callable[[Any], dict[str, Any]] = make_dict_unstructure_fn(
            cls, converter, _cattrs_omit_if_default=True
        )
        head = _KEY_ORDER.get(cls, ("type",))

        def hook(message: Any) -> dict[str, Any]:
            payload = {"type": message.TYPE, **fields(message)}
            return {**{key: payload[key] for key in head}, **payload}

        return hook

    converter.register_unstructure_hook_factory(
        lambda cls: isinstance(cls, type) and issubclass(cls, _Message), factory
    )
    converter.register_unstructure_hook_factory(
        lambda cls: cls in (InteractionBody, InteractionEvent),
        lambda cls: _without_nulls(cls, converter),
    )
    return converter


def _without_nulls(cls: type, converter: cattrs.Converter) -> Callable[[Any], dict[str, Any]]:
    """The interaction's optional keys are left out when null, as clients send them."""
    fields: Callable[[Any], dict[str, Any]] = make_dict_unstructure_fn(cls, converter)

    def hook(value: Any) -> dict[str, Any]:
        return {key: item for key, item in fields(value).items() if item is not None}

    return hook


def _unstructure_interaction(converter: cattrs.Converter) -> Callable[[Any], dict[str, Any]]:
    def hook(message: Interaction) -> dict[str, Any]:
        body = InteractionBody(
            event_id=message.event_id,
            event=InteractionEvent(
                prompt=message.prompt, negative_prompt=None, multi_modal_data=None
            ),
            transition_chunks=message.transition_chunks,
        )
        payload = converter.unstructure(body)
        # Written by hand: the camera's wire shape nests deeper than the type does, and
        # a prompt-only interaction must stay byte-identical (no multi_modal_data key).
        if message.camera is not None:
            payload["event"]["multi_modal_data"] = {"camera": _camera_payload(message.camera)}
        return {"type": message.TYPE, "interaction": payload}

    return hook


def _camera_payload(camera: Camera) -> dict[str, Any]:
    return {
        "mode": camera.mode,
        "data": {"translation": list(camera.translation), "rotation": list(camera.rotation)},
    }


_WIRE: Final = _make_wire_converter()


# --------------------------------------------------------------------------------------
# Structuring server messages
# --------------------------------------------------------------------------------------

# The reference server sends most errors without a code; these are its fixed texts.
_REFERENCE_ERROR_CODES: Final = (
    ("Timeout waiting for session.start", ErrorCode.START_TIMEOUT),
    ("Stall timeout", ErrorCode.STALL_TIMEOUT),
    ("session.start message too large", ErrorCode.MESSAGE_TOO_LARGE),
    ("control message too large", ErrorCode.MESSAGE_TOO_LARGE),
    ("Invalid JSON", ErrorCode.INVALID_JSON),
    ("Invalid session.start", ErrorCode.INVALID_REQUEST),
    ("Model mismatch", ErrorCode.MODEL_MISMATCH),
    ("Unknown message type", ErrorCode.UNKNOWN_TYPE),
    ("session.start must be", ErrorCode.INVALID_MESSAGE),
    ("Expected session.start", ErrorCode.INVALID_MESSAGE),
    ("WebSocket messages must be", ErrorCode.INVALID_MESSAGE),
    ("session.interaction", ErrorCode.INVALID_MESSAGE),
    ("event_id_conflict", ErrorCode.EVENT_ID_CONFLICT),
    ("Failed to apply interaction", ErrorCode.INTERACTION_FAILED),
)


def _error_code(raw_code: Any, message: str) -> ErrorCode | str:
    if raw_code is None:
        for prefix, code in _REFERENCE_ERROR_CODES:
            if message.startswith(prefix):
                return code
        return ErrorCode.INTERNAL_ERROR
    if isinstance(raw_code, bool) or not isinstance(raw_code, str | int):
        raise Invalid(f"code must be a string, got {show(raw_code)}")
    text = str(raw_code)
    try:
        return ErrorCode(text)
    except ValueError:
        return text


def _prepare(cls: type[ServerMessage], data: dict[str, Any]) -> dict[str, Any]:
    """Fill in what the reference leaves out, so the converter sees our full shape."""
    if cls is ChunkMetadata:
        data.setdefault("transport_chunk_index", -1)
        data.setdefault("generation_chunk_index", None)
        for key in ("started_event_ids", "active_event_ids", "completed_event_ids"):
            data.setdefault(key, [])
    elif cls is Error:
        message = data.get("message")
        if not isinstance(message, str):
            raise Invalid(f"message must be a string, got {show(message)}")
        data["code"] = _error_code(data.get("code"), message)
    return data


# `code` is already an ErrorCode or str when it reaches the converter (`_error_code`).
LENIENT_CONVERTER.register_structure_hook(ErrorCode | str, lambda value, _: value)


def parse_server_message(raw: str | bytes) -> ServerMessage:
    """Parse a server's JSON message, ours or the reference's; raises `ProtocolError`.

    Unknown keys are ignored so that clients keep working when servers add fields.
    """
    # No size limit: a client trusts its server, and the transport bounds frames anyway.
    # Lone surrogates are let through: a server that echoes one (the reference does) is
    # still understood; escaped as they arrive, they stay valid text for the client.
    msg = load_json(
        raw,
        max_bytes=2**62,
        too_large="server message too large",
        bad_json="Invalid JSON message",
        from_client=False,
    )
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "Server messages must be JSON objects")
    msg_type = msg.get("type")
    cls = _SERVER_TYPES.get(msg_type) if isinstance(msg_type, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {msg_type}")
    try:
        return LENIENT_CONVERTER.structure(_prepare(cls, dict(msg)), cls)
    except cattrs.ClassValidationError as exc:
        details = "; ".join(validation_problems(exc))
    except Invalid as exc:
        details = str(exc)
    raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"Invalid {msg_type} message: {details}")
