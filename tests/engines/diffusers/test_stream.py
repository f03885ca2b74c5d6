"""Streams (``trio_vstream.engines.diffusers._stream``), run straight on the engine:
what each pipeline call is given, how segments continue, how a stop ends one, and that
a finished session leaves nothing behind."""

from __future__ import annotations

import gc
import weakref
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from tests.engines.diffusers.support import (
    Probe,
    Stopped,
    assert_fox_to_whale,
    encode,
    fox_to_whale,
    no_stop,
    request,
    run_all,
)
from trio_vstream.engines import PromptChange, checkpoint_calling, load_engine


def test_interaction_blends_prompt_embeddings_over_the_next_segments(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    probe = Probe(pipe, keep_embeds=True)
    chunks = fox_to_whale(engine.open_stream(request(prompt="a red fox", num_frames=15)))
    probe.remove()
    assert len(chunks) == 3
    # Two steps a segment; guidance_scale 1: one transformer call per step.
    assert_fox_to_whale(chunks, probe.embeds, lambda text: encode(pipe, text), steps=2)
    assert chunks[2].active_event_ids == ()


def test_request_parameters_reach_the_pipeline_call(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    pipe = engine.model.pipe
    probe = Probe(pipe, keep_embeds=True)
    chunks = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=11,
            )
        )
    )
    probe.remove()
    assert len(probe.forwards) == 6  # 3 steps, each a conditional and an unconditional call
    torch.testing.assert_close(probe.embeds[0], encode(pipe, "a red fox in the snow"))
    torch.testing.assert_close(probe.embeds[1], encode(pipe, "blurry"))
    assert probe.flow_shifts == [5.0] * 6
    assert pipe.scheduler.config.flow_shift == 3.0  # for that call only
    # The seed decides the noise: same seed, same video; another seed, another video.
    again = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=11,
            )
        )
    )
    other = run_all(
        engine.open_stream(
            request(
                num_frames=5,
                num_inference_steps=3,
                guidance_scale=4.0,
                negative_prompt="blurry",
                flow_shift=5.0,
                seed=12,
            )
        )
    )
    np.testing.assert_array_equal(chunks[0].frames, again[0].frames)
    assert not np.array_equal(chunks[0].frames, other[0].frames)
    # Without an image-to-video pipeline, segments are clips of their own, each with its
    # own seed (seed + index): same prompt, yet a different clip.
    first, second = run_all(engine.open_stream(request(num_frames=10, seed=11)))
    assert not np.array_equal(first.frames, second.frames)


def test_i2v_segments_continue_from_the_previous_last_frame(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v, i2v_model=str(models.i2v))
    t2v_probe = Probe(engine.model.pipe)
    i2v_probe = Probe(engine.i2v.pipe)
    reference = np.zeros((20, 30, 3), np.uint8)
    reference[:, :15] = (250, 10, 10)
    chunks = run_all(engine.open_stream(request(num_frames=12, image=reference)))
    plain = run_all(engine.open_stream(request(num_frames=9)))
    t2v_probe.remove()
    i2v_probe.remove()

    # 5 frames, then 4 new ones per segment (the first is the frame continued from).
    assert [c.frames.shape[0] for c in chunks] == [5, 4, 3]
    images = i2v_probe.images
    assert len(images) == 3 + 1
    # The image reference, resized to the video, conditions the first segment...
    assert images[0].shape == (32, 48, 3)
    assert images[0][:, :20].mean(axis=(0, 1))[0] > 200
    assert images[0][:, 28:].max() < 10
    # ...and each later segment starts from the last frame of the one before.
    np.testing.assert_array_equal(images[1], chunks[0].frames[-1])
    np.testing.assert_array_equal(images[2], chunks[1].frames[-1])
    # Without an image, the text-to-video pipeline makes the first segment.
    assert len(t2v_probe.forwards) == 2 and len(t2v_probe.decodes) == 1
    assert [c.frames.shape[0] for c in plain] == [5, 4]
    np.testing.assert_array_equal(images[3], plain[0].frames[-1])


def test_a_raising_checkpoint_stops_the_segment_before_more_steps_and_the_decode(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    probe = Probe(engine.model.pipe)
    calls = 0

    def checkpoint() -> None:
        nonlocal calls
        calls += 1
        if len(probe.forwards) == 2:  # after the second step
            raise Stopped

    stream = engine.open_stream(request(num_inference_steps=10))
    with pytest.raises(Stopped):
        stream.next_chunk(checkpoint_calling(checkpoint, checkpoint))
    stream.close()
    assert len(probe.forwards) == 2
    assert probe.decodes == []
    # Nothing is left held: another stream runs.
    assert len(run_all(engine.open_stream(request(num_frames=5)))[0].frames) == 5
    probe.remove()


def _count_tensors() -> int:
    gc.collect()
    return sum(1 for obj in gc.get_objects() if issubclass(type(obj), torch.Tensor))


def test_no_tensor_of_a_finished_session_stays_referenced(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v, i2v_model=str(models.i2v), lora_root=str(models.root))
    image = np.full((32, 48, 3), 120, np.uint8)
    lora = {"path": str(models.lora), "scale": 0.5}

    def session(stop_after_steps: int | None = None) -> weakref.ref[Any]:
        stream = engine.open_stream(request(num_frames=12, image=image, lora=lora))
        probe_count = len(probe.forwards)

        def checkpoint() -> None:
            if (
                stop_after_steps is not None
                and len(probe.forwards) - probe_count >= stop_after_steps
            ):
                raise Stopped

        stop = checkpoint_calling(checkpoint, checkpoint)
        try:
            stream.next_chunk(stop)
            stream.interact(PromptChange("e1", "something else", transition_chunks=1))
            while stream.next_chunk(stop) is not None:
                pass
        except Stopped:
            pass
        finally:
            stream.close()
        return weakref.ref(stream)

    probe = Probe(engine.i2v.pipe)
    session()  # warm-up: lazily created state is not the session's
    baseline = _count_tensors()
    for stop in (None, 3):  # a whole session, and one stopped mid-segment
        ref = session(stop)
        assert ref() is None
        assert _count_tensors() == baseline
        assert all(r() is None for r in probe.embed_refs)
    probe.remove()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_gpu_memory_returns_to_baseline_after_a_session(models: SimpleNamespace) -> None:
    engine = load_engine(
        "diffusers",
        {"model": str(models.t2v), "segment_frames": "5", "lora_root": str(models.root)},
        device="cuda",
    )
    lora = {"path": str(models.lora), "scale": 0.7}
    try:
        run_all(engine.open_stream(request(num_frames=10, lora=lora)))  # warm-up
        gc.collect()
        torch.cuda.synchronize()
        baseline = torch.cuda.memory_allocated()
        stream = engine.open_stream(request(num_frames=10, lora=lora))
        stream.next_chunk(no_stop)
        stream.interact(PromptChange("e1", "other", transition_chunks=1))

        calls = 0

        def stop_mid_segment() -> None:
            nonlocal calls
            calls += 1
            if calls >= 3:  # after taking the pipeline, before the call, after one step
                raise Stopped

        with pytest.raises(Stopped):
            stream.next_chunk(checkpoint_calling(stop_mid_segment, stop_mid_segment))
        stream.close()
        del stream
        gc.collect()
        torch.cuda.synchronize()
        assert torch.cuda.memory_allocated() == baseline
    finally:
        engine.close()
