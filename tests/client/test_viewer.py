"""The simulated real-time viewer (`trio_vstream.client._viewer`): tables of numbers in,
figures and reports out; no clock, no sockets."""

from __future__ import annotations

import math

import pytest

from trio_vstream.client._viewer import PlaybackViewer, ViewerFigures, check_startup

# A chunk of 8 frames at 24 fps: a third of a second of media.
CHUNK = 8 / 24


def _viewer(arrivals: list[tuple[float, float]], **options: float) -> PlaybackViewer:
    """A viewer started at t=0 and fed ``(time, media seconds)`` arrivals."""
    viewer = PlaybackViewer(0.0, **options)
    for t, media in arrivals:
        viewer.receive(t, media)
    return viewer


def test_a_stream_faster_than_real_time_plays_without_a_stall() -> None:
    # Chunks of 1/3 s every 0.2 s: always ahead of the playhead.
    viewer = _viewer([(0.5 + 0.2 * i, CHUNK) for i in range(6)])
    viewer.end(1.6)
    figures = viewer.figures(1.6)
    assert figures.time_to_first_frame == pytest.approx(0.5)
    assert (figures.underruns, figures.stall_seconds, figures.late_chunks) == (0, 0.0, 0)
    assert figures.continuous_play_ratio == 1.0
    assert figures.on_time_share == 1.0
    assert figures.play_seconds == pytest.approx(1.1)  # 0.5 -> 1.6, all of it playing
    assert figures.buffered == pytest.approx(2.0)


@pytest.mark.parametrize(
    ("arrivals", "end", "underruns", "stall", "late", "play"),
    [
        # Chunks of 1/3 s every 0.5 s from t=1: each of the 3 after the first is late by
        # 1/6 s; the playhead then plays 1/3 s, and waits again.
        ([(1.0 + 0.5 * i, CHUNK) for i in range(4)], 2.5 + CHUNK, 3, 0.5, 3, 4 * CHUNK),
        # A chunk that arrives exactly as the playhead reaches it is on time.
        ([(0.0, 1.0), (1.0, 1.0)], 2.0, 0, 0.0, 0, 2.0),
        # One long gap: one underrun of 1.5 s, then on again.
        ([(0.0, 0.5), (2.0, 0.5), (2.4, 0.5)], 3.0, 1, 1.5, 1, 1.5),
    ],
)
def test_underruns_stall_time_and_late_chunks(
    arrivals: list[tuple[float, float]],
    end: float,
    underruns: int,
    stall: float,
    late: int,
    play: float,
) -> None:
    viewer = _viewer(arrivals)
    viewer.end(arrivals[-1][0])
    at = viewer.played_out_at
    assert at == pytest.approx(end)
    assert at is not None
    figures = viewer.figures(at)
    assert figures.underruns == underruns
    assert figures.stall_seconds == pytest.approx(stall)
    assert figures.late_chunks == late
    assert figures.play_seconds == pytest.approx(play)
    assert figures.position == pytest.approx(figures.buffered)
    assert figures.continuous_play_ratio == pytest.approx(play / (play + stall))
    assert figures.on_time_share == pytest.approx((len(arrivals) - late) / len(arrivals))


def test_a_stall_counts_while_it_lasts_and_once() -> None:
    viewer = _viewer([(0.0, 0.5)])
    assert viewer.figures(0.4).underruns == 0
    stalled = viewer.figures(1.25)
    assert (stalled.underruns, stalled.stall_seconds) == (1, pytest.approx(0.75))
    assert stalled.position == 0.5  # never past what arrived
    assert not viewer.playing
    assert viewer.figures(2.0).stall_seconds == pytest.approx(1.5)
    assert viewer.figures(2.0).underruns == 1
    viewer.receive(2.0, 0.5)
    assert viewer.playing
    assert viewer.figures(2.5).position == pytest.approx(1.0)


def test_the_startup_threshold_delays_the_first_frame() -> None:
    # 0.5 s of buffer wanted: the second chunk (2/3 s) reaches it at t=0.6.
    viewer = _viewer([(0.3, CHUNK), (0.6, CHUNK), (0.9, CHUNK)], startup_seconds=0.5)
    figures = viewer.figures(1.0)
    assert figures.time_to_first_frame == pytest.approx(0.6)
    assert figures.position == pytest.approx(0.4)
    assert figures.on_time_share == 1.0


def test_a_stream_that_ends_below_the_threshold_still_plays() -> None:
    viewer = _viewer([(0.2, CHUNK)], startup_seconds=0.5)
    assert viewer.figures(0.5).time_to_first_frame is None
    viewer.end(0.5)
    assert viewer.played_out_at == pytest.approx(0.5 + CHUNK)
    figures = viewer.figures(2.0)
    assert figures.time_to_first_frame == pytest.approx(0.5)
    assert (figures.underruns, figures.stall_seconds) == (0, 0.0)
    assert figures.play_seconds == pytest.approx(CHUNK)


