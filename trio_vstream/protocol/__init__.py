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
concern each, and their dependencies point one way, down (the import-linter contracts in
``pyproject.toml`` keep it so; all imports are at the top of each module):

* ``_client``: `ClientProtocol`, a client's side of a session as events;
* ``_start``: ``session.start``, its request model and its resolution into settings;
* ``_input_video``: ``session.start``'s ``input_video``, a session that follows a live
  input video (this project's extension);
* ``_interaction_script``: ``extra_params.interaction_script``, each entry parsed as a
  live interaction is;
* ``_control``: `parse_control`, what a client may send during a session;
* ``_messages``: every message after ``session.start`` and its wire text (one
  converter), and `parse_server_message`; beside it ``_camera_script`` (a camera per
  chunk), ``_codec_options`` (the x264 options a client may set) and
  ``_image_reference`` (an inline image decoded, an https URL checked);
* ``_wire`` (strict JSON and the shared converters) and ``_camera_keys`` (keys to
  camera velocities);
* at the bottom ``_errors``, ``_limits`` and ``_recording`` (the recording format's
  version).
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
from trio_vstream.protocol._control import parse_control
from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._image_reference import ImageInput, ImageURL
from trio_vstream.protocol._input_video import (
    INPUT_FRAME_FORMATS,
    MAX_INPUT_FPS,
    InputVideoRequest,
    InputVideoSettings,
)
from trio_vstream.protocol._interaction_script import (
    INTERACTION_SCRIPT_PARAM,
    ScriptedInteraction,
)
from trio_vstream.protocol._limits import (
    DEFAULT_LIMITS,
    MAX_PENDING_INTERACTIONS,
    MAX_STREAMING_BUFFER_SECONDS,
    Limits,
)
from trio_vstream.protocol._messages import (
    AUDIO_CODEC,
    DEFAULT_TRANSITION_CHUNKS,
    INPUT_END_MESSAGE,
    PING_MESSAGE,
    STOP_MESSAGE,
    ChunkMetadata,
    ControlMessage,
    Error,
    InputEnd,
    InputFrameCounts,
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
    MAX_FPS,
    PACING_PARAMS,
    ImageReference,
    Pacing,
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
    "INPUT_END_MESSAGE",
    "INPUT_FRAME_FORMATS",
    "INTERACTION_SCRIPT_PARAM",
    "MAX_FPS",
    "MAX_INPUT_FPS",
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
    "InputEnd",
    "InputFrameCounts",
    "InputVideoRequest",
    "InputVideoSettings",
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
