"""Sans-IO wire protocol of the ``/v1/realtime/video`` WebSocket endpoint.

Everything here is pure: text or bytes in, attrs objects (or a `ProtocolError`) out, and
back again. Keeping I/O out means the same rules serve the Trio server, clients and tests,
and every validation rule can be tested without a socket.

The wire format, the error texts and the order of checks follow the vllm-omni reference
handler, because existing clients match on those texts. Where the reference coerces or
silently ignores input (pydantic's lax mode, unknown keys), this module is strict: a
request that says ``"num_frames": "30"`` or ``"promt": ...`` is a client bug, and a
clear error is cheaper than a video that is not what was asked for.
"""

import base64
import binascii
import difflib
import enum
import json
import math
import re
import uuid
from collections.abc import Callable, Mapping
from typing import Any, ClassVar, Final, Literal, TypeAlias, get_args, get_origin

import attrs
import cattrs
from cattrs.errors import ForbiddenExtraKeysError
from cattrs.gen import make_dict_structure_fn, override

from trio_vstream.video import VideoDefaults

__all__ = [
    "DEFAULT_LIMITS",
    "DEFAULT_TRANSITION_CHUNKS",
    "DEFAULT_VIDEO_DEFAULTS",
    "PING_MESSAGE",
    "STOP_MESSAGE",
    "ChunkMetadata",
    "ControlMessage",
    "Error",
    "ErrorCode",
    "ImageInput",
    "ImageReference",
    "Interaction",
    "InteractionQueued",
    "Limits",
    "Ping",
    "Pong",
    "ProtocolError",
    "ServerMessage",
    "SessionDone",
    "SessionStart",
    "Stop",
    "VideoDefaults",
    "VideoParams",
    "VideoRequest",
    "VideoSettings",
    "VideoStart",
    "interaction_message",
    "parse_control",
    "parse_server_message",
    "parse_start",
    "start_message",
]


class ErrorCode(enum.StrEnum):
    """Machine-readable ``code`` of an ``error`` message; clients branch on these."""

    INVALID_JSON = "invalid_json"
    INVALID_MESSAGE = "invalid_message"
    UNKNOWN_TYPE = "unknown_type"
    MESSAGE_TOO_LARGE = "message_too_large"
    START_TIMEOUT = "start_timeout"
    STALL_TIMEOUT = "stall_timeout"
    MODEL_MISMATCH = "model_mismatch"
    INVALID_REQUEST = "invalid_request"
    EVENT_ID_CONFLICT = "event_id_conflict"
    INTERACTION_FAILED = "interaction_failed"
    GENERATION_FAILED = "generation_failed"
    ENCODING_FAILED = "encoding_failed"
    INTERNAL_ERROR = "internal_error"
    SERVER_BUSY = "server_busy"
    SERVER_SHUTDOWN = "server_shutdown"


class ProtocolError(Exception):
    """A message the client sent was rejected; carries what goes into the `error` message."""

    def __init__(self, code: ErrorCode, message: str, *, event_id: str | None = None) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.event_id = event_id

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.message!r}, event_id={self.event_id!r})"

    def to_error(self, request_id: str | None = None) -> "Error":
        """The ``error`` message to send back, so callers need not copy fields by hand."""
        return Error(self.code, self.message, request_id=request_id, event_id=self.event_id)


# --------------------------------------------------------------------------------------
# Configuration
# --------------------------------------------------------------------------------------


@attrs.frozen
class Limits:
    """Upper bounds that protect the server from requests it could not serve.

    The byte limits match the reference; the video limits bound GPU memory and time.
    """

    max_start_bytes: int = 4 * 1024 * 1024
    max_control_bytes: int = 128 * 1024
    max_width: int = 1920
    max_height: int = 1920
    max_num_frames: int = 2400
    max_total_pixels: int = 1920 * 1080 * 600


DEFAULT_LIMITS: Final = Limits()
DEFAULT_VIDEO_DEFAULTS: Final = VideoDefaults()

#: The engine's default for `Interaction.transition_chunks` (not applied here: ``None``
#: on the wire means "let the engine decide").
DEFAULT_TRANSITION_CHUNKS: Final = 3


# --------------------------------------------------------------------------------------
# Request model
# --------------------------------------------------------------------------------------

_CHECKS: Final = "trio_vstream.checks"


