"""Attacks on playback pacing: hostile ``streaming_buffer_seconds``, hostile
``session.playback`` reports, and a flood of interactions against the pending queue.

Every one is refused with a coded error, or bounded: a buffer is a finite number in
(0, 60] or the start is refused; a report is a finite number >= 0 or it gets
``invalid_message`` and the session goes on, and no report, however large, lets
generation run more than the buffer ahead of the media already made; the 65th pending
interaction ends the video request (``interaction_queue_full``), and nothing past the
64th is ever held or handed to the engine.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionClosed

from tests.instrumented import CameraEngine
from tests.session.playback_harness import harness, settle
from trio_vstream import protocol

LIMIT = protocol.MAX_PENDING_INTERACTIONS


@pytest.mark.parametrize(
    "value",
    [0, -1, 60.000001, 1e308, 10**400, True, False, "0.5", "Infinity", [0.5], {"s": 1}, ""],
)
async def test_a_hostile_buffer_refuses_the_start_before_the_engine_is_asked(
    mock_clock: trio.testing.MockClock, value: Any
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=value)
        await h.ended()
        [error] = client.json
        assert error["type"] == "error" and error["code"] == "invalid_request"
        assert "streaming_buffer_seconds" in error["message"]
        assert len(error["message"]) < 200  # a huge value is not echoed whole
        assert h.engine.streams == []


@pytest.mark.parametrize(
    "raw",
    [
        '{"type":"session.playback","position_seconds":NaN}',
        '{"type":"session.playback","position_seconds":-Infinity}',
        '{"type":"session.playback","position_seconds":1e400}',
        '{"type":"session.playback","position_seconds":-1e-300}',
        '{"type":"session.playback","position_seconds":"' + "9" * 5000 + '"}',
        '{"type":"session.playback","position_seconds":' + "9" * 4000 + "}",
        '{"type":"session.playback","position_seconds":[[[[[[[[1]]]]]]]]}',
        '{"type":"session.playback","position_seconds":null}',
        '{"type":"session.playback"}',
    ],
)
async def test_a_hostile_report_gets_a_coded_error_and_moves_nothing(
    mock_clock: trio.testing.MockClock, raw: str
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        await client.ws.send_message(raw)
        await settle()
        [error] = client.of_type("error")
        assert error["code"] in ("invalid_message", "invalid_json")
        assert len(error["message"]) < 200
        assert h.engine.chunks_made == 2
        assert client.terminal == [error] and h.summaries == []  # the session goes on


async def test_a_huge_report_opens_one_window_not_the_whole_video(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        for _ in range(3):
            await client.playback(1.7976931348623157e308)  # the largest double
        await settle()
        # Each report is clamped to the media made when it arrives (1.0 s, then at most
        # 2.0 s): generation is never more than the buffer plus a chunk past it.
        assert h.engine.chunks_made <= 6
        assert client.of_type("error") == []


async def test_a_flood_of_interactions_ends_the_video_request_at_the_65th(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=0.5)  # paused after one chunk
        await settle()
        sent = 0
        with contextlib.suppress(ConnectionClosed):  # the server may close first
            for n in range(3 * LIMIT):
                await client.camera(f"flood-{n}")
                sent += 1
        assert sent > LIMIT
        await h.ended()
        queued = [m["event_id"] for m in client.of_type("session.interaction.queued")]
        assert queued == [f"flood-{n}" for n in range(LIMIT)]
        terminal = client.json[-1]
        assert terminal["type"] == "error"
        assert terminal["code"] == "interaction_queue_full"
        assert f"'flood-{LIMIT}'" in terminal["message"]
        # Every other interaction gets a control error: the 64 held ones because the
        # video ended before a chunk took them, and what the receive loop read after the
        # 65th before the session closed.
        failed = client.of_type("error")[:-1]
        assert all(error["code"] == "interaction_failed" for error in failed)
        numbers = [int(error["event_id"].removeprefix("flood-")) for error in failed]
        assert sorted(n for n in numbers if n < LIMIT) == list(range(LIMIT))
        assert LIMIT not in numbers  # its answer is the terminal error
        assert client.closed
        # Held by the session, never more than 64, and none reached the engine.
        assert h.stream().changes == []
        assert h.stream().closed == 1
        assert h.summaries[0].error_code == "interaction_queue_full"
