"""``python -m trio_vstream replay`` (issue 16): a recorded session, replayed against a
fresh server, gives identical frames with its interactions at the recorded chunks; what
cannot be replayed says why, and exits with the documented status."""

from __future__ import annotations

import base64
import hashlib
import json
import os
import re
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import trio

from tests.conftest import decode_video
from tests.outputs.test_recording import (
    PNG,
    SLOW,
    SYNTHETIC,
    record_shapes_session,
    shapes,  # noqa: F401 - the module's engine fixture
    start_shapes_server,
)
from trio_vstream import cli
from trio_vstream.client import (
    API_KEY_ENV,
    EXIT_MISMATCH,
    ReplayError,
    load_recording,
    replay,
)
from trio_vstream.engines.shapes import ShapesEngine
from trio_vstream.outputs.recording import Recorder

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.slow
async def test_a_replay_gives_identical_frames_at_the_same_chunks(
    nursery: trio.Nursery,
    shapes: ShapesEngine,  # noqa: F811 - the fixture imported above
    tmp_path: Path,
) -> None:
    transcript, _ = await record_shapes_session(nursery, shapes, tmp_path / "first")
    request_id = transcript.messages[0]["request_id"]
    recording = tmp_path / "first" / f"{request_id}.json"
    plan = load_recording(recording)
    record = json.loads(recording.read_text())
    assert plan.expected_chunks == {
        entry["event_id"]: entry["started_chunk"] for entry in record["interactions"]
    }
    assert len(plan.expected_chunks) == 2
    script = plan.start_fields["extra_params"]["interaction_script"]
    assert [entry["chunk_index"] for entry in script] == list(plan.expected_chunks.values())

    # A fresh server, itself recording: the replay's own recording says the same.
    again = Recorder(tmp_path / "again", engine="shapes", model="shapes")
    server = await start_shapes_server(nursery, shapes, again)
    report = await replay(plan, server.url)
    assert report.mismatches == []
    assert report.started == plan.expected_chunks
    assert report.frames_compared == 24
    original = decode_video(transcript.video_bytes)
    replayed = decode_video(report.result.video)
    assert original.shape == replayed.shape == (24, 64, 64, 3)
    assert np.array_equal(original, replayed)

    # The same request without its interactions is another video: the check can fail.
    bare = load_recording(recording)
    bare.start_fields["extra_params"].pop("interaction_script")
    differing = await replay(bare, server.url)
    assert any("started never" in m for m in differing.mismatches)
    assert any("frame" in m and "differs" in m for m in differing.mismatches)

    # A recording of a replay replays too: its script comes back as interactions.
    assert await trio.to_thread.run_sync(again.wait_idle, 30)
    rerecorded = tmp_path / "again" / f"{report.result.request_id}.json"
    entries = json.loads(rerecorded.read_text())["interactions"]
    assert [(e["event_id"], e["source"], e["started_chunk"]) for e in entries] == [
        (event_id, "script", chunk) for event_id, chunk in plan.expected_chunks.items()
    ]
    assert load_recording(rerecorded).start_fields == plan.start_fields
    server.shutdown()


