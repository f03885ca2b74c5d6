"""Interactions in a paced session: a paced camera session's action windows, the pending
queue bounded at 64 in every session, and unpaced sessions left as they were.

Sessions run over in-memory WebSockets on a clock that stands still until the test
jumps it (`tests.session.playback_harness`), so an interaction's time of receipt, and
so the chunk and the window offset it gets, are the test's choice. Chunks are half a
second of media (4 frames at 8 fps): chunk k's action window is the half second from
when its generation started.
"""

from __future__ import annotations

import trio
import trio.testing

from tests.instrumented import CameraEngine, InstrumentedEngine
from tests.session.playback_harness import CHUNK_FRAMES, Client, Harness, harness, settle
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.taps import SessionTaps
from trio_vstream.session.endings import Outcome

LIMIT = protocol.MAX_PENDING_INTERACTIONS


def started(client: Client) -> list[list[str]]:
    """Each media chunk's ``started_event_ids``, in order."""
    return [chunk["started_event_ids"] for chunk in client.chunks]


class InteractionTap:
    """A session tap (`trio_vstream.outputs.taps.SessionTap`) that keeps what it hears of
    interactions."""

    def __init__(self) -> None:
        self.calls: list[tuple[str, ...]] = []

    def started(self, *args: object) -> None:
        pass

    def chunk(self, *args: object) -> None:
        pass

    def interaction(self, event_id: str, message: object, error: protocol.Error | None) -> None:
        self.calls.append(("queued" if error is None else "refused", event_id))

    def interaction_refused(self, event_id: str, error: protocol.Error) -> None:
        self.calls.append(("refused", event_id, error.message))

    def ended(self, *args: object) -> None:
        pass


def offsets(h: Harness) -> dict[str, float]:
    return {change.event_id: change.window_offset for change in h.stream().changes}


async def test_the_next_chunk_starts_at_the_window_deadline_and_only_then(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=10.0)  # the gate stays open
        await settle()
        assert h.engine.chunks_made == 1  # chunk 0 opened a window of 0.5 s
        await client.playback(0.5)  # a report cannot release it ahead of the deadline
        mock_clock.jump(0.49)
        await settle()
        assert h.engine.chunks_made == 1
        mock_clock.jump(0.01)
        await settle()
        assert h.engine.chunks_made == 2
        mock_clock.jump(0.5)
        await settle()
        assert h.engine.chunks_made == 3


