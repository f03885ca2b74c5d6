"""Video in from a file (``stream_video(input_video=...)``, ``client --input-video``):
the pure parts as tables (the pacer, the resampling), then against a real server whose
engine shows its input exactly (`EchoInputEngine`), so the output's frames can be
compared with the file's, and a scripted peer for the pacing window's acknowledgements.
"""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import trio
from trio_websocket import WebSocketConnection

from tests.client.test_client import finish
from tests.client.test_client_cli import run_cli
from tests.conftest import decode_video
from tests.fake_reference import VIDEO_START_REF, Peer, receive_json, send_session_done, start_peer
from tests.instrumented import EchoInputEngine, NoVideoInputEngine
from trio_vstream import cli
from trio_vstream.client import StreamOutcome, StreamResult, _input_video, stream_video
from trio_vstream.client._input_video import InputPacer, at_rate, probe_video
from trio_vstream.engines.synthetic import SyntheticSettings

SIZE = 64
FPS = 8
LEVELS = [20 + 12 * i for i in range(16)]  # one flat grey per frame, far enough apart
START: dict[str, Any] = {"prompt": "a watercolour painting", "size": f"{SIZE}x{SIZE}", "fps": FPS}


def make_video(
    path: Path, levels: list[int], *, fps: int = FPS, size: int = SIZE, codec: str = "ffv1"
) -> Path:
    """A small video file, one flat grey frame per level (ffv1: lossless)."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream(codec, rate=fps)
        stream.width = stream.height = size
        stream.pix_fmt = "yuv420p"
        for level in levels:
            picture = np.full((size, size, 3), level, np.uint8)
            container.mux(stream.encode(av.VideoFrame.from_ndarray(picture, format="rgb24")))
        container.mux(stream.encode())
    return path


@pytest.fixture
def clip(tmp_path: Path) -> Path:
    return make_video(tmp_path / "clip.mkv", LEVELS)


def assert_follows(video: bytes, levels: list[int]) -> None:
    """The video's frames are the levels, in order, each within JPEG's and H.264's error."""
    shown = decode_video(video).reshape(-1, SIZE * SIZE * 3).mean(axis=1)
    assert len(shown) == len(levels)
    assert np.abs(shown - np.array(levels)).max() <= 5, shown.round().tolist()


# ------------------------------------------------------------------- pure parts


def test_the_pacer_keeps_a_window_ahead_of_the_acknowledged_and_the_rate_after_a_burst() -> None:
    pacer = InputPacer(fps=4)
    assert pacer.window == 4
    for _ in range(4):  # the first second's burst
        assert pacer.send_at(0.0) == 0.0
        pacer.sending(0.0)
    assert pacer.send_at(0.0) is None  # a window ahead of nothing used: wait for a chunk
    pacer.acknowledge(None)  # a chunk that used no input yet moves nothing
    assert pacer.send_at(0.0) is None
    pacer.acknowledge(1)  # frames 0 and 1 used: two more may go, at the rate
    assert pacer.send_at(0.0) == 0.25
    pacer.sending(0.25)
    assert pacer.send_at(0.25) == 0.5
    pacer.sending(0.5)
    assert pacer.send_at(0.5) is None
    pacer.acknowledge(0)  # an older report never takes the window back
    assert pacer.acked == 2
    # Long idle: the bucket holds a window, no more.
    pacer.acknowledge(99)
    for _ in range(4):
        assert pacer.send_at(10.0) == 10.0
        pacer.sending(10.0)
    assert pacer.send_at(10.0) == 10.25
    assert pacer.sent == 10


@pytest.mark.parametrize(
    ("times", "fps", "last", "expected"),
    [
        ([0, 0.125, 0.25, 0.375], 8, 0.125, [0, 1, 2, 3]),  # the file's rate: one for one
        ([i / 16 for i in range(8)], 8, 1 / 16, [0, 2, 4, 6]),  # twice as fast: every other
        ([0, 0.25, 0.5], 8, 0.25, [0, 0, 1, 1, 2, 2]),  # half as fast: each twice
        # 30 fps in milliseconds (33, 67, 100): neither repeats nor skips a frame.
        ([0, 0.033, 0.067, 0.1, 0.133], 30, 0.033, [0, 1, 2, 3, 4]),
        ([5.0, 5.125], 8, 0.125, [0, 1]),  # counted from the first frame's time
        ([0], 1, 1 / 25, [0]),  # one short picture is still one frame
        ([], 8, 0.125, []),
    ],
)
def test_frames_are_resampled_to_the_declared_rate_by_their_timestamps(
    times: list[float], fps: int, last: float, expected: list[int]
) -> None:
    assert list(at_rate(((t, i) for i, t in enumerate(times)), fps, last)) == expected


def test_probe_reads_size_rate_and_duration(clip: Path) -> None:
    video = probe_video(clip)
    assert (video.width, video.height, video.fps) == (SIZE, SIZE, FPS)
    assert video.duration == pytest.approx(len(LEVELS) / FPS, abs=0.2)


