"""Diffusion-forcing pipelines (SkyReels-V2 DF), streamed window by window: the engine
drives the pipeline's window loop from its components, each ``next_chunk`` is one window,
and the frames, joined, are exactly those of the pipeline's single call."""

from __future__ import annotations

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
from trio_vstream.engines.diffusers.loops import forcing

WINDOW = 17
"""The engine's window in the tests (``segment_frames``, the call's ``base_num_frames``):
5 latent frames; the default overlap for it is 9 frames (3 latent), so every window after
the first adds 2 latent frames, 8 frames."""

OVERLAP = 9


def df_request(**fields: Any) -> Any:
    """32x32, two steps, no guidance, seed 1: milliseconds a window."""
    values: dict[str, Any] = {"width": 32, "height": 32, "num_inference_steps": 2, "fps": 24}
    values.update(fields)
    return request(**values)


def single_call(pipe: Any, *, num_frames: int, seed: int = 1, **kw: Any) -> np.ndarray:
    """The pipeline's own output for the whole video, in one call, as uint8 frames."""
    args: dict[str, Any] = {
        "prompt": "a red fox in the snow",
        "height": 32,
        "width": 32,
        "num_frames": num_frames,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "fps": 24,
        "base_num_frames": WINDOW,
        "overlap_history": OVERLAP,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
    args.update(kw)
    output = pipe(**args)
    return frames_to_uint8(output.frames).numpy()


class Counts:
    """Counts a pipeline's real transformer calls and VAE decoder calls (one per latent
    frame decoded), keeping the prompt embeddings each transformer call got."""

    def __init__(self, pipe: Any) -> None:
        self.forwards = 0
        self.decoded = 0
        self.embeds: list[torch.Tensor] = []

        def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            self.forwards += 1
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
    ("num_frames", "extra", "sizes", "forwards"),
    [
        # Synchronous: four windows, every one after the first adding 8 frames; each
        # window is two steps.
        (41, {}, [17, 8, 8, 8], [2, 2, 2, 2]),
        # Asynchronous with causal blocks of 3 latent frames, guidance (two transformer
        # calls a step) and a negative prompt: 21-frame windows overlapping by 9 (3 latent
        # frames). The first window staggers two blocks (4 steps); the others start from
        # a ready block (2 steps).
        (
            45,
            {"base_num_frames": 21, "ar_step": 2, "causal_block_size": 3},
            [21, 12, 12],
            [8, 4, 4],
        ),
    ],
    ids=["synchronous", "asynchronous"],
)
def test_windows_stream_as_the_single_call(
    num_frames: int,
    extra: dict[str, Any],
    sizes: list[int],
    forwards: list[int],
    skyreels: dict[str, Path],
    make_engine: Any,
    probes: list[Counts],
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    assert engine.loop is forcing.LOOP
    pipe = engine.model.pipe
    guided = {"guidance_scale": 6.0, "negative_prompt": "blurry"} if extra else {}
    c = Counts(pipe)
    probes.append(c)
    stream = engine.open_stream(df_request(num_frames=num_frames, extra_params=extra, **guided))
    first = stream.next_chunk(no_stop)
    first_work = (c.forwards, c.decoded)
    chunks = [first, *run_all(stream)]
    total_work = (c.forwards, c.decoded)
    assert [ch.frames.shape[0] for ch in chunks] == sizes
    assert [ch.index for ch in chunks] == list(range(len(sizes)))
    # The first chunk is handed over after the first window's steps and its own frames'
    # decode only (synchronous: 1/k of the video's transformer calls for k windows).
    assert (first_work[0], total_work[0]) == (forwards[0], sum(forwards))
    assert first_work[1] == (WINDOW if not extra else 21) // 4 + 1
    assert total_work[1] == (num_frames - 1) // 4 + 1  # each latent frame decoded once
    streamed = np.concatenate([ch.frames for ch in chunks])
    block = pipe.transformer.config.num_frame_per_block
    assert block == 1  # a window's causal block size was put back after it
    call_extra = {"overlap_history": OVERLAP, **extra}
    if extra:
        call_extra.update(guided)
    reference = single_call(pipe, num_frames=num_frames, **call_extra)
    pipe.transformer.register_to_config(num_frame_per_block=block)  # the call keeps its own
    assert reference.shape == streamed.shape == (num_frames, 32, 32, 3)
    np.testing.assert_array_equal(streamed, reference)  # exact: the same arithmetic


def test_image_reference_conditions_the_first_window(
    skyreels: dict[str, Path], make_engine: Any
) -> None:
    from PIL import Image

    image = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)
    i2v = make_engine(skyreels["i2v"], segment_frames=str(WINDOW))
    reference = single_call(i2v.model.pipe, num_frames=41, image=Image.fromarray(image))
    with pytest.raises(InvalidRequestError, match="image_reference is required"):
        i2v.open_stream(df_request(num_frames=41))
    streamed = run_all(i2v.open_stream(df_request(num_frames=41, image=image)))
    np.testing.assert_array_equal(np.concatenate([c.frames for c in streamed]), reference)
    # The text-to-video pipeline (the same weights) runs the same loop for an image.
    t2v = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    from_t2v = run_all(t2v.open_stream(df_request(num_frames=41, image=image)))
    np.testing.assert_array_equal(np.concatenate([c.frames for c in from_t2v]), reference)
    plain = run_all(t2v.open_stream(df_request(num_frames=41)))
    assert not np.array_equal(np.concatenate([c.frames for c in plain]), reference)