@attrs.frozen
class _Checks:
    """Constraints on one request field, checked while structuring.

    Checking inside the structure hook (rather than after) lets range errors be reported
    together with type errors in other fields, in one message.
    """

    ge: int | float | None = None
    gt: int | float | None = None
    le: int | float | None = None
    pattern: str | None = None
    pattern_hint: str = ""
    nonblank: bool = False

    def problem(self, value: Any) -> str | None:
        if self.nonblank and isinstance(value, str) and not value.strip():
            return "must be a non-empty string"
        if self.pattern is not None and not re.fullmatch(self.pattern, value):
            return f"must be {self.pattern_hint}, got {_show(value)}"
        if self.ge is not None and self.le is not None and not self.ge <= value <= self.le:
            return f"must be between {self.ge} and {self.le}, got {_show(value)}"
        if self.ge is not None and self.le is None and value < self.ge:
            return f"must be >= {self.ge}, got {_show(value)}"
        if self.gt is not None and not value > self.gt:
            return f"must be > {self.gt}, got {_show(value)}"
        return None


def _field(default: Any = None, **checks: Any) -> Any:
    return attrs.field(default=default, metadata={_CHECKS: _Checks(**checks)})


MAX_FPS: Final = 240
"""Beyond any display's rate; H.264 time bases overflow far above it."""

# ASCII digits only: `\d` would also match e.g. Arabic-Indic digits.
_SECONDS_PATTERN: Final = r"[1-9][0-9]*"
_SIZE_PATTERN: Final = r"([0-9]+)x([0-9]+)"


@attrs.frozen(kw_only=True)
class VideoParams:
    """The nested ``video_params`` block; the top-level fields of the same name win."""

    width: int | None = _field(ge=1)
    height: int | None = _field(ge=1)
    num_frames: int | None = _field(ge=1)
    fps: int | None = _field(ge=1, le=MAX_FPS)


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
    prompt: str = _field(default=attrs.NOTHING, nonblank=True)
    seconds: str | None = _field(
        pattern=_SECONDS_PATTERN, pattern_hint='a whole number of seconds as a string, like "4"'
    )
    size: str | None = _field(pattern=_SIZE_PATTERN, pattern_hint='"WIDTHxHEIGHT", like "1280x720"')
    image_reference: ImageReference | None = None
    video_params: VideoParams | None = None
    user: str | None = None
    width: int | None = _field(ge=1)
    height: int | None = _field(ge=1)
    fps: int | None = _field(ge=1, le=MAX_FPS)
    num_frames: int | None = _field(ge=1)
    negative_prompt: str | None = None
    num_inference_steps: int | None = _field(ge=1, le=200)
    guidance_scale: float | None = _field(ge=0, le=20)
    guidance_scale_2: float | None = _field(ge=0, le=20)
    boundary_ratio: float | None = _field(ge=0, le=1)
    flow_shift: float | None = None
    true_cfg_scale: float | None = _field(ge=0, le=20)
    seed: int | None = None
    quality: Literal["lossless", "high"] | None = None
    generate_sound: bool = False
    sound_duration: float | None = _field(gt=0)
    enable_frame_interpolation: bool = False
    frame_interpolation_exp: int = _field(default=1, ge=1)
    frame_interpolation_scale: float = _field(default=1.0, gt=0)
    frame_interpolation_model_path: str | None = None
    lora: dict[str, Any] | None = None
    extra_params: dict[str, Any] | None = None


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
    image: ImageInput | None
    config: dict[str, Any]
    pacing: Pacing | None = None
    """Set when the client asked for ``extra_params.pace_to_media_time``."""


# --------------------------------------------------------------------------------------
# Strict structuring
# --------------------------------------------------------------------------------------


class _Invalid(ValueError):
    """A value failed a check; the text reads after the field path ("width <text>")."""


def _show(value: Any, limit: int = 40) -> str:
    """Render a client value for an error message, in JSON terms and bounded in size."""
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "an object"
    if isinstance(value, list | tuple):
        return "an array"
    if isinstance(value, str) and len(value) > limit:
        value = value[:limit]
    try:
        text = json.dumps(value, ensure_ascii=False)
    except (TypeError, ValueError):
        text = repr(value)
    if len(text) > limit:
        text = text[: limit - 3] + "..."
    return text


def _quote(name: str, limit: int = 40) -> str:
    return f"'{name}'" if len(name) <= limit else f"'{name[: limit - 3]}...'"


