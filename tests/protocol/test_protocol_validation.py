"""Tests of session.start validation and the error types (protocol/_start.py, _errors.py).

No sockets, no Trio: text in, `SessionStart` or `ProtocolError` out.
"""

import base64
import json
from typing import Any

import pytest

from trio_vstream.protocol import (
    Error,
    ErrorCode,
    ImageInput,
    ImageURL,
    Limits,
    ProtocolError,
    SessionStart,
    VideoDefaults,
    VideoParams,
    VideoSettings,
    parse_control,
    parse_start,
)

PNG_BYTES = b"\x89PNG\r\n\x1a\n" + bytes(range(64))
PNG_URL = "data:image/png;base64," + base64.b64encode(PNG_BYTES).decode()


def start(**fields: Any) -> str:
    return json.dumps({"type": "session.start", "prompt": "a cat", **fields})


def start_ok(raw: str | bytes | None = None, **kwargs: Any) -> SessionStart:
    return parse_start(raw if raw is not None else start(), **kwargs)


def start_error(raw: str | bytes, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_start(raw, **kwargs)
    return info.value


def invalid_request(**fields: Any) -> str:
    """The message of the INVALID_REQUEST error a session.start with `fields` gets."""
    err = start_error(start(**fields))
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.message.startswith("Invalid session.start: ")
    return err.message.removeprefix("Invalid session.start: ")


# --------------------------------------------------------------------------------------
# Error codes
# --------------------------------------------------------------------------------------


def test_error_code_values_are_the_wire_strings() -> None:
    assert {code.name: str(code) for code in ErrorCode} == {
        "INVALID_JSON": "invalid_json",
        "INVALID_MESSAGE": "invalid_message",
        "UNKNOWN_TYPE": "unknown_type",
        "MESSAGE_TOO_LARGE": "message_too_large",
        "START_TIMEOUT": "start_timeout",
        "STALL_TIMEOUT": "stall_timeout",
        "MODEL_MISMATCH": "model_mismatch",
        "INVALID_REQUEST": "invalid_request",
        "EVENT_ID_CONFLICT": "event_id_conflict",
        "INTERACTION_FAILED": "interaction_failed",
        "INTERACTION_QUEUE_FULL": "interaction_queue_full",
        "GENERATION_FAILED": "generation_failed",
        "ENCODING_FAILED": "encoding_failed",
        "INTERNAL_ERROR": "internal_error",
        "SERVER_BUSY": "server_busy",
        "SERVER_SHUTDOWN": "server_shutdown",
        "ENGINE_UNAVAILABLE": "engine_unavailable",
        "READ_ONLY": "read_only",
        "WATCH_NOT_FOUND": "watch_not_found",
        "VIEWER_TOO_SLOW": "viewer_too_slow",
        "INVALID_INPUT_FRAME": "invalid_input_frame",
    }


def test_protocol_error_carries_fields_and_converts_to_error_message() -> None:
    err = ProtocolError(ErrorCode.INVALID_MESSAGE, "nope", event_id="e1")
    assert (err.code, err.message, err.event_id) == (ErrorCode.INVALID_MESSAGE, "nope", "e1")
    assert str(err) == "nope"
    assert Error.from_protocol_error(err, request_id="r1") == Error(
        ErrorCode.INVALID_MESSAGE, "nope", request_id="r1", event_id="e1"
    )
    assert ProtocolError(ErrorCode.INVALID_JSON, "x").event_id is None


# --------------------------------------------------------------------------------------
# parse_start: framing
# --------------------------------------------------------------------------------------


def test_minimal_start_uses_defaults() -> None:
    result = start_ok()
    assert result.request.prompt == "a cat"
    assert result.format == "m4s"
    assert result.image is None
    assert result.video == VideoSettings(width=256, height=256, fps=24, num_frames=48)
    assert result.config == {
        "prompt": "a cat",
        "enable_frame_interpolation": False,
        "frame_interpolation_exp": 1,
        "frame_interpolation_scale": 1.0,
    }


def test_bytes_input_is_accepted() -> None:
    assert start_ok(start().encode()).request.prompt == "a cat"


def test_start_too_large_is_checked_before_json() -> None:
    limits = Limits(max_start_bytes=50)
    raw = "x" * 51  # not even JSON: the size check comes first
    err = start_error(raw, limits=limits)
    assert err.code is ErrorCode.MESSAGE_TOO_LARGE
    assert err.message == "session.start message too large"
    assert start_error(raw.encode(), limits=limits).code is ErrorCode.MESSAGE_TOO_LARGE


def test_start_size_limit_counts_utf8_bytes_and_is_inclusive() -> None:
    raw = start(prompt="é" * 10)  # json.dumps escapes é; write it raw instead
    raw = raw.replace("\\u00e9", "é")
    size = len(raw.encode())
    assert size > len(raw)
    assert start_ok(raw, limits=Limits(max_start_bytes=size)).request.prompt == "é" * 10
    err = start_error(raw, limits=Limits(max_start_bytes=size - 1))
    assert err.code is ErrorCode.MESSAGE_TOO_LARGE
    assert start_error(raw.encode(), limits=Limits(max_start_bytes=size - 1)).code is (
        ErrorCode.MESSAGE_TOO_LARGE
    )


def test_default_start_limit_is_4_mib() -> None:
    big = start(prompt="p" * (4 * 1024 * 1024))
    assert start_error(big).code is ErrorCode.MESSAGE_TOO_LARGE
    assert start_ok(start(prompt="p" * (4 * 1024 * 1024 - 100))).request.prompt


@pytest.mark.parametrize(
    "raw",
    [
        "not json",
        "{",
        "",
        b"\xff\xfe{}",
        '{"type": "session.start", "prompt": "a", "seed": NaN}',
        '{"type": "session.start", "prompt": "a", "flow_shift": Infinity}',
        '{"type": "session.start", "prompt": "a", "flow_shift": -Infinity}',
        '{"type": "session.start", "prompt": "a", "flow_shift": 1e999}',
        "[" * 100_000 + "]" * 100_000,
    ],
)
def test_invalid_json_in_start(raw: str | bytes) -> None:
    err = start_error(raw)
    assert err.code is ErrorCode.INVALID_JSON
    assert err.message == "Invalid JSON in session.start"


@pytest.mark.parametrize("raw", ["[]", '"session.start"', "3", "null", "true"])
def test_start_must_be_an_object(raw: str) -> None:
    err = start_error(raw)
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "session.start must be a JSON object"


@pytest.mark.parametrize(
    ("body", "shown"),
    [
        ({"prompt": "a"}, "None"),
        ({"type": "session.stop"}, "session.stop"),
        ({"type": "session.ping", "prompt": "a"}, "session.ping"),
        ({"type": 5}, "5"),
    ],
)
def test_start_must_have_start_type(body: dict[str, Any], shown: str) -> None:
    err = start_error(json.dumps(body))
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == f"Expected session.start, got: {shown}"


@pytest.mark.parametrize("fmt", ["webm", "mp4", None, "M4S", 1, ["m4s"]])
def test_start_rejects_other_formats(fmt: Any) -> None:
    err = start_error(start(format=fmt))
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.message == "Invalid session.start format: expected 'm4s'."


def test_start_accepts_explicit_m4s_and_keeps_format_out_of_config() -> None:
    result = start_ok(start(format="m4s"))
    assert result.format == "m4s"
    assert "format" not in result.config
    assert "type" not in result.config


# --------------------------------------------------------------------------------------
# parse_start: sampling_params lifting
# --------------------------------------------------------------------------------------


def test_sampling_params_request_fields_are_lifted() -> None:
    result = start_ok(start(sampling_params={"seed": 7, "num_inference_steps": 20}))
    assert result.request.seed == 7
    assert result.request.num_inference_steps == 20
    assert result.request.extra_params is None
    assert "sampling_params" not in result.config
    assert result.config["seed"] == 7


def test_sampling_params_do_not_override_top_level_fields() -> None:
    result = start_ok(start(seed=1, sampling_params={"seed": 2, "prompt": "other"}))
    assert result.request.seed == 1
    assert result.request.prompt == "a cat"
    # The reference keeps the shadowed values for the model instead of dropping them.
    assert result.request.extra_params == {"seed": 2, "prompt": "other"}


def test_sampling_params_unknown_keys_go_to_extra_params_and_merge() -> None:
    result = start_ok(
        start(
            extra_params={"a": 1, "shared": "top"},
            sampling_params={"b": 2, "shared": "sp", "type": "t", "format": "f"},
        )
    )
    assert result.request.extra_params == {
        "a": 1,
        "shared": "sp",
        "b": 2,
        "type": "t",
        "format": "f",
    }
    assert result.format == "m4s"
    assert result.config["extra_params"] == result.request.extra_params


def test_sampling_params_extra_params_is_lifted_and_merged_with_leftovers() -> None:
    result = start_ok(start(sampling_params={"extra_params": {"a": 1}, "b": 2}))
    assert result.request.extra_params == {"a": 1, "b": 2}


def test_sampling_params_null_is_ignored() -> None:
    assert start_ok(start(sampling_params=None)).request.extra_params is None


@pytest.mark.parametrize("value", [[1], "seed=3", 3, True])
def test_sampling_params_must_be_an_object(value: Any) -> None:
    message = invalid_request(sampling_params=value)
    assert message.startswith("sampling_params must be an object")


def test_lifted_values_are_validated_like_top_level_ones() -> None:
    assert invalid_request(sampling_params={"seed": "3"}) == 'seed must be an integer, got "3"'


def test_extra_params_of_wrong_type_is_reported_even_with_sampling_params() -> None:
    message = invalid_request(extra_params=[1], sampling_params={"foo": 1})
    assert message == "extra_params must be an object, got an array"


# --------------------------------------------------------------------------------------
# parse_start: strict types
# --------------------------------------------------------------------------------------

INT_FIELDS = ["width", "height", "fps", "num_frames", "num_inference_steps", "seed"]
FLOAT_FIELDS = [
    "guidance_scale",
    "guidance_scale_2",
    "true_cfg_scale",
    "boundary_ratio",
    "flow_shift",
    "sound_duration",
    "frame_interpolation_scale",
]
STR_FIELDS = ["model", "user", "negative_prompt", "frame_interpolation_model_path"]
BOOL_FIELDS = ["generate_sound", "enable_frame_interpolation"]
OBJECT_FIELDS = ["lora", "extra_params"]


@pytest.mark.parametrize("field", [*INT_FIELDS, "frame_interpolation_exp"])
@pytest.mark.parametrize(
    ("value", "shown"),
    [
        ("30", '"30"'),
        (True, "true"),
        (False, "false"),
        (2.9, "2.9"),
        (3.0, "3.0"),
        ([4], "an array"),
    ],
)
def test_int_fields_reject_everything_but_integers(field: str, value: Any, shown: str) -> None:
    assert invalid_request(**{field: value}) == f"{field} must be an integer, got {shown}"


@pytest.mark.parametrize("field", ["width", "height", "fps", "num_frames"])
def test_video_params_ints_are_strict_too(field: str) -> None:
    message = invalid_request(video_params={field: "8"})
    assert message == f'video_params.{field} must be an integer, got "8"'


def test_int_fields_accept_integers() -> None:
    result = start_ok(start(seed=-5, num_inference_steps=30, width=320, height=240, fps=12))
    assert (result.request.seed, result.request.num_inference_steps) == (-5, 30)
    assert type(result.request.width) is int


def lasting(field: str, value: float) -> dict[str, Any]:
    """``{field: value}``, and for ``sound_duration`` a video that lasts ``value`` seconds
    at 100 fps (the sound is the video's own track: no other length is taken)."""
    if field != "sound_duration":
        return {field: value}
    return {field: value, "fps": 100, "num_frames": round(value * 100)}


@pytest.mark.parametrize("field", FLOAT_FIELDS)
def test_float_fields_accept_ints_and_floats(field: str) -> None:
    as_int = start_ok(start(**lasting(field, 1)))
    assert getattr(as_int.request, field) == 1.0
    assert type(getattr(as_int.request, field)) is float
    assert getattr(start_ok(start(**lasting(field, 0.5))).request, field) == 0.5


@pytest.mark.parametrize("field", FLOAT_FIELDS)
@pytest.mark.parametrize(("value", "shown"), [("1.5", '"1.5"'), (True, "true"), ({}, "an object")])
def test_float_fields_reject_bools_and_strings(field: str, value: Any, shown: str) -> None:
    assert invalid_request(**{field: value}) == f"{field} must be a number, got {shown}"


@pytest.mark.parametrize("field", [*STR_FIELDS, "seconds", "size"])
@pytest.mark.parametrize(("value", "shown"), [(4, "4"), (True, "true"), (["a"], "an array")])
def test_str_fields_reject_non_strings(field: str, value: Any, shown: str) -> None:
    assert invalid_request(**{field: value}) == f"{field} must be a string, got {shown}"


@pytest.mark.parametrize("value", [None, 1, True, ["p"]])
def test_prompt_must_be_a_string(value: Any) -> None:
    assert invalid_request(prompt=value).startswith("prompt must be a string, got ")


@pytest.mark.parametrize("field", BOOL_FIELDS)
@pytest.mark.parametrize(
    ("value", "shown"), [(1, "1"), (0, "0"), ("true", '"true"'), (None, "null")]
)
def test_bool_fields_accept_only_true_and_false(field: str, value: Any, shown: str) -> None:
    assert invalid_request(**{field: value}) == f"{field} must be true or false, got {shown}"


@pytest.mark.parametrize("field", BOOL_FIELDS)
def test_bool_fields_false_is_fine(field: str) -> None:
    assert getattr(start_ok(start(**{field: False})).request, field) is False


@pytest.mark.parametrize("field", [*OBJECT_FIELDS, "video_params", "image_reference"])
@pytest.mark.parametrize(("value", "shown"), [([], "an array"), ("abc", '"abc"'), (3, "3")])
def test_object_fields_must_be_objects(field: str, value: Any, shown: str) -> None:
    assert invalid_request(**{field: value}) == f"{field} must be an object, got {shown}"


def test_object_fields_keep_their_contents() -> None:
    lora = {"name": "style", "path": "/models/x", "scale": 0.5}
    result = start_ok(start(lora=lora, extra_params={"k": [1, None]}))
    assert result.request.lora == lora
    assert result.request.extra_params == {"k": [1, None]}
    # None inside free-form objects is the client's data, not an unset field.
    assert result.config["extra_params"] == {"k": [1, None]}


OPTIONAL_FIELDS = [
    *INT_FIELDS,
    *(f for f in FLOAT_FIELDS if f != "frame_interpolation_scale"),
    *STR_FIELDS,
    *OBJECT_FIELDS,
    "seconds",
    "size",
    "quality",
    "video_params",
    "image_reference",
]


@pytest.mark.parametrize("field", OPTIONAL_FIELDS)
def test_optional_fields_accept_null(field: str) -> None:
    result = start_ok(start(**{field: None}))
    assert getattr(result.request, field) is None
    assert field not in result.config


@pytest.mark.parametrize("field", ["frame_interpolation_exp", "frame_interpolation_scale"])
def test_fields_with_defaults_reject_null(field: str) -> None:
    assert invalid_request(**{field: None}).startswith(f"{field} must be ")


def test_quality_is_an_enum() -> None:
    assert start_ok(start(quality="lossless")).request.quality == "lossless"
    assert start_ok(start(quality="high")).config["quality"] == "high"
    assert invalid_request(quality="low") == 'quality must be one of "lossless", "high", got "low"'
    assert invalid_request(quality=True).startswith("quality must be one of ")


def test_unknown_top_level_key_is_named_with_a_suggestion() -> None:
    err = start_error(json.dumps({"type": "session.start", "promt": "a cat", "prompt": "b"}))
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.message == ("Invalid session.start: unknown field 'promt' (did you mean 'prompt'?)")


def test_unknown_key_without_close_match_has_no_suggestion() -> None:
    assert invalid_request(zzz=1) == "unknown field 'zzz'"


def test_several_unknown_keys_are_all_named() -> None:
    assert invalid_request(heigth=2, zzz=1) == (
        "unknown fields 'heigth' (did you mean 'height'?), 'zzz'"
    )


def test_unknown_nested_keys_are_rejected() -> None:
    assert invalid_request(video_params={"width": 64, "depth": 3}) == (
        "video_params: unknown field 'depth'"
    )
    assert invalid_request(image_reference={"image_url": PNG_URL, "detail": "x"}) == (
        "image_reference: unknown field 'detail'"
    )


def test_all_problems_are_reported_together() -> None:
    message = invalid_request(width="30", seed=True, num_inference_steps=500, promt="x")
    assert message.split("; ") == [
        'width must be an integer, got "30"',
        "num_inference_steps must be between 1 and 200, got 500",
        "seed must be an integer, got true",
        "unknown field 'promt' (did you mean 'prompt'?)",
    ]


def test_missing_prompt() -> None:
    err = start_error(json.dumps({"type": "session.start"}))
    assert err.code is ErrorCode.INVALID_REQUEST
    assert err.message == "Invalid session.start: prompt is required"


@pytest.mark.parametrize("prompt", ["", "   ", "\n\t"])
def test_blank_prompt(prompt: str) -> None:
    assert invalid_request(prompt=prompt) == "prompt must be a non-empty string"


def test_long_values_are_truncated_in_messages() -> None:
    message = invalid_request(seed="9" * 10_000)
    assert len(message) < 100
    assert message.startswith('seed must be an integer, got "999')


# --------------------------------------------------------------------------------------
# parse_start: ranges and patterns
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value", "expected"),
    [
        ("num_inference_steps", 500, "num_inference_steps must be between 1 and 200, got 500"),
        ("num_inference_steps", 0, "num_inference_steps must be between 1 and 200, got 0"),
        ("num_inference_steps", 201, "num_inference_steps must be between 1 and 200, got 201"),
        ("guidance_scale", -0.5, "guidance_scale must be between 0 and 20, got -0.5"),
        ("guidance_scale_2", 20.5, "guidance_scale_2 must be between 0 and 20, got 20.5"),
        ("true_cfg_scale", 21, "true_cfg_scale must be between 0 and 20, got 21.0"),
        ("boundary_ratio", 1.5, "boundary_ratio must be between 0 and 1, got 1.5"),
        ("boundary_ratio", -0.1, "boundary_ratio must be between 0 and 1, got -0.1"),
        ("sound_duration", 0, "sound_duration must be > 0, got 0.0"),
        ("frame_interpolation_exp", 0, "frame_interpolation_exp must be >= 1, got 0"),
        ("frame_interpolation_scale", 0, "frame_interpolation_scale must be > 0, got 0.0"),
        ("width", 0, "width must be >= 1, got 0"),
        ("height", -2, "height must be >= 1, got -2"),
        ("fps", 0, "fps must be between 1 and 240, got 0"),
        ("num_frames", 0, "num_frames must be >= 1, got 0"),
    ],
)
def test_range_checks(field: str, value: Any, expected: str) -> None:
    assert invalid_request(**{field: value}) == expected


