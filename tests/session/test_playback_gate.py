"""`PlaybackGate` and `InteractionQueue` without a session: the rules of playback pacing
and of action windows as tables of numbers, and the gate's wait on a virtual clock.
(tests/session/test_playback.py and test_paced_interactions.py check the same rules
through a session.)"""

from __future__ import annotations

import math

import pytest
import trio
import trio.testing

from trio_vstream import protocol
from trio_vstream.engines.contract import PromptChange
from trio_vstream.session.interaction_queue import InteractionQueue
from trio_vstream.session.pacing import PlaybackGate

FPS = 100  # so that a chunk of 0.5 s is 50 frames


def gate_after(
    buffer: float, chunks: list[float], reports: list[float], num_frames: int = 10**6
) -> PlaybackGate:
    gate = PlaybackGate(buffer, FPS, num_frames)
    for seconds in chunks:
        gate.generated(round(seconds * FPS))
    for position in reports:
        gate.report(position)
    return gate


@pytest.mark.parametrize(
    ("buffer", "chunks", "reports", "position", "may"),
    [
        (1.0, [], [], 0.0, True),  # nothing made yet
        (1.0, [0.5], [], 0.0, True),  # 0.5 s ahead of 1.0 s allowed
        (1.0, [0.5, 0.5], [], 0.0, False),  # no feedback: the window is full
        (0.75, [0.5, 0.5], [], 0.0, False),  # the chunk in flight went past it
        (1.0, [0.5, 0.5], [0.2], 0.2, True),
        (1.0, [0.5, 0.5], [0.0], 0.0, False),  # a report of 0.0 changes nothing
        (1.0, [0.5, 0.5], [0.5, 0.2], 0.5, True),  # backwards: ignored
        (1.0, [0.5, 0.5, 0.5], [0.5, 0.2], 0.5, False),
        (1.0, [0.5, 0.5], [7.0], 1.0, True),  # beyond the media: clamped to it
        (1.0, [0.5, 0.5], [7.0, 0.9], 1.0, True),  # the clamped playhead stays
        (0.25, [0.5], [0.25], 0.25, False),  # ahead by exactly the buffer: wait
        (0.25, [0.5], [0.3], 0.3, True),
    ],
)
def test_the_gate_as_a_table(
    buffer: float, chunks: list[float], reports: list[float], position: float, may: bool
) -> None:
    gate = gate_after(buffer, chunks, reports)
    assert gate.position == position
    assert gate.may_generate() is may


def test_a_position_clamped_once_moves_on_when_more_is_made() -> None:
    gate = gate_after(1.0, [0.5, 0.5], [5.0])
    assert gate.position == 1.0
    gate.generated(50)
    gate.report(5.0)
    assert gate.position == 1.5


def test_once_the_video_is_all_made_nothing_waits_for_the_playhead() -> None:
    # 100 frames, two chunks of 0.5 s: the engine's next call only ends the video.
    gate = gate_after(1.0, [0.5], [], num_frames=100)
    assert gate.may_generate() and not gate.finished
    gate.generated(50)
    assert gate.finished and gate.may_generate()


async def test_the_wait_ends_at_the_report_that_opens_the_gate(
    autojump_clock: trio.testing.MockClock,
) -> None:
    gate = gate_after(1.0, [0.5, 0.5], [])
    ended: list[float] = []

    async def wait() -> None:
        await gate.wait()
        ended.append(gate.position)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        gate.report(0.0)  # no change: still waiting
        await trio.testing.wait_all_tasks_blocked()
        assert ended == []
        gate.report(0.25)
    assert ended == [0.25]
    assert trio.current_time() == 0.0  # a report, not time, ended it

    await gate.wait()  # open: returns at once


async def test_a_cancelled_wait_ends_at_once(autojump_clock: trio.testing.MockClock) -> None:
    gate = gate_after(0.5, [0.5], [])
    with trio.move_on_after(3.0) as stopped:  # a stop, 3 s into a wait with no reports
        await gate.wait()
    assert stopped.cancelled_caught and trio.current_time() == 3.0


def change(event_id: str) -> PromptChange:
    return PromptChange(event_id, None, camera=protocol.Camera("velocity", (1, 0, 0), (0, 0, 0, 1)))


