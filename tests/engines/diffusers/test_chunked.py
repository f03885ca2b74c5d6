"""Chunk-autoregressive pipelines (Helios, its pyramid and distilled variants), streamed
chunk by chunk: each ``next_chunk`` is one chunk of the model's own loop, and the frames,
joined, are exactly those of the pipeline's single call."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from tests.conftest import decode_video
from tests.engines.diffusers.support import (
    START,
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
    run_session,
    take_turns,
)
from trio_vstream.engines import InvalidRequestError
from trio_vstream.engines.contract import EngineConfigError
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
        **{**steps, **kw},
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


# -- vllm-omni's Helios extra_params

DISTILLED_PRESET = {
    "is_enable_stage2": True,
    "pyramid_num_stages": 3,
    "pyramid_num_inference_steps_list": [2, 2, 2],
    "is_amplify_first_chunk": True,
}
"""vllm-omni's "distilled" Helios preset, as its clients send it."""

MID_STAGE2_PRESET = {
    "is_enable_stage2": True,
    "pyramid_num_stages": 3,
    "pyramid_num_inference_steps_list": [2, 2, 2],
    "use_cfg_zero_star": True,
    "use_zero_init": True,
    "zero_steps": 1,
}
"""vllm-omni's "mid-stage2" preset (20 steps a stage there; 2 here)."""


def streamed(engine: Any, **fields: Any) -> np.ndarray:
    return np.concatenate([c.frames for c in run_all(engine.open_stream(helios_request(**fields)))])


@pytest.mark.parametrize(
    ("variant", "vllm_omni", "own"),
    [
        ("distilled", DISTILLED_PRESET, {"is_amplify_first_chunk": True}),
        (
            "pyramid",
            {**MID_STAGE2_PRESET, "use_cfg_zero_star": False},
            {"use_zero_init": True, "zero_steps": 1},
        ),
    ],
)
def test_vllm_omni_pyramid_steps_make_the_frames_of_num_inference_steps(
    variant: str,
    vllm_omni: dict[str, Any],
    own: dict[str, Any],
    helios: dict[str, Path],
    make_engine: Any,
) -> None:
    """vllm-omni's form (``pyramid_num_inference_steps_list`` and its stage keys) and the
    engine's own (``num_inference_steps``, per stage) of one request: the same frames,
    over two chunks (the distilled preset amplifies the first one only)."""
    engine = make_engine(helios[variant], segment_frames=str(CHUNK))
    theirs = streamed(
        engine, num_frames=2 * CHUNK, num_inference_steps=None, extra_params=vllm_omni
    )
    ours = streamed(engine, num_frames=2 * CHUNK, num_inference_steps=2, extra_params=own)
    assert theirs.shape == (2 * CHUNK, 64, 64, 3)
    np.testing.assert_array_equal(theirs, ours)
    # vllm-omni counts num_inference_steps for stage 1 only: the list is what is run.
    both = streamed(engine, num_frames=2 * CHUNK, num_inference_steps=7, extra_params=vllm_omni)
    np.testing.assert_array_equal(both, ours)


def test_a_steps_list_per_stage_is_the_calls(
    helios: dict[str, Path], make_engine: Any, probes: list[Probe]
) -> None:
    """A list whose stages differ reaches the call as it is: the pipeline's own frames
    for it, and one forward per step of each stage."""
    engine = make_engine(helios["pyramid"], segment_frames=str(CHUNK))
    w = Probe(engine.model.pipe, keep_embeds=True)
    probes.append(w)
    steps = [1, 3, 2]
    frames = streamed(
        engine,
        num_frames=CHUNK,
        num_inference_steps=None,
        extra_params={"pyramid_num_inference_steps_list": steps},
    )
    assert len(w.forwards) == sum(steps)
    reference = single_call(
        engine.model.pipe, "pyramid", num_frames=CHUNK, pyramid_num_inference_steps_list=steps
    )
    np.testing.assert_array_equal(frames, reference)


MALFORMED_STEPS = [
    [2, 2],  # one stage short
    [2, 2, 2, 2],  # one too many
    [],
    [0, 2, 2],
    [2, -1, 2],
    [2, 2, 201],  # over the step cap
    [2, 2, 10**9],
    [2.0, 2, 2],  # not an integer
    [2, 2.5, 2],
    [True, 2, 2],  # a bool is no count
    ["2", 2, 2],
    [None, 2, 2],
    "2,2,2",
    2,
    {"0": 2},
    None,
]