def test_video_params_range_checks() -> None:
    assert (
        invalid_request(video_params={"fps": 0})
        == "video_params.fps must be between 1 and 240, got 0"
    )


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("num_inference_steps", 1),
        ("num_inference_steps", 200),
        ("guidance_scale", 0),
        ("guidance_scale", 20),
        ("boundary_ratio", 0),
        ("boundary_ratio", 1),
        ("sound_duration", 0.01),
        ("frame_interpolation_exp", 1),
        ("frame_interpolation_scale", 0.5),
        ("flow_shift", -3.0),
    ],
)
def test_range_bounds_are_inclusive(field: str, value: Any) -> None:
    assert getattr(start_ok(start(**lasting(field, value))).request, field) == value


@pytest.mark.parametrize("seconds", ["0", "01", "4.5", "-4", "abc", " 4", "4\n", "", "٤"])
def test_seconds_pattern(seconds: str) -> None:
    message = invalid_request(seconds=seconds)
    assert message.startswith('seconds must be a whole number of seconds as a string, like "4"')


@pytest.mark.parametrize("size", ["big", "1280", "1280x", "x720", "1280X720", "1280x720\n", "-2x4"])
def test_size_pattern(size: str) -> None:
    assert invalid_request(size=size).startswith('size must be "WIDTHxHEIGHT", like "1280x720"')


