"""Sans-IO wire protocol of the ``/v1/realtime/video`` WebSocket endpoint.

Everything here is pure: text or bytes in, attrs objects (or a `ProtocolError`) out, and
back again. Keeping I/O out means the same rules serve the Trio server, clients and tests,
and every validation rule can be tested without a socket. Nothing here imports Trio or
an engine.

The wire format, the error texts and the order of checks follow the vllm-omni reference
handler, because existing clients match on those texts. Where the reference coerces or
silently ignores input (pydantic's lax mode, unknown keys), this package is strict: a
request that says ``"num_frames": "30"`` or ``"promt": ...`` is a client bug, and a
clear error is cheaper than a video that is not what was asked for.

The public names all live here; the private modules are the seams behind them, one
concern each. What each holds is in the layout map, ``docs/architecture.md`` (kept there
only, so that a new module is one edit).

Dependencies point one way, down: ``_client`` and ``_start`` build on ``_messages``,
``_camera_script`` and ``_codec_options``, which build on ``_wire`` and ``_camera_keys``,
which build on ``_errors`` and ``_limits``. All imports are at the top of each module;
the import-linter contracts in ``pyproject.toml`` keep it so.
"""

from trio_vstream.protocol._camera_keys import CAMERA_KEYS, key_velocity
from trio_vstream.protocol._camera_script import (
    CAMERA_SCRIPT_PARAM,
    FRAMES_PER_SCRIPT_CHUNK,
    ScriptedCamera,
)
from trio_vstream.protocol._client import (
    CONTROL_ERROR_CODES,
    ChunkAnnounced,
    ChunkReceived,
    ClientProtocol,
    ClientState,
    ErrorReceived,
    Event,
    InteractionAccepted,
    PongReceived,
    ServerProtocolError,
    SessionEnded,
    VideoStarted,
    WatchStarted,
)
from trio_vstream.protocol._codec_options import (
    CODEC_OPTION_NAMES,
    CODEC_OPTIONS_PARAM,
    CodecOptionError,
    check_codec_options,
)
from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._limits import (
    DEFAULT_LIMITS,
    MAX_PENDING_INTERACTIONS,
    MAX_STREAMING_BUFFER_SECONDS,
    Limits,
)
from trio_vstream.protocol._messages import (
    AUDIO_CODEC,
    DEFAULT_TRANSITION_CHUNKS,
    PING_MESSAGE,
    STOP_MESSAGE,
    ChunkMetadata,
    ControlMessage,
    Error,
    Interaction,
    InteractionQueued,
    Ping,
    Playback,
    Pong,
    ServerMessage,
    SessionDone,
    Stop,
    VideoStart,
    WatchStart,
    audio_config,
    interaction_message,
    parse_control,
    parse_server_message,
    playback_message,
    start_message,
)
from trio_vstream.protocol._recording import (
    RECORDING_FORMAT,
    RECORDING_FORMAT_VERSION,
    RECORDING_READABLE_VERSIONS,
)
from trio_vstream.protocol._start import (
    DEFAULT_VIDEO_DEFAULTS,
    INTERACTION_SCRIPT_PARAM,
    MAX_FPS,
    PACING_PARAMS,
    ImageInput,
    ImageReference,
    ImageURL,
    Pacing,
    ScriptedInteraction,
    SessionStart,
    VideoParams,
    VideoRequest,
    VideoSettings,
    parse_start,
)
from trio_vstream.protocol._wire import safe_text
from trio_vstream.values import Camera, VideoDefaults

__all__ = [
    "AUDIO_CODEC",
    "CAMERA_KEYS",
    "CAMERA_SCRIPT_PARAM",
    "CODEC_OPTIONS_PARAM",
    "CODEC_OPTION_NAMES",
    "CONTROL_ERROR_CODES",
    "DEFAULT_LIMITS",
    "DEFAULT_TRANSITION_CHUNKS",
    "DEFAULT_VIDEO_DEFAULTS",
    "FRAMES_PER_SCRIPT_CHUNK",
    "INTERACTION_SCRIPT_PARAM",
    "MAX_FPS",
    "MAX_PENDING_INTERACTIONS",
    "MAX_STREAMING_BUFFER_SECONDS",
    "PACING_PARAMS",
    "PING_MESSAGE",
    "RECORDING_FORMAT",
    "RECORDING_FORMAT_VERSION",
    "RECORDING_READABLE_VERSIONS",
    "STOP_MESSAGE",
    "Camera",
    "ChunkAnnounced",
    "ChunkMetadata",
    "ChunkReceived",
    "ClientProtocol",
    "ClientState",
    "CodecOptionError",
    "ControlMessage",
    "Error",
    "ErrorCode",
    "ErrorReceived",
    "Event",
    "ImageInput",
    "ImageReference",
    "ImageURL",
    "Interaction",
    "InteractionAccepted",
    "InteractionQueued",
    "Limits",
    "Pacing",
    "Ping",
    "Playback",
    "Pong",
    "PongReceived",
    "ProtocolError",
    "ScriptedCamera",
    "ScriptedInteraction",
    "ServerMessage",
    "ServerProtocolError",
    "SessionDone",
    "SessionEnded",
    "SessionStart",
    "Stop",
    "VideoDefaults",
    "VideoParams",
    "VideoRequest",
    "VideoSettings",
    "VideoStart",
    "VideoStarted",
    "WatchStart",
    "WatchStarted",
    "audio_config",
    "check_codec_options",
    "interaction_message",
    "key_velocity",
    "parse_control",
    "parse_server_message",
    "parse_start",
    "playback_message",
    "safe_text",
    "start_message",
]
