"""vllm-omni's playback pacing on the wire: ``session.start.streaming_buffer_seconds``
and the ``session.playback`` control message, parsed (no server)."""

from __future__ import annotations

import json
from typing import Any

import pytest

from trio_vstream import protocol
from trio_vstream.protocol import ErrorCode

START = {"type": "session.start", "prompt": "a red circle"}


def start(**fields: Any) -> protocol.SessionStart:
    return protocol.parse_start(json.dumps({**START, **fields}))


@pytest.mark.parametrize("seconds", [0.001, 0.6, 1, 2.5, protocol.MAX_STREAMING_BUFFER_SECONDS])
def test_a_positive_finite_buffer_is_taken_and_echoed(seconds: float) -> None:
    parsed = start(streaming_buffer_seconds=seconds)
    assert parsed.request.streaming_buffer_seconds == float(seconds)
    assert parsed.config["streaming_buffer_seconds"] == float(seconds)


def test_without_a_buffer_a_session_is_unpaced() -> None:
    parsed = start()
    assert parsed.request.streaming_buffer_seconds is None
    assert "streaming_buffer_seconds" not in parsed.config
    assert start(streaming_buffer_seconds=None).request.streaming_buffer_seconds is None


@pytest.mark.parametrize(
    ("value", "words"),
    [
        (0, "must be > 0 and <= 60.0, got 0.0"),
        (-1.5, "must be > 0 and <= 60.0, got -1.5"),
        (60.5, "must be > 0 and <= 60.0, got 60.5"),
        (1e300, "must be > 0 and <= 60.0"),
        (10**400, "must be a finite number"),
        (True, "must be a number, got true"),
        ("1.0", 'must be a number, got "1.0"'),
        ([1.0], "must be a number, got an array"),
        ({"seconds": 1}, "must be a number, got an object"),
    ],
)
def test_anything_else_is_an_invalid_request(value: Any, words: str) -> None:
    with pytest.raises(protocol.ProtocolError) as refused:
        start(streaming_buffer_seconds=value)
    assert refused.value.code is ErrorCode.INVALID_REQUEST
    assert refused.value.message.startswith("Invalid session.start: streaming_buffer_seconds ")
    assert words in refused.value.message


def test_a_buffer_in_sampling_params_is_lifted_like_any_request_field() -> None:
    parsed = start(sampling_params={"streaming_buffer_seconds": 1.5})
    assert parsed.request.streaming_buffer_seconds == 1.5


@pytest.mark.parametrize("position", [0, 0.0, 0.1, 3, 12345.678])
def test_a_playback_report_parses_to_its_position(position: float) -> None:
    raw = json.dumps({"type": "session.playback", "position_seconds": position})
    assert protocol.parse_control(raw) == protocol.Playback(float(position))


def test_other_keys_of_a_playback_report_are_ignored_as_in_stop_and_ping() -> None:
    raw = json.dumps({"type": "session.playback", "position_seconds": 1.0, "buffered": 0.4})
    assert protocol.parse_control(raw) == protocol.Playback(1.0)


def test_a_playback_report_has_vllm_omnis_wire_shape() -> None:
    text = protocol.Playback(1.25).to_json()
    assert json.loads(text) == {"type": "session.playback", "position_seconds": 1.25}
    assert protocol.parse_control(text) == protocol.Playback(1.25)


@pytest.mark.parametrize(
    ("message", "code"),
    [
        ({"type": "session.playback"}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": None}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": -0.001}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": False}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": "2"}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": {}}, ErrorCode.INVALID_MESSAGE),
        ({"type": "session.playback", "position_seconds": 10**400}, ErrorCode.INVALID_MESSAGE),
    ],
)
def test_a_bad_position_is_a_coded_error(message: dict[str, Any], code: ErrorCode) -> None:
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_control(json.dumps(message))
    assert refused.value.code is code
    assert refused.value.message.startswith(
        "session.playback position_seconds must be a finite number >= 0, got "
    )
    assert refused.value.event_id is None


@pytest.mark.parametrize("literal", ["NaN", "Infinity", "-Infinity", "1e999"])
def test_a_position_that_is_not_finite_is_not_json(literal: str) -> None:
    with pytest.raises(protocol.ProtocolError) as refused:
        protocol.parse_control('{"type":"session.playback","position_seconds":' + literal + "}")
    assert refused.value.code is ErrorCode.INVALID_JSON


def test_the_queue_full_code_ends_a_session_for_clients() -> None:
    assert ErrorCode.INTERACTION_QUEUE_FULL == "interaction_queue_full"
    # Not a control error: a client takes it as the end of the session.
    assert ErrorCode.INTERACTION_QUEUE_FULL not in protocol.CONTROL_ERROR_CODES
