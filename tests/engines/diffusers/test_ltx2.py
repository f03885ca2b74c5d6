"""LTX-2 (``LTX2Pipeline`` and ``LTX2ImageToVideoPipeline``) with its soundtrack, served
segment by segment (``loops/ltx2.py``): each segment one call, the later ones continued
from the previous segment's last frame through the image-to-video pipeline, each chunk
carrying exactly its frames' samples of the call's waveform (`segment_audio`). What
reaches the calls, and what they return, is recorded by a wrapper around the
pipelines' own ``__call__``, which then runs; nothing under test is mocked.

The pipelines are `testing.build_ltx2`'s: 8x spatial and 2x temporal compression (segments
of ``2n+1`` frames), 24 kHz stereo sound. Building them takes seconds, so every test that
asks for them is ``slow`` (as ``tests/conftest.py`` marks the other pipelines' tests)."""

from __future__ import annotations

import re
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch
from PIL import Image

from tests.conftest import decode_video
from tests.engines.diffusers.support import (
    START,
    StopAtCall,
    Stopped,
    assert_fox_to_whale,
    fox_to_whale,
    memory_per_chunk,
    request,
    run_all,
    run_session,
)
from tests.engines.diffusers.support import record_calls as support_record_calls
from trio_vstream.client._mp4 import decode_audio
from trio_vstream.engines import Engine, InvalidRequestError, load_engine
from trio_vstream.engines.contract import EngineConfigError
from trio_vstream.engines.diffusers._stream import frames_to_uint8
from trio_vstream.engines.diffusers.loops.ltx2 import LOOP, segment_audio
from trio_vstream.engines.testing import check_engine
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.values import audio_samples_through

RATE = 24000
"""The tiny vocoder's sample rate (the released LTX2Vocoder's)."""

FPS = 24
"""1000 samples a frame."""

SEGMENT = 9
"""``segment_frames``: 5 latent frames."""

FAST = {"max_sequence_length": 16}
"""A 16-token prompt: the tiny encoder's whole vocabulary fits, and a call is quick."""


@pytest.fixture(scope="module")
def ltx2(tmp_path_factory: pytest.TempPathFactory) -> SimpleNamespace:
    """``t2v`` (LTX2Pipeline) and ``i2v`` (LTX2ImageToVideoPipeline), the same weights."""
    pytest.importorskip("diffusers")
    pytest.importorskip("transformers")
    from trio_vstream.engines.diffusers.testing import build_ltx2, build_ltx2_i2v

    root = tmp_path_factory.mktemp("ltx2_models")
    return SimpleNamespace(
        t2v=build_ltx2(root / "LTX2-tiny"), i2v=build_ltx2_i2v(root / "LTX2-tiny-I2V")
    )


def ltx_request(**fields: Any) -> Any:
    """32x32 at 24 fps, two steps, the pipeline's own guidance (video and audio), seed 1."""
    values: dict[str, Any] = {
        "width": 32,
        "height": 32,
        "fps": FPS,
        "num_frames": 25,
        "guidance_scale": None,
        "extra_params": FAST,
    }
    values.update(fields)
    return request(**values)


def direct(pipe: Any, *, seed: int, num_frames: int = SEGMENT, **kw: Any) -> Any:
    """The pipeline's own call for one segment (its output: frames and audio)."""
    args: dict[str, Any] = {
        "prompt": "a red fox in the snow",
        "height": 32,
        "width": 32,
        "num_frames": num_frames,
        "frame_rate": FPS,
        "num_inference_steps": 2,
        "generator": torch.Generator().manual_seed(seed),
        "output_type": "pt",
        **FAST,
    }
    args.update(kw)
    return pipe(**args)


def psnr(a: np.ndarray, b: np.ndarray) -> float:
    mse = float(np.mean((a.astype(np.float64) - b.astype(np.float64)) ** 2))
    return float("inf") if mse == 0 else 10 * np.log10(255.0**2 / mse)


