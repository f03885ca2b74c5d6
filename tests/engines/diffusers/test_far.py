"""AnyFlow FAR pipelines, streamed chunk by chunk: the engine drives the pipeline's causal
chunk loop (KV cache included) from its components, each ``next_chunk`` is one chunk, and
the frames, joined, are exactly those of the pipeline's single call."""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.engines.diffusers.support import (
    StopAtCall,
    Stopped,
    assert_fox_to_whale,
    encode,
    fox_to_whale,
    memory_per_chunk,
    no_stop,
    request,
    run_all,
    take_turns,
)
from trio_vstream.engines import InvalidRequestError
from trio_vstream.engines.contract import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops import far

FRAMES = 25
"""Seven latent frames: chunks of 1, 2, 2 and 2 (the tiny transformer's partition unit),
that is 1, 8, 8 and 8 frames; the fourth chunk sees the first one compressed."""

PARTITION = [1, 2, 2, 2]


@pytest.fixture(autouse=True)
def _eager_flex_attention() -> Iterator[None]:
    """FAR attends through flex attention, which on a CPU without ``torch.compile`` goes
    through a dynamo wrapper costing about 0.1 s a call; its eager path (the same math)
    keeps these tests short. Both the engine and the reference call run under it."""
    from torch.nn.attention import flex_attention

    before = getattr(flex_attention, "_FLEX_ATTENTION_DISABLE_COMPILE_DEBUG", False)
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)
        yield
    flex_attention._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = before


def far_request(**fields: Any) -> Any:
    """32x32, two steps, no guidance, seed 1: a fraction of a second a video."""
    values: dict[str, Any] = {"width": 32, "height": 32, "num_frames": FRAMES}
    values.update(fields)
    return request(**values)


def single_call(pipe: Any, *, seed: int = 1, **kw: Any) -> np.ndarray:
    """The pipeline's own output for the whole video, in one call, as uint8 frames."""
    args: dict[str, Any] = {
        "prompt": "a red fox in the snow",
        "height": 32,
        "width": 32,
        "num_frames": FRAMES,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "chunk_partition": PARTITION,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
    args.update(kw)
    return frames_to_uint8(pipe(**args).frames).numpy()


class Counts:
    """Counts a pipeline's transformer calls (denoising steps and cache passes apart)
    and VAE decoder calls (one per latent frame decoded), keeping the prompt embeddings
    each denoising step got."""

    def __init__(self, pipe: Any) -> None:
        self.steps = 0
        self.cache_passes = 0
        self.decoded = 0
        self.embeds: list[torch.Tensor] = []

        def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            if kwargs["kv_cache_flag"]["is_cache_step"]:
                self.cache_passes += 1
            else:
                self.steps += 1
                self.embeds.append(kwargs["encoder_hidden_states"].detach().clone())

        def before_decode(module: Any, args: Any) -> None:
            self.decoded += 1

        self._hooks = [
            pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True),
            pipe.vae.decoder.register_forward_pre_hook(before_decode),
        ]

    def remove(self) -> None:
        for hook in self._hooks:
            hook.remove()


