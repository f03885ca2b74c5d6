"""Attacks through an input video's frames (issue 34): each frame is client bytes.

A frame is vetted from its header before anything decodes (the declared format and
size, exactly), capped in bytes, decoded at a capped rate, and held in a bounded buffer:
a decompression bomb, a frame over the byte cap, a flood of frames, each is refused or
dropped and counted, and the session goes on.
"""

from __future__ import annotations

import json
import threading
from typing import Any

import pytest

from tests.conftest import Transcript, receive_into
from tests.instrumented import EchoInputEngine
from tests.security.test_image_bombs import BOMB
from tests.server.test_server_input_video import START, media_counts, png, run_with_input
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.session import input_video


@pytest.fixture
def decodes(monkeypatch: Any) -> list[int]:
    """Every decode's frame size in bytes, as it starts."""
    started: list[int] = []
    real = input_video.decode_frame

    def counting(data: bytes, *args: Any) -> Any:
        started.append(len(data))
        return real(data, *args)

    monkeypatch.setattr(input_video, "decode_frame", counting)
    return started


async def test_a_decompression_bomb_is_refused_from_its_header(
    start_server: Any, decodes: list[int]
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    frames = [BOMB, *(png(7) for _ in range(15))]
    transcript = await run_with_input(running, START, frames)
    (error,) = transcript.of_type("error")
    assert error["code"] == "invalid_input_frame"
    assert "16000x16000" in error["message"] and "64x64" in error["message"]
    assert len(BOMB) not in decodes  # never reached a decoder
    assert transcript.terminal[-1]["type"] == "session.done"


async def test_a_frame_over_the_cap_is_refused_before_its_header_is_read(
    start_server: Any, decodes: list[int]
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    huge = b"\x89PNG" + bytes(protocol.DEFAULT_LIMITS.max_input_frame_bytes)
    transcript = await run_with_input(running, START, [huge, *(png(7) for _ in range(15))])
    (error,) = transcript.of_type("error")
    assert error["code"] == "message_too_large" and "input frame 0" in error["message"]
    assert len(huge) not in decodes


@pytest.mark.parametrize(
    "field", [{"width": 4000, "height": 4000}, {"width": 1920, "height": 1921}]
)
async def test_an_input_too_large_to_decode_is_refused_at_the_start(
    start_server: Any, field: dict[str, int]
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "input_video": {**START["input_video"], **field}}
    transcript = await running.run_session(start)
    (error,) = transcript.terminal
    assert error["code"] == "invalid_request" and "input_video" in error["message"]


async def test_a_flood_of_frames_is_bounded_and_counted(
    start_server: Any, monkeypatch: Any
) -> None:
    """Frames sent far faster than decodes: the queue keeps what the buffer holds, drops
    the oldest, and every frame is accounted for as used or dropped."""
    held = threading.Event()
    real = input_video.decode_frame

    def held_decode(*args: Any) -> Any:
        held.wait(30)
        return real(*args)

    monkeypatch.setattr(input_video, "decode_frame", held_decode)
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    sent = 200
    # Ends with its input, so that every frame sent is in some chunk's counts.
    start = {**START, "num_frames": 400, "input_video": {**START["input_video"], "on_end": "end"}}
    try:
        async with running.connect() as ws:
            await ws.send_message(json.dumps(start))
            assert json.loads(await ws.get_message())["type"] == "video.start"
            for value in range(sent):
                await ws.send_message(png(value % 250))
            await ws.send_message('{"type":"input_video.end"}')
            held.set()
            transcript = Transcript()
            await receive_into(ws, transcript)
    finally:
        held.set()
    counts = media_counts(transcript)
    capacity = input_video.timeline_capacity(
        protocol.InputVideoSettings(
            frame_format="png",
            fps=8,
            width=64,
            height=64,
            strength=0.6,
            on_end="hold",
            max_wait_seconds=0.25,
            strict=False,
            max_frame_bytes=1,
        ),
        (64, 64),
    )
    used = sum(c["used"] for c in counts)
    dropped = sum(c["dropped"] for c in counts)
    assert used <= capacity + 1  # what the queue and the decoder in hand could keep
    assert used + dropped == sent
