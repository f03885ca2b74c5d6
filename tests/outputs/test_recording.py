"""``--record DIR`` (issue 16, recording): each session is kept as DIR/<id>.mp4, holding
exactly the frames the client got, beside DIR/<id>.json; stopped and failed sessions up
to what was sent; a full or a slow disk drops the recording and never the session."""

from __future__ import annotations

import base64
import errno
import hashlib
import json
import logging
import threading
from pathlib import Path
from typing import Any, BinaryIO

import numpy as np
import pytest
import trio

from tests.conftest import Transcript, decode_video, is_type, receive_into, receive_until
from tests.media.test_image_fetch import png_of
from tests.server.test_http import http_get
from trio_vstream import cli, protocol
from trio_vstream.engines.shapes import ShapesEngine, create_engine
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.recording import Recorder
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

SYNTHETIC = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 16}
SLOW = SyntheticSettings(step_delay=0.01, chunk_frames=4, steps=2)
SHAPES_START = {
    "type": "session.start",
    "prompt": "a red circle moving left on a black background",
    "model": "shapes",
    "size": "64x64",
    "num_frames": 24,
    "seed": 7,
    "extra_params": {"chunk_frames": 2},
}
CAMERA = {"mode": "velocity", "data": {"translation": [0.05, 0, 0], "rotation": [0, 0, 0, 1]}}
#: A PNG, as a client would send it.
PNG = png_of(np.full((20, 30, 3), 180, np.uint8))


@pytest.fixture(scope="module")
def shapes() -> ShapesEngine:
    return create_engine(device="cpu")


def interaction(event_id: str, prompt: str | None = None, camera: Any = None) -> str:
    event: dict[str, Any] = {}
    if prompt is not None:
        event["prompt"] = prompt
    if camera is not None:
        event["multi_modal_data"] = {"camera": camera}
    body = {"event_id": event_id, "event": event}
    return json.dumps({"type": "session.interaction", "interaction": body})


async def start_shapes_server(
    nursery: trio.Nursery, engine: ShapesEngine, recorder: Recorder | None
) -> VideoServer:
    server = VideoServer(
        engine,
        ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="shapes")),
        taps=recorder,
    )
    await nursery.start(server.run)
    return server


async def record_shapes_session(
    nursery: trio.Nursery, engine: ShapesEngine, directory: Path
) -> tuple[Transcript, Recorder]:
    """A shapes session with a prompt and a camera interaction, recorded into ``directory``."""
    recorder = Recorder(directory, engine="shapes", model="shapes", device="cpu")
    server = await start_shapes_server(nursery, engine, recorder)
    from trio_websocket import open_websocket_url

    transcript = Transcript()
    async with open_websocket_url(server.url, max_message_size=2**26) as ws:
        await ws.send_message(json.dumps(SHAPES_START))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("p1", prompt="a blue square on a black background"))
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("c1", camera=CAMERA))
        await receive_into(ws, transcript)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 30)
    server.shutdown()
    return transcript, recorder


def read_record(directory: Path, request_id: str) -> dict[str, Any]:
    return json.loads((directory / f"{request_id}.json").read_text())


def first_chunk_listing(transcript: Transcript, key: str) -> dict[str, int]:
    found: dict[str, int] = {}
    for metadata in transcript.of_type("video.chunk_metadata"):
        for event_id in metadata[key]:
            found.setdefault(event_id, metadata["generation_chunk_index"])
    return found


def assert_chunks_match(record: dict[str, Any], transcript: Transcript) -> None:
    sent = transcript.of_type("video.chunk_metadata")
    assert [
        (c["kind"], c["generation_chunk_index"], c["frames"], c["bytes"]) for c in record["chunks"]
    ] == [(m["kind"], m["generation_chunk_index"], m["num_frames"], m["byte_length"]) for m in sent]
    times = [c["t"] for c in record["chunks"]]
    assert times == sorted(times) and times[0] >= 0


