"""``session.start``: the request model and its resolution into settings.

`parse_start` is the whole of the server's first-message handling: strict types and
ranges (through `_wire`'s converter), the reference's ``sampling_params`` lifting,
pacing options, the codec options and scripts in ``extra_params``, and the video
geometry checked against `Limits` (`_limits`). Two parts it relies on have modules of
their own: the image (`_image_reference`, rules of URLs rather than of video) and the
interaction script (`_interaction_script`, whose entries go through the very parser
live interactions do).
"""

import math
from typing import Any, Final, Literal

import attrs
import cattrs

from trio_vstream.protocol._camera_script import ScriptedCamera, camera_script_of
from trio_vstream.protocol._codec_options import (
    CODEC_OPTIONS_PARAM,
    CodecOptionError,
    check_codec_options,
)
from trio_vstream.protocol._errors import ErrorCode, ProtocolError
from trio_vstream.protocol._image_reference import ImageInput, ImageURL, decode_image_url
from trio_vstream.protocol._input_video import (
    InputVideoRequest,
    InputVideoSettings,
    lift_input_video_aliases,
    resolve_input_video,
)
from trio_vstream.protocol._interaction_script import ScriptedInteraction, interaction_script_of
from trio_vstream.protocol._limits import DEFAULT_LIMITS, MAX_STREAMING_BUFFER_SECONDS, Limits
from trio_vstream.protocol._wire import (
    REQUEST_CONVERTER,
    field_with_checks,
    load_json,
    show,
    validation_problems,
)
from trio_vstream.values import VideoDefaults

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
    input_video: InputVideoRequest | None = None
    """This project's extension: the session follows a live input video (`_input_video`)."""


_REQUEST_FIELDS: Final = frozenset(f.name for f in attrs.fields(VideoRequest))


@attrs.frozen
class VideoSettings:
    """Resolved video geometry and timing, already checked against `Limits`."""

    width: int
    height: int
    fps: int
    num_frames: int


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
    interaction_script: tuple[ScriptedInteraction, ...] = ()
    """``extra_params.interaction_script``: interactions applied before given chunks."""
    input_video: InputVideoSettings | None = None
    """``input_video``, resolved: the session follows the frames the client sends."""
    sound: bool | None = None
    """``generate_sound`` as the client gave it, as vllm-omni reads it: None when left out
    (the engine's own way: a video with sound from an engine that makes it), True for
    sound (refused where the engine makes none), False for a video without an audio
    track. (``request.generate_sound`` is False both when left out and when false; the
    ``config`` echo has it only when given.) The session, which knows the engine, decides."""


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
    problems: list[str] = []
    lift_input_video_aliases(request_data, problems)
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
            image, problem = decode_image_url(reference.image_url)
            if problem is not None:
                problems.append(problem)

    codec_options = _codec_options_of(request.extra_params, problems)
    pacing = _pacing_of(request.extra_params, problems)

    video = _resolve_video(request, limits, defaults, problems)
    input_video = None
    if video is not None:
        _check_sound_duration(request.sound_duration, sound, video, problems)
        if request.input_video is not None:
            input_video = resolve_input_video(
                request.input_video,
                width=video.width,
                height=video.height,
                fps=video.fps,
                limits=limits,
                problems=problems,
            )
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
        input_video=input_video,
        sound=sound,
    )