def test_running_out_after_the_end_is_not_a_stall() -> None:
    viewer = _viewer([(0.0, 1.0)])
    viewer.end(0.1)
    figures = viewer.figures(5.0)
    assert (figures.underruns, figures.stall_seconds) == (0, 0.0)
    assert figures.play_seconds == pytest.approx(1.0)
    # The end of a stream that stalls ends the stall: no media is coming.
    stalled = _viewer([(0.0, 0.5)])
    stalled.end(1.0)
    assert stalled.figures(3.0).stall_seconds == pytest.approx(0.5)
    assert stalled.figures(3.0).underruns == 1


def test_nothing_is_known_before_the_first_chunk() -> None:
    figures = PlaybackViewer(10.0).figures(12.0)
    assert figures == ViewerFigures(
        time_to_first_frame=None,
        underruns=0,
        stall_seconds=0.0,
        play_seconds=0.0,
        chunks=0,
        late_chunks=0,
        position=0.0,
        buffered=0.0,
    )
    assert figures.continuous_play_ratio is None and figures.on_time_share is None
    viewer = PlaybackViewer(10.0)
    viewer.end(12.0)
    assert viewer.played_out_at is None


def test_reports_every_100_ms_with_the_real_playhead() -> None:
    viewer = _viewer([(1.0, 0.35)])
    assert viewer.report_interval == 0.1
    assert viewer.next_report_at == pytest.approx(1.1)
    # (time asked, position reported or None); asked just after each 100 ms tick.
    table = [
        (0.5, None),  # before the start (the clock never goes back: still 1.0)
        (1.05, None),  # not due yet
        (1.101, 0.101),
        (1.15, None),
        (1.201, 0.201),
        (1.301, 0.301),
        (1.401, 0.35),  # the playhead stopped at what arrived: never past it
        (1.501, None),  # stalled: it has not moved
        (1.601, None),
    ]
    for now, expected in table:
        position = viewer.report(now)
        if expected is None:
            assert position is None, now
        else:
            assert position == pytest.approx(expected), now
    viewer.receive(1.65, 0.35)
    assert viewer.report(1.701) == pytest.approx(0.401)


def test_a_late_report_does_not_make_the_next_ones_bunch_up() -> None:
    viewer = _viewer([(0.0, 10.0)])
    assert viewer.report(0.35) == pytest.approx(0.35)  # due at 0.1, asked late
    assert viewer.next_report_at == pytest.approx(0.45)
    assert viewer.report(0.4) is None
    assert viewer.report(0.451) == pytest.approx(0.451)
    assert viewer.next_report_at == pytest.approx(0.55)


def test_time_never_runs_backwards() -> None:
    viewer = _viewer([(1.0, 1.0)])
    assert viewer.figures(1.5).position == pytest.approx(0.5)
    viewer.receive(1.2, 1.0)  # recorded earlier than a time already seen: taken as 1.5
    figures = viewer.figures(1.5)
    assert figures.position == pytest.approx(0.5) and figures.buffered == 2.0


@pytest.mark.parametrize("media", [0.0, -1.0, math.nan, math.inf])
def test_a_chunk_without_media_time_is_a_caller_bug(media: float) -> None:
    with pytest.raises(ValueError, match="lasts > 0 seconds"):
        PlaybackViewer(0.0).receive(1.0, media)


def test_the_startup_threshold_stays_below_the_window() -> None:
    check_startup(0.0, 1.0)
    check_startup(0.9, 1.0)
    check_startup(5.0, None)
    with pytest.raises(ValueError, match="must stay below the generation window"):
        check_startup(1.0, 1.0)
    for bad in (-0.1, math.nan, math.inf):
        with pytest.raises(ValueError, match="must be >= 0"):
            check_startup(bad, None)
    with pytest.raises(ValueError, match="report interval"):
        PlaybackViewer(0.0, report_interval=0.0)


def test_the_summary_is_json_ready() -> None:
    viewer = _viewer([(0.25, 0.5), (1.0, 0.5)])
    summary = viewer.figures(1.5).summary()
    assert summary == {
        "time_to_first_frame_s": 0.25,
        "underruns": 1,
        "stall_s": 0.25,
        "play_s": 1.0,
        "continuous_play_ratio": 0.8,
        "chunks": 2,
        "chunks_on_time": 1,
        "on_time_share": 0.5,
        "position_s": 1.0,
        "buffered_s": 1.0,
    }


def test_when_the_playhead_reaches_a_time() -> None:
    viewer = PlaybackViewer(0.0, startup_seconds=0.5)
    assert viewer.reaches_at(0.2) is None  # nothing arrived: not playing
    viewer.receive(1.0, 0.25)
    assert viewer.reaches_at(0.2) is None  # below the startup threshold: not playing
    viewer.receive(2.0, 0.75)  # starts at t=2 with 1 s buffered
    assert viewer.reaches_at(0.4) == pytest.approx(2.4)
    assert viewer.reaches_at(1.0) == pytest.approx(3.0)  # the end of what arrived
    assert viewer.reaches_at(1.01) is None  # beyond it: only more media can tell
    viewer.advance(2.5)
    assert viewer.reaches_at(0.4) == 2.5  # passed already: now
    viewer.advance(3.5)  # stalled at 1.0 since t=3
    assert viewer.reaches_at(1.2) is None
    viewer.receive(4.0, 1.0)  # on again at t=4 from 1.0
    assert viewer.reaches_at(1.2) == pytest.approx(4.2)
