"""``/v1/recordings/<request_id>/<file>`` names files by a client's text: nothing outside the
recordings directory is ever read, and only the recording's own HLS is served.

The request id must be one the server makes (``video_stream-`` and 32 lowercase hex
digits), the file one of ``index.m3u8``, ``init.mp4``, ``<n>.m4s``, both checked before the
disk is touched; then each name is opened without following links. Every refusal is the
same 404. And recordings are private: with admin keys, only an admin key fetches them;
with API keys alone, an API key.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
import trio

from tests.outputs.test_recording_hls import MUTE, decode, get, path_of, record
from tests.security.raw_http import request
from trio_vstream.outputs.recording import Recorder
from trio_vstream.outputs.recording_hls import NOT_FOUND
from trio_vstream.server.access import AccessPolicy

KEY = "client-key_0123456789"
ADMIN = "operator-key_0123456789"
OTHER = "video_stream-" + "ab" * 16
SECRET = b"SECRET: a file outside the recordings directory\n"


@pytest.fixture
async def recorded(start_server: Any, tmp_path: Path) -> tuple[Any, Path, str]:
    """A server recording into ``tmp_path/rec``, one session recorded, and a secret file
    beside the directory."""
    directory = tmp_path / "rec"
    recorder = Recorder(directory, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder)
    request_id = await record(running, recorder)
    (tmp_path / "secret.txt").write_bytes(SECRET)
    return running, directory, request_id


async def test_traversal_and_other_names_are_404(recorded: tuple[Any, Path, str]) -> None:
    running, directory, request_id = recorded
    port = running.server.port
    # Whole recordings under names the server never makes: not served either.
    upper = "video_stream-" + "AB" * 16
    for name in ("other", upper, f"{request_id}.x", f".{request_id}"):
        for suffix in (".mp4", ".json"):
            (directory / f"{name}{suffix}").write_bytes(
                (directory / f"{request_id}{suffix}").read_bytes()
            )
    hostile = [
        "/v1/recordings/other/index.m3u8",
        f"/v1/recordings/{upper}/index.m3u8",
        f"/v1/recordings/{request_id}.x/index.m3u8",
        f"/v1/recordings/.{request_id}/index.m3u8",
        "/v1/recordings/../secret.txt",
        "/v1/recordings/../../etc/passwd",
        f"/v1/recordings/{request_id}/../../secret.txt",
        f"/v1/recordings/{request_id}/../{request_id}.json",
        f"/v1/recordings/{request_id}/%2e%2e/%2e%2e/secret.txt",
        f"/v1/recordings/{request_id}/..%2f..%2fsecret.txt",
        f"/v1/recordings/{request_id}%2f..%2f..%2fsecret.txt/index.m3u8",
        "/v1/recordings/%2e%2e/index.m3u8",
        "/v1/recordings/..%2fsecret.txt/index.m3u8",
        f"/v1/recordings/{request_id}/index.m3u8/../../../secret.txt",
        f"/v1/recordings/{request_id}//index.m3u8",
        f"/v1/recordings/{request_id}/index.m3u8/",
        f"/v1/recordings/{request_id}/index.m3u8%00",
        f"/v1/recordings/{request_id}/",
        f"/v1/recordings/{request_id}",
        f"/v1/recordings/{request_id}.json",
        f"/v1/recordings/{request_id}/{request_id}.mp4",
        f"/v1/recordings/{request_id}/{request_id}.json",
        f"/v1/recordings/{request_id}/fragmented.mp4",
        f"/v1/recordings/{request_id}/INDEX.M3U8",
        f"/v1/recordings/{request_id}/index.m3u",
        f"/v1/recordings/{request_id}/01.m4s",
        f"/v1/recordings/{request_id}/-1.m4s",
        f"/v1/recordings/{request_id}/.m4s",
        f"/v1/recordings/{request_id}/0.m4s.part",
        f"/v1/recordings/{request_id}/{'9' * 40}.m4s",
        f"/v1/recordings/{request_id.upper()}/index.m3u8",
        f"/v1/recordings/{request_id}0/index.m3u8",
        f"/v1/recordings/{request_id[:-1]}/index.m3u8",
        f"/v1/recordings/.{request_id}.hls/index.m3u8",
        f"/v1/recordings/{request_id}.hls/index.m3u8",
        "/v1/recordings/video_stream-/index.m3u8",
        "/v1/recordings/%76ideo_stream-" + "0" * 32 + "/index.m3u8",
        "/v1/recordings/" + "a" * 20000 + "/index.m3u8",
        f"/v1/recordings/{request_id}/" + "1" * 20000 + ".m4s",
    ]
    for path in hostile:
        answer = await get(port, path)
        assert (answer.status, answer.body) == (404, NOT_FOUND.body.encode()), path[:120]
        assert b"SECRET" not in answer.body
    # The real one is served, and nothing was converted but it.
    assert (await get(port, path_of(request_id))).status == 200
    assert [p.name for p in directory.iterdir() if p.suffix == ".hls"] == [f"{request_id}.hls"]
    assert running.server.recordings.conversions == 1


async def test_links_planted_in_the_directory_are_never_followed(
    recorded: tuple[Any, Path, str],
) -> None:
    running, directory, request_id = recorded
    port = running.server.port
    outside = directory.parent
    # A whole recording outside, and links to it under a name the server could have made.
    (outside / "out.mp4").write_bytes((directory / f"{request_id}.mp4").read_bytes())
    (outside / "out.json").write_bytes((directory / f"{request_id}.json").read_bytes())
    linked_video = "video_stream-" + "1" * 32
    (directory / f"{linked_video}.mp4").symlink_to(outside / "out.mp4")
    (directory / f"{linked_video}.json").write_text("{}")
    linked_both = "video_stream-" + "2" * 32
    (directory / f"{linked_both}.mp4").symlink_to(outside / "out.mp4")
    (directory / f"{linked_both}.json").symlink_to(outside / "out.json")
    # An HLS folder that is a link to one outside, with a playlist that is the secret.
    hls_outside = outside / "hls"
    hls_outside.mkdir()
    for name in ("index.m3u8", "init.mp4", "0.m4s"):
        (hls_outside / name).write_bytes(SECRET)
    linked_folder = "video_stream-" + "3" * 32
    (directory / f"{linked_folder}.hls").symlink_to(hls_outside, target_is_directory=True)
    # A real recording's HLS folder with files that are links to the secret.
    assert (await get(port, path_of(request_id))).status == 200
    hls = directory / f"{request_id}.hls"
    (hls / "index.m3u8").unlink()
    (hls / "index.m3u8").symlink_to(outside / "secret.txt")
    (hls / "7.m4s").symlink_to(outside / "secret.txt")
    (hls / "8.m4s").symlink_to("../../secret.txt")
    # A FIFO would block a plain open for good.
    fifo = "video_stream-" + "4" * 32
    os.mkfifo(directory / f"{fifo}.mp4")
    (directory / f"{fifo}.json").write_text("{}")
    os.mkfifo(hls / "9.m4s")

    for target in (linked_video, linked_both, linked_folder, fifo):
        for name in ("index.m3u8", "init.mp4", "0.m4s"):
            with trio.fail_after(10):
                answer = await get(port, path_of(target, name))
            assert (answer.status, answer.body) == (404, NOT_FOUND.body.encode()), (target, name)
    for name in ("index.m3u8", "7.m4s", "8.m4s", "9.m4s"):
        with trio.fail_after(10):
            answer = await get(port, path_of(request_id, name))
        assert (answer.status, answer.body) == (404, NOT_FOUND.body.encode()), name
    assert (await get(port, path_of(request_id, "init.mp4"))).status == 200
    # Nothing was converted from outside.
    assert not any(
        p.name.startswith((linked_video, linked_both)) and p.suffix == ".hls"
        for p in directory.iterdir()
    )
    assert running.server.recordings.conversions == 1


def headers(port: int, key: str | None) -> list[tuple[str, str]]:
    host = [("Host", f"127.0.0.1:{port}")]
    return host if key is None else [*host, ("Authorization", f"Bearer {key}")]


async def recorded_with_keys(
    start_server: Any, directory: Path, policy: AccessPolicy
) -> tuple[Any, str]:
    recorder = Recorder(directory, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder, access=policy)
    transcript = await running.run_session(
        {"type": "session.start", "prompt": "x", "size": "32x32", "fps": 8, "num_frames": 8},
        extra_headers=[("Authorization", f"Bearer {KEY}")],
    )
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    return running, transcript.messages[0]["request_id"]


async def test_with_admin_keys_only_an_admin_key_fetches_a_recording(
    start_server: Any, tmp_path: Path
) -> None:
    running, request_id = await recorded_with_keys(
        start_server, tmp_path, AccessPolicy(api_keys=(KEY,), admin_keys=(ADMIN,))
    )
    port = running.server.port
    for name in ("index.m3u8", "init.mp4", "0.m4s"):
        statuses = {
            key: (await request(port, path_of(request_id, name), headers(port, key))).status
            for key in (None, KEY, ADMIN, "wrong-key-0123456789")
        }
        assert statuses == {None: 401, KEY: 403, ADMIN: 200, "wrong-key-0123456789": 401}
    # Refused before anything is looked up: a missing recording is refused the same way.
    missing = path_of("video_stream-" + "0" * 32)
    assert (await request(port, missing, headers(port, KEY))).status == 403
    # A player carries the key on every request (ffplay -headers, hls.js xhrSetup).
    url = f"http://127.0.0.1:{port}{path_of(request_id)}"
    frames, _ = await trio.to_thread.run_sync(
        lambda: decode(url, headers=f"Authorization: Bearer {ADMIN}\r\n")
    )
    assert len(frames) == 8


async def test_with_api_keys_alone_an_api_key_fetches_a_recording(
    start_server: Any, tmp_path: Path
) -> None:
    running, request_id = await recorded_with_keys(
        start_server, tmp_path, AccessPolicy(api_keys=(KEY,))
    )
    port = running.server.port
    statuses = {
        key: (await request(port, path_of(request_id), headers(port, key))).status
        for key in (None, KEY, "wrong-key-0123456789")
    }
    assert statuses == {None: 401, KEY: 200, "wrong-key-0123456789": 401}