def _structure_int(value: Any, _: Any) -> int:
    # bool is an int subclass, and cattrs would happily truncate floats or parse strings.
    if isinstance(value, bool) or not isinstance(value, int):
        raise _Invalid(f"must be an integer, got {_show(value)}")
    return value


def _structure_float(value: Any, _: Any) -> float:
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise _Invalid(f"must be a number, got {_show(value)}")
    result = float(value)
    if not math.isfinite(result):
        raise _Invalid(f"must be a finite number, got {_show(value)}")
    return result


def _structure_str(value: Any, _: Any) -> str:
    if not isinstance(value, str):
        raise _Invalid(f"must be a string, got {_show(value)}")
    return value


def _structure_bool(value: Any, _: Any) -> bool:
    if not isinstance(value, bool):
        raise _Invalid(f"must be true or false, got {_show(value)}")
    return value


def _structure_object(value: Any, _: Any) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _Invalid(f"must be an object, got {_show(value)}")
    return value


def _is_literal(tp: Any) -> bool:
    return get_origin(tp) is Literal


def _structure_literal(value: Any, tp: Any) -> Any:
    choices = get_args(tp)
    # `in` alone would let True match 1; compare types too.
    if not any(type(value) is type(choice) and value == choice for choice in choices):
        allowed = ", ".join(_show(choice) for choice in choices)
        raise _Invalid(f"must be one of {allowed}, got {_show(value)}")
    return value


def _is_object_type(tp: Any) -> bool:
    return tp is dict or get_origin(tp) is dict


def _is_str_tuple(tp: Any) -> bool:
    return tp == tuple[str, ...]


def _structure_str_tuple(value: Any, _: Any) -> tuple[str, ...]:
    # cattrs would iterate a string into its characters.
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _Invalid(f"must be an array of strings, got {_show(value)}")
    return tuple(value)


def _checked(base: Callable[[Any, Any], Any], checks: _Checks) -> Callable[[Any, Any], Any]:
    def hook(value: Any, tp: Any) -> Any:
        result = base(value, tp)
        if result is not None:
            problem = checks.problem(result)
            if problem is not None:
                raise _Invalid(problem)
        return result

    return hook


def _make_attrs_hook(
    converter: cattrs.Converter, forbid_extra_keys: bool
) -> Callable[[type], Callable[[Any, Any], Any]]:
    def factory(cls: type) -> Callable[[Any, Any], Any]:
        attrs.resolve_types(cls)
        overrides = {}
        for field in attrs.fields(cls):
            checks = field.metadata.get(_CHECKS)
            if checks is not None:
                base = converter.get_structure_hook(field.type)
                overrides[field.name] = override(struct_hook=_checked(base, checks))
        inner = make_dict_structure_fn(
            cls, converter, _cattrs_forbid_extra_keys=forbid_extra_keys, **overrides
        )

        def hook(value: Any, tp: Any) -> Any:
            # Without this, a string would be taken apart into "unknown keys".
            if not isinstance(value, dict):
                raise _Invalid(f"must be an object, got {_show(value)}")
            return inner(value, tp)

        return hook

    return factory


def _make_converter(*, forbid_extra_keys: bool) -> cattrs.Converter:
    converter = cattrs.Converter(forbid_extra_keys=forbid_extra_keys, detailed_validation=True)
    converter.register_structure_hook(int, _structure_int)
    converter.register_structure_hook(float, _structure_float)
    converter.register_structure_hook(str, _structure_str)
    converter.register_structure_hook(bool, _structure_bool)
    converter.register_structure_hook_func(_is_object_type, _structure_object)
    converter.register_structure_hook_func(_is_literal, _structure_literal)
    converter.register_structure_hook_func(_is_str_tuple, _structure_str_tuple)
    converter.register_structure_hook_factory(
        attrs.has, _make_attrs_hook(converter, forbid_extra_keys)
    )
    return converter


_REQUEST_CONVERTER: Final = _make_converter(forbid_extra_keys=True)
_LENIENT_CONVERTER: Final = _make_converter(forbid_extra_keys=False)


def _describe(exc: BaseException, _type: Any) -> str:
    if isinstance(exc, KeyError):
        return "is required"
    if isinstance(exc, ForbiddenExtraKeysError):
        known = [f.name for f in attrs.fields(exc.cl)] if attrs.has(exc.cl) else []
        items = []
        for key in sorted(exc.extra_fields):
            hint = difflib.get_close_matches(key, known, n=1, cutoff=0.75)
            items.append(_quote(key) + (f" (did you mean {_quote(hint[0])}?)" if hint else ""))
        noun = "unknown field" if len(items) == 1 else "unknown fields"
        return f"{noun} {', '.join(items)}"
    if isinstance(exc, _Invalid):
        return str(exc)
    return f"is invalid ({exc})"


