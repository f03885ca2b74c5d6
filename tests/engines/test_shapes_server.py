"""The shapes engine end to end: a real server on loopback, H.264 decoded by the client,
judged by the evaluator (colour and background verdicts) on a few prompts."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import trio

from tests.conftest import Transcript, decode_video, receive_into, receive_until
from trio_vstream.engines.shapes import ShapesEngine, create_engine
from trio_vstream.models.shapes import evaluate
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

PROMPTS = [
    ("a red circle moving left on a black background", "red", "black"),
    ("Big yellow box, falling, navy backdrop.", "yellow", "navy"),
    ("one cyan triangle standing still over grey", "cyan", "gray"),
    ("a small purple ball drifting rightwards on a white background", "purple", "white"),
]


@pytest.fixture(scope="module")
def engine() -> ShapesEngine:
    return create_engine(device="cpu")


@pytest.mark.slow
async def test_prompts_come_out_in_the_right_colours(
    nursery: trio.Nursery, engine: ShapesEngine
) -> None:
    server = VideoServer(
        engine,
        ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
    )
    await nursery.start(server.run)
    from trio_websocket import open_websocket_url

    for index, (prompt, colour, background) in enumerate(PROMPTS):
        start: dict[str, Any] = {
            "type": "session.start",
            "prompt": prompt,
            "model": "shapes",
            "size": "128x128",
            "num_frames": 16,
            "seed": 100 + index,
        }
        transcript = Transcript()
        async with open_websocket_url(server.url, max_message_size=2**26) as ws:
            await ws.send_message(json.dumps(start))
            await receive_into(ws, transcript)
        assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
        frames = decode_video(transcript.video_bytes)
        assert frames.shape == (16, 128, 128, 3)
        verdict = evaluate.analyse_clip(frames)
        assert (verdict.colour, verdict.background) == (colour, background), prompt
    server.shutdown()


async def test_a_seed_the_engine_chose_is_echoed_and_reproduces_the_video(
    nursery: trio.Nursery, engine: ShapesEngine
) -> None:
    """Without a seed in the request, video.start's config carries the one the engine
    drew; sending it back gives the same frames (and slots: here the colour)."""
    server = VideoServer(
        engine,
        ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
    )
    await nursery.start(server.run)
    from trio_websocket import open_websocket_url

    async def run(extra: dict[str, Any]) -> Transcript:
        start = {"type": "session.start", "prompt": "a circle", "size": "64x64", "num_frames": 8}
        transcript = Transcript()
        async with open_websocket_url(server.url, max_message_size=2**26) as ws:
            await ws.send_message(json.dumps({**start, **extra}))
            await receive_into(ws, transcript)
        assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
        return transcript

    first = await run({})
    seed = first.messages[0]["config"]["seed"]
    assert isinstance(seed, int)
    again = await run({"seed": seed})
    assert again.messages[0]["config"]["seed"] == seed
    np.testing.assert_array_equal(decode_video(first.video_bytes), decode_video(again.video_bytes))
    other = await run({"seed": seed + 1})
    assert not np.array_equal(decode_video(first.video_bytes), decode_video(other.video_bytes))
    server.shutdown()


@pytest.mark.slow
async def test_the_evaluator_judges_streamed_video_and_interactions(
    nursery: trio.Nursery, engine: ShapesEngine
) -> None:
    """``bench/evaluate_shapes.py``'s measurements, at toy size, through a real server."""
    from bench import evaluate_shapes

    server = VideoServer(engine, ServerConfig(host="127.0.0.1", port=0))
    await nursery.start(server.run)
    quality = await evaluate_shapes.quality(server.url, "eval", count=2, frames=8)
    assert quality["clips"] == 2 and quality["colour"] == quality["background"] == 1.0
    interactions = await evaluate_shapes.interactions(server.url, "eval", trials=1)
    assert interactions["interaction"] == 1.0
    server.shutdown()


