"""The shapes engine following an input video (issue 34): its object goes where the
input's coloured region is, as the server feeds it, chunk by chunk.

The inputs are made here: a saturated green disc moving over a textured, noisy grey, put
through JPEG (PyAV's MJPEG) as a camera's frames would be. The object is found in the
output by the prompt's colour, so a test passes only if the engine moved it there.
"""

from __future__ import annotations

import fractions
from typing import Any

import av
import numpy as np
import pytest
import torch

from trio_vstream.engines.contract import (
    Checkpoint,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    VideoInput,
)
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.interfaces import FollowsInput, supports_video_input
from trio_vstream.engines.shapes import ShapesEngine, create_engine
from trio_vstream.engines.shapes.following import follow_offsets, region_centres
from trio_vstream.models.shapes.vocab import OBJECT_COLOURS
from trio_vstream.values import Camera

SIZE = 128
FRAMES = 64
PROMPT = "a large red square moving right on a black background"
GREEN = (40, 200, 60)
LEFT = Camera("velocity", (-0.1, 0.0, 0.0), (0.0, 0.0, 0.0, 1.0))


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


@pytest.fixture(scope="module")
def unfed(engine: ShapesEngine) -> np.ndarray:
    """The frames of `request` without input video: what the object does left to itself."""
    return follow(engine, request(None), None)


def request(strength: float | None = 0.6, **kw: Any) -> GenerationRequest:
    values: dict[str, Any] = {
        "request_id": "input",
        "prompt": PROMPT,
        "width": SIZE,
        "height": SIZE,
        "fps": 24,
        "num_frames": FRAMES,
        "seed": 3,
        "input_video": None if strength is None else VideoInput(fps=24, strength=strength),
    }
    return GenerationRequest(**(values | kw))


def grey_texture(count: int, seed: int = 0) -> np.ndarray:
    """(count, SIZE, SIZE, 3) uint8: a mid grey with a soft pattern and noise of 12 levels."""
    rng = np.random.default_rng(seed)
    ys, xs = np.mgrid[0:SIZE, 0:SIZE] + 0.5
    pattern = 115.0 + 35.0 * np.sin(xs / 7.0) * np.cos(ys / 11.0)
    grey = pattern + rng.normal(0.0, 12.0, (count, SIZE, SIZE))
    return np.repeat(np.clip(grey, 0, 255)[..., None], 3, axis=-1).astype(np.uint8)


def lissajous(count: int = FRAMES) -> np.ndarray:
    """(count, 2) centres as fractions of the frame: once round in x, twice in y (a figure
    eight), so x and y move independently."""
    t = np.arange(count) / count
    return np.stack([0.5 + 0.28 * np.cos(2 * np.pi * t), 0.5 + 0.25 * np.sin(4 * np.pi * t)], 1)


def with_disc(frames: np.ndarray, centres: np.ndarray, colour=GREEN) -> np.ndarray:
    frames = frames.copy()
    ys, xs = np.mgrid[0:SIZE, 0:SIZE] + 0.5
    for frame, (x, y) in zip(frames, centres * SIZE, strict=True):
        frame[(xs - x) ** 2 + (ys - y) ** 2 < 9.0**2] = colour
    return frames


def through_jpeg(frames: np.ndarray) -> np.ndarray:
    """Each frame encoded as a JPEG (4:2:0, a middling quality) and decoded again."""
    encoder = av.CodecContext.create("mjpeg", "w")
    encoder.width, encoder.height = SIZE, SIZE
    encoder.pix_fmt = "yuvj420p"
    encoder.time_base = fractions.Fraction(1, 24)
    encoder.options = {"qscale": "10"}
    decoder = av.CodecContext.create("mjpeg", "r")
    decoded = [
        picture.to_ndarray(format="rgb24")
        for frame in frames
        for packet in encoder.encode(av.VideoFrame.from_ndarray(frame, format="rgb24"))
        for picture in decoder.decode(packet)
    ]
    assert len(decoded) == len(frames)
    return np.stack(decoded)