# --------------------------------------------------------------------------------------
# parse_start: unsupported features, model
# --------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("fields", "sound"),
    [({}, None), ({"generate_sound": True}, True), ({"generate_sound": False}, False)],
)
def test_generate_sound_is_kept_as_given_for_the_session_to_decide(
    fields: dict[str, Any], sound: bool | None
) -> None:
    """Left out, true or false, as vllm-omni tells them apart: whether the engine makes
    sound is the session's to check."""
    parsed = start_ok(start(**fields))
    assert parsed.sound is sound
    assert parsed.request.generate_sound is bool(sound)
    # The echo (what a recording replays) tells them apart too.
    assert parsed.config.get("generate_sound", "left out") == (
        "left out" if sound is None else sound
    )
    lifted = start_ok(start(sampling_params={"generate_sound": False}))
    assert lifted.sound is False


def test_sound_duration_is_the_videos_own() -> None:
    """2 s of video (48 frames at 24 fps): its sound lasts as long, to within half a frame."""
    for duration in (2, 2.0, 2 + 0.4 / 24, 2 - 0.4 / 24):
        assert start_ok(start(sound_duration=duration)).request.sound_duration == duration
        assert start_ok(start(sound_duration=duration, generate_sound=True)).sound is True
    assert start_ok(start(seconds="3", sound_duration=3)).request.sound_duration == 3
    for duration in (1, 2.1, 4, 1e9):
        assert invalid_request(sound_duration=duration) == (
            "sound_duration must be the video's duration, 2 s (48 frames at 24 fps): the sound "
            f"is the video's own track, as long as its frames; got {duration:g}"
        )
    assert invalid_request(sound_duration=2, generate_sound=False) == (
        "sound_duration needs sound, and generate_sound is false"
    )