async def test_a_stopped_recording_replays_up_to_its_frames(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    async with running.connect() as ws:
        await ws.send_message(json.dumps(SYNTHETIC))
        while not isinstance(await ws.get_message(), bytes):
            pass
        await ws.send_message(json.dumps({"type": "session.stop"}))
        while True:
            message = await ws.get_message()
            if isinstance(message, str) and json.loads(message)["type"] == "session.done":
                break
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    [recording] = tmp_path.glob("*.json")
    plan = load_recording(recording)
    assert not plan.complete and plan.recorded_frames == 4
    report = await replay(plan, running.url)
    assert report.mismatches == []
    assert report.frames_compared == 4
    assert report.result.done is not None and report.result.done.stopped


def test_an_inline_image_comes_back_from_its_file(tmp_path: Path) -> None:
    record = minimal_record(
        image={
            "source": "inline",
            "file": "x.image.png",
            "mime_type": "image/png",
            "bytes": len(PNG),
            "sha256": hashlib.sha256(PNG).hexdigest(),
        }
    )
    (tmp_path / "x.image.png").write_bytes(PNG)
    path = write(tmp_path, record)
    plan = load_recording(path)
    url = plan.start_fields["image_reference"]["image_url"]
    assert url.startswith("data:image/png;base64,")
    assert base64.b64decode(url.partition(",")[2]) == PNG
    (tmp_path / "x.image.png").write_bytes(PNG + b"!")
    with pytest.raises(ReplayError, match="SHA-256 differs"):
        load_recording(path)


def minimal_record(**fields: Any) -> dict[str, Any]:
    return {
        "format": "trio_vstream.recording",
        "version": 1,
        "request_id": "video_stream-x",
        "request": {"prompt": "a red circle", "size": "64x48", "num_frames": 8},
        "seed": 3,
        "interactions": [],
        "chunks": [],
        "outcome": "completed",
        **fields,
    }


def write(tmp_path: Path, record: Any, name: str = "x.json") -> Path:
    path = tmp_path / name
    path.write_text(record if isinstance(record, str) else json.dumps(record))
    return path


@pytest.mark.parametrize(
    ("content", "message"),
    [
        (None, "cannot read .*missing.json: No such file or directory"),
        ("{not json", "is not a recording: invalid JSON"),
        ({"prompt": "x"}, 'is not a recording: no "format": "trio_vstream.recording"'),
        (minimal_record(version=3), "recording version 3; this trio_vstream reads versions 1 and"),
        (minimal_record(version=True), "recording version True; this trio_vstream reads versions"),
        (minimal_record(request=None), "request is missing or not an object"),
        (
            minimal_record(image={"source": "url", "url": "https://images.test/a.png"}),
            "was a URL .*https://images.test/a.png.*pass the image with --image FILE",
        ),
    ],
)
def test_unreplayable_recordings_are_usage_errors_that_say_why(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], content: Any, message: str
) -> None:
    path = tmp_path / "missing.json" if content is None else write(tmp_path, content)
    status = cli.main(["replay", str(path), "--url", "ws://127.0.0.1:9/v1/realtime/video"])
    assert status == 2
    error = capsys.readouterr().err
    assert error.startswith("python -m trio_vstream replay: error: ")
    assert re.search(message, error), error


async def run_replay_process(tmp_path: Path, *args: str) -> tuple[int, str, str]:
    """``python -m trio_vstream replay ARGS`` in a subprocess, as a user runs it."""
    environment = {k: v for k, v in os.environ.items() if k != API_KEY_ENV}
    with trio.fail_after(30):
        done = await trio.run_process(
            [sys.executable, "-m", "trio_vstream", "replay", *args],
            capture_stdout=True,
            capture_stderr=True,
            check=False,
            cwd=REPO,
            env=environment,
        )
    return done.returncode, done.stdout.decode(), done.stderr.decode()


@pytest.mark.slow
async def test_the_command_replays_writes_and_reports(start_server: Any, tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SLOW, taps=recorder)
    transcript = await running.run_session(SYNTHETIC)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    recording = tmp_path / f"{transcript.messages[0]['request_id']}.json"
    output = tmp_path / "replay.mp4"
    status, out, err = await run_replay_process(
        tmp_path, str(recording), "--url", running.url, "-o", str(output)
    )
    assert (status, err) == (0, "")
    assert "completed, 16 frames" in out
    assert "frames compared with the recording: 16" in out
    assert np.array_equal(decode_video(output.read_bytes()), decode_video(transcript.video_bytes))

    # A recording whose frames differ from what the server makes now: exit 5, and why.
    record = json.loads(recording.read_text())
    record["request"]["prompt"] = "a blue circle"
    changed = write(tmp_path, record, recording.name.replace(".json", "-b.json"))
    changed.with_suffix(".mp4").write_bytes(recording.with_suffix(".mp4").read_bytes())
    record["file"]["name"] = recording.with_suffix(".mp4").name
    changed.write_text(json.dumps(record))
    status, out, err = await run_replay_process(tmp_path, str(changed), "--url", running.url)
    assert status == EXIT_MISMATCH
    assert "differs: frame 0 differs from the recording's" in err


async def test_a_server_that_refuses_the_replay_exits_1(start_server: Any, tmp_path: Path) -> None:
    running = await start_server(SLOW)
    path = write(tmp_path, minimal_record(request={"prompt": "x", "model": "another"}))
    status, out, err = await run_replay_process(tmp_path, str(path), "--url", running.url)
    assert status == 1
    assert err.startswith("error: the server refused the replay: model_mismatch: ")
    assert out == ""


@pytest.mark.parametrize(
    ("fields", "complete"),
    [
        ({"version": 1}, True),  # before "truncated" existed: never truncated
        ({"version": 2, "truncated": False}, True),
        ({"version": 2, "truncated": True}, False),
        ({"version": 2, "truncated": True, "outcome": "stopped"}, False),
    ],
)
def test_both_recording_versions_are_read_and_a_truncated_one_is_incomplete(
    tmp_path: Path, fields: dict[str, Any], complete: bool
) -> None:
    plan = load_recording(write(tmp_path, minimal_record(**fields)))
    assert plan.complete is complete
