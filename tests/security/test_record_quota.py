"""Attack: a client fills the server's disk through ``--record`` (issue 20, item 9).

Every session was recorded, whatever its size and however many: clients could fill the
disk of a recording server, and only a full disk (``ENOSPC``) stopped them, dropping
whole recordings and failing whatever else shares the disk. Now ``--record-max-bytes``
bounds what the recordings in DIR may take (what is there already counts; by default
what DIR holds plus 90% of the free space at start). At the limit a new session is not
recorded (counted as dropped, logged once), and a recording under way stops and is
finished as it stands: a valid MP4 of the chunks written, and a JSON that says
``"truncated": true``, why, and what was not recorded. Inline images are bounded too.
"""

from __future__ import annotations

import base64
import json
import logging
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio
import trio.testing

from tests.conftest import Transcript, decode_video, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from tests.outputs.test_recording import PNG, SLOW, SYNTHETIC, interaction, read_record
from trio_vstream import cli, protocol
from trio_vstream.cli import serve
from trio_vstream.client._replay import load_recording
from trio_vstream.engines.contract import Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.outputs.recording import Recorder
from trio_vstream.server.app import ServerConfig, VideoServer


def recording_counts(server: VideoServer) -> dict[str, float | None]:
    registry, labels = server.metrics.registry, {"model": server.served_model}
    return {
        name: registry.get_sample_value(f"trio_vstream_recordings_{name}_total", labels)
        for name in ("written", "dropped", "truncated")
    }


def files_size(directory: Path) -> int:
    return sum(path.stat().st_size for path in directory.iterdir())