@pytest.mark.parametrize("value", MALFORMED_STEPS, ids=repr)
def test_a_malformed_steps_list_is_refused_by_name(
    value: Any, helios: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(helios["distilled"], segment_frames=str(CHUNK))
    extra = {**DISTILLED_PRESET, "pyramid_num_inference_steps_list": value}
    with pytest.raises(InvalidRequestError) as refused:
        engine.open_stream(helios_request(extra_params=extra))
    assert (
        "extra_params.pyramid_num_inference_steps_list must be a list of 3 integers from 1 to "
        "200, one per stage of HeliosPyramidPipeline"
    ) in str(refused.value)


@pytest.mark.parametrize(
    ("key", "value", "message"),
    [
        ("is_enable_stage2", False, "is_enable_stage2: false needs a Helios pipeline without"),
        ("is_enable_stage2", 1, "is_enable_stage2 must be true or false, got 1"),
        ("is_enable_stage2", "true", "is_enable_stage2 must be true or false, got 'true'"),
        ("pyramid_num_stages", 2, "pyramid_num_stages must be 3 (the stages of"),
        ("pyramid_num_stages", 4, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", 0, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", -3, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", 10**9, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", 3.0, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", True, "pyramid_num_stages must be 3"),
        ("pyramid_num_stages", "3", "pyramid_num_stages must be 3"),
        ("is_amplify_first_chunk", 1, "is_amplify_first_chunk must be true or false"),
        ("use_zero_init", "yes", "use_zero_init must be true or false"),
        ("zero_steps", True, "zero_steps must be an integer from 0 to 200"),
        ("zero_steps", -1, "zero_steps must be an integer from 0 to 200"),
        ("zero_steps", 201, "zero_steps must be an integer from 0 to 200"),
        ("zero_steps", 1.0, "zero_steps must be an integer from 0 to 200"),
        ("use_cfg_zero_star", True, "use_cfg_zero_star: HeliosPyramidPipeline is loaded with"),
        ("use_cfg_zero_star", 0, "use_cfg_zero_star must be true or false"),
        ("is_skip_first_chunk", True, "is_skip_first_chunk is not supported by HeliosPyramid"),
        ("image_noise_sigma_min", 0.1, "image_noise_sigma_min is not supported by HeliosPyr"),
        ("add_noise_to_video_latents", False, "the noising of its history latents"),
    ],
)
def test_each_vllm_omni_helios_key_is_checked_by_name(
    key: str, value: Any, message: str, helios: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(helios["pyramid"], segment_frames=str(CHUNK))
    with pytest.raises(InvalidRequestError, match=re.escape(message)):
        engine.open_stream(helios_request(extra_params={**DISTILLED_PRESET, key: value}))


def test_cfg_zero_star_is_the_pipelines_own(helios: dict[str, Path], make_engine: Any) -> None:
    """``use_cfg_zero_star`` is the pipeline's config (shared by every session): taken
    when it is that, refused otherwise, whichever way the pipeline was loaded."""
    engine = make_engine(helios["pyramid"], segment_frames=str(CHUNK))
    engine.open_stream(helios_request(extra_params={"use_cfg_zero_star": False})).close()
    engine.model.pipe.register_to_config(is_cfg_zero_star=True)
    engine.open_stream(helios_request(extra_params=MID_STAGE2_PRESET)).close()
    with pytest.raises(InvalidRequestError, match=r"is_cfg_zero_star=true .* can only be true"):
        engine.open_stream(helios_request(extra_params={"use_cfg_zero_star": False}))


def test_a_stage_1_helios_takes_stage_2_off_and_refuses_the_pyramid_keys(
    helios: dict[str, Path], make_engine: Any
) -> None:
    engine = make_engine(helios["base"], segment_frames=str(CHUNK))
    plain = streamed(engine, num_frames=CHUNK)
    off = {"is_enable_stage2": False, "use_cfg_zero_star": False}
    np.testing.assert_array_equal(streamed(engine, num_frames=CHUNK, extra_params=off), plain)
    for extra, message in (
        ({"is_enable_stage2": True}, "is_enable_stage2: true needs a Helios pyramid pipeline"),
        (
            {"pyramid_num_inference_steps_list": [2, 2, 2]},
            "extra_params.pyramid_num_inference_steps_list is not supported by HeliosPipeline: "
            "it samples at full resolution, with no pyramid stages; use num_inference_steps",
        ),
        ({"pyramid_num_stages": 3}, "pyramid_num_stages is not supported by HeliosPipeline"),
        ({"use_cfg_zero_star": True}, "is_cfg_zero_star=false"),
        ({"use_zero_init": True}, "use_zero_init is not supported by HeliosPipeline: it has no"),
        ({"zero_steps": 1}, "zero_steps is not supported by HeliosPipeline: it has no CFG-Zero*"),
        ({"is_amplify_first_chunk": True}, "is_amplify_first_chunk is not supported by Helios"),
        ({"video": "x"}, "video is not supported by HeliosPipeline: a video to continue is not"),
        ({"image": "x"}, "image is not supported by HeliosPipeline: use image_reference"),
    ):
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            engine.open_stream(helios_request(extra_params=extra))


async def test_vllm_omnis_distilled_preset_streams_through_the_server(
    helios: dict[str, Path], make_engine: Any, serve: Any
) -> None:
    """The session.start a vllm-omni client sends a Helios-Distilled server streams, frame
    for frame the video of the engine's own form; the mid-stage2 preset, on a pipeline
    loaded without CFG-Zero*, is refused with a code and the key."""
    server, _ = await serve(make_engine(helios["distilled"], segment_frames=str(CHUNK)))
    start = {
        **START,
        "size": "64x64",
        "num_frames": 2 * CHUNK,
        "guidance_scale": 1.0,
        "extra_params": DISTILLED_PRESET,
    }
    theirs = await run_session(server.url, start)
    assert theirs.terminal[-1]["type"] == "session.done"
    media = [m for m in theirs.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [m["num_frames"] for m in media] == [CHUNK, CHUNK]
    ours = await run_session(
        server.url,
        {**start, "num_inference_steps": 2, "extra_params": {"is_amplify_first_chunk": True}},
    )
    frames = decode_video(theirs.video_bytes)
    assert len(frames) == 2 * CHUNK
    np.testing.assert_array_equal(np.stack(frames), np.stack(decode_video(ours.video_bytes)))
    refused = await run_session(server.url, {**start, "extra_params": MID_STAGE2_PRESET})
    (error,) = refused.of_type("error")
    assert error["code"] == "invalid_request"
    assert (
        "extra_params.use_cfg_zero_star: HeliosPyramidPipeline is loaded with" in error["message"]
    )
