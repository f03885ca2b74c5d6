"""``session.start``: the request model and its resolution into settings.

`parse_start` is the whole of the server's first-message handling: strict types and
ranges (through `_wire`'s converter), the reference's ``sampling_params`` lifting,
the inline image, pacing options, the scripts in ``extra_params``, and the video
geometry checked against `Limits` (`_limits`). It sits above `_messages`: an
interaction script's entries are parsed by the very parser live interactions go through.
"""

import base64
import binascii
import ipaddress
import math
import re
import urllib.parse
from typing import Any, Final, Literal, Self

import attrs
import cattrs

from trio_vstream.protocol._camera_script import (
    CAMERA_SCRIPT_PARAM,
    ScriptedCamera,
    camera_script_of,
)
from trio_vstream.protocol._codec_options import (
    CODEC_OPTIONS_PARAM,
    CodecOptionError,
    check_codec_options,
)
from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._limits import DEFAULT_LIMITS, MAX_STREAMING_BUFFER_SECONDS, Limits
from trio_vstream.protocol._messages import Interaction, parse_control
from trio_vstream.protocol._wire import (
    REQUEST_CONVERTER,
    dump_json,
    field_with_checks,
    load_json,
    quote,
    show,
    validation_problems,
)
from trio_vstream.values import Camera, VideoDefaults

# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


DEFAULT_VIDEO_DEFAULTS: Final = VideoDefaults()


# --------------------------------------------------------------------------------------
# Request model
# --------------------------------------------------------------------------------------


MAX_FPS: Final = 240
"""Beyond any display's rate; H.264 time bases overflow far above it."""

# ASCII digits only: `\d` would also match e.g. Arabic-Indic digits.
_SECONDS_PATTERN: Final = r"[1-9][0-9]*"
_SIZE_PATTERN: Final = r"([0-9]+)x([0-9]+)"


@attrs.frozen(kw_only=True)
class VideoParams:
    """The nested ``video_params`` block; the top-level fields of the same name win."""

    width: int | None = field_with_checks(ge=1)
    height: int | None = field_with_checks(ge=1)
    num_frames: int | None = field_with_checks(ge=1)
    fps: int | None = field_with_checks(ge=1, le=MAX_FPS)


@attrs.frozen(kw_only=True)
class ImageReference:
    """``image_reference``: upstream accepts exactly one of the two keys."""

    image_url: str | None = None
    file_id: str | None = None


@attrs.frozen(kw_only=True)
class VideoRequest:
    """The client's request as sent, after strict type and range validation.

    Fields and their order mirror upstream ``VideoGenerationRequest`` so that the
    ``video.start`` config echo has the same shape as the reference's ``model_dump``.
    """

    model: str | None = None
    prompt: str = field_with_checks(default=attrs.NOTHING, nonblank=True)
    seconds: str | None = field_with_checks(
        pattern=_SECONDS_PATTERN, pattern_hint='a whole number of seconds as a string, like "4"'
    )
    size: str | None = field_with_checks(
        pattern=_SIZE_PATTERN, pattern_hint='"WIDTHxHEIGHT", like "1280x720"'
    )
    image_reference: ImageReference | None = None
    video_params: VideoParams | None = None
    user: str | None = None
    width: int | None = field_with_checks(ge=1)
    height: int | None = field_with_checks(ge=1)
    fps: int | None = field_with_checks(ge=1, le=MAX_FPS)
    num_frames: int | None = field_with_checks(ge=1)
    negative_prompt: str | None = None
    num_inference_steps: int | None = field_with_checks(ge=1, le=200)
    guidance_scale: float | None = field_with_checks(ge=0, le=20)
    guidance_scale_2: float | None = field_with_checks(ge=0, le=20)
    boundary_ratio: float | None = field_with_checks(ge=0, le=1)
    flow_shift: float | None = None
    true_cfg_scale: float | None = field_with_checks(ge=0, le=20)
    seed: int | None = None
    quality: Literal["lossless", "high"] | None = None
    generate_sound: bool = False
    sound_duration: float | None = field_with_checks(gt=0)
    enable_frame_interpolation: bool = False
    frame_interpolation_exp: int = field_with_checks(default=1, ge=1)
    frame_interpolation_scale: float = field_with_checks(default=1.0, gt=0)
    frame_interpolation_model_path: str | None = None
    lora: dict[str, Any] | None = None
    extra_params: dict[str, Any] | None = None
    streaming_buffer_seconds: float | None = field_with_checks(
        gt=0, le=MAX_STREAMING_BUFFER_SECONDS
    )
    """vllm-omni's playback pacing: generation stays at most this many seconds of media
    ahead of the playhead the client reports with ``session.playback`` (see
    `trio_vstream.session.pacing.PlaybackGate`). None: unpaced, as before."""


