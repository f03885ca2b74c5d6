"""Chunk-autoregressive pipelines (Helios, its pyramid and distilled variants), streamed
chunk by chunk: each ``next_chunk`` is one chunk of the model's own loop, and the frames,
joined, are exactly those of the pipeline's single call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.diffusers_engine.support import (
    Probe,
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
from trio_vstream.engines.base import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops import history

CHUNK = 33
"""Frames per Helios chunk: 9 latent frames."""


def helios_request(**fields: Any) -> Any:
    """64x64 (the smallest the tiny Helios takes), one step (per pyramid stage)."""
    values: dict[str, Any] = {"width": 64, "height": 64, "num_inference_steps": 1}
    values.update(fields)
    return request(**values)


def single_call(pipe: Any, variant: str, *, num_frames: int, seed: int = 1, **kw: Any) -> Any:
    """The pipeline's own output for the whole video, in one call, as uint8 frames."""
    steps = {"num_inference_steps": 1} if variant == "base" else {}
    if variant != "base":
        steps = {"pyramid_num_inference_steps_list": [1, 1, 1]}
    output = pipe(
        prompt="a red fox in the snow",
        height=64,
        width=64,
        num_frames=num_frames,
        guidance_scale=1.0,
        generator=torch.Generator().manual_seed(seed),
        output_type="pt",
        **steps,
        **kw,
    )
    return frames_to_uint8(output.frames).numpy()


@pytest.mark.parametrize("variant", ["base", "pyramid", "distilled"])
def test_streamed_chunks_equal_the_single_call(
    variant: str, helios: dict[str, Path], make_engine: Any, probes: list[Probe]
) -> None:
    engine = make_engine(helios[variant], segment_frames=str(CHUNK))
    assert engine.loop is history.LOOP
    pipe = engine.model.pipe
    w = Probe(pipe, keep_embeds=True)
    probes.append(w)
    frames = 97 if variant == "base" else 65  # three chunks; two where the loop is the same
    stream = engine.open_stream(helios_request(num_frames=frames))
    first = stream.next_chunk(no_stop)
    # The first chunk is handed over after the first chunk's work only: one chunk's
    # steps (pyramid: three stages of one step) and one decode, not the video's.
    steps_per_chunk = 1 if variant == "base" else 3
    assert (len(w.forwards), len(w.decodes)) == (steps_per_chunk, 1)
    chunks = [first, *run_all(stream)]
    assert [c.frames.shape[0] for c in chunks] == {97: [33, 33, 31], 65: [33, 32]}[frames]
    assert [c.index for c in chunks] == list(range(len(chunks)))
    streamed = np.concatenate([c.frames for c in chunks])
    reference = single_call(pipe, variant, num_frames=frames)
    assert reference.shape == streamed.shape == (frames, 64, 64, 3)
    np.testing.assert_array_equal(streamed, reference)  # exact: the same arithmetic


def test_image_reference_streams_as_the_single_call(
    helios: dict[str, Path], make_engine: Any
) -> None:
    from PIL import Image

    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    image = (np.random.default_rng(0).random((64, 64, 3)) * 255).astype(np.uint8)
    chunks = run_all(engine.open_stream(helios_request(num_frames=65, image=image)))
    streamed = np.concatenate([c.frames for c in chunks])
    reference = single_call(engine.model.pipe, "base", num_frames=65, image=Image.fromarray(image))
    np.testing.assert_array_equal(streamed, reference)
    plain = run_all(engine.open_stream(helios_request(num_frames=65)))
    assert not np.array_equal(np.concatenate([c.frames for c in plain]), streamed)