async def test_events_go_to_the_chunk_whose_window_they_fall_in_with_their_offset(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        # A buffer of one chunk: the gate closes after each, so the test decides when
        # the next one starts, after its deadline.
        client = await h.connect(streaming_buffer_seconds=0.5)
        await settle()
        t0 = trio.current_time()  # chunk 0 began here: its window is [t0, t0 + 0.5)
        await client.camera("a")
        await settle()  # received now, before the clock moves
        mock_clock.jump(0.125)
        await client.camera("b")
        await settle()
        # Acknowledged at once, held by the session: the engine has seen neither.
        assert [m["event_id"] for m in client.of_type("session.interaction.queued")] == [
            "a",
            "b",
        ]
        assert h.stream().changes == []
        mock_clock.jump(0.375)  # the deadline: chunk 1 may start, but the gate is shut
        await settle()
        assert trio.current_time() == t0 + 0.5
        await client.camera("at-deadline")  # received exactly at the deadline
        await settle()
        mock_clock.jump(0.25)
        await client.camera("late")
        await client.playback(0.5)  # the gate opens: chunk 1 starts at t0 + 0.75
        await settle()
        assert h.engine.chunks_made == 2
        assert started(client) == [[], ["a", "b"]]
        assert offsets(h) == {"a": 0.0, "b": 0.25}
        # Chunk 1's window is [t0 + 0.75, t0 + 1.25): one event inside it, then chunk 2.
        mock_clock.jump(0.25)
        await client.camera("inside")
        await client.playback(1.0)
        await settle()
        mock_clock.jump(0.25)  # chunk 1's deadline
        await settle()
        assert h.engine.chunks_made == 3
        # Received after chunk 0's deadline: the following chunk's, from its start (they
        # came before its window opened), then the one inside it, halfway through.
        assert started(client)[2] == ["at-deadline", "late", "inside"]
        assert offsets(h) == {"a": 0.0, "b": 0.25, "at-deadline": 0.0, "late": 0.0, "inside": 0.5}
        assert client.of_type("error") == []


async def test_generation_slower_than_real_time_adds_no_wait(
    mock_clock: trio.testing.MockClock,
) -> None:
    settings = SyntheticSettings(chunk_frames=CHUNK_FRAMES, steps=2, block_at_chunk=1)
    async with harness(CameraEngine, settings) as h:
        client = await h.connect(streaming_buffer_seconds=10.0)
        await settle()
        mock_clock.jump(0.5)  # chunk 0's deadline: chunk 1 starts, and blocks
        assert await trio.to_thread.run_sync(h.engine.blocks.wait_blocked, 1, 10)
        mock_clock.jump(2.0)  # chunk 1 takes 2 s to make 0.5 s of media
        h.engine.blocks.release()
        await settle()
        # Chunk 1's deadline passed while it was generated: chunk 2 went at once, and
        # chunk 3 waits for chunk 2's own deadline.
        assert h.engine.chunks_made == 3
        mock_clock.jump(0.5)
        await settle()
        assert h.engine.chunks_made == 4
        assert client.terminal == []


async def test_an_interaction_the_engine_refuses_at_hand_over_gets_its_error_then(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        tap = InteractionTap()
        h.server.tap_factories.append(lambda request_id, start: SessionTaps([tap]))
        h.engine.refuse.add("refused")
        client = await h.connect(streaming_buffer_seconds=10.0)
        await settle()
        await client.camera("refused")
        await client.camera("taken")
        await settle()
        assert len(client.of_type("session.interaction.queued")) == 2
        assert client.of_type("error") == []
        mock_clock.jump(0.5)
        await settle()
        [error] = client.of_type("error")
        assert error["code"] == "interaction_failed"
        assert error["event_id"] == "refused"
        assert "refused refused" in error["message"]
        assert started(client)[1] == ["taken"]
        assert client.terminal == [error]  # the session goes on
        # Recordings were told it was queued; they are told of the refusal too.
        assert tap.calls == [
            ("queued", "refused"),
            ("queued", "taken"),
            ("refused", "refused", error["message"]),
        ]
        h.engine.refuse.clear()
        await client.camera("refused")  # its id was freed: the client may retry with it
        await settle()
        mock_clock.jump(0.5)
        await settle()
        assert started(client)[2] == ["refused"]


async def test_what_is_checked_at_receipt_is_refused_at_receipt(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=10.0)
        await settle()
        await client.camera("once")
        await client.camera("once")
        await settle()
        [error] = client.of_type("error")
        assert (error["code"], error["event_id"]) == ("event_id_conflict", "once")


async def test_an_unpaced_camera_session_hands_interactions_over_at_once(
    mock_clock: trio.testing.MockClock,
) -> None:
    settings = SyntheticSettings(chunk_frames=CHUNK_FRAMES, steps=2, block_at_chunk=0)
    async with harness(CameraEngine, settings) as h:
        client = await h.connect(num_frames=4 * CHUNK_FRAMES)
        # Chunk 0 is being generated (held in its thread) when the camera comes.
        assert await trio.to_thread.run_sync(h.engine.blocks.wait_blocked, 1, 10)
        await client.camera("now")
        await trio.testing.wait_all_tasks_blocked()
        # Today's timing: the engine has it as soon as it came, from its chunk's start.
        assert [(c.event_id, c.window_offset) for c in h.stream().changes] == [("now", 0.0)]
        h.engine.blocks.release()
        await h.ended()
        assert started(client) == [["now"], [], [], []]  # no window, no deadline
        assert client.terminal[-1]["type"] == "session.done"


async def fill(client: Client, count: int, prefix: str = "e") -> None:
    for n in range(count):
        await client.camera(f"{prefix}{n}")


async def prompt(client: Client, event_id: str) -> None:
    await client.send(
        {
            "type": "session.interaction",
            "interaction": {"event_id": event_id, "event": {"prompt": f"colour {event_id}"}},
        }
    )


async def test_the_interaction_that_finds_the_queue_full_ends_the_video_request(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=0.5)
        await settle()
        await fill(client, LIMIT + 1)
        await h.ended()
        assert len(client.of_type("session.interaction.queued")) == LIMIT
        *held, error = client.terminal
        # The ones held for a chunk that will never start are told so, then the end.
        assert [(e["code"], e["event_id"]) for e in held] == [
            ("interaction_failed", f"e{n}") for n in range(LIMIT)
        ]
        assert error["code"] == "interaction_queue_full"
        assert f"{LIMIT} interactions pending" in error["message"]
        assert f"'e{LIMIT}'" in error["message"]  # names the one refused
        assert client.closed
        [summary] = h.summaries
        assert summary.outcome is Outcome.FAILED
        assert summary.error_code == "interaction_queue_full"
        assert h.stream().closed == 1


async def test_interactions_handed_to_the_engine_are_pending_until_a_chunk_starts_them(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A paced session on a prompt-only engine: interactions go to the engine at once, and
    # stay pending while the gate holds the chunk that would start them.
    async with harness(InstrumentedEngine) as h:
        client = await h.connect(streaming_buffer_seconds=0.5)
        await settle()
        for n in range(LIMIT):
            await prompt(client, f"p{n}")
        await settle()
        assert len(h.stream().changes) == LIMIT
        await client.playback(0.5)  # the next chunk starts all 64: none pending now
        await settle()
        assert len(started(client)[1]) == LIMIT
        for n in range(LIMIT):
            await prompt(client, f"again{n}")
        await settle()
        assert client.terminal == []
        assert len(client.of_type("session.interaction.queued")) == 2 * LIMIT
        await client.camera("one-more")  # refused as a camera (prompt-only engine)
        await prompt(client, "overflow")
        await h.ended()
        assert [e["code"] for e in client.of_type("error")] == [
            "interaction_failed",
            "interaction_queue_full",
        ]
        assert h.summaries[0].outcome is Outcome.FAILED


async def test_a_paced_camera_video_all_made_ends_without_waiting_for_a_deadline(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=10.0, num_frames=2 * CHUNK_FRAMES)
        await settle()
        mock_clock.jump(0.5)  # chunk 0's deadline: chunk 1, the last
        await h.ended()
        assert client.terminal[-1]["type"] == "session.done"
        assert len(client.chunks) == 2


async def test_the_wait_for_a_window_longer_than_the_stall_timeout_is_not_a_stall(
    mock_clock: trio.testing.MockClock,
) -> None:
    # A stall timeout of 0.2 s against windows of 0.5 s: the wait is deliberate, so it
    # keeps the stall guard quiet (as a paced send does), for a client that reports its
    # playback and never pings.
    async with harness(CameraEngine, stall_timeout=0.2) as h:
        client = await h.connect(streaming_buffer_seconds=10.0)
        await settle()
        for tick in range(1, 31):  # 1.5 s in steps of 0.05 s: three windows
            mock_clock.jump(0.05)
            if client.closed:
                break
            await client.playback(tick * 0.05)
            await settle()
        assert client.terminal == []
        assert h.engine.chunks_made == 4  # chunk 0, then one at each deadline
        await client.send({"type": "session.stop"})  # and a stop still ends the wait at once
        await h.ended()
        assert client.terminal[-1]["type"] == "session.done"
        assert client.terminal[-1]["stopped"] is True
        assert h.engine.chunks_made == 4


async def test_interactions_held_when_the_video_ends_get_an_error_before_session_done(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        # Two chunks, a buffer of one: the gate shuts after chunk 0 until a report.
        client = await h.connect(streaming_buffer_seconds=0.5, num_frames=2 * CHUNK_FRAMES)
        await settle()
        mock_clock.jump(0.5)  # chunk 0's deadline passes while the gate is shut
        await settle()
        await client.camera("never")  # after the deadline: held for chunk 2, never made
        await settle()
        assert [m["event_id"] for m in client.of_type("session.interaction.queued")] == ["never"]
        await client.playback(0.5)  # chunk 1, the last, then the video ends
        await h.ended()
    assert len(client.chunks) == 2
    *errors, done = client.terminal
    assert [(e["code"], e["event_id"]) for e in errors] == [("interaction_failed", "never")]
    assert "the video ended" in errors[0]["message"]
    assert done["type"] == "session.done" and done["stopped"] is False
    assert client.json[-1] == done
    assert h.stream().changes == []


async def test_interactions_held_when_a_stop_ends_the_video_get_an_error_before_session_done(
    mock_clock: trio.testing.MockClock,
) -> None:
    async with harness(CameraEngine) as h:
        client = await h.connect(streaming_buffer_seconds=10.0)
        await settle()
        await client.camera("held")  # for chunk 1, at the window's deadline
        await settle()
        await client.send({"type": "session.stop"})  # before the deadline
        await h.ended()
    *errors, done = client.terminal
    assert [(e["code"], e["event_id"]) for e in errors] == [("interaction_failed", "held")]
    assert "the video ended" in errors[0]["message"]
    assert done["type"] == "session.done" and done["stopped"] is True
    assert client.json[-1] == done
    assert len(client.chunks) == 1 and h.stream().changes == []