_REQUEST_FIELDS: Final = frozenset(f.name for f in attrs.fields(VideoRequest))


@attrs.frozen
class VideoSettings:
    """Resolved video geometry and timing, already checked against `Limits`."""

    width: int
    height: int
    fps: int
    num_frames: int


@attrs.frozen
class ImageInput:
    """A decoded ``data:`` URL; turning the bytes into pixels is the engine side's job."""

    mime_type: str
    data: bytes = attrs.field(repr=lambda data: f"<{len(data)} bytes>")


MAX_IMAGE_URL_CHARS: Final = 2048
"""Longer ``https://`` image URLs are refused (browsers and servers stop near here too)."""

# Dot-separated DNS labels (underscores too: some real hosts have them).
_LABEL: Final = r"[a-z0-9_](?:[a-z0-9_-]{0,61}[a-z0-9_])?"
_HOST_NAME: Final = re.compile(rf"(?:{_LABEL}\.)*{_LABEL}")


@attrs.frozen
class ImageURL:
    """An ``https://`` image URL, checked for form but not fetched.

    Whether to fetch it (from which hosts, within which limits) is the server's decision,
    made in ``trio_vstream.media.image_fetch``; the protocol stays free of I/O. ``host`` is
    lower-case, without the brackets of an IPv6 literal or a trailing dot, ready to be
    compared with an allow list; ``target`` is the HTTP request target (path and query,
    never the fragment).
    """

    url: str
    host: str
    port: int
    target: str

    @property
    def authority(self) -> str:
        """The ``Host`` header: the host, with the port when it is not 443."""
        host = f"[{self.host}]" if ":" in self.host else self.host
        return host if self.port == 443 else f"{host}:{self.port}"

    @classmethod
    def parse(cls, text: str) -> Self:
        """Parse an ``https://`` URL; raises ``ValueError`` saying what is wrong with it.

        Strict on purpose, because the result names a host the server may connect to:
        credentials, spaces and control characters (which could split an HTTP request
        line), non-ASCII host names (their ``xn--`` form is accepted) and malformed
        ports are refused rather than repaired.
        """
        if len(text) > MAX_IMAGE_URL_CHARS:
            raise ValueError(f"is longer than {MAX_IMAGE_URL_CHARS} characters")
        if any(ord(c) <= 0x20 or ord(c) == 0x7F for c in text):
            raise ValueError("holds spaces or control characters")
        if not text.isascii():
            raise ValueError("holds non-ASCII characters (percent-encode them)")
        try:
            parts = urllib.parse.urlsplit(text)
        except ValueError:  # e.g. brackets around something that is no IPv6 address
            raise ValueError("is not a valid URL") from None
        if parts.scheme.lower() != "https":
            raise ValueError("must be an https:// URL")
        if "@" in parts.netloc:
            raise ValueError("must not hold a user name or password")
        try:
            port = 443 if parts.port is None else parts.port
        except ValueError:
            raise ValueError("has an invalid port") from None
        if port == 0:
            raise ValueError("has an invalid port")
        host = (parts.hostname or "").removesuffix(".")
        if not host:
            raise ValueError("has no host")
        try:
            host = str(ipaddress.ip_address(host))
        except ValueError:
            if parts.netloc.startswith("[") or not _HOST_NAME.fullmatch(host):
                raise ValueError("has an invalid host name") from None
        target = parts.path or "/"
        if parts.query:
            target += "?" + parts.query
        return cls(url=text, host=host, port=port, target=target)


@attrs.frozen
class Pacing:
    """vllm-omni's opt-in pacing: chunks go out at the pace of the video, not faster.

    A chunk is not sent before its media time minus ``lead_seconds``, counted from
    the first chunk's send. When delivery falls more than ``max_lag_seconds`` behind
    the media clock (the model is slower than real time), the clock is moved up, so
    that a recovered model does not then burst to catch up.
    """

    lead_seconds: float = 0.5
    max_lag_seconds: float = 2.0


PACING_PARAMS: Final = ("pace_to_media_time", "pacing_lead_seconds", "pacing_max_lag_seconds")
"""The ``extra_params`` keys the server applies itself (never passed to an engine)."""