class PausingEngine(InstrumentedEngine):
    """Makes two chunks, then waits (in its worker thread) until the test says go."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.go = threading.Event()

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk
        made = 0

        def pausing_next_chunk(checkpoint: Any) -> Chunk | None:
            nonlocal made
            if made == 2:
                self.go.wait(timeout=30)
            made += 1
            return next_chunk(checkpoint)

        stream.next_chunk = pausing_next_chunk  # type: ignore[method-assign]
        return stream


async def test_a_recording_that_reaches_the_limit_stops_and_says_so(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream.outputs.recording")
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder, engine_class=PausingEngine)
    engine: PausingEngine = running.engine
    transcript = Transcript()
    try:
        async with running.connect() as ws:
            await ws.send_message(json.dumps(SYNTHETIC))  # 16 frames: 4 chunks of 4
            for _ in range(2):
                await receive_until(ws, transcript, is_type("video.chunk_metadata"))
                await receive_until(ws, transcript, lambda m: isinstance(m, bytes))
            await trio.testing.wait_all_tasks_blocked()  # both chunks handed to the tap
            recorder.max_bytes = recorder.used  # the disk's share is used up: now
            await ws.send_message(interaction("late", prompt="a blue circle"))
            await receive_until(ws, transcript, is_type("session.interaction.queued"))
            engine.go.set()
            await receive_into(ws, transcript)
    finally:
        engine.go.set()
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    # The client lost nothing.
    assert transcript.terminal[-1]["type"] == "session.done"
    assert len(transcript.of_type("video.chunk_metadata")) == 5  # 4 chunks and the trailer
    request_id = transcript.messages[0]["request_id"]
    record = read_record(tmp_path, request_id)
    assert record["outcome"] == "completed"
    assert record["truncated"] is True
    truncation = record["truncation"]
    assert "--record-max-bytes" in truncation["reason"]
    assert truncation["chunks_not_recorded"] == 3  # two media chunks and the trailer
    assert truncation["interactions_not_recorded"] == 1
    assert 0 < truncation["t"] <= record["duration"]
    assert [c["generation_chunk_index"] for c in record["chunks"]] == [0, 1]
    assert record["interactions"] == []
    # A valid MP4 of what was written: the client's first 8 frames, exactly.
    recorded = decode_video((tmp_path / f"{request_id}.mp4").read_bytes())
    assert record["file"]["frames"] == len(recorded) == 8
    assert np.array_equal(decode_video(transcript.video_bytes)[:8], recorded)
    assert (recorder.written, recorder.truncated, recorder.dropped) == (1, 1, 0)
    assert recording_counts(running.server) == {"written": 1, "dropped": 0, "truncated": 1}
    assert recorder.used == files_size(tmp_path)  # what is reserved is what is there
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1 and "recording stopped" in lines[0]
    # A replay compares the frames the recording holds, not the whole video's.
    assert load_recording(tmp_path / f"{request_id}.json").complete is False


async def test_sessions_past_the_limit_are_not_recorded_counted_and_logged_once(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream.outputs.recording")
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic", max_bytes=4096)
    running = await start_server(SLOW, taps=recorder)
    for _ in range(3):
        transcript = await running.run_session(SYNTHETIC)
        assert transcript.terminal[-1]["type"] == "session.done"  # the session is untouched
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert list(tmp_path.iterdir()) == []
    assert (recorder.written, recorder.dropped, recorder.used) == (0, 3, 0)
    assert recording_counts(running.server) == {"written": 0, "dropped": 3, "truncated": 0}
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(lines) == 1
    assert "new sessions are not recorded" in lines[0]


async def test_what_the_recordings_take_is_what_is_on_disk(
    start_server: Any, tmp_path: Path
) -> None:
    """The accounting is exact once recordings are written: a limit of just that lets
    none more in."""
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    image_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    await running.run_session({**SYNTHETIC, "image_reference": {"image_url": image_url}})
    await running.run_session(SYNTHETIC)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert recorder.written == 2
    assert recorder.used == files_size(tmp_path)
    again = Recorder(tmp_path, engine="synthetic", model="synthetic", max_bytes=recorder.used)
    assert again.used == recorder.used
    [tap] = again("video_stream-next", _start()).taps
    tap.started(*_video_start("video_stream-next"))
    tap.ended("completed", None)
    assert again.wait_idle(10)
    assert (again.written, again.dropped) == (0, 1)


def _start() -> protocol.SessionStart:
    return protocol.parse_start(json.dumps(SYNTHETIC))


def _video_start(request_id: str) -> tuple[protocol.VideoStart, protocol.SessionStart]:
    start = _start()
    return protocol.VideoStart(request_id, "m4s", start.config), start


def test_recordings_already_in_the_directory_count(tmp_path: Path) -> None:
    (tmp_path / "video_stream-old.mp4").write_bytes(b"m" * 5000)
    (tmp_path / "video_stream-old.json").write_bytes(b"j" * 700)
    (tmp_path / ".video_stream-crashed.fmp4.part").write_bytes(b"p" * 300)
    (tmp_path / "notes.txt").write_bytes(b"n" * 99_999)  # not a recording
    (tmp_path / "video_stream-folder").mkdir()
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic", max_bytes=6000)
    assert recorder.used == 6000
    [tap] = recorder("video_stream-new", _start()).taps
    tap.started(*_video_start("video_stream-new"))
    assert recorder.wait_idle(10)
    assert recorder.dropped == 1
    assert not list(tmp_path.glob("video_stream-new*"))


async def test_an_inline_image_over_its_bound_is_described_not_kept(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(
        tmp_path, engine="synthetic", model="synthetic", max_image_bytes=len(PNG) - 1
    )
    running = await start_server(SLOW, taps=recorder)
    image_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    transcript = await running.run_session(
        {**SYNTHETIC, "image_reference": {"image_url": image_url}}
    )
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    request_id = transcript.messages[0]["request_id"]
    image = read_record(tmp_path, request_id)["image"]
    assert image["file"] is None and image["bytes"] == len(PNG)
    assert f"{len(PNG) - 1} bytes" in image["not_kept"]
    assert not list(tmp_path.glob("*.image.*"))


@pytest.mark.parametrize(
    ("text", "size"),
    [("123", 123), ("500M", 500 * 1024**2), ("20G", 20 * 1024**3), ("1TiB", 1024**4)],
)
def test_record_max_bytes_takes_sizes(text: str, size: int) -> None:
    args = cli.build_parser().parse_args(["serve", "--record-max-bytes", text])
    assert args.record_max_bytes == size


@pytest.mark.parametrize("text", ["", "-1", "1.5G", "20X", "lots"])
def test_record_max_bytes_refuses_what_is_not_a_size(
    text: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit):
        cli.build_parser().parse_args(["serve", "--record-max-bytes", text])
    assert "--record-max-bytes" in capsys.readouterr().err


def make_recorder(directory: Path, *flags: str) -> Recorder:
    args = cli.build_parser().parse_args(["serve", "--record", str(directory), *flags])
    engine = SyntheticEngine(SyntheticSettings())
    config = ServerConfig()
    recorder = serve._recorder(args, engine, config)
    assert recorder is not None
    return recorder


def test_the_limit_is_the_flag_or_most_of_the_free_space(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "video_stream-old.mp4").write_bytes(b"m" * 1000)
    assert make_recorder(tmp_path, "--record-max-bytes", "1M").max_bytes == 1024**2

    class Usage:
        free = 10_000

    disk_usage: Callable[[Path], Usage] = lambda path: Usage()  # noqa: E731
    monkeypatch.setattr(serve.shutil, "disk_usage", disk_usage)
    assert make_recorder(tmp_path).max_bytes == 1000 + 9000