@pytest.mark.slow
async def test_a_vllm_omni_camera_interaction_steers_the_world_end_to_end(
    nursery: trio.Nursery, engine: ShapesEngine
) -> None:
    """A camera velocity sent the way vllm-omni's clients send it turns the object from
    the chunk that reports the event on; a target pose is refused, naming why."""
    server = VideoServer(
        engine,
        ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
    )
    await nursery.start(server.run)
    from trio_websocket import open_websocket_url

    def camera(mode: str, translation: list[float]) -> str:
        data = {"translation": translation, "rotation": [0, 0, 0, 1]}
        event = {"multi_modal_data": {"camera": {"mode": mode, "data": data}}}
        interaction = {"event_id": mode, "transition_chunks": 0, "event": event}
        return json.dumps({"type": "session.interaction", "interaction": interaction})

    start = {
        "type": "session.start",
        "prompt": "a red square moving right on a black background",
        "size": "64x64",
        "num_frames": 96,
        "seed": 9,
        "fps": 48,
        # Paced, so that the interaction lands mid-video however fast this machine is.
        "extra_params": {"pace_to_media_time": True},
    }
    transcript = Transcript()
    async with open_websocket_url(server.url, max_message_size=2**26) as ws:
        await ws.send_message(json.dumps(start))
        await receive_until(ws, transcript, lambda m: isinstance(m, bytes))
        await ws.send_message(camera("target", [1, 0, 0]))
        await ws.send_message(camera("velocity", [-0.05, 0, 0]))
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    [refusal] = transcript.of_type("error")
    assert refusal["code"] == "interaction_failed" and refusal["event_id"] == "target"
    assert "steers by camera velocity only" in refusal["message"]
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    [turned] = [m["generation_chunk_index"] for m in media if "velocity" in m["started_event_ids"]]
    assert 1 <= turned < len(media) - 1
    frames = decode_video(transcript.video_bytes)
    before, after = frames[: 8 * turned], frames[8 * turned :]
    assert evaluate.analyse_clip(before).motion == "right"
    assert evaluate.analyse_clip(after).motion == "left"
    server.shutdown()


async def test_the_client_streams_a_clip_through_the_built_in_model(
    nursery: trio.Nursery, engine: ShapesEngine, tmp_path: Any
) -> None:
    """``python -m trio_vstream client --input-video clip "a watercolour painting" -o
    out.mp4`` against the built-in model: a video as long as the clip, every frame used,
    the object going where the clip's green blob goes."""
    import subprocess
    import sys

    from tests.player import fake_camera

    server = VideoServer(
        engine,
        ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
    )
    await nursery.start(server.run)
    clip = tmp_path / "clip.y4m"  # PyAV reads Y4M: the fake camera's loop, 48 frames at 12 fps
    fake_camera.write_y4m(clip)
    out = tmp_path / "out.mp4"
    command = [
        *(sys.executable, "-m", "trio_vstream", "client", "--url", server.url),
        *("--input-video", str(clip), "--size", "128x128", "--fps", "12", "--json"),
        *("a red circle on a navy background", "-o", str(out)),
    ]
    done = await trio.to_thread.run_sync(
        lambda: subprocess.run(command, capture_output=True, text=True, timeout=120)
    )
    assert done.returncode == 0, done.stderr
    summary = json.loads(done.stdout)
    assert summary["input_video"]["sent"] == summary["input_video"]["used"] == 48
    frames = decode_video(out.read_bytes())
    assert frames.shape == (48, 128, 128, 3)
    # Where the object is, against where the blob was (scaled to the output's size).
    pairs = []
    for index, frame in enumerate(frames):
        background = evaluate.background_colour(frame[None])
        mask = evaluate.object_mask(frame, background)
        if mask.sum() >= 4:
            rows, cols = np.nonzero(mask)
            x, y = fake_camera.blob_centre(index)
            scale = 128 / fake_camera.SIZE
            pairs.append((x * scale, y * scale, cols.mean(), rows.mean()))
    track = np.array(pairs)
    assert len(track) >= 40
    for axis in (0, 1):
        assert np.corrcoef(track[:, axis], track[:, axis + 2])[0, 1] >= 0.9