def test_probe_refuses_frames_too_large_to_decode(
    clip: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A file's own size is checked before its first decode (a hostile header's
    30000x30000 would be gigabytes); here the bound is made small instead."""
    monkeypatch.setattr(_input_video, "MAX_SOURCE_PIXELS", SIZE * SIZE - 1)
    with pytest.raises(ValueError, match="its frames are 64x64, too large to decode"):
        probe_video(clip)


# ----------------------------------------------------- against a real server


async def test_the_output_follows_the_file_and_ends_with_it(start_server: Any, clip: Path) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "num_frames": 40, "input_video": {"on_end": "end", "strength": 0.3}}
    result = await stream_video(running.url, start, input_video=clip)

    assert result.outcome is StreamOutcome.COMPLETED, (result.error, result.problems)
    assert result.errors == [] and result.problems == []
    assert result.frames == len(LEVELS)  # not 40: the video ended with the file
    assert_follows(result.video, LEVELS)
    counts = result.input_frames
    assert counts is not None
    assert (result.input_frames_sent, counts.used, counts.dropped, counts.reused) == (16, 16, 0, 0)
    assert (counts.first, counts.last) == (0, 15) and result.input_ended
    assert result.summary()["input_video"] == {
        "sent": 16,
        "ended": True,
        "used": 16,
        "dropped": 0,
        "reused": 0,
    }
    sent = result.request["input_video"]
    assert sent == {
        "on_end": "end",
        "strength": 0.3,
        "frame_format": "jpeg",
        "fps": FPS,
        "width": SIZE,
        "height": SIZE,
    }
    request = running.engine.streams[0].request
    assert request.input_video is not None
    assert (request.input_video.fps, request.input_video.strength) == (FPS, 0.3)
    status, out, _ = finish(result)
    assert status == 0
    assert re.search(r"^input frames +16 sent, 16 used, 0 dropped, 0 reused$", out, re.M), out


async def test_hold_goes_on_from_the_last_frame(start_server: Any, clip: Path) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    start = {**START, "num_frames": 20, "input_video": {"on_end": "hold"}}
    result = await stream_video(running.url, start, input_video=clip)
    assert result.outcome is StreamOutcome.COMPLETED, (result.error, result.problems)
    assert_follows(result.video, LEVELS + [LEVELS[-1]] * 4)
    counts = result.input_frames
    assert counts is not None and (counts.used, counts.reused) == (16, 4)


async def test_an_engine_without_video_input_refuses_and_the_cli_says_so(
    start_server: Any, clip: Path
) -> None:
    running = await start_server(engine_class=NoVideoInputEngine)
    result = await stream_video(running.url, START, input_video=clip)
    assert result.outcome is StreamOutcome.ERROR and result.error is not None
    assert result.error.code == "invalid_request" and "input_video" in result.error.message
    assert result.input_frames_sent == 0 and result.input_frames is None
    status, out, err = finish(result)
    assert status == 1 and out == ""
    assert err.splitlines() == [f"error: server error invalid_request: {result.error.message}"]


async def test_a_stop_ends_the_sending(start_server: Any, tmp_path: Path) -> None:
    """A stop mid-file: no more frames, no ``input_video.end``, a completed count."""
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    clip = make_video(tmp_path / "long.mkv", [100] * 64)
    stop = trio.Event()
    sent_at_stop: list[int | None] = []

    def stop_at_first_chunk(_: Any, result: StreamResult) -> None:
        # The chunk's report lets more frames go: none may, once stopped.
        if not stop.is_set():
            sent_at_stop.append(result.input_frames_sent)
            stop.set()

    result = await stream_video(
        running.url, START, input_video=clip, stop_event=stop, on_chunk=stop_at_first_chunk
    )
    assert result.outcome is StreamOutcome.STOPPED
    assert result.input_frames_sent is not None and result.input_frames_sent >= 4
    assert sent_at_stop == [result.input_frames_sent]
    assert not result.input_ended


async def test_the_window_waits_for_the_chunks_acknowledgement(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    """A peer that reports no input used gets a second of frames, then nothing more
    (well past the rate's next frame); each frame it reports used lets one more go."""
    fps = 60
    clip = make_video(tmp_path / "fast.mkv", [100] * 90, fps=fps, size=16)
    arrived: list[int] = []

    async def frames_until_quiet(ws: WebSocketConnection) -> None:
        # 0.25 s is 15 frames at the rate: a window that did not hold would show.
        while True:
            with trio.move_on_after(0.25):
                data = await ws.get_message()
                assert isinstance(data, bytes), data
                arrived.append(len(data))
                continue
            return

    async def script(ws: WebSocketConnection, peer: Peer) -> None:
        start = await receive_json(ws, peer)
        assert start["input_video"]["fps"] == fps
        await ws.send_message(VIDEO_START_REF)
        with trio.fail_after(5):
            await frames_until_quiet(ws)
            assert len(arrived) == fps
            await send_chunk(ws, last=9)  # frames 0..9 used: ten more may go
            await frames_until_quiet(ws)
            assert len(arrived) == fps + 10
        await send_session_done(ws, 1)

    peer = await start_peer(nursery, script)
    result = await stream_video(peer.url, {"prompt": "x", "size": "16x16"}, input_video=clip)
    assert result.outcome is StreamOutcome.COMPLETED, result.problems
    assert result.input_frames_sent == fps + 10 and not result.input_ended


async def send_chunk(ws: WebSocketConnection, *, last: int) -> None:
    blob = b"\x00" * 8
    metadata = {
        "type": "video.chunk_metadata",
        "request_id": "ref-1",
        "kind": "media",
        "num_frames": 4,
        "byte_length": len(blob),
        "generation_chunk_index": 0,
        "started_event_ids": [],
        "active_event_ids": [],
        "completed_event_ids": [],
        "transport_chunk_index": 0,
        "input_frames": {"used": last + 1, "dropped": 0, "reused": 0, "first": 0, "last": last},
    }
    await ws.send_message(json.dumps(metadata))
    await ws.send_message(blob)


# ------------------------------------------------------------ the command line


@pytest.mark.slow
async def test_cli_streams_the_file_and_reports_its_frames(
    start_server: Any, clip: Path, tmp_path: Path
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4), engine_class=EchoInputEngine)
    output = tmp_path / "out.mp4"
    run = await run_cli(
        tmp_path, "a watercolour painting", "--url", running.url, "-o", str(output), "--json",
        "--size", f"{SIZE}x{SIZE}", "--fps", str(FPS), "--input-video", str(clip),
        "--strength", "0.4",
    )  # fmt: skip
    assert run.returncode == 0, run.stderr
    summary = run.summary
    assert summary["input_video"] == {
        "sent": 16,
        "ended": True,
        "used": 16,
        "dropped": 0,
        "reused": 0,
    }
    assert summary["frames"] == summary["output_frames"] == len(LEVELS)
    assert_follows(output.read_bytes(), LEVELS)
    request = running.engine.streams[0].request
    # No length given: one that covers the file (2 s), which the video ends with.
    assert request.num_frames == 2 * FPS
    assert request.input_video is not None and request.input_video.strength == 0.4