@pytest.mark.slow
async def test_a_session_is_recorded_with_the_frames_the_client_got(
    nursery: trio.Nursery, shapes: ShapesEngine, tmp_path: Path
) -> None:
    transcript, _ = await record_shapes_session(nursery, shapes, tmp_path)
    assert transcript.terminal[-1]["type"] == "session.done", transcript.terminal
    request_id = transcript.messages[0]["request_id"]
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{request_id}.json",
        f"{request_id}.mp4",
    ]
    received = decode_video(transcript.video_bytes)
    recorded = decode_video((tmp_path / f"{request_id}.mp4").read_bytes())
    assert received.shape == recorded.shape == (24, 64, 64, 3)
    assert np.array_equal(received, recorded)

    record = read_record(tmp_path, request_id)
    assert (record["format"], record["version"]) == (
        protocol.RECORDING_FORMAT,
        protocol.RECORDING_FORMAT_VERSION,
    )
    assert (record["request_id"], record["engine"], record["model"]) == (
        request_id,
        "shapes",
        "shapes",
    )
    assert record["seed"] == 7
    assert record["request"]["prompt"] == SHAPES_START["prompt"]
    assert record["request"]["extra_params"] == {"chunk_frames": 2}
    assert record["video"] == {"width": 64, "height": 64, "fps": 24, "num_frames": 24}
    assert record["outcome"] == "completed"
    assert record["terminal"] == transcript.terminal[-1]
    assert record["file"] == {
        "name": f"{request_id}.mp4",
        "frames": 24,
        "bytes": (tmp_path / f"{request_id}.mp4").stat().st_size,
    }
    assert_chunks_match(record, transcript)
    started = first_chunk_listing(transcript, "started_event_ids")
    completed = first_chunk_listing(transcript, "completed_event_ids")
    prompt, camera = record["interactions"]
    assert prompt["message"]["interaction"]["event"]["prompt"].startswith("a blue square")
    assert camera["message"]["interaction"]["event"]["multi_modal_data"]["camera"]["mode"] == (
        "velocity"
    )
    for entry in (prompt, camera):
        event_id = entry["event_id"]
        assert entry["accepted"] and entry["error"] is None and entry["source"] == "live"
        assert entry["started_chunk"] == started[event_id]
        assert entry["completed_chunk"] == completed.get(event_id)
        assert 0 < entry["t"] < record["duration"]
        assert entry["at"].endswith("+00:00")
    assert prompt["t"] < camera["t"]


async def test_a_stopped_session_is_recorded_up_to_what_was_sent(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(SYNTHETIC))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(interaction("e1", prompt="a blue circle"))
        await ws.send_message(interaction("e1", prompt="a green circle"))  # a conflict
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    terminal = transcript.messages[-1]
    assert (terminal["type"], terminal["stopped"]) == ("session.done", True)
    request_id = transcript.messages[0]["request_id"]
    record = read_record(tmp_path, request_id)
    assert record["outcome"] == "stopped"
    assert record["terminal"] == terminal
    assert_chunks_match(record, transcript)
    assert "trailer" not in [c["kind"] for c in record["chunks"]]
    received = decode_video(transcript.video_bytes)
    recorded = decode_video((tmp_path / f"{request_id}.mp4").read_bytes())
    assert len(recorded) == record["file"]["frames"] == sum(c["frames"] for c in record["chunks"])
    assert np.array_equal(received, recorded)
    first, second = record["interactions"]
    assert (first["event_id"], first["accepted"]) == ("e1", True)
    assert (second["event_id"], second["accepted"]) == ("e1", False)
    assert second["error"]["code"] == "event_id_conflict"
    assert second["started_chunk"] is None