def taken(queue: InteractionQueue) -> list[tuple[str, float]]:
    return [(c.event_id, c.window_offset) for c in queue.take()]


def test_before_the_first_chunk_everything_held_goes_from_its_start() -> None:
    queue = InteractionQueue(windows=True)
    assert queue.deadline is None
    queue.hold(change("a"), 10.0)
    queue.hold(change("b"), 10.3)
    assert taken(queue) == [("a", 0.0), ("b", 0.0)]
    assert queue.pending == 0  # taken: the session hands them over (and counts them then)


def test_a_window_takes_what_came_before_its_deadline_with_its_offset() -> None:
    queue = InteractionQueue(windows=True)
    queue.open_window(10.0, 0.5)  # chunk k began at 10.0 and made 0.5 s of media
    assert queue.deadline == 10.5
    for event_id, received in (
        ("early", 9.8),  # before the window opened: from the chunk's start
        ("start", 10.0),
        ("quarter", 10.125),
        ("last", 10.4999),
        ("deadline", 10.5),  # at the deadline: the following chunk's
        ("after", 10.7),
    ):
        queue.hold(change(event_id), received)
    got = dict(taken(queue))
    assert list(got) == ["early", "start", "quarter", "last"]
    assert got["early"] == 0.0 and got["start"] == 0.0 and got["quarter"] == 0.25
    assert 0.99 < got["last"] < 1.0
    assert queue.pending == 2
    queue.open_window(10.8, 0.5)  # the next chunk began late, at 10.8
    assert taken(queue) == [("deadline", 0.0), ("after", 0.0)]


@pytest.mark.parametrize(("start", "length"), [(0.1, 0.3), (86400.7, 0.5), (3.0, 1 / 3)])
def test_an_offset_is_always_below_one(start: float, length: float) -> None:
    queue = InteractionQueue(windows=True)
    queue.open_window(start, length)
    assert queue.deadline is not None
    queue.hold(change("edge"), math.nextafter(queue.deadline, 0.0))  # the last moment
    [(_, offset)] = taken(queue)
    assert 0.99 < offset < 1.0


@pytest.mark.parametrize(
    ("began", "opens_at"),
    [
        (10.5, 10.5),  # on the deadline
        (10.503, 10.5),  # woke 3 ms late: the window keeps to the media clock
        (10.54, 10.5),  # within one frame (1/24 s)
        (10.55, 10.55),  # later than a frame: generation was slower than real time
        (10.49, 10.49),  # before the deadline (the first chunk, or an unpaced session)
    ],
)
def test_a_chunk_that_woke_within_a_frame_of_its_deadline_opens_its_window_there(
    began: float, opens_at: float
) -> None:
    queue = InteractionQueue(windows=True)
    queue.open_window(10.0, 0.5)
    queue.open_window(began, 0.5, snap=1 / 24)
    assert queue.deadline == pytest.approx(opens_at + 0.5)


def test_windows_that_snap_never_drift_from_the_media_clock() -> None:
    """A hundred chunks, each woken 4 ms after its deadline: the hundredth window still
    ends at exactly a hundred chunks' media time."""
    queue = InteractionQueue(windows=True)
    queue.open_window(0.0, 0.5)
    for _ in range(99):
        assert queue.deadline is not None
        queue.open_window(queue.deadline + 0.004, 0.5, snap=1 / 24)
    assert queue.deadline == pytest.approx(50.0)


def test_an_unpaced_queue_has_no_deadline() -> None:
    queue = InteractionQueue()
    queue.open_window(10.0, 0.5)
    assert queue.deadline is None and not queue.windows


def test_pending_counts_held_and_handed_until_a_chunk_starts_them() -> None:
    queue = InteractionQueue(windows=True, limit=3)
    queue.hold(change("a"), 0.0)
    queue.handed("b")
    queue.handed("c")
    assert queue.pending == 3 and queue.full
    queue.started(("b", "not-ours"))
    assert queue.pending == 2 and not queue.full
    assert InteractionQueue().limit == protocol.MAX_PENDING_INTERACTIONS == 64
