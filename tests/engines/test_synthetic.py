"""The synthetic engine on its own: settings, frames, faults, cancellation."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from trio_vstream.engines import synthetic
from trio_vstream.engines.contract import (
    Checkpoint,
    EngineConfigError,
    EngineError,
    GenerationRequest,
    InvalidRequestError,
    PromptChange,
    checkpoint_calling,
)
from trio_vstream.engines.interfaces import supports_audio
from trio_vstream.engines.synthetic import (
    SyntheticEngine,
    SyntheticSettings,
    create_engine,
    parse_settings,
    session_settings,
)
from trio_vstream.values import audio_samples_through


def request(**overrides: object) -> GenerationRequest:
    fields: dict[str, object] = {
        "request_id": "r",
        "prompt": "red",
        "width": 32,
        "height": 16,
        "fps": 8,
        "num_frames": 10,
    }
    fields.update(overrides)
    return GenerationRequest(**fields)  # type: ignore[arg-type]


def drain(stream: object) -> list[object]:
    chunks = []
    while (chunk := stream.next_chunk(Checkpoint())) is not None:  # type: ignore[attr-defined]
        chunks.append(chunk)
    return chunks


def test_settings_parse_and_reject_clearly() -> None:
    settings = parse_settings({"steps": "2", "step_delay": "0.5", "concurrency": "0"})
    assert (settings.steps, settings.step_delay, settings.concurrency) == (2, 0.5, None)
    with pytest.raises(EngineConfigError, match="step_delay must be >= 0"):
        parse_settings({"step_delay": "-1"})
    with pytest.raises(EngineConfigError, match="chunk_frames must be >= 1, got 0"):
        parse_settings({"chunk_frames": "0"})
    with pytest.raises(EngineConfigError, match="unknown engine arg"):
        create_engine(colour="red")


def test_chunks_cover_exactly_the_requested_frames() -> None:
    engine = SyntheticEngine(parse_settings({"chunk_frames": "4"}))
    chunks = drain(engine.open_stream(request()))
    assert [c.index for c in chunks] == [0, 1, 2]  # type: ignore[attr-defined]
    shapes = [c.frames.shape for c in chunks]  # type: ignore[attr-defined]
    assert shapes == [(4, 16, 32, 3), (4, 16, 32, 3), (2, 16, 32, 3)]
    assert all(c.frames.dtype == np.uint8 for c in chunks)  # type: ignore[attr-defined]


def test_colour_follows_the_prompt_and_interactions() -> None:
    engine = SyntheticEngine(parse_settings({"chunk_frames": "2"}))
    stream = engine.open_stream(request(num_frames=8))
    first = stream.next_chunk(Checkpoint())
    stream.interact(PromptChange("e", "something else entirely", 0))
    second = stream.next_chunk(Checkpoint())
    assert first is not None and second is not None
    mean_first = first.frames.reshape(-1, 3).mean(axis=0)
    mean_second = second.frames.reshape(-1, 3).mean(axis=0)
    assert np.abs(mean_first - mean_second).max() > 10
    assert second.started_event_ids == ("e",) and second.completed_event_ids == ("e",)


def test_every_step_is_preceded_by_a_checkpoint() -> None:
    engine = SyntheticEngine(parse_settings({"steps": "3", "chunk_frames": "5"}))
    stream = engine.open_stream(request(num_frames=5))
    calls: list[int] = []
    stream.next_chunk(lambda: calls.append(1))
    assert len(calls) == 4  # three steps and the final render


def test_a_raising_checkpoint_stops_generation_at_once() -> None:
    engine = SyntheticEngine(parse_settings({"steps": "4", "hang_at_chunk": "0"}))
    stream = engine.open_stream(request())
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if calls == 3:
            raise KeyboardInterrupt  # stands in for trio.Cancelled, a BaseException

    with pytest.raises(KeyboardInterrupt):
        stream.next_chunk(checkpoint_calling(checkpoint, checkpoint))
    assert calls == 3


def test_fail_at_chunk_raises_an_engine_error() -> None:
    engine = SyntheticEngine(parse_settings({"fail_at_chunk": "1", "chunk_frames": "5"}))
    stream = engine.open_stream(request())
    assert stream.next_chunk(Checkpoint()) is not None
    with pytest.raises(EngineError, match="failure at chunk 1"):
        stream.next_chunk(Checkpoint())


def test_block_at_chunk_blocks_without_a_checkpoint_until_the_engine_closes() -> None:
    engine = SyntheticEngine(parse_settings({"chunk_frames": "5"}))
    stream = engine.open_stream(request(extra_params={"block_at_chunk": 1}))
    steps: list[int] = []
    checkpoint = checkpoint_calling(lambda: steps.append(1))
    assert stream.next_chunk(checkpoint) is not None
    before = len(steps)
    made: list[object] = []
    thread = threading.Thread(target=lambda: made.append(stream.next_chunk(checkpoint)))
    thread.start()
    assert engine.blocks.wait_blocked(1, timeout=10)
    assert len(steps) == before  # no checkpoint: nothing could reach it
    engine.close()  # releases it (and any later block) for good
    thread.join(timeout=10)
    assert not thread.is_alive() and made[0] is not None
    assert engine.blocks.waiting == 0
    assert stream.next_chunk(checkpoint) is None  # the video goes on to its end


def test_block_seconds_ends_a_block_by_itself() -> None:
    """A timed block returns without any release: nothing closes the engine while the
    thread runs, yet it goes on and the video reaches its end."""
    engine = SyntheticEngine(parse_settings({"chunk_frames": "5"}))
    extra = {"block_at_chunk": 0, "block_seconds": 0.01}
    stream = engine.open_stream(request(extra_params=extra))
    made: list[list[object]] = []
    thread = threading.Thread(target=lambda: made.append(drain(stream)), daemon=True)
    thread.start()
    try:
        thread.join(timeout=30)  # a bound for a broken engine, never reached by a working one
        assert not thread.is_alive(), "the block did not end by itself"
    finally:
        engine.close()  # a failed test leaves no thread behind
    assert len(made[0]) == 2  # both chunks: the block delayed the first, nothing more
    assert engine.blocks.waiting == 0


def test_a_block_without_block_seconds_ends_by_itself_after_the_maximum(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A client of a synthetic server cannot pin a thread for good: a block it asks for
    without ``block_seconds`` lasts `BLOCK_SECONDS_MAX` at most (shortened here, so the
    test need not wait a minute; before the fix it lasted until the engine's close)."""
    monkeypatch.setattr(synthetic, "BLOCK_SECONDS_MAX", 0.05)
    engine = SyntheticEngine(parse_settings({"chunk_frames": "5"}))
    stream = engine.open_stream(request(extra_params={"block_at_chunk": 0}))
    made: list[list[object]] = []
    thread = threading.Thread(target=lambda: made.append(drain(stream)), daemon=True)
    thread.start()
    try:
        thread.join(timeout=30)  # a bound for a broken engine, never reached by a working one
        assert not thread.is_alive(), "the block did not end by itself"
    finally:
        engine.close()
    assert len(made[0]) == 2
    assert engine.blocks.waiting == 0