@pytest.mark.parametrize(
    "guided",
    [{}, {"guidance_scale": 3.0, "negative_prompt": "blurry"}],
    ids=["plain", "guided"],
)
def test_chunks_stream_as_the_single_call(
    guided: dict[str, Any], anyflow_far: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    assert engine.loop is far.LOOP
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    stream = engine.open_stream(far_request(**guided))
    first = stream.next_chunk(no_stop)
    first_work = (c.steps, c.cache_passes, c.decoded)
    chunks = [first, *run_all(stream)]
    assert [ch.frames.shape[0] for ch in chunks] == [1, 8, 8, 8]
    assert [ch.index for ch in chunks] == [0, 1, 2, 3]
    # The first chunk is handed over after its own two steps and its one latent frame's
    # decode: no cache pass, nothing of the later chunks.
    assert first_work == (2, 0, 1)
    # In all, the single call's work: two steps a chunk, a cache pass after every chunk
    # but the last, and each latent frame decoded once.
    assert (c.steps, c.cache_passes, c.decoded) == (8, 3, 7)
    reference = single_call(pipe, **guided)
    streamed = np.concatenate([ch.frames for ch in chunks])
    assert reference.shape == streamed.shape == (FRAMES, 32, 32, 3)
    np.testing.assert_array_equal(streamed, reference)  # exact: the same arithmetic


def test_image_reference_is_the_first_chunk(anyflow_far: Path, make_engine: Any) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    video = torch.from_numpy(image.astype(np.float32) / 255.0).permute(2, 0, 1)[None, None]
    reference = single_call(engine.model.pipe, video=video)
    streamed = run_all(engine.open_stream(far_request(image=image)))
    assert [ch.frames.shape[0] for ch in streamed] == [1, 8, 8, 8]
    np.testing.assert_array_equal(np.concatenate([ch.frames for ch in streamed]), reference)
    plain = single_call(engine.model.pipe)
    assert not np.array_equal(reference, plain)


def test_sessions_take_turns_at_chunk_boundaries_each_with_its_own_state(
    anyflow_far: Path, make_engine: Any
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    streams = engine.open_stream(far_request(seed=1)), engine.open_stream(far_request(seed=2))
    for frames, seed in zip(take_turns(engine, *streams, chunks=4), (1, 2), strict=True):
        reference = single_call(engine.model.pipe, seed=seed)
        np.testing.assert_array_equal(frames, reference)


def test_stop_within_a_step_and_the_stopped_chunk_is_not_decoded(
    anyflow_far: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    c = Counts(engine.model.pipe)
    probes.append(c)
    stream = engine.open_stream(far_request(num_inference_steps=3))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint) is not None
        assert stops.calls == 3 + 1  # a checkpoint before each of the 3 steps, and the decode
        assert (c.steps, c.decoded) == (3, 1)
        # The second chunk: its cache pass, then its steps; stop at its third step's.
        stops.stop_at = stops.calls + 1 + 3
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._run.chunks_done == 1  # the stopped chunk is not kept
    finally:
        stream.close()
    assert c.steps == 3 + 2  # no step after the stop
    assert c.decoded == 1  # the stopped chunk was not decoded
    assert not engine.lock.locked


def test_interaction_blends_embeddings_from_the_next_chunk_on(
    anyflow_far: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    chunks = fox_to_whale(engine.open_stream(far_request(prompt="a red fox")))
    assert len(chunks) == 4
    assert_fox_to_whale(chunks, c.embeds, lambda text: encode(pipe, text), steps=2)


def test_memory_is_flat_over_chunks_but_sized_by_the_video(
    anyflow_far: Path, make_engine: Any
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    chunks = 5
    frames = 1 + 8 * (chunks - 1)
    stream = engine.open_stream(far_request(num_frames=frames, num_inference_steps=1))
    sizes, held, _ = memory_per_chunk(stream, chunks, lambda: stream._run.held_bytes)
    # What a session holds is allocated at its first chunk, as the single call allocates
    # it (the decoder's causal cache fills up with the second latent frame): nothing
    # grows from chunk to chunk after that, not even one latent frame's worth.
    assert len(set(held[1:])) == 1, held
    latent_frame = 16 * 4 * 4 * 4  # channels x 4x4 x float32
    assert max(sizes[1:]) - min(sizes[1:]) < latent_frame, sizes
    # But unlike Helios and SkyReels-V2 DF, it is not a fixed window: FAR keeps every
    # chunk in view, so a longer video holds more.
    longer = engine.open_stream(far_request(num_frames=frames + 16, num_inference_steps=1))
    try:
        longer.next_chunk(no_stop)
        assert longer._run.held_bytes > held[0]
    finally:
        longer.close()


def test_chunk_arguments_are_checked_before_the_stream_starts(
    anyflow_far: Path, make_engine: Any
) -> None:
    engine = make_engine(anyflow_far, segment_frames="8")
    with pytest.raises(InvalidRequestError, match=r"chunk_partition sums to 6, but 25 frames"):
        engine.open_stream(far_request(extra_params={"chunk_partition": [1, 2, 3]}))
    with pytest.raises(InvalidRequestError, match="set by the engine: use_kv_cache"):
        engine.open_stream(far_request(extra_params={"use_kv_cache": False}))
    image = np.zeros((32, 32, 3), dtype=np.uint8)
    with pytest.raises(InvalidRequestError, match="must start with 1"):
        engine.open_stream(far_request(image=image, extra_params={"chunk_partition": [3, 4]}))
    with pytest.raises(EngineConfigError, match="segment_frames"):
        make_engine(anyflow_far, segment_frames="9")
    # A partition of the request's own is the call's.
    custom = run_all(engine.open_stream(far_request(extra_params={"chunk_partition": [1, 3, 3]})))
    assert [ch.frames.shape[0] for ch in custom] == [1, 12, 12]
    reference = single_call(engine.model.pipe, chunk_partition=[1, 3, 3])
    np.testing.assert_array_equal(np.concatenate([ch.frames for ch in custom]), reference)


def test_a_schedule_of_the_requests_own_is_the_calls(anyflow_far: Path, make_engine: Any) -> None:
    """``sigmas`` or ``timesteps`` set the number of steps, as in the call: without
    num_inference_steps the engine takes the schedule's length (a step count of its own
    beside a schedule of another length makes the scheduler fail mid-video)."""
    engine = make_engine(anyflow_far, segment_frames="8")
    pipe = engine.model.pipe
    for name, schedule in (("sigmas", [1.0, 0.6, 0.3]), ("timesteps", [1000.0, 500.0])):
        extra = {"chunk_partition": PARTITION, name: schedule}
        stream = engine.open_stream(far_request(num_inference_steps=None, extra_params=extra))
        streamed = np.concatenate([ch.frames for ch in run_all(stream)])
        reference = single_call(pipe, num_inference_steps=len(schedule), **{name: schedule})
        np.testing.assert_array_equal(streamed, reference)
