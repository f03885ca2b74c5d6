"""Playback pacing in a session (vllm-omni's ``streaming_buffer_seconds`` and
``session.playback``): when generation waits, what ends the wait, what a paused session
holds, and what keeps it alive.

Each test runs sessions over in-memory WebSockets on a clock that stands still until the
test jumps it (`tests.session.playback_harness`): "the engine was asked for N chunks"
is read once nothing can move any more, so a pause is a fact, not a race. The engine's
chunks are half a second of media (4 frames at 8 fps).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import pytest
import trio
import trio.testing

from tests.instrumented import InstrumentedEngine, InstrumentedStream
from tests.session.playback_harness import CHUNK_FRAMES, START, harness, settle
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, batched
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.session.endings import Outcome

STALL = 60.0  # the session's stall timeout (SessionConfig's default)


async def test_with_no_feedback_generation_pauses_once_the_window_is_full(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        # 0.5 s, then 1.0 s generated: 1.0 s ahead of a playhead never reported.
        assert h.engine.chunks_made == 2
        assert len(client.chunks) == 2 and client.terminal == []
        echo = client.of_type("video.start")[0]["config"]
        assert echo["streaming_buffer_seconds"] == 1.0


async def test_the_chunk_in_flight_may_take_generation_past_the_bound(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        await h.connect(streaming_buffer_seconds=0.75)
        await settle()
        # 0.5 s < 0.75 s at the second boundary: that chunk is made, and ends 1.0 s ahead.
        assert h.engine.chunks_made == 2


async def test_each_report_lets_generation_run_up_to_the_window_again(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        await client.playback(0.5)
        await settle()
        assert h.engine.chunks_made == 3  # 1.5 s made, 1.0 s ahead of 0.5 s
        await client.playback(0.6)
        await settle()
        assert h.engine.chunks_made == 4  # 1.5 - 0.6 < 1.0: one more, to 2.0 s
        assert client.of_type("error") == []


async def test_positions_that_go_backwards_are_ignored(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        await client.playback(0.5)
        await settle()
        assert h.engine.chunks_made == 3
        for position in (0.2, 0.0, 0.5):  # backwards, then the same again: no change
            await client.playback(position)
        await settle()
        assert h.engine.chunks_made == 3
        await client.playback(0.55)  # forward again, from 0.5, not from 0.0
        await settle()
        assert h.engine.chunks_made == 4
        assert client.of_type("error") == []


async def test_positions_beyond_the_media_generated_are_clamped_to_it(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        await client.playback(1000.0)  # 1.0 s was generated: the playhead is 1.0 s
        await settle()
        # Not a gate opened for good: the window runs from 1.0 s to 2.0 s.
        assert h.engine.chunks_made == 4
        await client.playback(1000.0)  # clamped again, to 2.0 s now
        await settle()
        assert h.engine.chunks_made == 6


@pytest.mark.parametrize(
    ("message", "words"),
    [
        ({"type": "session.playback"}, "got null"),
        ({"type": "session.playback", "position_seconds": -0.5}, "got -0.5"),
        ({"type": "session.playback", "position_seconds": "1.0"}, 'got "1.0"'),
        ({"type": "session.playback", "position_seconds": True}, "got true"),
        ({"type": "session.playback", "position_seconds": [1]}, "got an array"),
        ({"type": "session.playback", "position_seconds": 10**400}, "got 1000"),
    ],
)
async def test_a_bad_position_gets_a_coded_error_and_the_session_goes_on(
    mock_clock: trio.testing.MockClock, message: dict[str, Any], words: str
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        await client.send(message)
        await settle()
        [error] = client.of_type("error")
        assert error["code"] == "invalid_message"
        assert "session.playback position_seconds must be a finite number >= 0" in error["message"]
        assert words in error["message"]
        assert h.engine.chunks_made == 2  # the bad report moved nothing
        await client.playback(0.5)  # and the session still listens
        await settle()
        assert h.engine.chunks_made == 3
        assert client.terminal == [error]  # the error is its only one, and not terminal
        assert h.summaries == []


async def test_a_stop_ends_a_paused_session_at_once_and_closes_the_engine_stream(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        paused_at = trio.current_time()
        await client.send({"type": "session.ping"})  # controls are answered while paused
        await settle()
        assert len(client.of_type("session.pong")) == 1
        await client.send({"type": "session.stop"})
        await h.ended()
        # The clock never moved: nothing waited for a report, a step or a timeout.
        assert trio.current_time() == paused_at
        assert client.terminal == [
            {
                "type": "session.done",
                "request_id": client.json[0]["request_id"],
                "chunks": 2,
                "stopped": True,
            }
        ]
        assert client.closed
        [summary] = h.summaries
        assert summary.outcome is Outcome.STOPPED
        assert h.stream().closed == 1
        assert h.engine.chunks_made == 2


async def test_a_paused_session_is_not_progress_but_pings_keep_it_alive(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        pinged = await h.connect(streaming_buffer_seconds=1.0)
        silent = await h.connect(streaming_buffer_seconds=1.0)
        await settle()
        for _ in range(3):  # 1.8 stall timeouts in all, paused throughout
            mock_clock.jump(STALL * 0.6)
            await pinged.send({"type": "session.ping"})
            await settle()
        await h.ended()
        # The silent one was not kept alive by being paused, nor by the other's pings.
        assert silent.terminal == [
            {
                "type": "error",
                "message": "Stall timeout: no generation progress",
                "code": "stall_timeout",
                "request_id": silent.json[0]["request_id"],
            }
        ]
        assert pinged.terminal == []
        await pinged.playback(0.5)  # still paused, still served
        await settle()
        assert len(pinged.chunks) == 3


async def test_a_session_without_a_buffer_is_unpaced_and_ignores_reports(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(num_frames=8 * CHUNK_FRAMES)
        await client.playback(0.0)
        await h.ended()
        assert h.engine.chunks_made == 8  # every chunk, with no report past 0.0
        assert client.terminal[-1]["type"] == "session.done"
        assert client.of_type("error") == []
        assert "streaming_buffer_seconds" not in client.json[0]["config"]


async def test_with_pace_to_media_time_too_generating_waits_for_the_playhead_sending_for_time(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect(
            streaming_buffer_seconds=1.0,
            extra_params={"pace_to_media_time": True, "pacing_lead_seconds": 0.25},
        )
        await settle()
        assert h.engine.chunks_made == 2
        # Chunk 1 is due at 0.5 s less the 0.25 s lead: still held, while generation is
        # held by the playhead.
        assert len(client.chunks) == 1
        await client.playback(1.0)
        await settle()
        assert h.engine.chunks_made == 4
        assert len(client.chunks) == 1  # the clock has not moved
        mock_clock.jump(0.25)
        await settle()
        assert len(client.chunks) == 2
        mock_clock.jump(1.0)
        await settle()
        assert len(client.chunks) == 4
        assert h.engine.chunks_made == 4  # still waiting for a report past 1.0 s


class SteppingBatchEngine(InstrumentedEngine):
    """Batches (``max_batch`` 2): each chunk's steps run inside ``checkpoint.batched``,
    where the server's batcher waits for a row from every session inside before it runs
    a batch. A paused session still inside would hold every other session back."""

    max_batch = 2

    def run_batch(self, rows: Sequence[int]) -> list[int]:
        return [row + 1 for row in rows]

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        instrumented = stream.next_chunk

        def next_chunk(checkpoint: Checkpoint) -> Chunk | None:
            with batched(checkpoint, self.run_batch) as step:
                step(0)
                step(1)
            return instrumented(checkpoint)

        stream.next_chunk = next_chunk  # type: ignore[method-assign]
        return stream


@pytest.mark.parametrize(
    "engine_class", [InstrumentedEngine, SteppingBatchEngine], ids=["step slots", "batches"]
)
async def test_a_paused_session_holds_no_step_slot_and_no_batch_row(
    mock_clock: trio.testing.MockClock, engine_class: type[InstrumentedEngine]
) -> None:
    # One step at a time (or one batcher for all): a paused session holding its turn
    # would keep the other from ever stepping.
    settings = SyntheticSettings(chunk_frames=CHUNK_FRAMES, steps=2, concurrency=1)
    async with harness(engine_class, settings) as h:
        paused = await h.connect(streaming_buffer_seconds=0.5)
        await settle()
        assert h.engine.chunks_made == 1
        limiter = h.server._resources.step_limiter
        if limiter is not None:
            assert limiter.statistics().borrowed_tokens == 0
        other = await h.connect(num_frames=6 * CHUNK_FRAMES)
        # Its end waits for its stream's close, in a thread `settle` cannot see.
        await h.ended()
        assert other.terminal[-1]["type"] == "session.done"
        assert len(other.chunks) == 6
        assert len(paused.chunks) == 1 and paused.terminal == []
        await paused.playback(0.5)  # and the paused one steps again when released
        await settle()
        assert len(paused.chunks) == 2


async def test_the_start_is_still_refused_with_a_bad_buffer(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        client = await h.connect({**START, "streaming_buffer_seconds": 0})
        await h.ended()
        [error] = client.terminal
        assert error["code"] == "invalid_request"
        assert "streaming_buffer_seconds must be > 0 and <= 60.0" in error["message"]
        assert h.engine.streams == []


async def test_a_video_all_made_ends_without_waiting_for_the_playhead(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness() as h:
        # Two chunks fill the 1.0 s window and are the whole video: its end (the engine's
        # call that says so) waits for no report.
        client = await h.connect(streaming_buffer_seconds=1.0, num_frames=2 * CHUNK_FRAMES)
        await h.ended()
        assert client.terminal[-1]["type"] == "session.done"
        assert client.terminal[-1]["stopped"] is False
        assert len(client.chunks) == 2