def follow(engine: ShapesEngine, req: GenerationRequest, video: np.ndarray | None) -> np.ndarray:
    """Run a stream as the server does (``feed_input`` then ``next_chunk``, each chunk
    ``next_chunk_frames`` long); the frames, (T, H, W, 3)."""
    stream = engine.open_stream(req)
    chunks: list[np.ndarray] = []
    done = 0
    try:
        while True:
            if video is not None:
                count = stream.next_chunk_frames
                stream.feed_input(video[done : done + count])
            chunk = stream.next_chunk(Checkpoint())
            if chunk is None:
                break
            frames = frames_to_uint8_array(chunk.frames, width=req.width, height=req.height)
            if video is not None:
                assert len(frames) == count
            chunks.append(frames)
            done += len(frames)
    finally:
        stream.close()
    return np.concatenate(chunks)


def object_centres(frames: np.ndarray, colour: str = "red") -> np.ndarray:
    """(T, 2): the centre of each frame's pixels of the object's colour, as fractions."""
    near = ((frames.astype(np.float32) - OBJECT_COLOURS[colour]) ** 2).sum(-1) < 100.0**2
    assert near.sum(axis=(1, 2)).min() > 50, "a frame without the object"
    ys, xs = np.mgrid[0 : frames.shape[1], 0 : frames.shape[2]] + 0.5
    count = near.sum(axis=(1, 2))
    x = (near * xs).sum(axis=(1, 2)) / count / frames.shape[2]
    y = (near * ys).sum(axis=(1, 2)) / count / frames.shape[1]
    return np.stack([x, y], 1)


