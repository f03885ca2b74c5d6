"""A paced session's steers placed in their chunk's action window (issue 22).

`PromptChange.window_offset` says where in the chunk's window a change came. The shapes
model conditions a whole chunk on one embedding and moves its object one pixel a frame
or not at all, so the engine integrates: each key weighs its share of the window
(`window_shares`), and the chunk takes the motion of the window's net displacement
(`integrated_motion`). Checked as tables of numbers, then on the model's frames: a short
press moves the object in its chunk and not the next, offset 0 is today's behaviour.
"""

from __future__ import annotations

import numpy as np
import pytest

from tests.engines.test_shapes_engine import frames_of, request, run
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, PromptChange
from trio_vstream.engines.shapes import (
    ShapesEngine,
    WindowChange,
    create_engine,
    integrated_motion,
    window_shares,
)
from trio_vstream.models.shapes import evaluate
from trio_vstream.values import Camera

IDENTITY = (0.0, 0.0, 0.0, 1.0)
STILL, RIGHT, LEFT = "still|p", "right|p", "left|p"


def steer(key: str, offset: float) -> WindowChange:
    return WindowChange(key=key, offset=offset, steer=True)


def camera(x: float = 0.0, y: float = 0.0) -> Camera:
    return Camera("velocity", (x, y, 0.0), IDENTITY)


@pytest.mark.parametrize(
    ("window", "shares"),
    [
        ([steer(RIGHT, 0.25)], {STILL: 0.25, RIGHT: 0.75}),
        ([steer(RIGHT, 0.5)], {STILL: 0.5, RIGHT: 0.5}),
        ([steer(RIGHT, 0.9)], {STILL: 0.9, RIGHT: 0.1}),  # late: still counts, in proportion
        ([steer(RIGHT, 0.25), steer(STILL, 0.5)], {STILL: 0.75, RIGHT: 0.25}),  # short press
        ([steer(RIGHT, 0.0), steer(LEFT, 0.5)], {RIGHT: 0.5, LEFT: 0.5}),
        # Out of order (one clock cannot do that): a change takes effect no earlier than
        # the one before it, so the last to arrive is in force at the end, as scheduled.
        ([steer(RIGHT, 0.5), steer(LEFT, 0.25)], {STILL: 0.5, LEFT: 0.5}),
        ([steer(RIGHT, 0.5), steer(LEFT, 1.5)], {STILL: 0.5, RIGHT: 0.5}),  # past the end
    ],
)
def test_each_key_weighs_its_share_of_the_window(
    window: list[WindowChange], shares: dict[str, float]
) -> None:
    assert window_shares(((STILL, 1.0),), window) == pytest.approx(shares)


def test_the_mix_before_the_first_change_is_the_previous_chunks_mix() -> None:
    blending = (("|blue", 0.6), ("|red", 0.4))
    shares = window_shares(blending, [steer(RIGHT, 0.5)])
    assert shares == pytest.approx({RIGHT: 0.5, "|blue": 0.3, "|red": 0.2})


@pytest.mark.parametrize(
    "window",
    [
        [],  # nothing received
        [steer(RIGHT, 0.0), steer(LEFT, 0.0)],  # all from the first frame, as unpaced
        [steer(RIGHT, float("nan"))],  # not finite (the session never sends it): as 0
        [WindowChange(key="|blue", offset=0.6, steer=False)],  # a prompt
        [steer(RIGHT, 0.3), WindowChange(key="right|p", offset=0.6, steer=False)],  # a blend
    ],
)
def test_a_window_placed_from_the_first_frame_gives_no_shares(window: list[WindowChange]) -> None:
    assert window_shares(((STILL, 1.0),), window) is None


@pytest.mark.parametrize(
    ("shares", "last", "motion"),
    [
        ({"still": 0.8, "right": 0.2}, "still", "right"),  # a short press moves
        ({"still": 0.9, "right": 0.1}, "right", "right"),  # a late press counts
        ({"left": 0.75, "right": 0.25}, "right", "right"),  # the latest steer, at once
        ({"left": 0.95, "right": 0.05}, "right", "right"),
        ({"right": 0.5, "up": 0.5}, "up", "up"),
        ({"left": 0.9, "still": 0.1}, "still", "left"),  # a late stop: the motion before it
        ({"left": 0.25, "right": 0.25, "still": 0.5}, "still", "still"),  # cancel, then stop
        ({"up": 0.3, "down": 0.1, "left": 0.25, "still": 0.35}, "still", "left"),  # (-0.25, -0.2)
        ({"still": 1.0}, "still", "still"),
    ],
)
def test_the_chunk_follows_the_latest_steer_or_a_still_windows_net_displacement(
    shares: dict[str, float], last: str, motion: str
) -> None:
    assert integrated_motion(shares, last) == motion