def test_sessions_take_turns_at_chunk_boundaries_each_with_its_own_history(
    helios: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    streams = (
        engine.open_stream(helios_request(num_frames=65, seed=1)),
        engine.open_stream(helios_request(num_frames=65, seed=2)),
    )
    pipe = engine.model.pipe
    for frames, seed in zip(take_turns(engine, *streams, chunks=2), (1, 2), strict=True):
        reference = single_call(pipe, "base", num_frames=65, seed=seed)
        np.testing.assert_array_equal(frames, reference)


def test_stop_within_a_step_and_the_stopped_chunk_is_not_decoded(
    helios: dict[str, Path], make_engine: Any, probes: list[Probe]
) -> None:
    engine = make_engine(helios["pyramid"], segment_frames=str(CHUNK))
    w = Probe(engine.model.pipe, keep_embeds=True)
    probes.append(w)
    stream = engine.open_stream(helios_request(num_frames=99, num_inference_steps=2))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint) is not None
        per_chunk = stops.calls  # 1 before the call + 6 steps (3 stages of 2)
        assert per_chunk == 7 and (len(w.forwards), len(w.decodes)) == (6, 1)
        # The second chunk's third checkpoint: after its second step.
        stops.stop_at = stops.calls + 3
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
    finally:
        stream.close()
    assert len(w.forwards) == 6 + 2  # no step after the stop
    assert len(w.decodes) == 1  # the stopped chunk was not decoded
    assert not engine.lock.locked


def test_interaction_blends_embeddings_from_the_next_chunk_on(
    helios: dict[str, Path], make_engine: Any, probes: list[Probe]
) -> None:
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    pipe = engine.model.pipe
    w = Probe(pipe, keep_embeds=True)
    probes.append(w)
    chunks = fox_to_whale(
        engine.open_stream(helios_request(prompt="a red fox", num_frames=4 * CHUNK))
    )
    assert len(chunks) == 4
    # One step a chunk, no guidance.
    assert_fox_to_whale(chunks, w.embeds, lambda text: encode(pipe, text), steps=1)


def test_memory_stays_flat_over_many_chunks(helios: dict[str, Path], make_engine: Any) -> None:
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    chunks = 7
    stream = engine.open_stream(helios_request(num_frames=chunks * CHUNK))
    sizes, held, frames = memory_per_chunk(
        stream, chunks, lambda: stream._run.history.held_latent_frames
    )
    assert set(frames) == {CHUNK}
    assert held[:3] == [9, 18, 19] and set(held[2:]) == {19}  # the history window, no more
    # From the third chunk on (the window is full), nothing grows, chunk after chunk: not
    # even one latent frame's worth (a chunk adds nine to a history that is not trimmed).
    latent_frame = 16 * 8 * 8 * 4  # channels x 8x8 x float32
    assert max(sizes[2:]) - min(sizes[2:]) < latent_frame, sizes


def test_chunk_loop_arguments_are_the_engines(helios: dict[str, Path], make_engine: Any) -> None:
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    with pytest.raises(InvalidRequestError, match=r"history_sizes.*video_latents"):
        engine.open_stream(
            helios_request(extra_params={"video_latents": None, "history_sizes": [8, 2, 1]})
        )
    with pytest.raises(EngineConfigError, match="33-frame chunks"):
        make_engine(helios["base"], segment_frames="17")


def test_a_requests_sigmas_are_the_calls(helios: dict[str, Path], make_engine: Any) -> None:
    """``extra_params.sigmas`` (a JSON list) reaches the call as the array its scheduler
    computes with (a list would be repeated, not scaled, and the call would fail); the
    call's own default schedule, given explicitly, makes the call's own frames."""
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    pipe = engine.model.pipe
    default = np.linspace(0.999, 0.0, 2)[:-1].tolist()  # the call's, for one step
    for sigmas, reference_sigmas in ((default, None), ([0.6], np.array([0.6]))):
        # No num_inference_steps: the schedule's length is the steps. Two chunks: the
        # schedule is the same for each.
        stream = engine.open_stream(
            helios_request(num_frames=65, num_inference_steps=None, extra_params={"sigmas": sigmas})
        )
        streamed = np.concatenate([c.frames for c in run_all(stream)])
        extra = {} if reference_sigmas is None else {"sigmas": reference_sigmas}
        reference = single_call(pipe, "base", num_frames=65, **extra)
        np.testing.assert_array_equal(streamed, reference)


def test_pyramid_steps_are_per_stage(
    helios: dict[str, Path], make_engine: Any, probes: list[Probe]
) -> None:
    engine = make_engine(helios["distilled"], segment_frames=str(CHUNK))
    w = Probe(engine.model.pipe, keep_embeds=True)
    probes.append(w)
    run_all(engine.open_stream(helios_request(num_frames=CHUNK, num_inference_steps=2)))
    assert len(w.forwards) == 3 * 2