def _validation_problems(exc: BaseException) -> list[str]:
    """Turn a cattrs error tree into "path description" sentences."""
    problems = []
    for line in cattrs.transform_error(exc, path="$", format_exception=_describe):
        description, _, path = line.rpartition(" @ ")
        path = path.removeprefix("$").removeprefix(".")
        if not path:
            problems.append(description)
        elif description.startswith("unknown field"):
            problems.append(f"{path}: {description}")
        else:
            problems.append(f"{path} {description}")
    return problems


# --------------------------------------------------------------------------------------
# Decoding helpers
# --------------------------------------------------------------------------------------


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def _parse_finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text} does not fit a double")
    return value


def _load_json(
    raw: str | bytes,
    *,
    max_bytes: int,
    too_large: str,
    bad_json: str,
    unicode_only: bool = True,
) -> Any:
    """Size check, then strict JSON, and (``unicode_only``) no lone surrogates.

    NaN/Infinity are refused because they are not JSON: echoing them back in
    ``video.start`` would produce text that browsers' ``JSON.parse`` rejects.
    """
    if isinstance(raw, bytes | bytearray | memoryview):
        data = bytes(raw)
        if len(data) > max_bytes:
            raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, too_large)
        try:
            text = data.decode("utf-8")
        except UnicodeDecodeError:
            raise ProtocolError(ErrorCode.INVALID_JSON, bad_json) from None
    else:
        text = raw
        # Characters are at most 4 UTF-8 bytes: skip encoding what is clearly fine or huge.
        if len(text) > max_bytes or (
            len(text) * 4 > max_bytes and len(text.encode("utf-8", "surrogatepass")) > max_bytes
        ):
            raise ProtocolError(ErrorCode.MESSAGE_TOO_LARGE, too_large)
    try:
        value = json.loads(text, parse_constant=_reject_constant, parse_float=_parse_finite_float)
    except (ValueError, RecursionError):
        raise ProtocolError(ErrorCode.INVALID_JSON, bad_json) from None
    where = _lone_surrogate_at(value) if unicode_only else None
    if where is not None:
        # JSON can escape half of a UTF-16 pair ("\udc80"). Such a string cannot be
        # encoded as UTF-8: it would break an engine's tokenizer or our own reply.
        raise ProtocolError(
            ErrorCode.INVALID_MESSAGE,
            f"{bad_json}: the string at {where} is not valid Unicode (a lone surrogate)",
        )
    return value


_LONE_SURROGATE: Final = re.compile("[\ud800-\udfff]")