async def test_a_failed_session_is_recorded_up_to_what_was_sent(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    transcript = await running.run_session({**SYNTHETIC, "extra_params": {"fail_at_chunk": 2}})
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert transcript.terminal[-1]["code"] == "generation_failed"
    request_id = transcript.messages[0]["request_id"]
    record = read_record(tmp_path, request_id)
    assert record["outcome"] == "failed"
    assert record["terminal"] == transcript.terminal[-1]
    assert record["request"]["extra_params"] == {"fail_at_chunk": 2}
    assert [c["generation_chunk_index"] for c in record["chunks"]] == [0, 1]
    assert_chunks_match(record, transcript)
    recorded = decode_video((tmp_path / f"{request_id}.mp4").read_bytes())
    assert np.array_equal(decode_video(transcript.video_bytes), recorded)
    assert len(recorded) == 8


async def test_an_inline_image_is_kept_beside_the_json_by_its_hash(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    image_url = "data:image/png;base64," + base64.b64encode(PNG).decode()
    transcript = await running.run_session(
        {**SYNTHETIC, "image_reference": {"image_url": image_url}}
    )
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    request_id = transcript.messages[0]["request_id"]
    record = read_record(tmp_path, request_id)
    assert "image_reference" not in record["request"]
    assert record["image"] == {
        "source": "inline",
        "file": f"{request_id}.image.png",
        "mime_type": "image/png",
        "bytes": len(PNG),
        "sha256": hashlib.sha256(PNG).hexdigest(),
    }
    assert (tmp_path / f"{request_id}.image.png").read_bytes() == PNG
    assert image_url not in (tmp_path / f"{request_id}.json").read_text()


class FullDisk:
    """The part file on a disk that fills up: the first write fits, the next does not."""

    def __init__(self, path: Path) -> None:
        self.file: BinaryIO = open(path, "xb")  # noqa: SIM115 - closed by the writer
        self.writes = 0

    def write(self, data: bytes) -> int:
        self.writes += 1
        if self.writes > 1:
            raise OSError(errno.ENOSPC, "No space left on device")
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()


async def test_a_full_disk_drops_the_recording_and_the_session_goes_on(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_vstream.outputs.recording")
    recorder = Recorder(
        tmp_path,
        engine="synthetic",
        model="synthetic",
        open_part=FullDisk,  # type: ignore[arg-type]
    )
    running = await start_server(SLOW, taps=recorder)
    transcript = await running.run_session(SYNTHETIC)
    assert transcript.terminal[-1]["type"] == "session.done"
    assert len(transcript.of_type("video.chunk_metadata")) == 5  # 4 media + trailer
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert list(tmp_path.iterdir()) == []  # the partial files are gone
    assert recorder.dropped == 1
    assert recording_counts(running.server) == {"written": 0, "dropped": 1, "active": 0}
    [line] = [r.getMessage() for r in caplog.records]
    assert "recording dropped" in line and "No space left on device" in line


def recording_counts(server: VideoServer) -> dict[str, float | None]:
    """The recorder's figures in the server's ``/metrics`` registry."""
    registry, labels = server.metrics.registry, {"model": server.served_model}
    return {
        "written": registry.get_sample_value("trio_vstream_recordings_written_total", labels),
        "dropped": registry.get_sample_value("trio_vstream_recordings_dropped_total", labels),
        "active": registry.get_sample_value("trio_vstream_recordings_active", labels),
    }


async def test_metrics_count_recordings_written_and_being_written(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    assert recording_counts(running.server) == {"written": 0, "dropped": 0, "active": 0}
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**SYNTHETIC, "num_frames": 400}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        assert recording_counts(running.server)["active"] == 1  # until the session ends
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert recording_counts(running.server) == {"written": 1, "dropped": 0, "active": 0}
    status, body = await http_get(running.server.port, "/metrics")
    assert status == 200
    assert 'trio_vstream_recordings_written_total{model="synthetic"} 1.0' in body.decode()


async def test_a_server_without_recording_has_no_recording_figures(start_server: Any) -> None:
    running = await start_server(SLOW)
    assert "trio_vstream_recordings" not in running.server.metrics.exposition().decode()


class StuckDisk:
    """A part file whose writes wait until the test lets them through."""

    def __init__(self, path: Path, gate: threading.Event) -> None:
        self.file: BinaryIO = open(path, "xb")  # noqa: SIM115 - closed by the writer
        self.gate = gate

    def write(self, data: bytes) -> int:
        self.gate.wait()
        return self.file.write(data)

    def close(self) -> None:
        self.file.close()


async def test_a_writer_that_falls_behind_never_delays_the_session(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_vstream.outputs.recording")
    gate = threading.Event()
    recorder = Recorder(
        tmp_path,
        engine="synthetic",
        model="synthetic",
        max_queued_items=2,
        open_part=lambda path: StuckDisk(path, gate),  # type: ignore[arg-type,return-value]
    )
    running = await start_server(SLOW, taps=recorder)
    try:
        # The writer is stuck on its first chunk for the whole session: the session
        # completes anyway, and the recording, two items behind, is dropped.
        transcript = await running.run_session(SYNTHETIC)
        assert transcript.terminal[-1]["type"] == "session.done"
        assert len(transcript.of_type("video.chunk_metadata")) == 5
        assert not gate.is_set()
    finally:
        gate.set()
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert list(tmp_path.iterdir()) == []
    assert recorder.dropped == 1
    [line] = [r.getMessage() for r in caplog.records]
    assert "recording dropped" in line and "fell behind" in line


async def test_an_unwritable_directory_costs_the_recording_only(
    start_server: Any, tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    """The directory vanished (an unmounted disk): the part file cannot even be opened."""
    directory = tmp_path / "recordings"
    recorder = Recorder(directory, engine="synthetic", model="synthetic")
    directory.rmdir()
    running = await start_server(SLOW, taps=recorder)
    transcript = await running.run_session(SYNTHETIC)
    assert transcript.terminal[-1]["type"] == "session.done"
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    assert recorder.dropped == 1
    assert "cannot write it" in caplog.text


def test_closing_the_recorder_writes_a_session_that_never_ended(tmp_path: Path) -> None:
    """The server was cancelled before the session could end (a second Ctrl-C): what was
    recorded is still written, as ``unfinished``."""
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    start = protocol.parse_start(json.dumps(SYNTHETIC))
    [tap] = recorder("video_stream-x", start).taps
    tap.started(protocol.VideoStart("video_stream-x", "m4s", start.config), start)
    assert recorder.close(timeout=10)
    record = read_record(tmp_path, "video_stream-x")
    assert (record["outcome"], record["terminal"], record["file"]) == ("unfinished", None, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["video_stream-x.json"]


def test_an_interaction_refused_at_its_hand_over_is_recorded_as_refused(tmp_path: Path) -> None:
    """A paced camera session reports an interaction queued, then refused when its chunk
    starts: the recording's entry ends refused, with when and why, as the client was told."""
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    start = protocol.parse_start(json.dumps(SYNTHETIC))
    [tap] = recorder("video_stream-r", start).taps
    tap.started(protocol.VideoStart("video_stream-r", "m4s", start.config), start)
    for event_id in ("kept", "refused"):
        tap.interaction(event_id, protocol.parse_control(interaction(event_id, "a")), None)
    error = protocol.Error(
        protocol.ErrorCode.INTERACTION_FAILED, "Failed to apply interaction: no", "r", "refused"
    )
    tap.interaction_refused("refused", error)
    tap.ended("completed", None)
    assert recorder.close(timeout=10)
    kept, refused = read_record(tmp_path, "video_stream-r")["interactions"]
    assert (kept["event_id"], kept["accepted"], kept["error"]) == ("kept", True, None)
    assert "refused_t" not in kept
    assert (refused["event_id"], refused["accepted"]) == ("refused", False)
    assert refused["error"] == {"code": "interaction_failed", "message": error.message}
    assert refused["refused_t"] >= refused["t"]


def test_an_unusable_record_directory_is_a_usage_error(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")
    status = cli.main(["serve", "--engine", "synthetic", "--record", str(blocker / "dir")])
    assert status == 2
    assert capsys.readouterr().err == f"error: --record {blocker / 'dir'}: Not a directory\n"