@pytest.mark.slow
def test_first_segment_is_the_direct_call_and_later_ones_continue_from_its_last_frame(
    ltx2: SimpleNamespace, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ltx2.t2v, i2v_model=str(ltx2.i2v), segment_frames=str(SEGMENT))
    assert engine.loop is LOOP
    assert (engine.audio_sample_rate, engine.audio_channels) == (RATE, 2)
    t2v, i2v = engine.model.pipe, engine.i2v.pipe
    first_calls = record_calls(monkeypatch, t2v)
    later_calls = record_calls(monkeypatch, i2v)
    chunks = run_all(engine.open_stream(ltx_request()))
    # 9 frames, then 8 and 8 new ones (each call's first frame is the one continued from).
    assert [c.frames.shape[0] for c in chunks] == [9, 8, 8]
    assert (len(first_calls), len(later_calls)) == (1, 2)
    calls = first_calls + later_calls
    assert [c["generator"] for c in calls] == [1, 2, 3]  # seed + index
    assert all(c["num_frames"] == SEGMENT and c["frame_rate"] == FPS for c in calls)
    assert "image" not in calls[0] and "audio_latents" not in calls[0]
    for call, before in zip(later_calls, chunks[:2], strict=True):
        np.testing.assert_array_equal(call["image"], before.frames[-1])

    # The first segment is the pipeline's own call: frames, and every sample its vocoder made.
    reference = direct(t2v, seed=1)
    expected = frames_to_uint8(reference.frames).numpy()
    assert psnr(chunks[0].frames, expected) >= 40
    wave = reference.audio[0].float().numpy()
    made = wave.shape[1]
    assert 0 < made < SEGMENT * 1000  # LTX-2's causal audio VAE: a little short
    np.testing.assert_allclose(chunks[0].audio[:, :made], wave, atol=1e-5)
    # Exactly each chunk's frames' samples, however many the vocoder made.
    sent = 0
    for chunk, call in zip(chunks, calls, strict=True):
        frames = chunk.frames.shape[0]
        count = audio_samples_through(sent + frames, RATE, FPS) - audio_samples_through(
            sent, RATE, FPS
        )
        assert chunk.audio.shape == (2, count) and chunk.audio.dtype == np.float32
        dropped = 0 if sent == 0 else 1
        np.testing.assert_array_equal(
            chunk.audio,
            segment_audio(
                call["wave"], rate=RATE, fps=FPS, dropped=dropped, first=sent, frames=frames
            ),
        )
        sent += frames
    # A continued segment's sound starts after its first frame's (dropped with the frame).
    later = later_calls[0]["wave"]
    np.testing.assert_array_equal(chunks[1].audio[:, : made - 1000], later[:, 1000:made])
    # The short tail is the waveform's end mirrored: no silence at a segment boundary.
    np.testing.assert_array_equal(
        chunks[0].audio[:, made:], wave[:, made - 2 : made - 2 - (9000 - made) : -1]
    )

    # Each continued segment is the image-to-video pipeline's own call from the last frame.
    continued = direct(i2v, seed=2, image=Image.fromarray(chunks[0].frames[-1]))
    assert psnr(chunks[1].frames, frames_to_uint8(continued.frames).numpy()[1:]) >= 40

    # Through the stream's AAC: the joined audio decodes to exactly 25 frames' samples, and
    # the first segment's is the direct call's sound.
    encoder = FragmentedMP4Encoder(
        width=32, height=32, fps=FPS, audio_sample_rate=RATE, audio_channels=2
    )
    data = b"".join(encoder.encode(c.frames, audio=c.audio) for c in chunks) + encoder.close()
    decoded = decode_audio(data)
    assert decoded is not None
    rate, pcm = decoded
    assert rate == RATE and pcm.shape == (2, audio_samples_through(25, RATE, FPS))
    for channel in range(2):
        assert np.corrcoef(pcm[channel, :made], wave[channel])[0, 1] >= 0.99