# ------------------------------------------------------------------ on the model's frames


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


STILL_PROMPT = "a red square not moving on a black background"
"""The object is still until steered: any motion in a chunk is the steer's."""


def run_windows(
    engine: ShapesEngine, req: GenerationRequest, windows: dict[int, list[PromptChange]]
) -> list[Chunk]:
    """Run a stream, handing chunk k's window its changes before making chunk k."""
    stream = engine.open_stream(req)
    chunks: list[Chunk] = []
    try:
        while True:
            for change in windows.get(len(chunks), []):
                stream.interact(change)
            chunk = stream.next_chunk(Checkpoint())
            if chunk is None:
                return chunks
            chunks.append(chunk)
    finally:
        stream.close()


def test_changes_at_offset_0_give_the_frames_they_give_unpaced(engine: ShapesEngine) -> None:
    """Offset 0 is today's behaviour: every change from the chunk's first frame, the last
    one in force (here a press and a release, so the object stays still)."""
    req = request(STILL_PROMPT, num_frames=16, seed=7, num_inference_steps=1)
    press, release = camera(x=1.0), camera()
    at_zero = run_windows(
        engine,
        req,
        {
            1: [
                PromptChange("p", None, camera=press, window_offset=0.0),
                PromptChange("r", None, camera=release, window_offset=0.0),
            ]
        },
    )
    unpaced = run_windows(
        engine,
        req,
        {1: [PromptChange("p", None, camera=press), PromptChange("r", None, camera=release)]},
    )
    only_release = run_windows(engine, req, {1: [PromptChange("r", None, camera=release)]})
    np.testing.assert_array_equal(frames_of(at_zero), frames_of(unpaced))
    np.testing.assert_array_equal(frames_of(at_zero), frames_of(only_release))
    assert at_zero[1].started_event_ids == ("p", "r")


LEFT_PROMPT = "a red square moving left on a black background"


@pytest.mark.slow
@pytest.mark.parametrize(
    ("offset", "motion"),
    [(0.0, "right"), (0.25, "right"), (0.5, "right"), (0.75, "right"), (0.95, "right")],
)
def test_a_steer_anywhere_in_the_window_turns_its_chunk(
    engine: ShapesEngine, offset: float, motion: str
) -> None:
    """Moving left, steered right at ``offset`` into chunk 1's window: chunk 1 moves right
    wherever in the window the steer came (the latest steer wins), and so does chunk 2.
    One step a chunk: chunk 1's frames are compared exactly with those of a run with no
    steer (left), steered at offset 0 (right) or stopped (still)."""
    req = request(LEFT_PROMPT, num_frames=24, seed=7, num_inference_steps=1)
    right = PromptChange("right", None, camera=camera(x=1.0), window_offset=offset)
    placed = run(engine, req, {1: right})
    assert placed[1].started_event_ids == ("right",)
    reference = {
        "left": run(engine, req),
        "right": run(engine, req, {1: PromptChange("right", None, camera=camera(x=1.0))}),
        "still": run(engine, req, {1: PromptChange("still", None, camera=camera())}),
    }
    np.testing.assert_array_equal(frames_of(placed[1:2]), frames_of(reference[motion][1:2]))
    # The window's end is what goes on: chunk 2 is steered right whatever the offset.
    assert evaluate.analyse_clip(frames_of(placed[2:])).motion == "right"


@pytest.mark.slow
def test_a_short_press_moves_the_object_in_its_chunk_and_not_the_next(
    engine: ShapesEngine,
) -> None:
    """Right for a quarter of chunk 1's window, then still: chunk 1 moves right, chunk 2 is
    still, and both changes are reported started in chunk 1. Ignoring the offsets, the
    press would be lost (the last change, still, from the first frame)."""
    press = PromptChange("press", None, camera=camera(x=1.0), window_offset=0.5)
    release = PromptChange("release", None, camera=camera(), window_offset=0.75)
    # The live defaults (3 steps, no guidance): what a paced page session runs.
    req = request(STILL_PROMPT, num_frames=24, seed=7, num_inference_steps=3, guidance_scale=1.0)
    chunks = run_windows(engine, req, {1: [press, release]})
    assert chunks[1].started_event_ids == ("press", "release")
    assert chunks[1].completed_event_ids == ("press", "release")
    frames = frames_of(chunks)
    motions = [evaluate.analyse_clip(frames[i : i + 8]).motion for i in (0, 8, 16)]
    assert motions == ["still", "right", "still"]
