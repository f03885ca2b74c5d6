"""FramePack (``HunyuanVideoFramepackPipeline``, vanilla sampling), streamed section by
section: the engine drives the pipeline's section loop from its components, each
``next_chunk`` hands over the frames a section made final (its cross-faded overlap held
back until the next section has blended it), and the frames, joined, are exactly those
of the pipeline's single call."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.diffusers_engine.support import (
    Stopped,
    live_tensor_bytes,
    no_stop,
    request,
    run_all,
)
from trio_vstream.engines import InvalidRequestError, PromptChange, checkpoint_calling
from trio_vstream.engines.base import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8

FRAMES = 27
"""Three sections of 3 latent frames (``segment_frames`` 12): the call makes 37 frames
(ceil(27 / 9) sections); the stream sends the first 4, then 12, then the last section's
blended overlap (9) and 2 of its own frames."""

SECTION = "12"
"""``segment_frames``: a section's 12 frames, ``latent_window_size`` 3."""

VANILLA = {"sampling_type": "vanilla"}

IMAGE = (np.random.default_rng(0).random((32, 32, 3)) * 255).astype(np.uint8)


def fp_request(**fields: Any) -> Any:
    """32x32, two steps, distilled guidance 1, seed 1, the first frame given."""
    values: dict[str, Any] = {
        "width": 32,
        "height": 32,
        "num_frames": FRAMES,
        "image": IMAGE,
        "extra_params": VANILLA,
    }
    values.update(fields)
    return request(**values)


def single_call(pipe: Any, *, seed: int = 1, **kw: Any) -> np.ndarray:
    """The pipeline's own output for the whole video, in one call, as uint8 frames."""
    args: dict[str, Any] = {
        "image": Image.fromarray(IMAGE),
        "prompt": "a red fox in the snow",
        "height": 32,
        "width": 32,
        "num_frames": FRAMES,
        "latent_window_size": 3,
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
        "sampling_type": "vanilla",
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
    }
    args.update(kw)
    return frames_to_uint8(pipe(**args).frames).numpy()


class Counts:
    """Counts a pipeline's transformer calls and VAE decodes (one a section), keeping the text
    conditioning each transformer call got."""

    def __init__(self, pipe: Any) -> None:
        self.steps = 0
        self.decoded = 0
        self.embeds: list[torch.Tensor] = []
        self.pooled: list[torch.Tensor] = []

        def before_forward(module: Any, args: Any, kwargs: dict[str, Any]) -> None:
            self.steps += 1
            self.embeds.append(kwargs["encoder_hidden_states"].detach().clone())
            self.pooled.append(kwargs["pooled_projections"].detach().clone())

        self._hook = pipe.transformer.register_forward_pre_hook(before_forward, with_kwargs=True)
        # vae.decode itself: its decoder runs once per temporal tile of a section.
        self._vae = pipe.vae
        decode = pipe.vae.decode

        def counting_decode(*args: Any, **kwargs: Any) -> Any:
            self.decoded += 1
            return decode(*args, **kwargs)

        pipe.vae.decode = counting_decode

    def remove(self) -> None:
        self._hook.remove()
        del self._vae.decode


