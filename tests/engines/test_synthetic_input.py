"""The synthetic engine's video input (`interfaces.FollowsInput`), on its own: each
chunk's frames are its input blended with the pattern by ``strength``."""

from __future__ import annotations

import numpy as np
import pytest

from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    EngineError,
    GenerationRequest,
    VideoInput,
)
from trio_vstream.engines.interfaces import FollowsInput, supports_video_input
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream

HEIGHT, WIDTH = 16, 24


def request(strength: float | None, num_frames: int = 10) -> GenerationRequest:
    video = VideoInput(fps=8, strength=strength) if strength is not None else None
    return GenerationRequest(
        request_id="r",
        prompt="red",
        width=WIDTH,
        height=HEIGHT,
        fps=8,
        num_frames=num_frames,
        seed=3,
        input_video=video,
    )


def engine() -> SyntheticEngine:
    return SyntheticEngine(SyntheticSettings(chunk_frames=4))


def noise(count: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (count, HEIGHT, WIDTH, 3), np.uint8)


def follow(stream: SyntheticStream) -> list[tuple[np.ndarray, np.ndarray]]:
    """Feed each chunk noise of its length, as the server does: (input, output) pairs."""
    pairs: list[tuple[np.ndarray, np.ndarray]] = []
    while (count := stream.next_chunk_frames) > 0:
        fed = noise(count, seed=len(pairs))
        stream.feed_input(fed)
        chunk = stream.next_chunk(Checkpoint())
        assert chunk is not None
        pairs.append((fed.copy(), chunk.frames))
    assert stream.next_chunk(Checkpoint()) is None
    return pairs


def test_it_declares_video_input_and_its_streams_follow_it() -> None:
    assert supports_video_input(engine())
    assert isinstance(engine().open_stream(request(0.5)), FollowsInput)


def test_each_chunk_is_as_long_as_next_chunk_frames_said() -> None:
    stream = engine().open_stream(request(0.5))
    counts = []
    while (count := stream.next_chunk_frames) > 0:
        stream.feed_input(noise(count))
        chunk = stream.next_chunk(Checkpoint())
        assert chunk is not None and len(chunk.frames) == count
        counts.append(count)
    assert counts == [4, 4, 2] and stream.next_chunk_frames == 0


def test_strength_zero_is_the_input_exactly() -> None:
    for fed, shown in follow(engine().open_stream(request(0.0))):
        assert shown.dtype == np.uint8 and np.array_equal(shown, fed)


def test_strength_one_ignores_the_input() -> None:
    followed = [shown for _, shown in follow(engine().open_stream(request(1.0)))]
    own = [chunk.frames for chunk in _drain(engine().open_stream(request(None)))]
    assert all(np.array_equal(a, b) for a, b in zip(followed, own, strict=True))


def test_strength_in_between_blends_the_two() -> None:
    pattern = [chunk.frames for chunk in _drain(engine().open_stream(request(None)))]
    pairs = follow(engine().open_stream(request(0.25)))
    for (fed, shown), own in zip(pairs, pattern, strict=True):
        expected = 0.75 * fed.astype(float) + 0.25 * own.astype(float)
        assert np.abs(shown.astype(float) - expected).max() <= 1.0


@pytest.mark.parametrize(
    "frames",
    [
        noise(3),  # not the chunk's length
        np.zeros((4, HEIGHT, WIDTH + 2, 3), np.uint8),  # not the request's size
        np.zeros((4, HEIGHT, WIDTH), np.uint8),  # no colour axis
        np.zeros((4, HEIGHT, WIDTH, 3), np.float32),  # not uint8
    ],
    ids=["length", "size", "channels", "dtype"],
)
def test_a_wrong_input_is_an_engine_error(frames: np.ndarray) -> None:
    stream = engine().open_stream(request(0.5))
    with pytest.raises(EngineError, match="input frames"):
        stream.feed_input(frames)


def test_a_chunk_without_its_input_is_an_engine_error() -> None:
    stream = engine().open_stream(request(0.5))
    with pytest.raises(EngineError, match="no input frames fed for chunk 0"):
        stream.next_chunk(Checkpoint())


def test_a_session_without_input_video_takes_no_input() -> None:
    stream = engine().open_stream(request(None))
    assert stream.next_chunk_frames == 4
    with pytest.raises(EngineError, match="without input_video"):
        stream.feed_input(noise(4))


def _drain(stream: SyntheticStream) -> list[Chunk]:
    chunks = []
    while (chunk := stream.next_chunk(Checkpoint())) is not None:
        chunks.append(chunk)
    return chunks