@attrs.frozen
class SessionStart:
    """A fully validated ``session.start``: everything the server needs to begin."""

    request: VideoRequest
    video: VideoSettings
    format: str
    image: ImageInput | ImageURL | None
    """Inline image data, or an https URL the server fetches if its operator allows."""
    config: dict[str, Any]
    pacing: Pacing | None = None
    """Set when the client asked for ``extra_params.pace_to_media_time``."""
    codec_options: dict[str, str] = attrs.field(factory=dict)
    """``extra_params.video_codec_options``, allowed and checked, as libx264 takes them."""
    camera_script: tuple[ScriptedCamera, ...] = ()
    """``extra_params.camera_action_script``, one camera per chunk (see `_camera_script`)."""
    interaction_script: tuple["ScriptedInteraction", ...] = ()
    """``extra_params.interaction_script``: interactions applied before given chunks."""
    sound: bool | None = None
    """``generate_sound`` as the client gave it, as vllm-omni reads it: None when left out
    (the engine's own way: a video with sound from an engine that makes it), True for
    sound (refused where the engine makes none), False for a video without an audio
    track. (``request.generate_sound`` is False both when left out and when false; the
    ``config`` echo has it only when given.) The session, which knows the engine, decides."""


INTERACTION_SCRIPT_PARAM: Final = "interaction_script"
"""This project's extension: the ``extra_params`` key of an interaction script (the
server applies it and never passes it to an engine)."""

_SCRIPT_WHERE: Final = f"extra_params.{INTERACTION_SCRIPT_PARAM}"
_SCRIPT_KEYS: Final = ("chunk_index", "interaction")
_MAX_SCRIPT_PROBLEMS: Final = 10


@attrs.frozen
class ScriptedInteraction:
    """One entry of ``extra_params.interaction_script``: an interaction the session hands
    the engine right before generation chunk ``chunk_index``, exactly as if a client had
    sent it during the chunk before. What replays a recording at the same chunk indices,
    which a client racing a fast engine over the network cannot do."""

    chunk_index: int
    event_id: str
    prompt: str | None
    transition_chunks: int | None = None
    camera: Camera | None = None


def interaction_script_of(
    extra_params: dict[str, Any] | None,
    num_frames: int | None,
    camera_scripted: bool,
    problems: list[str],
) -> tuple[ScriptedInteraction, ...]:
    """The request's interaction script, in chunk order (empty: none).

    Each entry is ``{"chunk_index": K, "interaction": {...}}``, the ``interaction`` object
    of a ``session.interaction`` message, checked by the same parser (so a script entry is
    exactly what a live interaction may be) plus what a script needs: an ``event_id``
    (how a chunk's ``started_event_ids`` names it), unique, and not a camera script's
    reserved ``script-<n>``; no camera when ``camera_action_script`` owns the camera; a
    chunk index the video can reach. Every bad entry is named by its path.
    """
    if not extra_params or INTERACTION_SCRIPT_PARAM not in extra_params:
        return ()
    script = extra_params[INTERACTION_SCRIPT_PARAM]
    if not isinstance(script, list) or not script:
        got = "an empty array" if script == [] else show(script)
        problems.append(f"{_SCRIPT_WHERE} must be a non-empty array of entries, got {got}")
        return ()
    entries: list[ScriptedInteraction] = []
    refused: list[str] = []
    seen: dict[str, int] = {}
    for index, value in enumerate(script):
        where = f"{_SCRIPT_WHERE}[{index}]"
        if not isinstance(value, dict):
            refused.append(f"{where} must be an object with chunk_index and interaction")
            continue
        unknown = sorted(str(key) for key in value if key not in _SCRIPT_KEYS)
        missing = [key for key in _SCRIPT_KEYS if key not in value]
        if unknown or missing:
            what = f"unknown field {quote(unknown[0])}" if unknown else f"no {missing[0]}"
            refused.append(f"{where} has {what} (an entry holds chunk_index and interaction)")
            continue
        chunk = value["chunk_index"]
        if isinstance(chunk, bool) or not isinstance(chunk, int) or chunk < 0:
            refused.append(f"{where}.chunk_index must be an integer >= 0, got {show(chunk)}")
            continue
        if num_frames is not None and chunk >= num_frames:
            refused.append(
                f"{where}.chunk_index is {chunk}, but the video has only {num_frames} frames"
            )
            continue
        try:
            message = parse_control(
                dump_json({"type": Interaction.TYPE, "interaction": value["interaction"]}),
                limits=Limits(max_control_bytes=DEFAULT_LIMITS.max_start_bytes),
            )
        except ProtocolError as exc:
            refused.append(f"{where}.interaction: {exc.message}")
            continue
        assert isinstance(message, Interaction)
        event_id = message.event_id
        if event_id is None:
            refused.append(f"{where}.interaction must have an event_id")
        elif event_id.startswith("script-"):
            refused.append(
                f"{where}.interaction.event_id {show(event_id)}: ids script-<n> are "
                f"reserved for extra_params.{CAMERA_SCRIPT_PARAM}"
            )
        elif event_id in seen:
            refused.append(
                f"{where}.interaction.event_id {show(event_id)} is already used by "
                f"{_SCRIPT_WHERE}[{seen[event_id]}]"
            )
        elif message.camera is not None and camera_scripted:
            refused.append(
                f"{where}.interaction has a camera, but this session's camera follows "
                f"extra_params.{CAMERA_SCRIPT_PARAM}"
            )
        else:
            seen[event_id] = index
            entries.append(
                ScriptedInteraction(
                    chunk, event_id, message.prompt, message.transition_chunks, message.camera
                )
            )
    if refused:
        problems.extend(refused[:_MAX_SCRIPT_PROBLEMS])
        if len(refused) > _MAX_SCRIPT_PROBLEMS:
            problems.append(
                f"{_SCRIPT_WHERE}: {len(refused) - _MAX_SCRIPT_PROBLEMS} more bad entries"
            )
        return ()
    return tuple(sorted(entries, key=lambda entry: entry.chunk_index))