@pytest.mark.parametrize(
    "guided",
    [{}, {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}],
    ids=["plain", "true-cfg"],
)
def test_sections_stream_as_the_single_call(
    guided: dict[str, Any], framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    assert engine.framepack and not (engine.chunked or engine.windowed or engine.far)
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    stream = engine.open_stream(fp_request(**guided))
    per_step = 2 if guided else 1
    first = stream.next_chunk(no_stop)
    # The first chunk comes after the first section's own steps and its one decode.
    assert (c.steps, c.decoded) == (2 * per_step, 1)
    chunks = [first, *run_all(stream)]
    assert [ch.frames.shape[0] for ch in chunks] == [4, 12, 11]
    assert (c.steps, c.decoded) == (3 * 2 * per_step, 3)
    reference = single_call(pipe, **guided)
    assert reference.shape == (37, 32, 32, 3)
    streamed = np.concatenate([ch.frames for ch in chunks])
    np.testing.assert_array_equal(streamed, reference[:FRAMES])  # exact: the same arithmetic
    if guided:
        assert not np.array_equal(reference, single_call(pipe))


def test_sessions_take_turns_at_section_boundaries_each_with_its_own_state(
    framepack: Path, make_engine: Any
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    a = engine.open_stream(fp_request(seed=1))
    b = engine.open_stream(fp_request(seed=2))
    made: dict[int, list[np.ndarray]] = {id(a): [], id(b): []}
    try:
        for stream in [a, b] * 3:
            made[id(stream)].append(stream.next_chunk(no_stop).frames)
            assert not engine.lock.locked  # the pipeline is free between sections
        assert a.next_chunk(no_stop) is None and b.next_chunk(no_stop) is None
    finally:
        a.close()
        b.close()
    for stream, seed in ((a, 1), (b, 2)):
        reference = single_call(engine.model.pipe, seed=seed)
        np.testing.assert_array_equal(np.concatenate(made[id(stream)]), reference[:FRAMES])


def test_stop_within_a_step_and_the_stopped_section_is_not_decoded(
    framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    c = Counts(engine.model.pipe)
    probes.append(c)
    stream = engine.open_stream(fp_request(num_inference_steps=3))
    calls = 0
    stop_at = 0

    def step() -> None:
        nonlocal calls
        calls += 1
        if stop_at and calls >= stop_at:
            raise Stopped

    checkpoint = checkpoint_calling(step)
    try:
        assert stream.next_chunk(checkpoint) is not None
        assert calls == 1 + 3 + 1  # the image encodes, each of the 3 steps, the decode
        assert (c.steps, c.decoded) == (3, 1)
        stop_at = calls + 3  # the second section's third step
        with pytest.raises(Stopped):
            stream.next_chunk(checkpoint)
        assert stream._framepack.sections_done == 1  # the stopped section is not kept
    finally:
        stream.close()
    assert c.steps == 3 + 2  # no step after the stop
    assert c.decoded == 1  # the stopped section was not decoded
    assert not engine.lock.locked


def test_interaction_blends_conditioning_from_the_next_section_on(
    framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    stream = engine.open_stream(fp_request(prompt="a red fox", num_frames=36))
    try:
        stream.next_chunk(no_stop)
        stream.interact(PromptChange("e1", "a blue whale", transition_chunks=2))
        chunks = [stream.next_chunk(no_stop) for _ in range(3)]
        assert stream.next_chunk(no_stop) is None
    finally:
        stream.close()

    def encode(text: str) -> tuple[torch.Tensor, torch.Tensor]:
        with torch.no_grad():
            embeds, pooled, _ = pipe.encode_prompt(prompt=text)
        return embeds, pooled

    fox, whale = encode("a red fox"), encode("a blue whale")
    assert not torch.allclose(fox[0], whale[0]) and not torch.allclose(fox[1], whale[1])
    half = tuple(0.5 * f + 0.5 * w for f, w in zip(fox, whale, strict=True))
    expected = [e for e in (fox, half, whale, whale) for _ in range(2)]  # two steps a section
    assert len(c.embeds) == len(expected)
    for used, pooled, (target, target_pooled) in zip(c.embeds, c.pooled, expected, strict=True):
        torch.testing.assert_close(used, target, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(pooled, target_pooled, rtol=1e-5, atol=1e-6)
    assert chunks[0].started_event_ids == ("e1",) and chunks[0].active_event_ids == ("e1",)
    assert chunks[1].completed_event_ids == ("e1",)


def test_memory_is_flat_over_sections(framepack: Path, make_engine: Any) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    sections = 5
    stream = engine.open_stream(fp_request(num_frames=9 * sections, num_inference_steps=1))
    sizes: list[int] = []
    held: list[int] = []
    try:
        for _ in range(sections - 1):
            chunk = stream.next_chunk(no_stop)
            assert chunk is not None
            del chunk
            sizes.append(live_tensor_bytes())
            held.append(stream._framepack.held_bytes)
            assert stream._framepack.held_latent_frames == 19  # max(16+2+1, 2*3)
    finally:
        stream.close()
    # The image's latent and embedding, the last 19 latent frames, the held-back overlap:
    # the same from the first section on, whatever the video's length.
    assert len(set(held)) == 1, held
    latent_frame = 4 * 4 * 4 * 4  # channels x 4x4 x float32
    assert max(sizes[1:]) - min(sizes[1:]) < latent_frame, sizes


def test_arguments_are_checked_before_the_stream_starts(framepack: Path, make_engine: Any) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    for extra in ({}, {"sampling_type": "inverted_anti_drifting"}):
        with pytest.raises(InvalidRequestError, match="inverted_anti_drifting makes the video"):
            engine.open_stream(fp_request(extra_params=extra))
    with pytest.raises(InvalidRequestError, match="image_reference is required"):
        engine.open_stream(fp_request(image=None))
    with pytest.raises(InvalidRequestError, match="latent_window_size must be an integer"):
        engine.open_stream(fp_request(extra_params={**VANILLA, "latent_window_size": 0}))
    with pytest.raises(InvalidRequestError, match="set by the engine: prompt_template"):
        engine.open_stream(fp_request(extra_params={**VANILLA, "prompt_template": {}}))
    with pytest.raises(InvalidRequestError, match="multiples of 16"):
        engine.open_stream(fp_request(width=40))
    with pytest.raises(EngineConfigError, match="segment_frames"):
        make_engine(framepack, segment_frames="10")
    # A window of the request's own is the call's.
    custom = run_all(
        engine.open_stream(fp_request(extra_params={**VANILLA, "latent_window_size": 2}))
    )
    # 27 frames, sections of 5: 6 sections; 4 final frames, then 8 a section.
    assert [ch.frames.shape[0] for ch in custom] == [4, 8, 8, 7]
    reference = single_call(engine.model.pipe, latent_window_size=2)
    np.testing.assert_array_equal(np.concatenate([ch.frames for ch in custom]), reference[:FRAMES])