def safe_text(text: str) -> str:
    """Client text made fit to send back: lone surrogates written as ``\\udc80``."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")


def _lone_surrogate_at(value: Any) -> str | None:
    """The path of the first string (key or value) holding a lone surrogate, if any."""
    pending: list[tuple[str, Any]] = [("the top level", value)]
    while pending:
        path, item = pending.pop()
        if isinstance(item, str):
            if _LONE_SURROGATE.search(item):
                return path
        elif isinstance(item, dict):
            for key, child in item.items():
                child_path = key if path == "the top level" else f"{path}.{key}"
                if _LONE_SURROGATE.search(key):
                    return safe_text(child_path)
                pending.append((child_path, child))
        elif isinstance(item, list):
            pending.extend((f"{path}[{index}]", child) for index, child in enumerate(item))
    return None


_DATA_URL: Final = re.compile(
    r"data:(?P<type>[^;,]*)(?P<params>(?:;[^;,]*)*?)(?P<b64>;base64)?,(?P<data>.*)",
    re.DOTALL | re.IGNORECASE,
)
_IMAGE_TYPE: Final = re.compile(r"image/[a-z0-9][a-z0-9!#$&^_.+-]*")


def _decode_image_url(url: str) -> tuple[ImageInput | None, str | None]:
    """Decode ``data:image/...;base64,...``; anything that would need a fetch is refused.

    Fetching http URLs or reading paths on behalf of a client would turn the server into
    an SSRF / local-file-read gadget, so only inline data is accepted.
    """
    where = "image_reference.image_url"
    match = _DATA_URL.fullmatch(url)
    if match is None:
        return None, (
            f"{where} must be a data:image/<type>;base64,<data> URL "
            f"(remote URLs and file paths are not fetched), got {_show(url)}"
        )
    mime_type = match["type"].strip().lower()
    if not _IMAGE_TYPE.fullmatch(mime_type):
        return None, f"{where} must have an image/* media type, got {_show(mime_type or '')}"
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
        problems.append(f"extra_params.pace_to_media_time must be a boolean, got {_show(enabled)}")
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


def _codec_options_problem(extra_params: dict[str, Any] | None) -> str | None:
    if not extra_params or "video_codec_options" not in extra_params:
        return None
    options = extra_params["video_codec_options"]
    where = "extra_params.video_codec_options"
    if not isinstance(options, dict):
        return f"{where} must be an object, got {_show(options)}"
    for key, value in options.items():
        if isinstance(value, bool) or not isinstance(value, str | int | float):
            return f"{where}[{_quote(key)}] must be a string or a number, got {_show(value)}"
    return None


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
            problems.append(f"size is too large, got {_show(request.size)}")
            return None
        width, height = int(size_w), int(size_h)
        if width < 1 or height < 1:
            problems.append(f"size width and height must be >= 1, got {_show(request.size)}")
            return None
        width_from = height_from = f" (from size {_show(request.size)})"

    if fps is None:
        fps = defaults.fps
    if num_frames is None and request.seconds is not None:
        if len(request.seconds) > _MAX_DIGITS:
            problems.append(f"seconds is too large, got {_show(request.seconds)}")
            return None
        num_frames = int(request.seconds) * fps
        frames_from = f" (seconds {_show(request.seconds)} at {fps} fps)"

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
            f"got {_show(sampling_params)}",
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
    msg = _load_json(
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
        request = _REQUEST_CONVERTER.structure(request_data, VideoRequest)
    except cattrs.ClassValidationError as exc:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST,
            "Invalid session.start: " + "; ".join(_validation_problems(exc)),
        ) from None

    if served_model is not None and request.model is not None and request.model != served_model:
        raise ProtocolError(
            ErrorCode.MODEL_MISMATCH,
            f"Model mismatch: request specifies '{request.model}' "
            f"but server is running '{served_model}'.",
        )

    problems: list[str] = []
    # Refuse rather than ignore: the client would otherwise get a silent, sound-less video.
    if request.generate_sound:
        problems.append("generate_sound is not supported by this server")
    if request.enable_frame_interpolation:
        problems.append("enable_frame_interpolation is not supported by this server")

    image: ImageInput | None = None
    reference = request.image_reference
    if reference is not None:
        if reference.file_id is not None:
            problems.append(
                "image_reference.file_id is not supported: only image_url data URLs are supported"
            )
        elif reference.image_url is None:
            problems.append("image_reference must contain image_url")
        else:
            image, problem = _decode_image_url(reference.image_url)
            if problem is not None:
                problems.append(problem)

    codec_problem = _codec_options_problem(request.extra_params)
    if codec_problem is not None:
        problems.append(codec_problem)
    pacing = _pacing_of(request.extra_params, problems)

    video = _resolve_video(request, limits, defaults, problems)
    if problems or video is None:
        raise ProtocolError(
            ErrorCode.INVALID_REQUEST, "Invalid session.start: " + "; ".join(problems)
        )
    return SessionStart(
        request=request,
        video=video,
        format=output_format,
        image=image,
        config=_config_of(request),
        pacing=pacing,
    )


# --------------------------------------------------------------------------------------
# Client -> server control messages
# --------------------------------------------------------------------------------------


def _dump(payload: dict[str, Any]) -> str:
    # ensure_ascii: a lone surrogate from a "\ud800" escape must not reach a text frame.
    return json.dumps(payload, separators=(",", ":"), allow_nan=False)


@attrs.frozen
class Stop:
    """``session.stop``: end the session after the chunk in flight."""

    def to_json(self) -> str:
        return STOP_MESSAGE


@attrs.frozen
class Ping:
    """``session.ping``: keeps the stall clock from running out; answered by `Pong`."""

    def to_json(self) -> str:
        return PING_MESSAGE


@attrs.frozen
class Interaction:
    """``session.interaction``: steer the running generation towards a new prompt."""

    event_id: str
    prompt: str
    transition_chunks: int | None = None

    def to_json(self) -> str:
        return interaction_message(
            self.prompt, event_id=self.event_id, transition_chunks=self.transition_chunks
        )


ControlMessage: TypeAlias = Stop | Ping | Interaction

STOP_MESSAGE: Final = '{"type":"session.stop"}'
PING_MESSAGE: Final = '{"type":"session.ping"}'


def _parse_interaction(msg: dict[str, Any]) -> Interaction:
    def fail(message: str, event_id: str | None) -> ProtocolError:
        return ProtocolError(ErrorCode.INVALID_MESSAGE, message, event_id=event_id)

    interaction = msg.get("interaction")
    if not isinstance(interaction, dict):
        raise fail("session.interaction requires an interaction object", None)

    event_id = interaction.get("event_id")
    # Only an id the client chose is worth echoing in an error.
    known_id: str | None = None
    if event_id is None:
        event_id = uuid.uuid4().hex
    elif not isinstance(event_id, str) or not event_id:
        raise fail("session.interaction event_id must be a non-empty string", None)
    else:
        known_id = event_id

    event = interaction.get("event")
    if not isinstance(event, dict):
        raise fail("session.interaction requires event object", known_id)
    prompt = event.get("prompt")
    if not isinstance(prompt, str) or not prompt.strip():
        raise fail("session.interaction requires a non-empty event.prompt", known_id)
    if event.get("negative_prompt") is not None:
        raise fail("session.interaction negative_prompt is not supported in this release", known_id)

    transition_chunks = interaction.get("transition_chunks")
    if transition_chunks is not None:
        if (
            isinstance(transition_chunks, bool)
            or not isinstance(transition_chunks, int | float)
            or (isinstance(transition_chunks, float) and not transition_chunks.is_integer())
        ):
            raise fail("session.interaction transition_chunks must be an integer", known_id)
        transition_chunks = int(transition_chunks)
        if transition_chunks < 0:
            raise fail("session.interaction transition_chunks must be >= 0", known_id)

    return Interaction(event_id=event_id, prompt=prompt, transition_chunks=transition_chunks)


def parse_control(raw: str | bytes, *, limits: Limits = DEFAULT_LIMITS) -> ControlMessage:
    """Validate a message received after ``session.start``; raises `ProtocolError`.

    Whether an interaction's event_id was already used is session state, so the caller
    checks that (``event_id_conflict``).
    """
    msg = _load_json(
        raw,
        max_bytes=limits.max_control_bytes,
        too_large="control message too large",
        bad_json="Invalid JSON message",
    )
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "WebSocket messages must be JSON objects")
    msg_type = msg.get("type")
    if msg_type == "session.stop":
        return Stop()
    if msg_type == "session.ping":
        return Ping()
    if msg_type == "session.interaction":
        return _parse_interaction(msg)
    raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {msg_type}")


def start_message(prompt: str, **fields: Any) -> str:
    """Build a ``session.start`` for a client; fields go in as given (no validation)."""
    return _dump({"type": "session.start", "prompt": prompt, **fields})


def interaction_message(
    prompt: str, event_id: str | None = None, transition_chunks: int | None = None
) -> str:
    """Build a ``session.interaction``; a missing event_id lets the server pick one."""
    interaction: dict[str, Any] = {}
    if event_id is not None:
        interaction["event_id"] = event_id
    interaction["event"] = {"prompt": prompt}
    if transition_chunks is not None:
        interaction["transition_chunks"] = transition_chunks
    return _dump({"type": "session.interaction", "interaction": interaction})


# --------------------------------------------------------------------------------------
# Server -> client messages
# --------------------------------------------------------------------------------------


@attrs.frozen
class VideoStart:
    """Accepts the session; ``config`` echoes the request so clients see what is used."""

    TYPE: ClassVar[str] = "video.start"
    request_id: str
    format: str
    config: dict[str, Any]

    def to_json(self) -> str:
        return _dump(
            {
                "type": self.TYPE,
                "request_id": self.request_id,
                "format": self.format,
                "config": self.config,
            }
        )


@attrs.frozen
class ChunkMetadata:
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

    def to_json(self) -> str:
        return _dump(
            {
                "type": self.TYPE,
                "request_id": self.request_id,
                "kind": self.kind,
                "num_frames": self.num_frames,
                "byte_length": self.byte_length,
                "generation_chunk_index": self.generation_chunk_index,
                "started_event_ids": list(self.started_event_ids),
                "active_event_ids": list(self.active_event_ids),
                "completed_event_ids": list(self.completed_event_ids),
                "transport_chunk_index": self.transport_chunk_index,
            }
        )


@attrs.frozen
class InteractionQueued:
    """The interaction was handed to the engine; it applies at the next chunk boundary."""

    TYPE: ClassVar[str] = "session.interaction.queued"
    request_id: str
    event_id: str

    def to_json(self) -> str:
        return _dump({"type": self.TYPE, "request_id": self.request_id, "event_id": self.event_id})


@attrs.frozen
class SessionDone:
    """Last message of a session that was not ended by an error."""

    TYPE: ClassVar[str] = "session.done"
    request_id: str
    chunks: int
    stopped: bool

    def to_json(self) -> str:
        return _dump(
            {
                "type": self.TYPE,
                "request_id": self.request_id,
                "chunks": self.chunks,
                "stopped": self.stopped,
            }
        )


@attrs.frozen
class Pong:
    """Reply to `Ping`."""

    TYPE: ClassVar[str] = "session.pong"

    def to_json(self) -> str:
        return '{"type":"session.pong"}'


@attrs.frozen
class Error:
    """An ``error`` message; keys whose value is ``None`` are left out, as in the reference."""

    TYPE: ClassVar[str] = "error"
    code: ErrorCode | str
    message: str
    request_id: str | None = None
    event_id: str | None = None

    def to_json(self) -> str:
        payload: dict[str, Any] = {
            "type": self.TYPE,
            "message": self.message,
            "code": str(self.code),
        }
        if self.request_id is not None:
            payload["request_id"] = self.request_id
        if self.event_id is not None:
            payload["event_id"] = self.event_id
        return _dump(payload)


ServerMessage: TypeAlias = (
    VideoStart | ChunkMetadata | InteractionQueued | SessionDone | Pong | Error
)

_SERVER_TYPES: Final[Mapping[str, type]] = {
    cls.TYPE: cls
    for cls in (VideoStart, ChunkMetadata, InteractionQueued, SessionDone, Pong, Error)
}

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
        raise _Invalid(f"code must be a string, got {_show(raw_code)}")
    text = str(raw_code)
    try:
        return ErrorCode(text)
    except ValueError:
        return text


def parse_server_message(raw: str | bytes) -> ServerMessage:
    """Parse a server's JSON message, ours or the reference's; raises `ProtocolError`.

    Unknown keys are ignored so that clients keep working when servers add fields.
    """
    # No size limit: a client trusts its server, and the transport bounds frames anyway.
    # Lone surrogates are let through: a server that echoes one (the reference does) is
    # still understood; escaped as they arrive, they stay valid text for the client.
    msg = _load_json(
        raw,
        max_bytes=2**62,
        too_large="server message too large",
        bad_json="Invalid JSON message",
        unicode_only=False,
    )
    if not isinstance(msg, dict):
        raise ProtocolError(ErrorCode.INVALID_MESSAGE, "Server messages must be JSON objects")
    msg_type = msg.get("type")
    cls = _SERVER_TYPES.get(msg_type) if isinstance(msg_type, str) else None
    if cls is None:
        raise ProtocolError(ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {msg_type}")

    data = dict(msg)
    try:
        if cls is ChunkMetadata:
            data.setdefault("transport_chunk_index", -1)
            data.setdefault("generation_chunk_index", None)
            for key in ("started_event_ids", "active_event_ids", "completed_event_ids"):
                data.setdefault(key, [])
        elif cls is Error:
            message = data.get("message")
            if not isinstance(message, str):
                raise _Invalid(f"message must be a string, got {_show(message)}")
            data["code"] = _error_code(data.get("code"), message)
            data["message"] = message
            return Error(
                data["code"],
                message,
                request_id=_optional_str(data.get("request_id"), "request_id"),
                event_id=_optional_str(data.get("event_id"), "event_id"),
            )
        return _LENIENT_CONVERTER.structure(data, cls)
    except cattrs.ClassValidationError as exc:
        details = "; ".join(_validation_problems(exc))
    except _Invalid as exc:
        details = str(exc)
    raise ProtocolError(ErrorCode.INVALID_MESSAGE, f"Invalid {msg_type} message: {details}")


def _optional_str(value: Any, name: str) -> str | None:
    if value is not None and not isinstance(value, str):
        raise _Invalid(f"{name} must be a string, got {_show(value)}")
    return value