def test_a_timed_block_still_ends_at_the_engines_close() -> None:
    """The longest block (60 s) is released at once by the engine's close, as an
    untimed one is: a server that stops never waits for it."""
    engine = SyntheticEngine(parse_settings({"block_at_chunk": "0", "block_seconds": "60"}))
    stream = engine.open_stream(request())
    made: list[object] = []
    thread = threading.Thread(target=lambda: made.append(stream.next_chunk(Checkpoint())))
    thread.start()
    assert engine.blocks.wait_blocked(1, timeout=10)
    engine.close()
    thread.join(timeout=10)
    assert not thread.is_alive() and made[0] is not None


@pytest.mark.parametrize("value", [0, -1, 60.5, True, "1", [1], float("nan"), float("inf")])
def test_block_seconds_is_a_bounded_number(value: object) -> None:
    engine = SyntheticEngine()
    with pytest.raises(
        InvalidRequestError, match=r"extra_params.block_seconds must be a number > 0 and <= 60"
    ):
        engine.open_stream(request(extra_params={"block_at_chunk": 0, "block_seconds": value}))


def test_block_seconds_is_also_an_engine_arg_and_bounded() -> None:
    assert parse_settings({"block_seconds": "2.5"}).block_seconds == 2.5
    timed = session_settings(SyntheticSettings(), request(extra_params={"block_seconds": 60}))
    assert timed.block_seconds == 60.0
    for raw, why in (("0", "must be > 0"), ("61", "must be <= 60"), ("-1", "must be >= 0")):
        with pytest.raises(EngineConfigError, match=f"block_seconds {why}"):
            parse_settings({"block_seconds": raw})