def test_frame_interpolation_is_refused() -> None:
    assert invalid_request(enable_frame_interpolation=True) == (
        "enable_frame_interpolation is not supported by this server"
    )


def test_frame_interpolation_settings_alone_are_harmless() -> None:
    result = start_ok(start(frame_interpolation_exp=2, frame_interpolation_scale=0.5))
    assert result.config["frame_interpolation_exp"] == 2
    assert result.config["frame_interpolation_scale"] == 0.5


def test_model_mismatch() -> None:
    err = start_error(start(model="other"), served_model="wan")
    assert err.code is ErrorCode.MODEL_MISMATCH
    assert err.message == "Model mismatch: request specifies 'other' but server is running 'wan'."


def test_model_match_or_absence_is_fine() -> None:
    assert start_ok(start(model="wan"), served_model="wan").request.model == "wan"
    assert start_ok(start(), served_model="wan").request.model is None
    assert start_ok(start(model="anything")).config["model"] == "anything"


def test_validation_errors_come_before_model_mismatch() -> None:
    err = start_error(start(model="other", seed="x"), served_model="wan")
    assert err.code is ErrorCode.INVALID_REQUEST


# --------------------------------------------------------------------------------------
# parse_start: video resolution
# --------------------------------------------------------------------------------------


def video_of(**fields: Any) -> VideoSettings:
    return start_ok(start(**fields)).video


