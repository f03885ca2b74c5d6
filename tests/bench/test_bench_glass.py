"""The ``glass`` scenario's pure parts: reading a turn and the play ratio from presented
frames (tables of numbers; the run itself, in chromium, is
``tests/player/test_player_glass.py``)."""

from __future__ import annotations

import base64

import numpy as np
import pytest

from bench import run as bench
from bench.scenarios.glass import (
    CANVAS,
    STALL_SLACK_S,
    Presented,
    chunk_margins_ms,
    engine_chunk_ms,
    play_ratio,
    presented_frames,
    turn_latency_ms,
)

FPS = 24.0


def frames_at(shown: list[float], x: list[float], media: list[float] | None = None) -> Presented:
    media = media if media is not None else [i / FPS for i in range(len(shown))]
    return Presented(media=np.array(media), shown=np.array(shown), x=np.array(x, dtype=float))


def steady(count: int, start: float = 10.0) -> list[float]:
    return [start + i / FPS for i in range(count)]


def test_a_turn_is_the_first_presented_frame_moving_the_keys_way() -> None:
    # Left at 2 px a frame for 10 frames, then right from frame 10 on.
    x = [100.0 - 2 * i for i in range(10)]
    x += [x[-1] + 2 * (i + 1) for i in range(10)]
    shown = steady(20)
    pressed = shown[4] + 0.001
    latency = turn_latency_ms(frames_at(shown, x), pressed, sign=1.0)
    assert latency == pytest.approx((shown[10] - pressed) * 1000)
    # Pressed while it already moves that way: the next frame shows it.
    assert turn_latency_ms(frames_at(shown, x), shown[12], sign=1.0) == pytest.approx(
        (shown[13] - shown[12]) * 1000
    )
    # Nothing after the last frames: no turn.
    assert turn_latency_ms(frames_at(shown, x), shown[-1], sign=1.0) is None
    # The other key's way: the object already moved left before the press, not after it.
    assert turn_latency_ms(frames_at(shown, x), pressed, sign=-1.0) == pytest.approx(
        (shown[5] - pressed) * 1000
    )


def test_a_single_frame_of_jitter_is_not_a_turn() -> None:
    x = [100.0 - 2 * i for i in range(20)]
    x[8] += 5.0  # one frame jumps right, the next back
    shown = steady(20)
    assert turn_latency_ms(frames_at(shown, x), shown[2], sign=1.0) is None


def test_frames_without_an_object_break_a_turn_and_still_is_no_motion() -> None:
    assert turn_latency_ms(frames_at(steady(10), [50.0] * 10), 10.0, sign=1.0) is None
    x = [50.0, 52.0, float("nan"), 56.0, 58.0, 60.0, 62.0]
    shown = steady(len(x))
    # No move can be read into or out of frame 2: the turn is frames 4 to 6.
    pressed = shown[0] - 0.01
    assert turn_latency_ms(frames_at(shown, x), pressed, sign=1.0) == pytest.approx(
        (shown[4] - pressed) * 1000
    )


def test_play_ratio_counts_waits_not_vsync_jitter_nor_jumps_forward() -> None:
    # 24 fps shown on a 60 Hz display: gaps of 2 and 3 vsyncs around 1/24 s.
    shown = [10.0 + round(i / FPS * 60) / 60 for i in range(48)]
    frames = frames_at(shown, [0.0] * 48)
    assert play_ratio(frames, shown[0], shown[-1]) == pytest.approx(1.0)
    # A 0.5 s wait before frame 24.
    waited = shown[:24] + [t + 0.5 for t in shown[24:]]
    ratio = play_ratio(frames_at(waited, [0.0] * 48), waited[0], waited[-1])
    wait = waited[24] - waited[23] - 1 / FPS  # the half second, and that vsync's jitter
    assert 0.49 < wait < 0.51
    assert ratio == pytest.approx(1 - wait / (waited[-1] - waited[0]))
    # The page jumping 1 s ahead to the live edge: the media moves on, nobody waits.
    media = [i / FPS + (1.0 if i >= 24 else 0.0) for i in range(48)]
    assert play_ratio(frames_at(shown, [0.0] * 48, media), shown[0], shown[-1]) == 1.0
    # Nothing presented for the span's last second: it waited.
    span_end = shown[-1] + 1.0
    ratio = play_ratio(frames, shown[0], span_end)
    assert ratio == pytest.approx(1 - (1.0 - STALL_SLACK_S) / (span_end - shown[0]))
    assert play_ratio(frames, 0.0, 0.0) is None


def test_presented_frames_find_the_object_across_the_torus_edge() -> None:
    def frame(column: int) -> str:
        pixels = np.zeros((CANVAS, CANVAS, 3), dtype=np.uint8)
        pixels[:, :] = (20, 20, 80)  # navy
        for c in (column - 1, column, column + 1):
            pixels[30:34, c % CANVAS] = (220, 30, 30)
        return base64.b64encode(pixels.tobytes()).decode()

    columns = [CANVAS - 4, CANVAS - 2, 0, 2]
    raw = [[i / FPS, 1000 * (10 + i / FPS), frame(c)] for i, c in enumerate(columns)]
    frames = presented_frames(raw)
    steps = np.diff(frames.x)
    assert steps == pytest.approx([2.0, 2.0, 2.0], abs=0.2)  # unwrapped, not a jump back
    assert frames.shown[0] == pytest.approx(10.0)


def test_chunk_margins_run_from_arrival_to_the_first_frame_presented() -> None:
    shown = steady(16)  # frames 0..15 shown from 10 s on
    frames = frames_at(shown, [0.0] * 16)
    arrivals = [[0.0, 9_900.0], [8 / FPS, shown[8] * 1000 - 40.0], [1.0, 20_000.0]]
    # The third chunk's frames were never presented: no margin.
    assert chunk_margins_ms(frames, arrivals) == pytest.approx([100.0, 40.0])


def test_engine_chunk_ms_is_the_mean_of_the_servers_histogram() -> None:
    text = """# HELP trio_vstream_engine_chunk_seconds ...
trio_vstream_engine_chunk_seconds_bucket{le="0.1",model="shapes"} 3.0
trio_vstream_engine_chunk_seconds_count{model="shapes"} 4.0
trio_vstream_engine_chunk_seconds_sum{model="shapes"} 0.9
trio_vstream_engine_chunk_seconds_created{model="shapes"} 1.7e9
"""
    assert engine_chunk_ms(text) == pytest.approx(225.0)
    assert engine_chunk_ms("") is None


def test_glass_is_asked_for_by_name_and_starts_its_own_server() -> None:
    parse = bench.build_parser().parse_args
    assert "glass" not in bench.settings_from(parse([])).scenarios
    assert bench.settings_from(parse(["--scenario", "glass"])).scenarios == ("glass",)
    with pytest.raises(SystemExit):
        bench.settings_from(parse(["--scenario", "glass", "--url", "ws://h:1/v"]))
    quick = bench.settings_from(parse(["--quick", "--scenario", "glass"]))
    # Short, and still more than one press each way.
    assert quick.glass_seconds / quick.glass_press_every_s >= 3
    assert quick.glass_seconds < bench.Settings(scenarios=()).glass_seconds
