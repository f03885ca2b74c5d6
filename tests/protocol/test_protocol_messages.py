"""Tests of control and server messages (protocol/_messages.py): parsing and wire text.

No sockets, no Trio. Wire texts are compared exactly: clients match on them.
"""

import json
from typing import Any

import pytest

from tests.protocol.test_protocol_validation import ODD_VALUES, PNG_URL, start
from trio_vstream.protocol import (
    AUDIO_CODEC,
    PING_MESSAGE,
    STOP_MESSAGE,
    ChunkMetadata,
    Error,
    ErrorCode,
    Interaction,
    InteractionQueued,
    Limits,
    Ping,
    Pong,
    ProtocolError,
    SessionDone,
    Stop,
    VideoStart,
    audio_config,
    interaction_message,
    parse_control,
    parse_server_message,
    parse_start,
    start_message,
)


def control_error(raw: str | bytes, **kwargs: Any) -> ProtocolError:
    with pytest.raises(ProtocolError) as info:
        parse_control(raw, **kwargs)
    return info.value


def interaction(**body: Any) -> str:
    return json.dumps({"type": "session.interaction", "interaction": body})


# --------------------------------------------------------------------------------------
# parse_control
# --------------------------------------------------------------------------------------


def test_stop_and_ping() -> None:
    assert parse_control('{"type": "session.stop"}') == Stop()
    assert parse_control(b'{"type": "session.ping", "extra": 1}') == Ping()
    assert parse_control(STOP_MESSAGE) == Stop()
    assert parse_control(PING_MESSAGE) == Ping()


def test_control_too_large() -> None:
    raw = json.dumps({"type": "session.ping", "pad": "x" * 200})
    err = control_error(raw, limits=Limits(max_control_bytes=len(raw) - 1))
    assert (err.code, err.message) == (ErrorCode.MESSAGE_TOO_LARGE, "control message too large")
    assert parse_control(raw, limits=Limits(max_control_bytes=len(raw))) == Ping()
    assert control_error(raw.encode(), limits=Limits(max_control_bytes=10)).code is (
        ErrorCode.MESSAGE_TOO_LARGE
    )


def test_default_control_limit_is_128_kib() -> None:
    raw = interaction(event={"prompt": "p" * (128 * 1024)})
    assert control_error(raw).code is ErrorCode.MESSAGE_TOO_LARGE


@pytest.mark.parametrize("raw", ["nope", "{", b"\xc3\x28", '{"type": NaN}'])
def test_control_invalid_json(raw: str | bytes) -> None:
    err = control_error(raw)
    assert (err.code, err.message) == (ErrorCode.INVALID_JSON, "Invalid JSON message")


@pytest.mark.parametrize("raw", ["[]", "1", '"session.stop"', "null"])
def test_control_must_be_object(raw: str) -> None:
    err = control_error(raw)
    assert (err.code, err.message) == (
        ErrorCode.INVALID_MESSAGE,
        "WebSocket messages must be JSON objects",
    )


@pytest.mark.parametrize(
    ("body", "shown"),
    [({"type": "session.start", "prompt": "x"}, "session.start"), ({}, "None"), ({"type": 3}, "3")],
)
def test_control_unknown_type(body: dict[str, Any], shown: str) -> None:
    err = control_error(json.dumps(body))
    assert (err.code, err.message) == (ErrorCode.UNKNOWN_TYPE, f"Unknown message type: {shown}")


def test_interaction_full() -> None:
    raw = interaction(event_id="e1", event={"prompt": "a dog", "extra": 1}, transition_chunks=2)
    assert parse_control(raw) == Interaction(event_id="e1", prompt="a dog", transition_chunks=2)


def test_interaction_without_event_id_leaves_it_to_the_server() -> None:
    """None, not a minted id: the protocol stays pure; session.py mints the id."""
    first = parse_control(interaction(event={"prompt": "a dog"}))
    second = parse_control(interaction(event_id=None, event={"prompt": "a dog"}))
    assert first == second == Interaction(event_id=None, prompt="a dog")