def test_top_level_values_win_over_video_params() -> None:
    nested = {"width": 64, "height": 48, "fps": 8, "num_frames": 10}
    assert video_of(video_params=nested) == VideoSettings(64, 48, 8, 10)
    assert video_of(video_params=nested, width=96, fps=30) == VideoSettings(96, 48, 30, 10)
    assert video_of(video_params=nested, height=32, num_frames=5) == VideoSettings(64, 32, 8, 5)


def test_size_overrides_width_and_height() -> None:
    got = video_of(size="640x360", width=100, height=100, video_params={"width": 2, "height": 2})
    assert (got.width, got.height) == (640, 360)


def test_fps_defaults_from_engine_defaults() -> None:
    defaults = VideoDefaults(width=128, height=64, fps=16, num_frames=33)
    assert start_ok(defaults=defaults).video == VideoSettings(128, 64, 16, 33)


def test_seconds_times_fps_gives_num_frames() -> None:
    assert video_of(seconds="2").num_frames == 48
    assert video_of(seconds="2", fps=10).num_frames == 20
    assert video_of(seconds="3", video_params={"fps": 5}).num_frames == 15
    defaults = VideoDefaults(fps=16)
    assert start_ok(start(seconds="2"), defaults=defaults).video.num_frames == 32


def test_explicit_num_frames_win_over_seconds() -> None:
    assert video_of(seconds="2", num_frames=7).num_frames == 7
    assert video_of(seconds="2", video_params={"num_frames": 9}).num_frames == 9