@pytest.mark.parametrize("fault", ["fail_at_chunk", "hang_at_chunk", "block_at_chunk"])
@pytest.mark.parametrize("value", [-1, True, 1.5, "1", [1]])
def test_a_sessions_faults_are_checked_integers(fault: str, value: object) -> None:
    engine = SyntheticEngine()
    with pytest.raises(InvalidRequestError, match=f"extra_params.{fault} must be an integer >= 0"):
        engine.open_stream(request(extra_params={fault: value}))


def test_same_seed_same_frames() -> None:
    engine = SyntheticEngine()
    a = drain(engine.open_stream(request(seed=5)))
    b = drain(engine.open_stream(request(seed=5)))
    c = drain(engine.open_stream(request(seed=6)))
    assert all(np.array_equal(x.frames, y.frames) for x, y in zip(a, b, strict=True))  # type: ignore[attr-defined]
    assert not np.array_equal(a[0].frames, c[0].frames)  # type: ignore[attr-defined]


def test_audio_tone_makes_a_sine_continuous_across_chunks() -> None:
    engine = create_engine(audio_tone="440", audio_sample_rate="44100", chunk_frames="3")
    assert supports_audio(engine)
    assert (engine.audio_sample_rate, engine.audio_channels) == (44100, 1)
    stream = engine.open_stream(request(fps=16, num_frames=10))
    chunks = drain(stream)
    # 44100 / 16 = 2756.25 samples a frame: after 3, 6, 9, 10 frames the stream is at
    # 8268.75, 16537.5, 24806.25, 27562.5 samples, rounded 8269, 16538, 24806, 27563;
    # each chunk carries the difference, not its own rounding (8269 every time).
    sizes = [chunk.audio.shape[0] for chunk in chunks]  # type: ignore[attr-defined]
    assert sizes == [8269, 8269, 8268, 2757]
    assert sum(sizes) == audio_samples_through(10, 44100, 16) == 27563
    joined = np.concatenate([chunk.audio for chunk in chunks])  # type: ignore[attr-defined]
    assert joined.dtype == np.float32
    expected = 0.5 * np.sin(2 * np.pi * 440 * np.arange(27563) / 44100)
    np.testing.assert_allclose(joined, expected, atol=1e-6)


def test_without_audio_tone_the_engine_is_silent() -> None:
    engine = create_engine()
    assert not supports_audio(engine)
    assert all(chunk.audio is None for chunk in drain(engine.open_stream(request())))  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    ("args", "match"),
    [
        ({"audio_tone": "0"}, "audio_tone must be >= 1"),
        ({"audio_tone": "nan"}, "audio_tone must be >= 1"),
        ({"audio_tone": "30000"}, "below half the sample rate"),
        ({"audio_tone": "440", "audio_sample_rate": "96000"}, "audio_sample_rate must be one"),
        ({"audio_sample_rate": "48k"}, "audio_sample_rate must be an integer"),
    ],
)
def test_audio_args_are_checked(args: dict[str, str], match: str) -> None:
    with pytest.raises(EngineConfigError, match=match):
        create_engine(**args)
