"""Video in, end to end through a real server: frames sent as binary messages come out
of the stream as the engine was fed them (`EchoInputEngine` shows its input)."""

from __future__ import annotations

import json
from typing import Any

import av
import numpy as np

from tests.conftest import Transcript, decode_video, receive_into
from tests.instrumented import EchoInputEngine, EchoInputStream
from trio_vstream.engines.synthetic import SyntheticSettings

SIZE = 64
START: dict[str, Any] = {
    "type": "session.start",
    "prompt": "follow",
    "size": f"{SIZE}x{SIZE}",
    "fps": 8,
    "num_frames": 16,
    "input_video": {"frame_format": "png", "fps": 8},
}


def png(value: int, size: int = SIZE) -> bytes:
    """A flat grey frame as PNG (lossless: the decoded stream can be compared)."""
    frame = av.VideoFrame.from_ndarray(np.full((size, size, 3), value, np.uint8), format="rgb24")
    codec = av.CodecContext.create("png", "w")
    codec.width = codec.height = size
    codec.pix_fmt = "rgb24"
    return b"".join(bytes(p) for p in codec.encode(frame))


async def run_with_input(
    running: Any, start: dict[str, Any], frames: list[bytes], end: bool = True
) -> Transcript:
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        first = json.loads(await ws.get_message())
        transcript.messages.append(first)
        assert first["type"] == "video.start", first
        for data in frames:
            await ws.send_message(data)
        if end:
            await ws.send_message('{"type":"input_video.end"}')
        await receive_into(ws, transcript)
    return transcript


async def test_the_engine_is_fed_each_frame_in_order(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    values = [10 * (i + 1) for i in range(16)]
    transcript = await run_with_input(running, START, [png(v) for v in values])
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    (stream,) = running.engine.streams
    assert isinstance(stream, EchoInputStream)
    fed = np.concatenate(stream.fed)
    assert [int(f[0, 0, 0]) for f in fed] == values
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [m["input_frames"]["used"] for m in media] == [4, 4, 4, 4]
    assert sum(m["input_frames"]["dropped"] + m["input_frames"]["reused"] for m in media) == 0
    assert [(m["input_frames"]["first"], m["input_frames"]["last"]) for m in media] == [
        (0, 3),
        (4, 7),
        (8, 11),
        (12, 15),
    ]
    shown = decode_video(transcript.video_bytes)[:, SIZE // 2, SIZE // 2, 0].astype(int)
    assert np.abs(shown - np.array(values)).max() <= 3