def correlations(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    return tuple(float(np.corrcoef(a[:, axis], b[:, axis])[0, 1]) for axis in (0, 1))  # type: ignore[return-value]


def test_the_engine_takes_input_video_and_its_streams_can_be_fed(engine: ShapesEngine) -> None:
    assert supports_video_input(engine)
    stream = engine.open_stream(request(extra_params={"chunk_frames": 5}, num_frames=12))
    try:
        assert isinstance(stream, FollowsInput)
        counts = []
        while stream.next_chunk_frames:
            counts.append(stream.next_chunk_frames)
            stream.feed_input(grey_texture(counts[-1]))
            assert stream.next_chunk(Checkpoint()) is not None
        assert counts == [5, 5, 2]
        assert stream.next_chunk(Checkpoint()) is None
    finally:
        stream.close()


def test_the_object_follows_a_coloured_region_round_a_figure_eight(
    engine: ShapesEngine, unfed: np.ndarray
) -> None:
    path = lissajous()
    video = through_jpeg(with_disc(grey_texture(FRAMES), path))
    found = region_centres(video)
    assert np.abs(found - path).max() < 0.02  # the region, through JPEG and noise
    followed = object_centres(follow(engine, request(0.6), video))
    x, y = correlations(followed, path)
    assert x >= 0.9 and y >= 0.9, (x, y)
    # The same object left to itself goes its own way: the input is what moved it.
    assert max(correlations(object_centres(unfed), path)) < 0.5


@pytest.mark.slow
def test_the_lower_the_strength_the_closer_the_object_follows(engine: ShapesEngine) -> None:
    path = lissajous()
    video = with_disc(grey_texture(FRAMES), path)
    errors = [
        float(np.abs(object_centres(follow(engine, request(strength), video)) - path).mean())
        for strength in (0.0, 0.6, 0.9)
    ]
    assert errors == sorted(errors), errors
    assert errors[0] < 0.02, errors  # strength 0: on the region, to a pixel or two of 128


def test_strength_one_ignores_the_input(engine: ShapesEngine, unfed: np.ndarray) -> None:
    video = with_disc(grey_texture(FRAMES), lissajous())
    np.testing.assert_array_equal(follow(engine, request(1.0), video), unfed)
    assert not np.array_equal(follow(engine, request(0.99), video), unfed)


def test_without_a_coloured_region_the_object_keeps_its_own_motion(
    engine: ShapesEngine, unfed: np.ndarray
) -> None:
    video = through_jpeg(grey_texture(FRAMES, seed=5))
    assert np.isnan(region_centres(video)).all()
    frames = follow(engine, request(0.0), video)
    assert frames.shape == (FRAMES, SIZE, SIZE, 3)
    np.testing.assert_array_equal(frames, unfed)


@pytest.mark.slow
def test_a_region_that_goes_away_leaves_the_object_where_it_was_led(
    engine: ShapesEngine,
) -> None:
    # The disc stays in the bottom right for two chunks, then leaves the picture; the
    # object starts in the top left (seed 3), so only the input can take it there.
    still = np.tile([[0.7, 0.7]], (FRAMES, 1))
    video = with_disc(grey_texture(FRAMES), still)
    video[16:] = grey_texture(FRAMES - 16, seed=1)
    prompt = "a large red square on a black background, still"
    centres = object_centres(follow(engine, request(0.3, prompt=prompt), video))
    free = object_centres(follow(engine, request(None, prompt=prompt), None))
    assert np.abs(free - 0.7).min() > 0.3
    assert np.abs(centres[8:16] - 0.7).max() < 0.05
    assert np.abs(centres[16:] - centres[15]).max() < 0.03  # still, where it was


def test_a_steer_pushes_the_object_off_the_region_its_way(engine: ShapesEngine) -> None:
    still = np.tile([[0.5, 0.5]], (FRAMES, 1))
    video = with_disc(grey_texture(FRAMES), still)
    stream = engine.open_stream(request(0.8, num_frames=32))
    chunks = []
    try:
        for index in range(4):
            if index == 2:
                stream.interact(PromptChange("left", None, camera=LEFT))
            stream.feed_input(video[: stream.next_chunk_frames])
            chunk = stream.next_chunk(Checkpoint())
            assert chunk is not None
            chunks.append(frames_to_uint8_array(chunk.frames, width=SIZE, height=SIZE))
    finally:
        stream.close()
    centres = object_centres(np.concatenate(chunks))
    # Moving right, it sits right of the disc; steered left, left of it.
    assert centres[8:16, 0].mean() > 0.55
    assert centres[24:32, 0].mean() < 0.45
    assert np.abs(centres[8:, 1] - 0.5).max() < 0.05


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_object_follows_on_cuda_too() -> None:
    path = lissajous()
    video = with_disc(grey_texture(FRAMES), path)
    followed = object_centres(follow(create_engine(device="cuda"), request(0.6), video))
    x, y = correlations(followed, path)
    assert x >= 0.9 and y >= 0.9, (x, y)


@pytest.mark.parametrize(
    ("frames", "what"),
    [
        (np.zeros((7, SIZE, SIZE, 3), np.uint8), r"\(7, 128, 128, 3\)"),
        (np.zeros((8, SIZE, 64, 3), np.uint8), r"\(8, 128, 64, 3\)"),
        (np.zeros((8, SIZE, SIZE), np.uint8), r"\(8, 128, 128\)"),
        (np.zeros((8, SIZE, SIZE, 3), np.float32), "float32"),
        ([[0]], "list"),
    ],
)
def test_input_of_the_wrong_shape_is_refused_by_name(
    engine: ShapesEngine, frames: Any, what: str
) -> None:
    stream = engine.open_stream(request())
    try:
        expected = rf"input frames must be a \(8, 128, 128, 3\) uint8 .*{what}"
        with pytest.raises(EngineError, match=expected):
            stream.feed_input(frames)
    finally:
        stream.close()


def test_a_stream_is_fed_only_when_its_request_has_input_video(engine: ShapesEngine) -> None:
    stream = engine.open_stream(request(None))
    try:
        with pytest.raises(EngineError, match="has no input_video"):
            stream.feed_input(grey_texture(8))
    finally:
        stream.close()
    stream = engine.open_stream(request())
    try:
        with pytest.raises(EngineError, match=r"fed each chunk's input \(feed_input\)"):
            stream.next_chunk(Checkpoint())
    finally:
        stream.close()


@pytest.mark.parametrize("strength", [-0.1, 1.5, float("nan")])
def test_a_strength_outside_zero_to_one_is_refused(engine: ShapesEngine, strength: float) -> None:
    with pytest.raises(InvalidRequestError, match=r"strength must be in \[0, 1\]"):
        engine.open_stream(request(strength))


def test_the_dominant_colour_wins_over_a_smaller_one_of_another_hue() -> None:
    frames = with_disc(grey_texture(4), np.tile([[0.3, 0.7]], (4, 1)))
    ys, xs = np.mgrid[0:SIZE, 0:SIZE]
    frames[:, (xs - 100) ** 2 + (ys - 20) ** 2 < 16] = (220, 40, 40)  # a smaller red spot
    np.testing.assert_allclose(region_centres(through_jpeg(frames)), [[0.3, 0.7]] * 4, atol=0.01)


@pytest.mark.parametrize(
    ("level", "noise"), [(128, 0.0), (128, 20.0), (20, 8.0), (235, 8.0)], ids=str
)
def test_grey_dark_and_white_noisy_frames_have_no_region(level: int, noise: float) -> None:
    rng = np.random.default_rng(2)
    shared = rng.normal(0.0, noise, (8, SIZE, SIZE, 1))  # brightness noise, and a little colour
    frames = level + shared + rng.normal(0.0, noise / 2, (8, SIZE, SIZE, 3))
    assert np.isnan(region_centres(np.clip(frames, 0, 255).astype(np.uint8))).all()


def test_each_frame_closes_its_share_of_the_gap() -> None:
    # The model's object at x = 10, 11, 12 (moving right); the target at 20, but in the last
    # frame. Gain 0.5: halfway from where the object would be (where it was, one on), then
    # on by its own motion.
    own = np.array([[10.0, 5.0], [11.0, 5.0], [12.0, 5.0]])
    targets = np.array([[20.0, 5.0], [20.0, 5.0], [np.nan, np.nan]])
    offsets, placed = follow_offsets(own, targets, 0.5, np.zeros(2), 32)
    np.testing.assert_allclose(own + offsets, [[15.0, 5.0], [18.0, 5.0], [19.0, 5.0]])
    assert placed
    # Across the screen, never round the torus's edge: from 2 to 30 is 28 to the right,
    # from where the object is (its offset so far taken in).
    across, _ = follow_offsets(
        np.array([[2.0, 5.0]]), np.array([[30.0, 5.0]]), 0.5, np.zeros(2), 32
    )
    np.testing.assert_allclose(across, [[14.0, 0.0]])
    # An offset of 40 already has the object at (2 + 40) mod 32 = 10: halfway on is 20.
    own = np.array([[2.0, 5.0]])
    further, _ = follow_offsets(own, np.array([[30.0, 5.0]]), 0.5, np.array([40.0, 0.0]), 32)
    np.testing.assert_allclose(np.remainder(own + further, 32), [[20.0, 5.0]])


def test_a_stream_starts_on_its_input_whatever_the_strength() -> None:
    # Not yet placed: the first frame with a target and an object goes all the way there;
    # a frame before it without a target moves nothing; after it, the gain's share.
    own = np.array([[3.0, 4.0], [4.0, 4.0], [5.0, 4.0], [6.0, 4.0]])
    targets = np.array([[np.nan, np.nan], [20.0, 10.0], [20.0, 10.0], [24.0, 10.0]])
    offsets, placed = follow_offsets(own, targets, 0.25, np.zeros(2), 32, placed=False)
    assert placed
    np.testing.assert_allclose(
        own + offsets, [[3.0, 4.0], [20.0, 10.0], [20.75, 10.0], [22.3125, 10.0]]
    )
    # Strength 1 (gain 0) never moves the object, placed or not.
    still, placed = follow_offsets(own, targets, 0.0, np.zeros(2), 32, placed=False)
    assert not placed and not still.any()