@pytest.mark.parametrize(("value", "expected"), [(0, 0), (3, 3), (3.0, 3), (None, None), (10, 10)])
def test_interaction_transition_chunks_accepted(value: Any, expected: int | None) -> None:
    got = parse_control(interaction(event={"prompt": "p"}, transition_chunks=value))
    assert isinstance(got, Interaction)
    assert got.transition_chunks == expected
    assert type(got.transition_chunks) is type(expected)


@pytest.mark.parametrize("value", [2.5, True, False, "3", [3], {}])
def test_interaction_transition_chunks_must_be_integer(value: Any) -> None:
    err = control_error(interaction(event_id="e9", event={"prompt": "p"}, transition_chunks=value))
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "session.interaction transition_chunks must be an integer"
    assert err.event_id == "e9"


@pytest.mark.parametrize("value", [-1, -1.0])
def test_interaction_transition_chunks_must_not_be_negative(value: Any) -> None:
    err = control_error(interaction(event_id="e9", event={"prompt": "p"}, transition_chunks=value))
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "session.interaction transition_chunks must be >= 0"
    assert err.event_id == "e9"


@pytest.mark.parametrize("value", [None, 3, "x", []])
def test_interaction_requires_interaction_object(value: Any) -> None:
    raw = json.dumps({"type": "session.interaction", "interaction": value})
    err = control_error(raw)
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "session.interaction requires an interaction object"
    assert err.event_id is None
    no_key = control_error('{"type": "session.interaction"}')
    assert no_key.message == "session.interaction requires an interaction object"


@pytest.mark.parametrize("event_id", ["", 5, True, ["e"]])
def test_interaction_event_id_must_be_non_empty_string(event_id: Any) -> None:
    err = control_error(interaction(event_id=event_id, event={"prompt": "p"}))
    assert err.code is ErrorCode.INVALID_MESSAGE
    assert err.message == "session.interaction event_id must be a non-empty string"
    assert err.event_id is None


@pytest.mark.parametrize("event", [None, "a dog", ["a dog"]])
def test_interaction_requires_event_object(event: Any) -> None:
    err = control_error(interaction(event_id="e2", event=event))
    assert (err.code, err.message, err.event_id) == (
        ErrorCode.INVALID_MESSAGE,
        "session.interaction requires event object",
        "e2",
    )


def test_interaction_event_error_has_no_event_id_when_server_generated() -> None:
    assert control_error(interaction(event=None)).event_id is None


@pytest.mark.parametrize("event", [{}, {"prompt": ""}, {"prompt": "  "}, {"prompt": 3}])
def test_interaction_requires_prompt(event: dict[str, Any]) -> None:
    err = control_error(interaction(event_id="e3", event=event))
    assert (err.code, err.message, err.event_id) == (
        ErrorCode.INVALID_MESSAGE,
        "session.interaction requires a non-empty event.prompt",
        "e3",
    )


def test_interaction_negative_prompt_is_not_supported() -> None:
    err = control_error(interaction(event_id="e4", event={"prompt": "p", "negative_prompt": "x"}))
    assert (err.code, err.message, err.event_id) == (
        ErrorCode.INVALID_MESSAGE,
        "session.interaction negative_prompt is not supported in this release",
        "e4",
    )
    ok = parse_control(interaction(event_id="e4", event={"prompt": "p", "negative_prompt": None}))
    assert ok == Interaction(event_id="e4", prompt="p", transition_chunks=None)


def test_interaction_checks_run_in_reference_order() -> None:
    # Both the event_id and the event are wrong: the event_id is reported.
    err = control_error(interaction(event_id="", event=None))
    assert err.message == "session.interaction event_id must be a non-empty string"
    err = control_error(interaction(event={"prompt": ""}, transition_chunks="x"))
    assert err.message == "session.interaction requires a non-empty event.prompt"


