"""Video in, end to end through a real server: frames sent as binary messages come out
of the stream as the engine was fed them (`EchoInputEngine` shows its input)."""

from __future__ import annotations

import json
import time
from typing import Any

import av
import numpy as np
import trio

from tests.conftest import Transcript, decode_video, receive_into
from tests.instrumented import (
    EchoInputEngine,
    EchoInputStream,
    InstrumentedStream,
    NoVideoInputEngine,
)
from trio_vstream.engines.contract import GenerationRequest
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


async def test_the_synthetic_engine_follows_its_input(start_server: Any) -> None:
    """The plain synthetic engine serves video in: at strength 0 its video is its input."""
    running = await start_server(SyntheticSettings(chunk_frames=4))
    start = {**START, "input_video": {**START["input_video"], "strength": 0}}
    values = [15 * (i + 1) for i in range(16)]
    transcript = await run_with_input(running, start, [png(v) for v in values])
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    assert sum(m["used"] for m in media_counts(transcript)) == 16
    shown = decode_video(transcript.video_bytes)[:, SIZE // 2, SIZE // 2, 0].astype(int)
    assert np.abs(shown - np.array(values)).max() <= 3


def media_counts(transcript: Transcript) -> list[dict[str, Any]]:
    return [
        m["input_frames"]
        for m in transcript.of_type("video.chunk_metadata")
        if m["kind"] == "media"
    ]


async def test_an_engine_without_video_input_refuses_it_by_name(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=NoVideoInputEngine)
    transcript = await running.run_session(START)
    (error,) = transcript.terminal
    assert error["code"] == "invalid_request"
    assert "input_video" in error["message"] and "synthetic" in error["message"]
    assert not transcript.of_type("video.start")


async def test_a_binary_message_without_input_video_is_refused_and_the_session_goes_on(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=NoVideoInputEngine)
    start = {k: v for k, v in START.items() if k != "input_video"}
    transcript = await run_with_input(running, start, [png(1)], end=False)
    errors = transcript.of_type("error")
    assert errors[0]["code"] == "invalid_message" and "input_video" in errors[0]["message"]
    assert transcript.terminal[-1]["type"] == "session.done"


async def test_refused_frames_are_coded_counted_and_the_session_goes_on(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    frames = [png(50), b"not an image", png(60, size=32), png(70), *(png(80) for _ in range(12))]
    transcript = await run_with_input(running, START, frames)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    refused = [e for e in transcript.of_type("error") if e["code"] == "invalid_input_frame"]
    assert len(refused) == 2
    assert "input frame 1" in refused[0]["message"]
    assert "32x32" in refused[1]["message"] and "64x64" in refused[1]["message"]
    counts = media_counts(transcript)
    # Every frame sent is used or dropped, once.
    assert sum(c["used"] + c["dropped"] for c in counts) == len(frames)
    assert sum(c["dropped"] for c in counts) == 2
    # The refused frames' output frames repeat the frame before them.
    (stream,) = running.engine.streams
    fed = np.concatenate(stream.fed)[:, 0, 0, 0].tolist()
    assert fed[:4] == [50, 50, 50, 70]


async def test_a_strict_session_ends_at_its_first_refused_frame(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "input_video": {**START["input_video"], "strict": True}}
    transcript = await run_with_input(running, start, [png(50), b"\xff\xd8\xff garbage"], end=False)
    (error,) = transcript.terminal
    assert error["code"] == "invalid_input_frame" and "input frame 1" in error["message"]


async def test_a_frame_over_the_byte_limit_is_refused_unread(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    big = png(1) + b"\0" * (1024 * 1024)
    transcript = await run_with_input(running, START, [big, *(png(9) for _ in range(15))])
    (error,) = [e for e in transcript.of_type("error")]
    assert error["code"] == "message_too_large" and "input frame 0" in error["message"]
    assert transcript.terminal[-1]["type"] == "session.done"


async def test_on_end_end_completes_the_video_with_its_input(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "input_video": {**START["input_video"], "on_end": "end"}}
    transcript = await run_with_input(running, start, [png(10 * (i + 1)) for i in range(6)])
    (done,) = transcript.terminal
    assert done["type"] == "session.done", done
    counts = media_counts(transcript)  # two chunks of the 16 frames asked for
    assert [c["used"] for c in counts] == [4, 2]
    assert counts[1]["reused"] == 2  # past the input's end: its last frame, counted


async def test_on_end_hold_goes_on_from_the_last_frame(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    transcript = await run_with_input(running, START, [png(10 * (i + 1)) for i in range(6)])
    assert transcript.terminal[-1]["type"] == "session.done"
    assert len(media_counts(transcript)) == 4
    (stream,) = running.engine.streams
    fed = np.concatenate(stream.fed)[:, 0, 0, 0].tolist()
    assert fed == [10, 20, 30, 40, 50, 60] + [60] * 10


async def test_no_input_in_time_reuses_and_counts(start_server: Any) -> None:
    """A client that sends nothing: each chunk waits max_wait_ms, then goes on from black."""
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "num_frames": 8, "input_video": {**START["input_video"], "max_wait_ms": 0}}
    transcript = await run_with_input(running, start, [], end=False)
    counts = media_counts(transcript)
    assert (
        counts
        == [
            {"used": 0, "dropped": 0, "reused": 4, "first": None, "last": None},
        ]
        * 2
    )
    assert transcript.terminal[-1]["type"] == "session.done"


async def test_an_input_twice_the_output_rate_uses_every_other_frame(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "num_frames": 8, "input_video": {**START["input_video"], "fps": 16}}
    transcript = await run_with_input(running, start, [png(10 + i) for i in range(16)])
    (stream,) = running.engine.streams
    fed = np.concatenate(stream.fed)[:, 0, 0, 0].tolist()
    assert fed == [10 + i for i in range(0, 16, 2)]
    counts = media_counts(transcript)
    assert sum(c["used"] for c in counts) == 8
    assert sum(c["used"] + c["dropped"] for c in counts) <= 16  # the last ones: no chunk left


async def test_the_receive_loop_never_waits_for_a_decode(
    start_server: Any, monkeypatch: Any
) -> None:
    """Decodes held in their thread: a ping sent behind frames is still answered, and a
    stop still ends the session."""
    import threading

    from trio_vstream.session import input_video

    held = threading.Event()
    decoding = threading.Event()
    real = input_video.decode_frame

    def slow(*args: Any) -> Any:
        decoding.set()
        held.wait(30)
        return real(*args)

    monkeypatch.setattr(input_video, "decode_frame", slow)
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    try:
        async with running.connect() as ws:
            await ws.send_message(json.dumps(START))
            assert json.loads(await ws.get_message())["type"] == "video.start"
            for value in range(8):
                await ws.send_message(png(value))
            await trio.to_thread.run_sync(decoding.wait, 30)
            await ws.send_message('{"type":"session.ping"}')
            with trio.fail_after(10):
                while json.loads(await ws.get_message())["type"] != "session.pong":
                    pass
            assert not held.is_set()  # answered while the decode was still held
            await ws.send_message('{"type":"session.stop"}')
            held.set()
            transcript = Transcript()
            await receive_into(ws, transcript)
        assert transcript.terminal[-1]["type"] == "session.done"
        assert transcript.terminal[-1]["stopped"] is True
    finally:
        held.set()


async def test_models_says_whether_the_engine_takes_video_input(start_server: Any) -> None:
    from tests.server.test_http import http_get_with_headers

    for engine_class, takes in ((EchoInputEngine, True), (NoVideoInputEngine, False)):
        running = await start_server(SyntheticSettings(), engine_class=engine_class)
        _, _, body = await http_get_with_headers(running.server.port, "/v1/models")
        assert json.loads(body)["data"][0]["trio_vstream"]["video_input"] is takes


async def test_an_end_that_comes_while_a_chunk_waits_ends_the_video(start_server: Any) -> None:
    """on_end "end": the end may come while the next chunk waits for frames past it; that
    chunk is not made of repeated frames, the video ends."""
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {
        **START,
        "num_frames": 40,
        "input_video": {**START["input_video"], "on_end": "end", "max_wait_ms": 5000},
    }
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        for value in range(8):
            await ws.send_message(png(value))
        media = 0
        while media < 2:
            message = await ws.get_message()
            transcript.messages.append(
                message if isinstance(message, bytes) else json.loads(message)
            )
            if isinstance(message, str) and '"kind":"media"' in message:
                media += 1
        # The third chunk now waits (up to 5 s) for frames 8..11, which never come.
        await ws.send_message('{"type":"input_video.end"}')
        with trio.fail_after(4):  # well before the wait's own end
            await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    assert [c["used"] for c in media_counts(transcript)] == [4, 4]


async def test_a_session_paced_by_playback_keeps_its_input_in_step(start_server: Any) -> None:
    """Both clocks count output frames: generation held by the playhead holds the input's
    clock too, so input sent ahead waits in the buffer and every frame is used in order."""
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "streaming_buffer_seconds": 0.5}
    values = [10 * (i + 1) for i in range(16)]
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        for value in values:
            await ws.send_message(png(value))
        await ws.send_message('{"type":"input_video.end"}')
        frames = 0
        with trio.fail_after(20):
            while True:
                raw = await ws.get_message()
                message = raw if isinstance(raw, bytes) else json.loads(raw)
                transcript.messages.append(message)
                if isinstance(message, dict) and message["type"] == "session.done":
                    break
                if isinstance(message, dict) and message.get("kind") == "media":
                    # Played at once: the playhead reaches what arrived, and no further.
                    frames += message["num_frames"]
                    await ws.send_message(
                        json.dumps({"type": "session.playback", "position_seconds": frames / 8})
                    )
    counts = media_counts(transcript)
    assert [c["used"] for c in counts] == [4, 4, 4, 4]
    assert sum(c["dropped"] + c["reused"] for c in counts) == 0
    (stream,) = running.engine.streams
    assert np.concatenate(stream.fed)[:, 0, 0, 0].tolist() == values


class SlowToOpenEngine(EchoInputEngine):
    """Opens its streams a while after asked: the session prepares that long."""

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        time.sleep(0.5)
        return super().open_stream(request)


async def test_a_frame_sent_before_video_start_is_taken_as_after_it(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=SlowToOpenEngine)
    big = png(90) + bytes(200 * 1024)  # a valid PNG (trailing bytes are ignored), 200 KiB
    transcript = Transcript()
    async with running.connect() as ws:
        # Without waiting for video.start, as a client streaming a camera might.
        await ws.send_message(json.dumps(START))
        await ws.send_message(big)
        for value in range(1, 16):
            await ws.send_message(png(value))
        await ws.send_message('{"type":"input_video.end"}')
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    assert not transcript.of_type("error"), transcript.of_type("error")
    (stream,) = running.engine.streams
    assert isinstance(stream, EchoInputStream)
    assert int(np.concatenate(stream.fed)[0, 0, 0, 0]) == 90  # the first frame was frame 0
