"""The engine (``trio_vstream.engines.diffusers``) through the server, and its request
planning: what a session sees end to end, and which requests ``open_stream`` refuses."""

from __future__ import annotations

import json
import threading
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import trio
from trio_websocket import open_websocket_url

from tests.conftest import (
    CLIENT_MAX_MESSAGE,
    Transcript,
    decode_video,
    receive_into,
    record_stops,
)
from tests.engines.diffusers.support import START, Probe, request, run_all, run_session
from trio_vstream.engines import GenerationRequest, InvalidRequestError


async def test_server_streams_segments_that_decode_to_the_requested_video(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    assert engine.name == "Wan-tiny-T2V"
    server, summaries = await serve(engine)
    transcript = await run_session(server.url, {**START, "num_frames": 12})

    metas = transcript.of_type("video.chunk_metadata")
    media = [m for m in metas if m["kind"] == "media"]
    # Segments of 5 frames (Wan's 4k+1), the last one trimmed to what is left.
    assert [m["num_frames"] for m in media] == [5, 5, 2]
    assert [m["generation_chunk_index"] for m in media] == [0, 1, 2]
    assert transcript.terminal[-1]["type"] == "session.done"
    frames = decode_video(transcript.video_bytes)
    assert len(frames) == 12
    assert frames[0].shape == (32, 48, 3)
    with trio.fail_after(5):  # the server sums up once its side of the close is done
        await summaries.wait_for(1)
    assert summaries[0].outcome.value == "completed"


async def test_stop_mid_segment_runs_at_most_one_more_step_and_no_decode(
    models: SimpleNamespace, make_engine: Any, serve: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    engine = make_engine(models.t2v)
    gate = threading.Event()
    probe = Probe(engine.model.pipe, gate=gate)  # the first step waits for the stop
    server, summaries = await serve(engine)
    stops = record_stops(monkeypatch)
    transcript = Transcript()
    try:
        async with open_websocket_url(server.url, max_message_size=CLIENT_MAX_MESSAGE) as ws:
            await ws.send_message(
                json.dumps({**START, "num_inference_steps": 30, "guidance_scale": 1.0})
            )
            # Inside the first segment's steps, held there until the server has the stop:
            # however slowly it reads the stop under load, the step is still running.
            assert await trio.to_thread.run_sync(probe.wait_for_forwards, 1, 10.0)
            await ws.send_message('{"type": "session.stop"}')
            with trio.fail_after(10):
                await stops.first.wait()
            gate.set()
            await receive_into(ws, transcript)
    finally:
        gate.set()
        probe.remove()

    done = transcript.terminal
    assert len(done) == 1 and done[0]["type"] == "session.done" and done[0]["stopped"] is True
    assert not [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    # One step per forward here.
    assert sum(1 for t, _ in probe.forwards if t > stops.times[0]) <= 1
    assert len(probe.forwards) < 10
    assert probe.decodes == []  # the VAE never ran for the stopped segment
    with trio.fail_after(5):
        await summaries.wait_for(1)
    assert summaries[0].outcome.value == "stopped"
    # The pipeline is free again: another session runs to the end.
    transcript = await run_session(server.url, {**START, "num_frames": 5})
    assert len(decode_video(transcript.video_bytes)) == 5


async def test_unknown_extra_params_are_invalid_request(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v)
    server, _ = await serve(engine)
    transcript = await run_session(
        server.url, {**START, "extra_params": {"bogus_knob": 1, "max_sequence_length": 64}}
    )
    [error] = transcript.terminal
    assert error["type"] == "error" and error["code"] == "invalid_request"
    # Only the unknown key is refused, and the message lists what the pipeline takes.
    assert error["message"].endswith(
        "unknown extra_params for WanPipeline: bogus_knob (a pipeline served segment by "
        "segment takes attention_kwargs, max_sequence_length)"
    )


async def test_concurrent_sessions_take_whole_segments_in_turn_and_keep_their_lora(
    models: SimpleNamespace, make_engine: Any, serve: Any
) -> None:
    engine = make_engine(models.t2v, lora_root=str(models.root))
    lora = {"path": str(models.lora), "scale": 1.0}
    # Each session alone, straight on the engine: the reference frames.
    alone_plain = run_all(engine.open_stream(request(prompt="plain", num_frames=10)))
    alone_lora = run_all(engine.open_stream(request(prompt="lora", num_frames=10, lora=lora)))

    recorded: dict[str, list[np.ndarray]] = {"plain": [], "lora": []}
    open_stream = engine.open_stream

    def recording_open_stream(req: GenerationRequest) -> Any:
        stream = open_stream(req)
        next_chunk = stream.next_chunk

        def recording_next_chunk(checkpoint: Any) -> Any:
            chunk = next_chunk(checkpoint)
            if chunk is not None:
                recorded[req.prompt].append(chunk.frames)
            return chunk

        stream.next_chunk = recording_next_chunk  # type: ignore[method-assign]
        return stream

    engine.open_stream = recording_open_stream  # type: ignore[method-assign]
    # Slower steps, so that the two sessions' segments overlap in time.
    probe = Probe(engine.model.pipe, step_delay=0.005)
    server, summaries = await serve(engine)
    common = {**START, "num_frames": 10, "guidance_scale": 1.0}
    async with trio.open_nursery() as nursery:
        nursery.start_soon(run_session, server.url, {**common, "prompt": "plain"})
        nursery.start_soon(run_session, server.url, {**common, "prompt": "lora", "lora": lora})
    probe.remove()

    with trio.fail_after(5):  # the server sums up once its side of the close is done
        await summaries.wait_for(2)
    assert [s.outcome.value for s in summaries] == ["completed", "completed"]
    # Same frames as alone: the LoRA applied to its own session's segments only.
    for name, alone in (("plain", alone_plain), ("lora", alone_lora)):
        assert len(recorded[name]) == len(alone) == 2
        for got, expected in zip(recorded[name], alone, strict=True):
            np.testing.assert_array_equal(got, expected.frames)
    assert not np.array_equal(alone_plain[0].frames, alone_lora[0].frames)
    # Whole segments in turn: between a segment's first step and its decode, no other
    # session's step ran; and both sessions did run while the other was open.
    events = sorted(
        [(t, thread, "step") for t, thread in probe.forwards]
        + [(t, thread, "decode") for t, thread in probe.decodes]
    )
    owner = None
    for _, thread, kind in events:
        if kind == "step":
            assert owner in (None, thread), "steps of two segments interleaved"
            owner = thread
        else:
            assert owner == thread
            owner = None
    assert engine.model.pipe.get_list_adapters() in ({}, {"transformer": []})


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"width": 40}, "multiples of 16 for WanPipeline, got 40x32"),
        ({"guidance_scale_2": 3.0}, "guidance_scale_2 needs a two-stage pipeline"),
        ({"boundary_ratio": 0.5}, "boundary_ratio needs a two-stage pipeline"),
        ({"true_cfg_scale": 2.0}, "true_cfg_scale is not supported by WanPipeline"),
        ({"image": np.zeros((8, 8, 3), np.uint8)}, "image_reference needs an image-to-video"),
        ({"extra_params": {"generator": 3}}, "extra_params set by the engine: generator"),
        ({"extra_params": {"attention_kwargs": {}, "zzz": 1}}, r"unknown extra_params .*: zzz \("),
        ({"lora": {"path": "no/such/lora"}}, "lora: no LoRA file .* inside the server's"),
        ({"lora": {"path": "/", "alpha": 1}}, "lora: unknown key"),
        ({"lora": {"path": "/etc"}}, "lora: no LoRA file .* inside the server's lora_root"),
        ({"lora": {"path": "../../x"}}, "lora: no LoRA file .* inside the server's lora_root"),
    ],
)
def test_requests_the_pipeline_cannot_serve_are_rejected_when_opened(
    models: SimpleNamespace, make_engine: Any, fields: dict[str, Any], message: str
) -> None:
    engine = make_engine(models.t2v, lora_root=str(models.root))
    with pytest.raises(InvalidRequestError, match=message):
        engine.open_stream(request(**fields))