# --------------------------------------------------------------------------------------
# Client-side builders
# --------------------------------------------------------------------------------------


def test_start_message_round_trips() -> None:
    raw = start_message("a cat", width=320, height=240, seed=1)
    assert json.loads(raw)["type"] == "session.start"
    result = parse_start(raw)
    assert result.request.prompt == "a cat"
    assert result.video.width == 320 and result.request.seed == 1


def test_interaction_message_round_trips() -> None:
    raw = interaction_message("a dog", event_id="e1", transition_chunks=0)
    assert parse_control(raw) == Interaction("e1", "a dog", 0)
    minimal = json.loads(interaction_message("a dog"))
    assert minimal == {"type": "session.interaction", "interaction": {"event": {"prompt": "a dog"}}}


def test_control_messages_serialise() -> None:
    message = Interaction(event_id="e5", prompt="p", transition_chunks=None)
    assert parse_control(message.to_json()) == message
    assert parse_control(Stop().to_json()) == Stop()
    assert parse_control(Ping().to_json()) == Ping()


# --------------------------------------------------------------------------------------
# Server -> client messages
# --------------------------------------------------------------------------------------

SERVER_MESSAGES = [
    VideoStart("r1", "m4s", {"prompt": "a cat", "video_params": {"width": 64}}),
    ChunkMetadata("r1", "media", 16, 1234, 0, ("e1",), ("e1",), (), 0),
    ChunkMetadata("r1", "trailer", 0, 99, None, (), (), ("e1", "e2"), 7),
    InteractionQueued("r1", "e1"),
    SessionDone("r1", 3, False),
    SessionDone("r1", 0, True),
    Pong(),
    Error(ErrorCode.INVALID_JSON, "Invalid JSON message"),
    Error(ErrorCode.EVENT_ID_CONFLICT, "event_id_conflict", request_id="r1", event_id="e1"),
    Error("some_future_code", "x", request_id="r1"),
]


@pytest.mark.parametrize("message", SERVER_MESSAGES, ids=lambda m: type(m).__name__)
def test_server_messages_round_trip(message: Any) -> None:
    raw = message.to_json()
    assert raw.startswith('{"type":"' + message.TYPE + '"')
    assert ": " not in raw and ", " not in raw  # compact
    assert parse_server_message(raw) == message
    assert parse_server_message(raw.encode()) == message


def test_server_message_wire_shapes() -> None:
    assert json.loads(SERVER_MESSAGES[1].to_json()) == {
        "type": "video.chunk_metadata",
        "request_id": "r1",
        "kind": "media",
        "num_frames": 16,
        "byte_length": 1234,
        "generation_chunk_index": 0,
        "started_event_ids": ["e1"],
        "active_event_ids": ["e1"],
        "completed_event_ids": [],
        "transport_chunk_index": 0,
    }
    trailer = json.loads(SERVER_MESSAGES[2].to_json())
    assert trailer["generation_chunk_index"] is None  # sent as null, like the reference
    assert Pong().to_json() == '{"type":"session.pong"}'
    assert json.loads(SessionDone("r", 2, True).to_json()) == {
        "type": "session.done",
        "request_id": "r",
        "chunks": 2,
        "stopped": True,
    }
    assert list(json.loads(VideoStart("r", "m4s", {}).to_json())) == [
        "type",
        "request_id",
        "format",
        "config",
    ]


def test_error_omits_none_keys() -> None:
    assert json.loads(Error(ErrorCode.SERVER_BUSY, "busy").to_json()) == {
        "type": "error",
        "message": "busy",
        "code": "server_busy",
    }
    full = json.loads(Error(ErrorCode.INTERACTION_FAILED, "m", "r", "e").to_json())
    assert full == {
        "type": "error",
        "message": "m",
        "code": "interaction_failed",
        "request_id": "r",
        "event_id": "e",
    }


