"""FramePack (``HunyuanVideoFramepackPipeline``). Vanilla sampling is streamed section by
section: the engine drives the pipeline's section loop from its components, each
``next_chunk`` hands over the frames a section made final (its cross-faded overlap held
back until the next section has blended it), and the frames, joined, are exactly those
of the pipeline's single call. Inverted sampling (the call's default) is served segment
by segment: each segment is one real call of one section, the later ones continued from
the previous segment's last frame; what reaches the call is recorded by a wrapper around
the pipeline's own ``__call__``, which then runs."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.engines.diffusers.support import (
    StopAtCall,
    Stopped,
    assert_fox_to_whale,
    fox_to_whale,
    memory_per_chunk,
    no_stop,
    record_calls,
    request,
    run_all,
    take_turns,
)
from trio_vstream.engines import InvalidRequestError
from trio_vstream.engines.contract import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops.framepack import LOOP as SECTION_LOOP

FRAMES = 27
"""Three sections of 3 latent frames (``segment_frames`` 12): the call makes 37 frames
(ceil(27 / 9) sections); the stream sends the first 4, then 12, then the last section's
blended overlap (9) and 2 of its own frames."""

SECTION = "12"
"""``segment_frames``: a section's 12 frames, ``latent_window_size`` 3."""

VANILLA = {"sampling_type": "vanilla"}

INVERTED = "inverted_anti_drifting"

SEGMENT = 13
"""An inverted segment: one section of ``latent_window_size`` 3 (``segment_frames`` 12)
makes 13 frames, the conditioning image's first; a continued segment adds 12."""

ONE_SECTION = 9
"""``num_frames`` for one inverted section of 3 latent frames: ``(3-1)*4+1``."""

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


def fp_encode(pipe: Any, text: str) -> tuple[torch.Tensor, torch.Tensor]:
    """A prompt's LLaMA embeddings and CLIP pooled embedding, as the pipeline makes them."""
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(prompt=text)
    return embeds, pooled


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


def inverted_call(pipe: Any, image: np.ndarray, *, seed: int, **kw: Any) -> np.ndarray:
    """The pipeline's own output for one inverted section from ``image``, as uint8 frames."""
    args: dict[str, Any] = {
        "num_frames": ONE_SECTION,
        "sampling_type": INVERTED,
        "image": Image.fromarray(image),
    }
    args.update(kw)
    return single_call(pipe, seed=seed, **args)


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
    assert engine.loop is SECTION_LOOP
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
    streams = engine.open_stream(fp_request(seed=1)), engine.open_stream(fp_request(seed=2))
    for frames, seed in zip(take_turns(engine, *streams, chunks=3), (1, 2), strict=True):
        reference = single_call(engine.model.pipe, seed=seed)
        np.testing.assert_array_equal(frames, reference[:FRAMES])


def test_stop_within_a_step_and_the_stopped_section_is_not_decoded(
    framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    c = Counts(engine.model.pipe)
    probes.append(c)
    stream = engine.open_stream(fp_request(num_inference_steps=3))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint) is not None
        assert stops.calls == 1 + 3 + 1  # the image encodes, each of the 3 steps, the decode
        assert (c.steps, c.decoded) == (3, 1)
        stops.stop_at = stops.calls + 3  # the second section's third step
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._run.sections_done == 1  # the stopped section is not kept
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
    chunks = fox_to_whale(engine.open_stream(fp_request(prompt="a red fox", num_frames=36)))
    assert len(chunks) == 4
    # Two steps a section; the LLaMA embeddings and the CLIP pooled one blended alike.
    used = list(zip(c.embeds, c.pooled, strict=True))
    assert_fox_to_whale(chunks, used, lambda text: fp_encode(pipe, text), steps=2)


def test_memory_is_flat_over_sections(framepack: Path, make_engine: Any) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    sections = 5
    stream = engine.open_stream(fp_request(num_frames=9 * sections, num_inference_steps=1))
    loop = stream._run
    sizes, kept, _ = memory_per_chunk(
        stream, sections - 1, lambda: (loop.held_bytes, loop.held_latent_frames), to_the_end=False
    )
    held = [held_bytes for held_bytes, _ in kept]
    assert {frames for _, frames in kept} == {19}  # max(16+2+1, 2*3)
    # The image's latent and embedding, the last 19 latent frames, the held-back overlap:
    # the same from the first section on, whatever the video's length.
    assert len(set(held)) == 1, held
    latent_frame = 4 * 4 * 4 * 4  # channels x 4x4 x float32
    assert max(sizes[1:]) - min(sizes[1:]) < latent_frame, sizes