def test_a_lone_width_or_height_takes_the_other_from_defaults() -> None:
    assert video_of(width=320) == VideoSettings(320, 256, 24, 48)
    assert video_of(video_params={"height": 128}) == VideoSettings(256, 128, 24, 48)


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"width": 1922}, "width must be at most 1920, got 1922"),
        ({"height": 2000}, "height must be at most 1920, got 2000"),
        ({"num_frames": 2401}, "num_frames must be at most 2400, got 2401"),
        ({"size": "4000x720"}, 'width must be at most 1920, got 4000 (from size "4000x720")'),
        (
            {"seconds": "101"},
            'num_frames must be at most 2400, got 2424 (seconds "101" at 24 fps)',
        ),
        (
            {"width": 1920, "height": 1080, "num_frames": 602},
            "width * height * num_frames must be at most 1244160000, "
            "got 1920 * 1080 * 602 = 1248307200",
        ),
    ],
)
def test_limits(fields: dict[str, Any], expected: str) -> None:
    assert expected in invalid_request(**fields).split("; ")


def test_limits_are_inclusive() -> None:
    assert video_of(width=1920, height=1080, num_frames=600) == VideoSettings(1920, 1080, 24, 600)
    assert video_of(width=1920, height=1920, num_frames=2) == VideoSettings(1920, 1920, 24, 2)
    assert video_of(seconds="100").num_frames == 2400


def test_custom_limits() -> None:
    limits = Limits(max_width=64, max_height=64, max_num_frames=8, max_total_pixels=64 * 64 * 4)
    message = start_error(start(width=66, height=64, num_frames=9), limits=limits).message
    assert message.split("; ") == [
        "Invalid session.start: width must be at most 64, got 66",
        "num_frames must be at most 8, got 9",
        "width * height * num_frames must be at most 16384, got 66 * 64 * 9 = 38016",
    ]
    assert start_ok(start(width=64, height=64, num_frames=4), limits=limits).video.num_frames == 4


def test_defaults_are_checked_against_limits_too() -> None:
    err = start_error(start(), defaults=VideoDefaults(width=255))
    assert err.message == "Invalid session.start: width must be even (H.264 yuv420p), got 255"


@pytest.mark.parametrize(
    ("fields", "expected"),
    [
        ({"width": 255}, "width must be even (H.264 yuv420p), got 255"),
        ({"height": 99}, "height must be even (H.264 yuv420p), got 99"),
        ({"size": "321x240"}, "width must be even (H.264 yuv420p), got 321"),
    ],
)
def test_odd_sizes_are_refused(fields: dict[str, Any], expected: str) -> None:
    assert invalid_request(**fields) == expected


def test_zero_size_is_refused() -> None:
    assert invalid_request(size="0x720") == 'size width and height must be >= 1, got "0x720"'


def test_absurdly_long_numbers_do_not_blow_up() -> None:
    assert invalid_request(seconds="9" * 5000).startswith("seconds is too large")
    assert invalid_request(size="9" * 5000 + "x2").startswith("size is too large")
    err = start_error('{"type":"session.start","prompt":"a","seed":' + "9" * 5000 + "}")
    assert err.code is ErrorCode.INVALID_JSON


def test_range_and_limit_problems_are_joined() -> None:
    message = invalid_request(width=255, enable_frame_interpolation=True)
    assert message == (
        "enable_frame_interpolation is not supported by this server; "
        "width must be even (H.264 yuv420p), got 255"
    )


# --------------------------------------------------------------------------------------
# parse_start: image_reference
# --------------------------------------------------------------------------------------


def test_data_url_is_decoded() -> None:
    result = start_ok(start(image_reference={"image_url": PNG_URL}))
    assert result.image == ImageInput(mime_type="image/png", data=PNG_BYTES)
    assert result.request.image_reference is not None
    assert result.config["image_reference"] == {"image_url": PNG_URL}