def test_non_ascii_and_lone_surrogates_serialise_safely() -> None:
    raw = VideoStart("r", "m4s", {"prompt": "猫\ud800"}).to_json()
    raw.encode("utf-8")  # must not raise: a text frame has to be valid UTF-8
    assert parse_server_message(raw) == VideoStart("r", "m4s", {"prompt": "猫\ud800"})


def test_config_from_parse_start_round_trips_through_video_start() -> None:
    result = parse_start(start(image_reference={"image_url": PNG_URL}, seed=1))
    message = VideoStart("r", result.format, result.config)
    assert parse_server_message(message.to_json()) == message


def test_parse_reference_chunk_metadata_without_transport_index() -> None:
    raw = json.dumps(
        {
            "type": "video.chunk_metadata",
            "request_id": "video_stream-abc",
            "kind": "media",
            "num_frames": 2,
            "byte_length": 11,
            "generation_chunk_index": None,
            "started_event_ids": [],
            "active_event_ids": [],
            "completed_event_ids": [],
            "unexpected": {"x": 1},
        }
    )
    assert parse_server_message(raw) == ChunkMetadata(
        "video_stream-abc", "media", 2, 11, None, (), (), (), -1
    )


def test_chunk_metadata_of_a_stream_with_sound_carries_vllm_omnis_audio_fields() -> None:
    message = ChunkMetadata(
        "r", "media", 8, 100, 0, (), (), (), 0, num_audio_samples=16000, audio_sample_rate=48000
    )
    wire = json.loads(message.to_json())
    assert (wire["num_audio_samples"], wire["audio_sample_rate"]) == (16000, 48000)
    assert parse_server_message(message.to_json()) == message
    # Without sound the keys are left out (the wire stays the reference's), and a server
    # that writes them as null reads the same.
    silent = ChunkMetadata("r", "media", 8, 100, 0, (), (), (), 0)
    assert "num_audio_samples" not in silent.to_json()
    nulls = {**json.loads(silent.to_json()), "num_audio_samples": None, "audio_sample_rate": None}
    assert parse_server_message(json.dumps(nulls)) == silent


def test_chunk_metadata_with_audio_fields_of_the_wrong_type_is_refused() -> None:
    raw = json.loads(ChunkMetadata("r", "media", 8, 100, 0, (), (), (), 0).to_json())
    with pytest.raises(ProtocolError) as caught:
        parse_server_message(json.dumps({**raw, "num_audio_samples": "many"}))
    assert caught.value.code is ErrorCode.INVALID_MESSAGE


def test_audio_config_names_the_codec() -> None:
    assert audio_config(48000, 2) == {"sample_rate": 48000, "channels": 2, "codec": "mp4a.40.2"}
    assert AUDIO_CODEC == "mp4a.40.2"


def test_parse_minimal_chunk_metadata() -> None:
    raw = (
        '{"type":"video.chunk_metadata","request_id":"r","kind":"trailer",'
        '"num_frames":0,"byte_length":5}'
    )
    assert parse_server_message(raw) == ChunkMetadata("r", "trailer", 0, 5, None, (), (), (), -1)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ("Timeout waiting for session.start", ErrorCode.START_TIMEOUT),
        ("Stall timeout: no generation progress", ErrorCode.STALL_TIMEOUT),
        ("session.start message too large", ErrorCode.MESSAGE_TOO_LARGE),
        ("control message too large", ErrorCode.MESSAGE_TOO_LARGE),
        ("Invalid JSON in session.start", ErrorCode.INVALID_JSON),
        ("Invalid JSON message", ErrorCode.INVALID_JSON),
        ("session.start must be a JSON object", ErrorCode.INVALID_MESSAGE),
        ("Expected session.start, got: None", ErrorCode.INVALID_MESSAGE),
        ("WebSocket messages must be JSON objects", ErrorCode.INVALID_MESSAGE),
        ("session.interaction requires event object", ErrorCode.INVALID_MESSAGE),
        ("Invalid session.start format: expected 'm4s'.", ErrorCode.INVALID_REQUEST),
        ("Invalid session.start: 1 validation error", ErrorCode.INVALID_REQUEST),
        (
            "Model mismatch: request specifies 'a' but server is running 'b'.",
            ErrorCode.MODEL_MISMATCH,
        ),
        ("Unknown message type: x", ErrorCode.UNKNOWN_TYPE),
        ("diffusion engine exploded", ErrorCode.INTERNAL_ERROR),
    ],
)
def test_parse_reference_error_without_code(message: str, code: ErrorCode) -> None:
    parsed = parse_server_message(json.dumps({"type": "error", "message": message}))
    assert parsed == Error(code, message)