@pytest.mark.parametrize(
    ("make", "message"),
    [
        (lambda d: d / "missing.mp4", "no such file"),
        (lambda d: (d / "notes.mp4").write_text("hello") and d / "notes.mp4", "not a video file"),
        (lambda d: make_sound(d / "sound.wav"), "has no video stream (only audio)"),
    ],
    ids=["missing", "text", "audio-only"],
)
def test_cli_refuses_a_file_that_is_not_a_video_before_connecting(
    make: Any,
    message: str,
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(tmp_path)
    source = make(tmp_path)
    # Port 9 (discard): were it to connect, the error would be another one.
    url = "ws://127.0.0.1:9/v1/realtime/video"
    status = cli.main(["client", "x", "-o", "o.mp4", "--url", url, "--input-video", str(source)])
    err = capsys.readouterr().err
    assert status == 2, err
    assert f"--input-video {source}: {message}" in err
    assert not (tmp_path / "o.mp4").exists()


async def test_the_library_refuses_a_file_that_is_not_a_video_before_connecting(
    tmp_path: Path,
) -> None:
    notes = tmp_path / "notes.txt"
    notes.write_text("hello")
    with pytest.raises(ValueError, match=f"input video {notes}: not a video file"):
        await stream_video("ws://127.0.0.1:9/v1/realtime/video", START, input_video=notes)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--strength", "0.5"], "--strength goes with --input-video"),
        (["--input-end", "hold"], "--input-end goes with --input-video"),
        (["--input-video", "clip.mkv", "--strength", "2"], "from 0 to 1"),
        (["--input-video", "clip.mkv", "--input-fps", "61"], "from 1 to 60"),
        (
            ["--input-video", "clip.mkv", "--param", "input_video={}"],
            "--param input_video conflicts",
        ),
    ],
)
def test_cli_input_flags_usage_errors(
    args: list[str],
    message: str,
    clip: Path,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.chdir(clip.parent)
    with pytest.raises(SystemExit) as info:
        raise SystemExit(cli.main(["client", "x", "-o", "o.mp4", *args]))
    assert info.value.code == 2
    assert message in capsys.readouterr().err


def make_sound(path: Path) -> Path:
    """A second of silence as WAV: a media file with no video stream."""
    with av.open(str(path), "w") as container:
        stream = container.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(
            np.zeros((1, 8000), np.int16), format="s16", layout="mono"
        )
        frame.sample_rate = 8000
        container.mux(stream.encode(frame))
        container.mux(stream.encode())
    return path
