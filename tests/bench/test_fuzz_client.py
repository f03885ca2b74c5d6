"""The fuzz's client code (``bench/_fuzz/client.py``) against a real server: a healthy one
passes start and control, one that fails after accepting a session is flagged, and input
frames are judged by what they are, a refusal that comes late from the decoder too.
"""

from __future__ import annotations

from typing import Any

from bench._frames import encoded_frame
from bench._fuzz.client import control_alone, run_start
from bench._fuzz.oracle import Problem, judge_start
from bench._fuzz.settings import CONTROL_SIZE
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings

LIMIT = protocol.DEFAULT_LIMITS.max_start_bytes
CONTROL_LIMIT = protocol.DEFAULT_LIMITS.max_control_bytes


def _keys(problems: list[Problem]) -> list[str]:
    return [problem.key for problem in problems]


async def test_an_accepted_session_that_fails_is_flagged(start_server: Any) -> None:
    server = await start_server(SyntheticSettings(fail_at_chunk=0))
    transcript = await run_start(server.url, protocol.start_message("a", size="64x64"))
    outcome, problems = judge_start(transcript, LIMIT)
    assert outcome == "violation"
    assert _keys(problems) == ["accepted-then-generation_failed"]


async def test_a_healthy_server_passes_start_and_control(start_server: Any) -> None:
    server = await start_server(SyntheticSettings(steps=1, step_delay=0.005, chunk_frames=2))
    transcript = await run_start(server.url, protocol.start_message("a", size="64x64"))
    assert judge_start(transcript, LIMIT) == ("accepted", [])
    transcript = await run_start(server.url, '{"type":"session.start","prompt":"\\udc80"}')
    outcome, problems = judge_start(transcript, LIMIT)
    assert outcome.startswith("error:") and problems == []
    message = protocol.interaction_message("a green circle", event_id="e1")
    problems, messages, close_code, request_id = await control_alone(
        server.url, message, CONTROL_LIMIT
    )
    assert problems == []
    assert close_code == 1000 and request_id is not None
    assert any('"session.interaction.queued"' in m for m in messages if isinstance(m, str))


async def test_a_session_killed_after_a_control_message_is_flagged(start_server: Any) -> None:
    # The engine fails at its second chunk: the replay waits for chunks, so it sees it.
    server = await start_server(SyntheticSettings(steps=1, step_delay=0.005, fail_at_chunk=1))
    problems, *_ = await control_alone(server.url, protocol.PING_MESSAGE, CONTROL_LIMIT)
    assert "session-ended-generation_failed" in _keys(problems)


def _frame(frame_format: str) -> bytes:
    return encoded_frame(frame_format, CONTROL_SIZE, CONTROL_SIZE, 0)


def _undecodable_png() -> bytes:
    """A PNG whose header holds but whose pixels do not: refused by the decoder only."""
    data = bytearray(_frame("png"))
    pixels = data.index(b"IDAT")
    for at in range(pixels + 10, pixels + 200):
        data[at] ^= 0x55
    return bytes(data)


async def test_input_frames_are_judged_by_what_they_are(start_server: Any) -> None:
    server = await start_server(SyntheticSettings(steps=1, step_delay=0.005, chunk_frames=2))
    cases: list[tuple[str | None, str, str | bytes]] = [
        ("jpeg", "control.frame-valid.jpeg", _frame("jpeg")),  # taken
        ("jpeg", "control.frame-valid.png", _frame("png")),  # refused at once
        ("png", "control.frame-corrupt.png", _undecodable_png()),  # refused by the decoder
        (None, "control.frame-valid.jpeg", _frame("jpeg")),  # invalid_message: no input video
        ("webp", "control.input-end", protocol.INPUT_END_MESSAGE),  # only the pong
    ]
    for input_format, kind, wire in cases:
        problems, messages, close_code, _ = await control_alone(
            server.url, wire, CONTROL_LIMIT, kind=kind, input_format=input_format
        )
        assert problems == [], (kind, input_format, messages)
        assert close_code == 1000
    # The decoder's refusal of a frame said to be valid comes after its pong: flagged.
    problems, *_ = await control_alone(
        server.url,
        _undecodable_png(),
        CONTROL_LIMIT,
        kind="control.frame-valid.png",
        input_format="png",
    )
    assert _keys(problems) == ["valid-frame-refused"]
