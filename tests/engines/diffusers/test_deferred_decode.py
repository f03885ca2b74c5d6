"""SkyReels-V2 DF windows decoded off the step path (``defer_decode=1``, with
``max_batch`` > 1): each batched window is returned with its VAE decode still to run
(`ForcingFrames`), and decoded later, in order, after the stream has made its next
windows and been closed, it gives the frames the eager decode gives, continuing the
session's causal decoder cache exactly."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest

from tests.engines.diffusers.support import no_stop
from tests.engines.diffusers.test_batching import df_request
from trio_vstream.engines import Engine, load_engine
from trio_vstream.engines.contract import Chunk, EngineError, release_frames
from trio_vstream.engines.diffusers import DiffusersEngine
from trio_vstream.engines.diffusers._settings import parse_settings
from trio_vstream.engines.diffusers.loops.forcing import ForcingFrames
from trio_vstream.engines.frames import frames_to_uint8_array
from trio_vstream.engines.testing import check_engine


def windows(engine: DiffusersEngine, num_frames: int = 33) -> list[Chunk]:
    """A stream's chunks, undecoded, made before the stream is closed."""
    stream = engine.open_stream(df_request("a", 1, num_frames=num_frames))
    chunks = []
    try:
        while (chunk := stream.next_chunk(no_stop)) is not None:
            chunks.append(chunk)
    finally:
        stream.close()
    return chunks


def decoded(chunks: list[Chunk]) -> np.ndarray:
    return np.concatenate([frames_to_uint8_array(c.frames, width=32, height=32) for c in chunks])


@pytest.mark.slow
def test_deferred_windows_decode_after_the_close_to_the_eager_frames(
    skyreels: dict[str, Path], make_engine: Any
) -> None:
    deferred = make_engine(skyreels["t2v"], segment_frames="17", max_batch="8", defer_decode="1")
    eager = make_engine(skyreels["t2v"], segment_frames="17", max_batch="8")
    chunks = windows(deferred)
    assert all(isinstance(c.frames, ForcingFrames) for c in chunks)
    assert [c.frames.shape[0] for c in chunks] == [17, 8, 8]  # known before any decode
    later = decoded(chunks)  # in order, the stream closed
    np.testing.assert_array_equal(later, decoded(windows(eager)))
    # Decoded again, the frames are the same: the cache did not run on.
    np.testing.assert_array_equal(decoded(chunks[:1]), later[:17])
    for chunk in chunks:
        release_frames(chunk.frames)
    with pytest.raises(EngineError, match="after their release"):
        chunks[0].frames.decode()


@pytest.mark.slow
def test_a_deferring_engine_keeps_the_contract(skyreels: dict[str, Path]) -> None:
    # Among the rules: chunks decoded after the stream's next windows and its close equal
    # those decoded at once ("deferred"), and a released window leaves it serving.
    def factory() -> Engine:
        args = {
            "model": str(skyreels["t2v"]),
            "segment_frames": "17",
            "threads": "1",
            "max_batch": "4",
            "defer_decode": "1",
        }
        return load_engine("diffusers", args, device="cpu")

    check_engine(
        factory, df_request("kit", 1, num_frames=25, guidance_scale=1.0, negative_prompt=None)
    )


def test_defer_decode_is_off_by_default_and_parsed() -> None:
    assert parse_settings({"model": "m"}).defer_decode is False
    assert parse_settings({"model": "m", "defer_decode": "on"}).defer_decode is True
    with pytest.raises(EngineError, match="defer_decode must be 1 or 0"):
        parse_settings({"model": "m", "defer_decode": "2"})


def test_defer_decode_is_ignored_with_a_warning_where_windows_are_not_batched(
    skyreels: dict[str, Path], make_engine: Any, caplog: pytest.LogCaptureFixture
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames="17", defer_decode="1")
    assert "defer_decode ignored" in caplog.text
    chunk = windows(engine, num_frames=17)[0]
    assert not isinstance(chunk.frames, ForcingFrames)  # decoded in next_chunk