_DATA_URL: Final = re.compile(
    r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*?)(?P<b64>;base64)?,(?P<data>.*)",
    re.DOTALL | re.IGNORECASE,
)
_IMAGE_TYPE: Final = re.compile(r"image/[a-z0-9][a-z0-9!#$&^_.+-]*")


def _decode_image_url(url: str) -> tuple[ImageInput | ImageURL | None, str | None]:
    """Decode ``data:image/...;base64,...``, or parse (never fetch) an ``https://`` URL.

    Reading paths or fetching other URLs on behalf of a client would turn the server
    into an SSRF / local-file-read gadget, so nothing else is accepted; whether an https
    URL is fetched at all is the server's choice (off unless its operator lists hosts).
    """
    where = "image_reference.image_url"
    if url[:6].lower() == "https:":
        try:
            return ImageURL.parse(url), None
        except ValueError as exc:
            return None, f"{where} {exc}, got {show(url)}"
    match = _DATA_URL.fullmatch(url)
    if match is None:
        return None, (
            f"{where} must be a data:image/<type>;base64,<data> URL or an https:// URL "
            f"(other URLs and file paths are not fetched), got {show(url)}"
        )
    mime_type = match["type"].strip().lower()
    if not _IMAGE_TYPE.fullmatch(mime_type):
        return None, f"{where} must have an image/* media type, got {show(mime_type or '')}"
    if match["b64"] is None:
        return None, f"{where} must be base64-encoded (data:{mime_type};base64,...)"
    payload = re.sub(r"[ \t\r\n]", "", match["data"])
    try:
        data = base64.b64decode(payload, validate=True)
    except (binascii.Error, ValueError):
        return None, f"{where} has invalid base64 data"
    if not data:
        return None, f"{where} has no image data"
    return ImageInput(mime_type=mime_type, data=data), None


def _pacing_of(extra_params: dict[str, Any] | None, problems: list[str]) -> Pacing | None:
    """The pacing a request asks for (None: send chunks as soon as they are ready)."""
    extra = extra_params or {}
    enabled = extra.get("pace_to_media_time", False)
    if not isinstance(enabled, bool):
        problems.append(f"extra_params.pace_to_media_time must be a boolean, got {show(enabled)}")
        return None
    values: dict[str, float] = {}
    for key, field in (
        ("pacing_lead_seconds", "lead_seconds"),
        ("pacing_max_lag_seconds", "max_lag_seconds"),
    ):
        if key not in extra:
            continue
        value = extra[key]
        if (
            isinstance(value, bool)
            or not isinstance(value, int | float)
            or not math.isfinite(value)
            or not 0 <= value <= 3600
        ):
            problems.append(f"extra_params.{key} must be a number of seconds in 0..3600")
            continue
        values[field] = float(value)
    return Pacing(**values) if enabled else None