@pytest.mark.slow
def test_memory_is_flat_over_segments(ltx2: SimpleNamespace, make_engine: Any) -> None:
    engine = make_engine(ltx2.t2v, i2v_model=str(ltx2.i2v), segment_frames=str(SEGMENT))
    segments = 5
    stream = engine.open_stream(
        ltx_request(num_frames=1 + 8 * segments, num_inference_steps=1, guidance_scale=1.0)
    )
    run = stream._run
    sizes, kept, frames = memory_per_chunk(
        stream, segments - 1, lambda: (run._wave, run._last_frame is not None), to_the_end=False
    )
    assert frames == [9, 8, 8, 8]
    # Between chunks a session keeps the last frame (as a PIL image), never a waveform.
    assert kept == [(None, True)] * (segments - 1)
    waveform = 2 * 9000 * 4  # one segment's stereo float32 sound
    assert max(sizes[1:]) - min(sizes[1:]) < waveform, sizes


def test_segment_audio_counts_are_exact_over_many_segments() -> None:
    rng = np.random.default_rng(0)
    rate, fps, sent, total = 44100, 7, 0, 0
    for index in range(40):
        frames = int(rng.integers(1, 12))
        dropped = 0 if index == 0 else 1
        # Waveforms short, exact and long: a count of samples comes out whatever came in.
        length = int(rng.integers(0, 3 * 6300 * (frames + dropped) // 7))
        wave = rng.standard_normal((2, length)).astype(np.float32)
        audio = segment_audio(wave, rate=rate, fps=fps, dropped=dropped, first=sent, frames=frames)
        sent += frames
        total += audio.shape[1]
        assert audio.shape[0] == 2 and audio.flags.c_contiguous
        begin = audio_samples_through(dropped, rate, fps)
        kept = max(0, min(length - begin, audio.shape[1]))
        np.testing.assert_array_equal(audio[:, :kept], wave[:, begin : begin + kept])
    assert total == audio_samples_through(sent, rate, fps)  # no drift after 40 segments
    # Nothing to mirror: silence fills the count.
    silent = segment_audio(
        np.zeros((1, 0), np.float32), rate=8000, fps=8, dropped=0, first=0, frames=2
    )
    np.testing.assert_array_equal(silent, np.zeros((1, 2000), np.float32))


@pytest.mark.slow
def test_stop_within_a_step_and_the_stopped_segment_is_not_decoded(
    ltx2: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(ltx2.t2v, segment_frames=str(SEGMENT))
    pipe = engine.model.pipe
    steps: list[int] = []
    decoded: list[int] = []
    hooks = [
        pipe.transformer.register_forward_pre_hook(lambda *_: steps.append(1)),
        pipe.vae.decoder.register_forward_pre_hook(lambda *_: decoded.append(1)),
        pipe.vocoder.register_forward_pre_hook(lambda *_: decoded.append(2)),
    ]
    stream = engine.open_stream(ltx_request(num_inference_steps=3, guidance_scale=1.0))
    stops = StopAtCall()
    try:
        first = stream.next_chunk(stops.checkpoint)
        assert first.frames.shape[0] == SEGMENT and first.audio.shape == (2, 9000)
        assert stops.calls == 1 + 3  # before the call, then after each of its 3 steps
        per_step = len(steps) // 3  # LTX-2's guidance passes (CFG batched, STG, modality)
        assert decoded == [1, 2]  # the picture, then the sound
        stops.stop_at = stops.calls + 3  # after the second segment's second step
        with pytest.raises(Stopped):
            stream.next_chunk(stops.checkpoint)
        assert stream._frames_done == SEGMENT  # the stopped segment sent nothing
    finally:
        stream.close()
        for hook in hooks:
            hook.remove()
    assert len(steps) == (3 + 2) * per_step  # no step after the stop
    assert decoded == [1, 2]  # the stopped segment's picture and sound were never made
    assert stream._run._wave is None
    assert not engine.lock.locked


@pytest.mark.slow
def test_a_prompt_change_takes_effect_from_the_next_segment(
    ltx2: SimpleNamespace, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ltx2.t2v, segment_frames=str(SEGMENT))
    pipe = engine.model.pipe
    calls = record_calls(monkeypatch, pipe)
    chunks = fox_to_whale(engine.open_stream(ltx_request(prompt="a red fox", guidance_scale=1.0)))
    # Without an image-to-video pipeline, each segment is a clip of its own: 9, 9, 7 frames.
    assert [(c.frames.shape[0], c.audio.shape[1]) for c in chunks] == [
        (9, 9000),
        (9, 9000),
        (7, 7000),
    ]

    def expected(text: str) -> torch.Tensor:
        with torch.no_grad():
            embeds, *_ = pipe.encode_prompt(
                prompt=text, do_classifier_free_guidance=False, max_sequence_length=16
            )
        return embeds

    # One call a segment: the fox's embeddings, half of each, then the whale's.
    assert_fox_to_whale(chunks, [c["prompt_embeds"] for c in calls], expected, steps=1)


@pytest.mark.slow
def test_extra_params_are_allow_listed_and_checked_before_the_stream_starts(
    ltx2: SimpleNamespace, make_engine: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(ltx2.t2v, segment_frames=str(SEGMENT))
    # What the pipeline takes: sizes of 32n, 2n+1 frames here (8n+1 for the released VAE),
    # its own size and frame rate by default.
    assert (engine.size_multiple, engine.frame_step) == (32, 2)
    defaults = engine.video_defaults
    assert (defaults.width, defaults.height, defaults.fps) == (768, 512, 24)
    calls = record_calls(monkeypatch, engine.model.pipe)
    refused = {
        "audio_latents": "set by the engine: audio_latents",
        "min_seconds": "set by the engine: max_seconds, min_seconds",
        "latents": "set by the engine: latents",
        "frame_rate": "set by the engine: frame_rate (use fps)",
        "enable_prompt_enhancement": "unknown extra_params for LTX2Pipeline",
        "system_prompt": "unknown extra_params for LTX2Pipeline",
        "image_crf": "unknown extra_params for LTX2Pipeline",  # no image-to-video here
    }
    for key, message in refused.items():
        extra = {key: 1.0}
        if key == "min_seconds":
            extra["max_seconds"] = 2.0
        with pytest.raises(InvalidRequestError, match=re.escape(message)):
            engine.open_stream(ltx_request(extra_params=extra))
    bad = {
        "stg_scale": [-1, 21, float("nan"), True, "1"],
        "guidance_rescale": [1.5, None],
        "audio_guidance_scale": [1e9],
        "spatio_temporal_guidance_blocks": [[], [2], [0, 0], [0, 1, 1], "0", [True], 0],
        "use_cross_timestep": [1, "true"],
        "motion_speed": [0, 11],
        "max_sequence_length": [0, 1025],
    }
    for key, values in bad.items():
        for value in values:
            with pytest.raises(InvalidRequestError, match=f"extra_params.{key} must be"):
                engine.open_stream(ltx_request(extra_params={key: value}))
    with pytest.raises(InvalidRequestError, match="multiples of 32"):
        engine.open_stream(ltx_request(width=48))
    assert calls == []  # nothing reached the pipeline
    # What is taken reaches the call as it was given.
    taken = {
        "stg_scale": 0.0,
        "audio_stg_scale": 0.0,
        "modality_scale": 1,
        "spatio_temporal_guidance_blocks": [1, 0],
        "use_cross_timestep": False,
        "motion_speed": 0.5,
        **FAST,
    }
    engine.open_stream(ltx_request(num_frames=SEGMENT, extra_params=taken)).close()
    chunk = run_all(engine.open_stream(ltx_request(num_frames=3, extra_params=taken)))
    assert [c.frames.shape[0] for c in chunk] == [3]
    (call,) = calls
    assert {key: call[key] for key in taken} == taken
    assert call["num_frames"] == 3


@pytest.mark.slow
def test_startup_refuses_a_continuation_without_sound(
    ltx2: SimpleNamespace, models: SimpleNamespace, make_engine: Any
) -> None:
    with pytest.raises(EngineConfigError, match="WanImageToVideoPipeline makes no sound"):
        make_engine(ltx2.t2v, i2v_model=str(models.i2v))
    with pytest.raises(EngineConfigError, match="segment_frames must be 2"):
        make_engine(ltx2.t2v, segment_frames="8")


@pytest.mark.slow
async def test_the_stream_declares_its_sound_and_refuses_with_a_code(
    ltx2: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(ltx2.t2v, segment_frames=str(SEGMENT))
    server, _ = await serve(engine)
    start = {
        **START,
        "size": "32x32",
        "fps": FPS,
        "num_frames": SEGMENT,
        "num_inference_steps": 1,
        "extra_params": FAST,
    }
    refused = await run_session(server.url, {**start, "extra_params": {"audio_latents": [[0.0]]}})
    (error,) = refused.of_type("error")
    assert error["code"] == "invalid_request"
    assert "audio_latents" in error["message"]
    transcript = await run_session(server.url, start)
    (video_start,) = transcript.of_type("video.start")
    assert video_start["config"]["audio"] == {
        "sample_rate": RATE,
        "channels": 2,
        "codec": "mp4a.40.2",
    }
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [(m["num_audio_samples"], m["audio_sample_rate"]) for m in media] == [(9000, RATE)]
    decoded = decode_audio(transcript.video_bytes)
    assert decoded is not None and decoded[1].shape == (2, 9000)


@pytest.mark.slow
async def test_generate_sound_true_streams_ltx2s_sound_and_false_leaves_it_out(
    ltx2: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    """vllm-omni's ``generate_sound``: true, the vocoder's sound in the video; false, the
    same frames without an audio track (LTX-2 makes the two together, so the frames do
    not change)."""
    engine = make_engine(ltx2.t2v, segment_frames=str(SEGMENT))
    server, _ = await serve(engine)
    start = {
        **START,
        "size": "32x32",
        "fps": FPS,
        "num_frames": SEGMENT,
        "num_inference_steps": 1,
        "extra_params": FAST,
    }
    sound = await run_session(
        server.url, {**start, "generate_sound": True, "sound_duration": SEGMENT / FPS}
    )
    assert sound.terminal[-1]["type"] == "session.done", sound.terminal
    (video_start,) = sound.of_type("video.start")
    assert video_start["config"]["audio"]["sample_rate"] == RATE
    media = [m for m in sound.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [m["num_audio_samples"] for m in media] == [9000]
    decoded = decode_audio(sound.video_bytes)
    assert decoded is not None and decoded[1].shape == (2, 9000)
    silent = await run_session(server.url, {**start, "generate_sound": False})
    assert silent.terminal[-1]["type"] == "session.done", silent.terminal
    assert "audio" not in silent.of_type("video.start")[0]["config"]
    assert decode_audio(silent.video_bytes) is None
    np.testing.assert_array_equal(
        np.stack(decode_video(silent.video_bytes)), np.stack(decode_video(sound.video_bytes))
    )


@pytest.mark.slow
def test_the_engine_keeps_the_contract_with_its_sound(ltx2: SimpleNamespace) -> None:
    """`check_engine`, its audio rule included: every chunk exactly its frames' samples,
    stopped at each checkpoint, failed, interacted with."""

    def factory() -> Engine:
        args = {
            "model": str(ltx2.t2v),
            "i2v_model": str(ltx2.i2v),
            "segment_frames": str(SEGMENT),
            "threads": "1",
        }
        return load_engine("diffusers", args, device="cpu")

    check_engine(factory, ltx_request(num_frames=17, num_inference_steps=1, guidance_scale=1.0))


def record_calls(monkeypatch: pytest.MonkeyPatch, pipe: Any) -> list[dict[str, Any]]:
    """`support.record_calls`, and under ``"wave"`` the waveform each call returned
    (channels, samples)."""

    def keep_wave(seen: dict[str, Any], output: Any) -> None:
        seen["wave"] = output.audio[0].float().numpy().copy()

    return support_record_calls(monkeypatch, pipe, keep_wave)