def test_data_url_media_type_is_normalised_and_whitespace_tolerated() -> None:
    b64 = base64.b64encode(PNG_BYTES).decode()
    url = f"DATA:Image/JPEG;base64,{b64[:10]}\n{b64[10:]}"
    image = start_ok(start(image_reference={"image_url": url})).image
    assert image == ImageInput(mime_type="image/jpeg", data=PNG_BYTES)


def test_data_url_with_parameters() -> None:
    url = PNG_URL.replace("image/png;", "image/png;name=x.png;")
    assert start_ok(start(image_reference={"image_url": url})).image == ImageInput(
        "image/png", PNG_BYTES
    )


@pytest.mark.parametrize(
    "url",
    [
        "http://example.com/cat.png",
        "ftp://example.com/cat.png",
        "file:///etc/passwd",
        "/etc/passwd",
        "cat.png",
        "",
    ],
)
def test_only_data_urls_are_accepted(url: str) -> None:
    message = invalid_request(image_reference={"image_url": url})
    assert message.startswith(
        "image_reference.image_url must be a data:image/<type>;base64,<data> URL or an "
        "https:// URL (other URLs and file paths are not fetched)"
    )


def test_an_https_url_is_parsed_not_fetched() -> None:
    """Whether it is fetched is the server's choice (trio_vstream.media.image_fetch)."""
    url = "https://Images.Example.org.:8443/cats/1.png?size=big#top"
    result = start_ok(start(image_reference={"image_url": url}))
    assert result.image == ImageURL(
        url=url, host="images.example.org", port=8443, target="/cats/1.png?size=big"
    )
    assert isinstance(result.image, ImageURL)
    assert result.image.authority == "images.example.org:8443"
    assert result.config["image_reference"] == {"image_url": url}
    v6 = ImageURL.parse("HTTPS://[2001:DB8::1]")
    assert (v6.host, v6.port, v6.target, v6.authority) == ("2001:db8::1", 443, "/", "[2001:db8::1]")


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("https://user:pw@example.com/x.png", "must not hold a user name or password"),
        ("https://example.com:99999/x.png", "has an invalid port"),
        ("https://example.com:0/x.png", "has an invalid port"),
        ("https:///x.png", "has no host"),
        ("https://exa mple.com/x.png", "holds spaces or control characters"),
        ("https://example.com/x.png\r\nX-Evil: 1", "holds spaces or control characters"),
        ("https://bücher.example/x.png", "holds non-ASCII characters (percent-encode them)"),
        ("https://-bad-.example/x.png", "has an invalid host name"),
        ("https://[not-v6]/x.png", "is not a valid URL"),
        ("https://example.com/" + "a" * 2048, "is longer than 2048 characters"),
    ],
)
def test_bad_https_urls(url: str, reason: str) -> None:
    message = invalid_request(image_reference={"image_url": url})
    assert message.startswith(f"image_reference.image_url {reason}, got "), message


@pytest.mark.parametrize(
    ("url", "expected"),
    [
        (
            "data:text/plain;base64,aGVsbG8=",
            'image_reference.image_url must have an image/* media type, got "text/plain"',
        ),
        (
            "data:;base64,aGVsbG8=",
            'image_reference.image_url must have an image/* media type, got ""',
        ),
        (
            "data:image/png,rawbytes",
            "image_reference.image_url must be base64-encoded (data:image/png;base64,...)",
        ),
        ("data:image/png;base64,@@@@", "image_reference.image_url has invalid base64 data"),
        ("data:image/png;base64,aGVsbG8", "image_reference.image_url has invalid base64 data"),
        ("data:image/png;base64,", "image_reference.image_url has no image data"),
    ],
)
def test_bad_data_urls(url: str, expected: str) -> None:
    assert invalid_request(image_reference={"image_url": url}) == expected


def test_file_id_is_refused() -> None:
    assert invalid_request(image_reference={"file_id": "file-123"}) == (
        "image_reference.file_id is not supported: use image_url (a data: or https:// URL)"
    )


def test_empty_image_reference() -> None:
    assert invalid_request(image_reference={}) == "image_reference must contain image_url"


def test_image_url_must_be_a_string() -> None:
    assert invalid_request(image_reference={"image_url": 5}) == (
        "image_reference.image_url must be a string, got 5"
    )


def test_null_image_reference_means_none() -> None:
    assert start_ok(start(image_reference=None)).image is None


# --------------------------------------------------------------------------------------
# parse_start: video_codec_options
# --------------------------------------------------------------------------------------