def test_arguments_are_checked_before_the_stream_starts(
    framepack: Path, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    calls = record_calls(monkeypatch, engine.model.pipe)
    # Any sampling_type but the two is refused, naming the field, the value and both.
    for value in ("backwards", "Vanilla", None, 1):
        with pytest.raises(InvalidRequestError) as refused:
            engine.open_stream(fp_request(extra_params={"sampling_type": value}))
        message = str(refused.value)
        assert f"extra_params.sampling_type must be {INVERTED!r} or 'vanilla'" in message
        assert message.endswith(f"got {value!r}")
    # Both samplings check the rest alike (no sampling_type: the call's default, inverted).
    for sampling in (VANILLA, {}):
        with pytest.raises(InvalidRequestError, match="image_reference is required"):
            engine.open_stream(fp_request(image=None, extra_params=sampling))
        with pytest.raises(InvalidRequestError, match="latent_window_size must be an integer"):
            engine.open_stream(fp_request(extra_params={**sampling, "latent_window_size": 0}))
        with pytest.raises(InvalidRequestError, match="set by the engine: prompt_template"):
            engine.open_stream(fp_request(extra_params={**sampling, "prompt_template": {}}))
    assert calls == []  # nothing reached the pipeline
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
    # Inverted, a window of the request's own is the call's too: segments of 9 frames.
    calls.clear()
    inverted = run_all(
        engine.open_stream(fp_request(num_frames=17, extra_params={"latent_window_size": 2}))
    )
    assert [ch.frames.shape[0] for ch in inverted] == [9, 8]
    assert [(c["latent_window_size"], c["num_frames"]) for c in calls] == [(2, 5), (2, 5)]
    reference = inverted_call(engine.model.pipe, IMAGE, seed=1, latent_window_size=2, num_frames=5)
    np.testing.assert_array_equal(inverted[0].frames, reference)


@pytest.mark.parametrize(
    ("extra", "guided"),
    [
        ({}, {}),
        ({"sampling_type": INVERTED}, {"true_cfg_scale": 3.0, "negative_prompt": "blurry"}),
    ],
    ids=["default", "explicit-true-cfg"],
)
def test_inverted_sampling_streams_segment_by_segment_from_the_last_frame(
    extra: dict[str, Any],
    guided: dict[str, Any],
    framepack: Path,
    make_engine: Any,
    probes: list[Counts],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    assert engine.loop is SECTION_LOOP
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    calls = record_calls(monkeypatch, pipe)
    stream = engine.open_stream(
        fp_request(num_frames=2 * SEGMENT - 1, extra_params=extra, **guided)
    )
    per_step = 2 if guided else 1
    try:
        first = stream.next_chunk(no_stop)
        # The first chunk comes after one whole call: one section's steps, one decode.
        assert (len(calls), c.steps, c.decoded) == (1, 2 * per_step, 1)
        second = stream.next_chunk(no_stop)
        assert stream.next_chunk(no_stop) is None
    finally:
        stream.close()
    assert (len(calls), c.steps, c.decoded) == (2, 4 * per_step, 2)
    # 13 frames (the image's, then 12), then 12 new ones: the 25 asked for.
    assert (first.frames.shape, second.frames.shape) == ((SEGMENT, 32, 32, 3), (12, 32, 32, 3))
    for call, seed in zip(calls, (1, 2), strict=True):
        assert call["sampling_type"] == INVERTED
        assert (call["latent_window_size"], call["num_frames"]) == (3, ONE_SECTION)
        assert call["generator"] == seed  # the segment path's seed + index
        assert "image_latents" not in call and "last_image" not in call
    # The first segment is conditioned on the image reference, the second on the first
    # segment's last frame.
    np.testing.assert_array_equal(calls[0]["image"], IMAGE)
    np.testing.assert_array_equal(calls[1]["image"], first.frames[-1])
    assert not np.array_equal(calls[1]["image"], IMAGE)
    # Each segment is exactly the pipeline's own call from that image (with the request's
    # parameters); the continued one without its first frame, the image's copy.
    calls.clear()
    reference = inverted_call(pipe, IMAGE, seed=1, **guided)
    assert reference.shape == (SEGMENT, 32, 32, 3)
    np.testing.assert_array_equal(first.frames, reference)
    continued = inverted_call(pipe, first.frames[-1], seed=2, **guided)
    np.testing.assert_array_equal(second.frames, continued[1:])
    if guided:  # the negative prompt reached the call: without it, another video
        assert not np.array_equal(reference, inverted_call(pipe, IMAGE, seed=1))


def test_inverted_stop_within_a_step_and_the_stopped_segment_is_not_decoded(
    framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    c = Counts(engine.model.pipe)
    probes.append(c)
    stream = engine.open_stream(fp_request(num_inference_steps=3, extra_params={}))
    stops = StopAtCall()
    try:
        assert stream.next_chunk(stops.checkpoint).frames.shape[0] == SEGMENT
        assert stops.calls == 1 + 3  # before the call, then after each of its 3 steps
        assert (c.steps, c.decoded) == (3, 1)
        stops.stop_at = stops.calls + 3  # after the second segment's second step
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._frames_done == SEGMENT  # the stopped segment sent nothing
    finally:
        stream.close()
    assert c.steps == 3 + 2  # no step after the stop
    assert c.decoded == 1  # the stopped segment was not decoded
    assert not engine.lock.locked


def test_inverted_interaction_blends_conditioning_from_the_next_segment_on(
    framepack: Path, make_engine: Any, probes: list[Counts]
) -> None:
    engine = make_engine(framepack, segment_frames=SECTION)
    pipe = engine.model.pipe
    c = Counts(pipe)
    probes.append(c)
    chunks = fox_to_whale(
        engine.open_stream(
            fp_request(prompt="a red fox", num_frames=SEGMENT + 2 * 12, extra_params={})
        )
    )
    assert len(chunks) == 3
    # Two steps a segment; the LLaMA embeddings and the CLIP pooled one blended alike.
    used = list(zip(c.embeds, c.pooled, strict=True))
    assert_fox_to_whale(chunks, used, lambda text: fp_encode(pipe, text), steps=2)
