"""`InputTimeline`, the input's clock, alone: which input frame each output frame is
made from, and the counts a client is told (every frame used or dropped, once)."""

from __future__ import annotations

import numpy as np

from trio_vstream.session.input_video import InputTimeline

SHAPE = (2, 2)


def frame(value: int) -> np.ndarray:
    return np.full((*SHAPE, 3), value, np.uint8)


def arrive(timeline: InputTimeline, *values: int) -> None:
    for value in values:
        timeline.decoded(timeline.arrived(), frame(value))


def values(frames: np.ndarray) -> list[int]:
    return [int(f[0, 0, 0]) for f in frames]


def test_an_input_at_the_output_rate_is_used_frame_for_frame() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    arrive(timeline, 1, 2, 3, 4, 5)
    frames, counts = timeline.take(4, SHAPE)
    assert values(frames) == [1, 2, 3, 4]
    assert (counts.used, counts.dropped, counts.reused, counts.first, counts.last) == (
        4,
        0,
        0,
        0,
        3,
    )


def test_an_input_at_half_the_output_rate_shows_each_frame_twice() -> None:
    timeline = InputTimeline(4, 8, capacity=16)
    arrive(timeline, 1, 2, 3)
    frames, counts = timeline.take(6, SHAPE)
    assert values(frames) == [1, 1, 2, 2, 3, 3]
    assert (counts.used, counts.reused) == (3, 0)


def test_late_input_repeats_the_last_frame_and_the_clock_waits_for_it() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    arrive(timeline, 1, 2)
    assert not timeline.ready(4)
    frames, counts = timeline.take(4, SHAPE)
    assert values(frames) == [1, 2, 2, 2]
    assert (counts.used, counts.reused) == (2, 2)
    arrive(timeline, 3, 4, 5, 6)  # late, not lost: the next chunk starts with them
    frames, counts = timeline.take(4, SHAPE)
    assert values(frames) == [3, 4, 5, 6]
    assert (counts.used, counts.dropped, counts.reused, counts.first) == (4, 0, 0, 2)


def test_before_any_input_the_frames_are_black_and_counted() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    frames, counts = timeline.take(3, SHAPE)
    assert values(frames) == [0, 0, 0]
    assert (counts.used, counts.reused, counts.first, counts.last) == (0, 3, None, None)


def test_a_full_buffer_drops_the_oldest_and_the_output_skips_ahead() -> None:
    timeline = InputTimeline(8, 8, capacity=4)
    arrive(timeline, *range(1, 11))  # ten frames, room for four
    frames, counts = timeline.take(4, SHAPE)
    assert values(frames) == [7, 8, 9, 10]
    assert (counts.used, counts.dropped, counts.first) == (4, 6, 6)


def test_refused_frames_resolve_in_order_and_count_as_dropped() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    first, second, third = timeline.arrived(), timeline.arrived(), timeline.arrived()
    timeline.refuse(second)  # refused at once, decoded neighbours still pending
    assert timeline.resolved == 0
    timeline.decoded(first, frame(1))
    assert timeline.resolved == 2
    timeline.decoded(third, frame(3))
    frames, counts = timeline.take(3, SHAPE)
    assert values(frames) == [1, 1, 3]
    assert (counts.used, counts.dropped, counts.reused) == (2, 1, 1)


def test_a_late_frame_is_used_when_it_comes_not_dropped() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    arrive(timeline, 1)
    timeline.take(3, SHAPE)  # frame 2 is late: the clock waits for it
    arrive(timeline, 2)
    frames, counts = timeline.take(1, SHAPE)
    assert values(frames) == [2] and counts.dropped == 0


def test_an_ended_input_is_exhausted_once_every_frame_is_used() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    arrive(timeline, 1, 2)
    timeline.ended = True
    assert timeline.ready(4) and not timeline.exhausted
    frames, counts = timeline.take(4, SHAPE)
    assert values(frames) == [1, 2, 2, 2] and counts.reused == 2
    assert timeline.exhausted


def test_at_the_largest_size_two_seconds_wait_compressed_beyond_the_decoded_buffer() -> None:
    """A 1080p frame is 6 MB decoded: the decoded buffer holds ten, the rest of two seconds
    of input waits compressed, so a client a second ahead loses nothing."""
    from trio_vstream import protocol
    from trio_vstream.session.input_video import buffer_frames, timeline_capacity

    settings = protocol.InputVideoSettings(
        frame_format="jpeg",
        fps=24,
        width=1920,
        height=1080,
        strength=0.6,
        on_end="end",
        max_wait_seconds=0.25,
        strict=False,
        max_frame_bytes=1 << 20,
    )
    assert buffer_frames(settings) == 48
    assert 2 <= timeline_capacity(settings, (1080, 1920)) < 24


def test_a_skipped_frame_moves_the_output_past_it() -> None:
    timeline = InputTimeline(8, 8, capacity=16)
    arrive(timeline, 1, 2)
    skipped = timeline.arrived()
    timeline.skip(skipped)
    arrive(timeline, 4)
    frames, counts = timeline.take(1, SHAPE)
    assert values(frames) == [4]
    assert (counts.used, counts.dropped) == (1, 3)