def test_sessions_take_turns_at_window_boundaries_each_with_its_own_state(
    skyreels: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    streams = (
        engine.open_stream(df_request(num_frames=33, seed=1)),
        engine.open_stream(df_request(num_frames=33, seed=2)),
    )
    for frames, seed in zip(take_turns(engine, *streams, chunks=3), (1, 2), strict=True):
        reference = single_call(engine.model.pipe, num_frames=33, seed=seed)
        np.testing.assert_array_equal(frames, reference)


def test_stop_within_a_step_and_the_stopped_window_is_not_decoded(
    skyreels: dict[str, Path], make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    c = Counts(engine.model.pipe)
    probes.append(c)
    stream = engine.open_stream(df_request(num_frames=41, num_inference_steps=3))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint) is not None
        assert stops.calls == 3 + 1  # a checkpoint before each of the 3 steps, and the decode
        assert (c.forwards, c.decoded) == (3, 5)
        # The second window's third checkpoint: after its second step.
        stops.stop_at = stops.calls + 3
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._run.windows_done == 1  # the stopped window is not kept
    finally:
        stream.close()
    assert c.forwards == 3 + 2  # no step after the stop
    assert c.decoded == 5  # the stopped window was not decoded
    assert not engine.lock.locked


def test_interaction_blends_embeddings_from_the_next_window_on(
    skyreels: dict[str, Path], make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    chunks = fox_to_whale(engine.open_stream(df_request(prompt="a red fox", num_frames=41)))
    assert len(chunks) == 4
    assert_fox_to_whale(chunks, c.embeds, lambda text: encode(pipe, text), steps=2)


def test_memory_stays_flat_over_many_windows(skyreels: dict[str, Path], make_engine: Any) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    windows = 6
    stream = engine.open_stream(df_request(num_frames=WINDOW + 8 * (windows - 1)))
    sizes, held, _ = memory_per_chunk(stream, windows, lambda: stream._run.held_latent_frames)
    assert set(held) == {3}  # the overlap, whatever the length
    # From the second window on nothing grows: not even one latent frame's worth (a
    # window adds two to a history that is not trimmed).
    latent_frame = 16 * 4 * 4 * 4  # channels x 4x4 x float32
    assert max(sizes[1:]) - min(sizes[1:]) < latent_frame, sizes


def test_window_arguments_are_checked_before_the_stream_starts(
    skyreels: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(skyreels["t2v"], segment_frames=str(WINDOW))
    with pytest.raises(InvalidRequestError, match=r"overlap_history .* less than the window"):
        engine.open_stream(df_request(num_frames=41, extra_params={"overlap_history": 17}))
    with pytest.raises(InvalidRequestError, match="whole number of causal blocks"):
        engine.open_stream(df_request(num_frames=41, extra_params={"causal_block_size": 2}))
    with pytest.raises(InvalidRequestError, match="ar_step must be an integer"):
        engine.open_stream(df_request(num_frames=41, extra_params={"ar_step": -1}))
    with pytest.raises(EngineConfigError, match="base_num_frames"):
        make_engine(skyreels["t2v"], segment_frames="18")