def _codec_options_of(extra_params: dict[str, Any] | None, problems: list[str]) -> dict[str, str]:
    """``extra_params.video_codec_options`` checked against the allow-list (see
    `_codec_options`), as the strings libx264 takes; empty when none are given."""
    if not extra_params or CODEC_OPTIONS_PARAM not in extra_params:
        return {}
    try:
        return check_codec_options(extra_params[CODEC_OPTIONS_PARAM])
    except CodecOptionError as exc:
        problems.append(str(exc))
        return {}


# Longer digit strings cannot be within any sane limit, and int() of thousands of
# digits is slow (and refused beyond sys.get_int_max_str_digits()).
_MAX_DIGITS: Final = 12


def _resolve_video(
    request: VideoRequest, limits: Limits, defaults: VideoDefaults, problems: list[str]
) -> VideoSettings | None:
    """Mirror upstream ``resolve_video_params()``, then fill defaults and apply limits."""
    nested = request.video_params or VideoParams()
    width = request.width if request.width is not None else nested.width
    height = request.height if request.height is not None else nested.height
    fps = request.fps if request.fps is not None else nested.fps
    num_frames = request.num_frames if request.num_frames is not None else nested.num_frames
    width_from = height_from = frames_from = ""

    if request.size is not None:
        size_w, _, size_h = request.size.partition("x")
        if len(size_w) > _MAX_DIGITS or len(size_h) > _MAX_DIGITS:
            problems.append(f"size is too large, got {show(request.size)}")
            return None
        width, height = int(size_w), int(size_h)
        if width < 1 or height < 1:
            problems.append(f"size width and height must be >= 1, got {show(request.size)}")
            return None
        width_from = height_from = f" (from size {show(request.size)})"

    if fps is None:
        fps = defaults.fps
    if num_frames is None and request.seconds is not None:
        if len(request.seconds) > _MAX_DIGITS:
            problems.append(f"seconds is too large, got {show(request.seconds)}")
            return None
        num_frames = int(request.seconds) * fps
        frames_from = f" (seconds {show(request.seconds)} at {fps} fps)"

    # Forgiving on purpose: a lone width or height takes the other from the defaults.
    if width is None:
        width = defaults.width
    if height is None:
        height = defaults.height
    if num_frames is None:
        num_frames = defaults.num_frames

    before = len(problems)
    for name, value, bound, source in (
        ("width", width, limits.max_width, width_from),
        ("height", height, limits.max_height, height_from),
        ("num_frames", num_frames, limits.max_num_frames, frames_from),
    ):
        if value > bound:
            problems.append(f"{name} must be at most {bound}, got {value}{source}")
    total = width * height * num_frames
    if total > limits.max_total_pixels:
        problems.append(
            f"width * height * num_frames must be at most {limits.max_total_pixels}, "
            f"got {width} * {height} * {num_frames} = {total}"
        )
    # H.264 in yuv420p subsamples chroma 2x2, so libx264 refuses odd dimensions.
    for name, value in (("width", width), ("height", height)):
        if value % 2:
            problems.append(f"{name} must be even (H.264 yuv420p), got {value}")
    if len(problems) > before:
        return None
    return VideoSettings(width=width, height=height, fps=fps, num_frames=num_frames)


def _config_echo(request: VideoRequest, sound: bool | None) -> dict[str, Any]:
    """The request's ``video.start`` echo: its fields, ``None`` ones dropped, and
    ``generate_sound`` only as the client gave it. Left out and false are two requests
    (`SessionStart.sound`), and the echo is what a recording replays."""
    config = _config_of(request)
    if sound is None:
        config.pop("generate_sound", None)
    return config


def _check_sound_duration(
    duration: float | None, sound: bool | None, video: VideoSettings, problems: list[str]
) -> None:
    """``sound_duration`` as vllm-omni means it: the sound's length, by default the
    video's. Here the sound is the video's own audio track, chunk by chunk, exactly as long
    as its frames; so only the video's duration is taken (to within half a frame), and only
    for a video with sound."""
    if duration is None:
        return
    if sound is False:
        problems.append("sound_duration needs sound, and generate_sound is false")
        return
    seconds = video.num_frames / video.fps
    if abs(duration - seconds) > 0.5 / video.fps:
        problems.append(
            f"sound_duration must be the video's duration, {seconds:g} s "
            f"({video.num_frames} frames at {video.fps} fps): the sound is the video's own "
            f"track, as long as its frames; got {duration:g}"
        )


