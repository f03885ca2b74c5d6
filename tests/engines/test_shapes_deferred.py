"""The shapes engine's deferred decode (``defer_decode``, on by default): its chunks hold
`DeferredFrames` that decode, later and after the stream's close, to exactly the frames
the eager decode makes; released, they hold nothing and decode no more."""

from __future__ import annotations

from functools import partial

import numpy as np
import pytest

from trio_vstream.engines.contract import (
    Checkpoint,
    Chunk,
    DeferredFrames,
    EngineConfigError,
    EngineError,
    GenerationRequest,
    checkpoint_calling,
    release_frames,
)
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.shapes import ShapesEngine, ShapesFrames, create_engine, parse_settings


@pytest.fixture(scope="module")
def engines() -> dict[bool, ShapesEngine]:
    return {
        True: create_engine(device="cpu"),
        False: create_engine(device="cpu", defer_decode="0"),
    }


def request(num_frames: int = 14, **extra: object) -> GenerationRequest:
    return GenerationRequest(
        request_id="deferred",
        prompt="a red circle moving right on a black background",
        width=48,
        height=40,
        fps=24,
        num_frames=num_frames,
        seed=7,
        extra_params=extra,
    )


def chunks_of(engine: ShapesEngine, req: GenerationRequest) -> list[Chunk]:
    """Every chunk of a stream, undecoded, made before the stream is closed."""
    stream = engine.open_stream(req)
    chunks = []
    try:
        while (chunk := stream.next_chunk(Checkpoint())) is not None:
            chunks.append(chunk)
    finally:
        stream.close()
    return chunks


def frames(chunks: list[Chunk]) -> list[np.ndarray]:
    return [frames_to_uint8_array(c.frames, width=48, height=40) for c in chunks]


@pytest.mark.slow
@pytest.mark.parametrize("chunk_frames", [8, 3])
def test_deferred_frames_decode_after_the_close_to_the_eager_frames(
    engines: dict[bool, ShapesEngine], chunk_frames: int
) -> None:
    req = request(chunk_frames=chunk_frames)
    deferred = chunks_of(engines[True], req)  # decoded only now, the stream closed
    eager = chunks_of(engines[False], req)
    # The first chunk is decoded at once, for the time to first chunk; the others later.
    assert not isinstance(deferred[0].frames, DeferredFrames)
    assert all(isinstance(c.frames, ShapesFrames) for c in deferred[1:])
    assert not any(isinstance(c.frames, DeferredFrames) for c in eager)
    assert [c.frames.shape for c in deferred] == [c.frames.shape for c in eager]
    for a, b in zip(frames(deferred), frames(eager), strict=True):
        np.testing.assert_array_equal(a, b)


@pytest.mark.slow
def test_the_deferred_chunk_is_returned_before_its_decode(
    engines: dict[bool, ShapesEngine],
) -> None:
    """Eager, the decode is a unit of heavy work behind a checkpoint; deferred (from the
    second chunk on), it is not in ``next_chunk`` at all: one checkpoint fewer, and the
    frames undecoded."""
    counts = {}
    for deferred, engine in engines.items():
        steps: list[int] = []
        stream = engine.open_stream(request(num_frames=16))
        try:
            stream.next_chunk(Checkpoint())
            chunk = stream.next_chunk(checkpoint_calling(partial(steps.append, 1)))
        finally:
            stream.close()
        assert chunk is not None
        assert isinstance(chunk.frames, DeferredFrames) is deferred
        counts[deferred] = len(steps)
        release_frames(chunk.frames)
    assert counts[False] == counts[True] + 1


@pytest.mark.slow
def test_released_frames_hold_nothing_and_decode_no_more(
    engines: dict[bool, ShapesEngine],
) -> None:
    chunk = chunks_of(engines[True], request(num_frames=16))[1]
    assert isinstance(chunk.frames, ShapesFrames)
    release_frames(chunk.frames)
    release_frames(chunk.frames)  # twice, as the server may
    assert chunk.frames._native is None
    with pytest.raises(EngineError, match="after their release"):
        chunk.frames.decode()


def test_defer_decode_is_an_on_off_engine_arg() -> None:
    assert parse_settings({}).defer_decode is True
    assert parse_settings({"defer_decode": "off"}).defer_decode is False
    assert parse_settings({"defer_decode": "1"}).defer_decode is True
    with pytest.raises(EngineConfigError, match="defer_decode must be 1 or 0"):
        parse_settings({"defer_decode": "maybe"})