def test_video_codec_options_accepts_strings_and_numbers() -> None:
    options = {"preset": "ultrafast", "crf": 23.5, "qp": "0", "g": 48}
    result = start_ok(start(extra_params={"video_codec_options": options}))
    assert result.request.extra_params == {"video_codec_options": options}
    # As libx264 takes them, for the encoder (the config echo keeps what was sent).
    assert result.codec_options == {"preset": "ultrafast", "crf": "23.5", "qp": "0", "g": "48"}
    assert start_ok(start()).codec_options == {}


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ("crf=23", 'extra_params.video_codec_options must be an object, got "crf=23"'),
        ([1], "extra_params.video_codec_options must be an object, got an array"),
        (
            {"crf": [23]},
            "extra_params.video_codec_options.crf: must be a number in 0..51, got an array",
        ),
        (
            {"tune": True},
            "extra_params.video_codec_options.tune: true is not allowed; allowed: film, "
            "animation, grain, stillimage, fastdecode, zerolatency, psnr, ssim",
        ),
        (
            {"preset": None},
            "extra_params.video_codec_options.preset: null is not allowed (slower presets "
            "cost too much CPU); allowed: ultrafast, superfast, veryfast, faster, fast, medium",
        ),
    ],
)
def test_video_codec_options_are_checked(options: Any, expected: str) -> None:
    assert invalid_request(extra_params={"video_codec_options": options}) == expected


def test_video_codec_options_in_sampling_params_are_checked() -> None:
    message = invalid_request(sampling_params={"video_codec_options": {"crf": {}}})
    assert message.startswith("extra_params.video_codec_options.crf: must be")


# --------------------------------------------------------------------------------------
# parse_start: config echo
# --------------------------------------------------------------------------------------


def test_config_echoes_request_in_field_order_without_nones() -> None:
    result = start_ok(
        start(
            model="wan",
            seed=3,
            video_params={"width": 64, "fps": None},
            negative_prompt=None,
            guidance_scale=5,
            sampling_params={"num_inference_steps": 4},
        )
    )
    assert result.config == {
        "model": "wan",
        "prompt": "a cat",
        "video_params": {"width": 64},
        "num_inference_steps": 4,
        "guidance_scale": 5.0,
        "seed": 3,
        "enable_frame_interpolation": False,
        "frame_interpolation_exp": 1,
        "frame_interpolation_scale": 1.0,
    }
    assert list(result.config)[:3] == ["model", "prompt", "video_params"]
    assert result.request.video_params == VideoParams(width=64)
    json.dumps(result.config)  # must be serialisable as-is


# --------------------------------------------------------------------------------------
# Robustness: nothing but ProtocolError escapes, whatever the client sends
# --------------------------------------------------------------------------------------

ODD_VALUES: list[Any] = [
    None,
    True,
    0,
    -1,
    2.5,
    10**30,
    "",
    "x",
    "1x1",
    [],
    [None],
    {},
    {"width": "x", "image_url": 3, "file_id": None},
]


@pytest.mark.parametrize(
    "field",
    [
        "model",
        "prompt",
        "seconds",
        "size",
        "image_reference",
        "video_params",
        "width",
        "quality",
        "lora",
        "extra_params",
        "sampling_params",
        "format",
        "generate_sound",
        "guidance_scale",
    ],
)
def test_parse_start_never_crashes(field: str) -> None:
    for value in ODD_VALUES:
        try:
            result = parse_start(start(**{field: value}))
        except ProtocolError as err:  # parsed or refused (no pytest.raises): both are right
            assert isinstance(err.code, ErrorCode)  # noqa: PT017
            assert "is invalid (" not in err.message  # noqa: PT017  # no unformatted cattrs internals
        else:
            assert isinstance(result, SessionStart)


@pytest.mark.parametrize("where", ["top", "video_params"])
def test_fps_is_bounded_before_it_reaches_the_encoder(where: str) -> None:
    """Found by bench/fuzz.py: fps 2**31 overflowed the H.264 time base (internal_error)."""
    fields = {"fps": 2**31} if where == "top" else {"video_params": {"fps": 2**31}}
    error = start_error(start(**fields))
    assert error.code is ErrorCode.INVALID_REQUEST
    assert "fps must be between 1 and 240" in error.message
    assert start_ok(start(fps=240)).video.fps == 240


@pytest.mark.parametrize("parse", ["start", "control"])
def test_json_nested_deeper_than_the_limit_is_refused_by_name(parse: str) -> None:
    """Found by bench/fuzz.py: a session.start whose extra_params nested a few hundred
    deep was accepted, then echoing it in video.start ran out of stack (internal_error)."""
    from trio_vstream.protocol._wire import MAX_JSON_DEPTH

    def nested(depth: int) -> str:
        return "[" * depth + "]" * depth

    if parse == "start":
        ok = f'{{"type":"session.start","prompt":"a","extra_params":{{"x":{nested(29)}}}}}'
        deep = f'{{"type":"session.start","prompt":"a","extra_params":{{"x":{nested(400)}}}}}'
        assert parse_start(ok).config["extra_params"]["x"]
        with pytest.raises(ProtocolError) as caught:
            parse_start(deep)
    else:
        deep = f'{{"type":"session.ping","x":{nested(400)}}}'
        with pytest.raises(ProtocolError) as caught:
            parse_control(deep)
    assert caught.value.code is ErrorCode.INVALID_MESSAGE
    assert f"nests deeper than {MAX_JSON_DEPTH} levels" in caught.value.message