def _lift_sampling_params(msg: dict[str, Any]) -> dict[str, Any]:
    """Flatten the legacy ``sampling_params`` block the way the reference does.

    A key that names a request field and is not already given at the top level is
    lifted; everything else is kept for the model in ``extra_params``.
    """
    request_data = {k: v for k, v in msg.items() if k not in {"type", "format", "sampling_params"}}
    sampling_params = msg.get("sampling_params")
    if sampling_params is None:
        return request_data
    if not isinstance(sampling_params, dict):
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            f"Invalid session.start: sampling_params must be an object, "
            f"got {show(sampling_params)}",
        )
    leftovers: dict[str, Any] = {}
    for key, value in sampling_params.items():
        if key in _REQUEST_FIELDS and key not in request_data:
            request_data[key] = value
        else:
            leftovers[key] = value
    if leftovers:
        base = request_data.get("extra_params")
        if base is None:
            request_data["extra_params"] = leftovers
        elif isinstance(base, dict):
            request_data["extra_params"] = {**base, **leftovers}
        # Otherwise extra_params is invalid and validation will say so.
    return request_data


def _config_of(obj: Any) -> Any:
    """JSON form of a request with ``None`` fields dropped, like ``model_dump(exclude_none)``."""
    if attrs.has(type(obj)):
        return {
            field.name: _config_of(value)
            for field in attrs.fields(type(obj))
            if (value := getattr(obj, field.name)) is not None
        }
    return obj


# --------------------------------------------------------------------------------------
# session.start
# --------------------------------------------------------------------------------------


def parse_start(
    raw: str | bytes,
    *,
    limits: Limits = DEFAULT_LIMITS,
    served_model: str | None = None,
    defaults: VideoDefaults = DEFAULT_VIDEO_DEFAULTS,
) -> SessionStart:
    """Validate the first message of a session; raises `ProtocolError` on any problem."""
    msg = load_json(
        raw,
        max_bytes=limits.max_start_bytes,
        too_large="session.start message too large",
        bad_json="Invalid JSON in session.start",
    )
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "session.start must be a JSON object")
    if msg.get("type") != "session.start":
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE, f"Expected session.start, got: {msg.get('type')}"
        )
    output_format = msg.get("format", "m4s")
    if output_format != "m4s":
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, "Invalid session.start format: expected 'm4s'."
        )

    request_data = _lift_sampling_params(msg)
    try:
        request = REQUEST_CONVERTER.structure(request_data, VideoRequest)
    except cattrs.ClassValidationError as exc:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            "Invalid session.start: " + "; ".join(validation_problems(exc)),
        ) from None

    if served_model is not None and request.model is not None and request.model != served_model:
        raise ProtocolError(
            ErrorCode.MODEL_MISMATCH,
            f"Model mismatch: request specifies '{request.model}' "
            f"but server is running '{served_model}'.",
        )

    problems: list[str] = []
    # Whether the engine makes sound is the session's to check (this module knows no
    # engine): here, only whether the client said anything of it.
    sound = request.generate_sound if "generate_sound" in request_data else None
    if request.enable_frame_interpolation:
        problems.append("enable_frame_interpolation is not supported by this server")

    image: ImageInput | ImageURL | None = None
    reference = request.image_reference
    if reference is not None:
        if reference.file_id is not None:
            problems.append(
                "image_reference.file_id is not supported: use image_url (a data: or https:// URL)"
            )
        elif reference.image_url is None:
            problems.append("image_reference must contain image_url")
        else:
            image, problem = _decode_image_url(reference.image_url)
            if problem is not None:
                problems.append(problem)

    codec_options = _codec_options_of(request.extra_params, problems)
    pacing = _pacing_of(request.extra_params, problems)

    video = _resolve_video(request, limits, defaults, problems)
    if video is not None:
        _check_sound_duration(request.sound_duration, sound, video, problems)
    num_frames = video.num_frames if video is not None else None
    camera_script = camera_script_of(request.extra_params, num_frames, problems)
    interaction_script = interaction_script_of(
        request.extra_params, num_frames, bool(camera_script), problems
    )
    if problems or video is None:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, "Invalid session.start: " + "; ".join(problems)
        )
    return SessionStart(
        request=request,
        video=video,
        format=output_format,
        image=image,
        config=_config_echo(request, sound),
        pacing=pacing,
        codec_options=codec_options,
        camera_script=camera_script,
        interaction_script=interaction_script,
        sound=sound,
    )