def test_parse_error_codes() -> None:
    parsed = parse_server_message(
        '{"type":"error","message":"event_id_conflict","code":"event_id_conflict",'
        '"request_id":"r","event_id":"e"}'
    )
    assert parsed == Error(ErrorCode.EVENT_ID_CONFLICT, "event_id_conflict", "r", "e")
    assert isinstance(parsed, Error) and parsed.code is ErrorCode.EVENT_ID_CONFLICT
    numeric = parse_server_message('{"type":"error","message":"m","code":400}')
    assert numeric == Error("400", "m")


@pytest.mark.parametrize(
    ("raw", "code", "text"),
    [
        ("nope", ErrorCode.INVALID_JSON, "Invalid JSON message"),
        ("[1]", ErrorCode.INVALID_MESSAGE, "Server messages must be JSON objects"),
        ('{"type":"video.end"}', ErrorCode.UNKNOWN_TYPE, "Unknown message type: video.end"),
        ("{}", ErrorCode.UNKNOWN_TYPE, "Unknown message type: None"),
        (
            '{"type":"session.done","request_id":"r","chunks":"2","stopped":1}',
            ErrorCode.INVALID_MESSAGE,
            'Invalid session.done message: chunks must be an integer, got "2"; '
            "stopped must be true or false, got 1",
        ),
        (
            '{"type":"session.done"}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid session.done message: request_id is required; chunks is required; "
            "stopped is required",
        ),
        (
            '{"type":"video.chunk_metadata","request_id":"r","kind":"x","num_frames":1,'
            '"byte_length":1,"started_event_ids":"abc"}',
            ErrorCode.INVALID_MESSAGE,
            'Invalid video.chunk_metadata message: kind must be one of "media", "trailer", '
            'got "x"; started_event_ids must be an array of strings, got "abc"',
        ),
        (
            '{"type":"video.start","request_id":"r","format":"m4s","config":[]}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid video.start message: config must be an object, got an array",
        ),
        (
            '{"type":"error","message":null}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid error message: message must be a string, got null",
        ),
        (
            '{"type":"error","message":"m","code":true}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid error message: code must be a string, got true",
        ),
        (
            '{"type":"error","message":"m","event_id":5}',
            ErrorCode.INVALID_MESSAGE,
            "Invalid error message: event_id must be a string, got 5",
        ),
    ],
)
def test_parse_server_message_rejects_junk(raw: str, code: ErrorCode, text: str) -> None:
    with pytest.raises(ProtocolError) as info:
        parse_server_message(raw)
    assert (info.value.code, info.value.message) == (code, text)


def test_parse_control_never_crashes() -> None:
    for value in ODD_VALUES:
        for body in (
            {"type": "session.interaction", "interaction": value},
            {"type": "session.interaction", "interaction": {"event": value}},
            {"type": "session.interaction", "interaction": {"event_id": value, "event": {}}},
            {"type": value},
        ):
            try:
                parse_control(json.dumps(body))
            except ProtocolError as err:  # parsed or refused (no pytest.raises): both are right
                assert isinstance(err.code, ErrorCode)  # noqa: PT017
