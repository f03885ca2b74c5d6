"""Recordings play as HLS (VOD): ``GET /v1/recordings/<request_id>/index.m3u8`` on a server
started with ``--record``, its init segment and segments converted once from the
recording's MP4, packets copied; FFmpeg's HLS demuxer decodes them to the recording's
very frames and sound."""

from __future__ import annotations

import json
from fractions import Fraction
from pathlib import Path
from typing import Any

import av
import m3u8
import numpy as np
import pytest
import trio

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.security.raw_http import Response, request
from tests.security.test_security_headers import assert_secured
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.media.remux import Fragment
from trio_vstream.outputs.recording import Recorder
from trio_vstream.outputs.recording_hls import (
    CACHE_CONTROL,
    REQUEST_ID,
    group_segments,
    playlist,
)

# 20 frames at 8 fps in chunks of 4: five fragments of 0.5 s, in segments of 2 s and 0.5 s.
START = {"type": "session.start", "prompt": "a tone", "size": "64x48", "fps": 8, "num_frames": 20}
SOUND = SyntheticSettings(chunk_frames=4, audio_tone=440.0, audio_sample_rate=48000)
MUTE = SyntheticSettings(chunk_frames=4)


def path_of(request_id: str, name: str = "index.m3u8") -> str:
    return f"/v1/recordings/{request_id}/{name}"


async def get(port: int, path: str, *headers: tuple[str, str]) -> Response:
    return await request(port, path, [("Host", f"127.0.0.1:{port}"), *headers])


async def record(running: Any, recorder: Recorder, start: dict[str, Any] = START) -> str:
    """One session, recorded whole; its request id."""
    transcript = await running.run_session(start)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    request_id: str = transcript.messages[0]["request_id"]
    return request_id


def decode(source: str, **options: str) -> tuple[np.ndarray, np.ndarray | None]:
    """Every video frame (RGB) and all the sound (PCM) of a file or URL, as FFmpeg plays it."""
    with av.open(source, options=options) as container:
        frames, sound = [], []
        streams = [container.streams.video[0], *container.streams.audio[:1]]
        for packet in container.demux(streams):
            for frame in packet.decode():
                if isinstance(frame, av.VideoFrame):
                    frames.append(frame.to_ndarray(format="rgb24"))
                elif isinstance(frame, av.AudioFrame):
                    sound.append(frame.to_ndarray())
    return np.stack(frames), np.concatenate(sound, axis=1) if sound else None


async def test_a_recording_plays_as_hls_with_its_frames_and_sound(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SOUND, taps=recorder)
    port = running.server.port
    request_id = await record(running, recorder)
    assert REQUEST_ID.fullmatch(request_id)  # the allow-list takes the server's own ids

    answer = await get(port, path_of(request_id))
    assert answer.status == 200, answer
    assert answer.headers["content-type"] == "application/vnd.apple.mpegurl"
    assert answer.headers["cache-control"] == CACHE_CONTROL
    assert_secured(answer, "the playlist")
    document = m3u8.loads(answer.body.decode())
    assert document.playlist_type == "vod" and document.is_endlist
    assert document.version == 7 and document.is_independent_segments
    assert [s.uri for s in document.segments] == ["0.m4s", "1.m4s"]
    assert all(s.init_section.uri == "init.mp4" for s in document.segments)
    durations = [Fraction(str(s.duration)) for s in document.segments]
    assert durations == [2, Fraction(1, 2)]
    assert sum(durations) == Fraction(20, 8)  # the session's frames at its fps
    assert document.target_duration == 2
    assert '#EXT-X-MAP:URI="init.mp4"' in answer.body.decode()

    init = await get(port, path_of(request_id, "init.mp4"))
    assert init.status == 200 and init.headers["content-type"] == "video/mp4"
    assert b"moov" in init.body and b"mp4a" in init.body and b"moof" not in init.body
    assert init.headers["cache-control"] == CACHE_CONTROL and init.headers["etag"]
    first = await get(port, path_of(request_id, "0.m4s"))
    assert first.status == 200 and first.body.count(b"moof") == 4  # four chunks in 2 s
    assert (await get(port, path_of(request_id, "2.m4s"))).status == 404

    # FFmpeg's HLS demuxer, over HTTP from this very server: the recording's frames and
    # sound, exactly (nothing was re-encoded).
    url = f"http://127.0.0.1:{port}{path_of(request_id)}"
    frames, sound = await trio.to_thread.run_sync(decode, url)
    mp4 = str(tmp_path / f"{request_id}.mp4")
    recorded_frames, recorded_sound = decode(mp4)
    assert frames.shape == (20, 48, 64, 3)
    assert np.array_equal(frames, recorded_frames)
    assert sound is not None and recorded_sound is not None
    assert sound.shape == recorded_sound.shape and sound.shape[1] >= 20 * 48000 // 8
    assert np.array_equal(sound, recorded_sound)

    # Converted once, kept beside the recording; a revalidation costs nothing.
    assert running.server.recordings.conversions == 1
    assert sorted(p.name for p in (tmp_path / f"{request_id}.hls").iterdir()) == [
        "0.m4s",
        "1.m4s",
        "index.m3u8",
        "init.mp4",
    ]
    again = await get(
        port, path_of(request_id, "init.mp4"), ("If-None-Match", init.headers["etag"])
    )
    assert (again.status, again.body, again.headers["etag"]) == (304, b"", init.headers["etag"])
    assert "content-length" not in again.headers
    assert again.headers["cache-control"] == CACHE_CONTROL
    assert_secured(again, "a 304")
    assert running.server.recordings.conversions == 1


async def test_concurrent_first_requests_convert_once(start_server: Any, tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder)
    port = running.server.port
    request_id = await record(running, recorder)
    answers: list[Response] = []

    async def fetch(name: str) -> None:
        answers.append(await get(port, path_of(request_id, name)))

    async with trio.open_nursery() as nursery:
        for name in ("index.m3u8", "init.mp4", "0.m4s", "1.m4s") * 2:
            nursery.start_soon(fetch, name)
    assert [a.status for a in answers] == [200] * 8
    assert running.server.recordings.conversions == 1
    # Nothing else left in the directory: no second folder, no temporary one.
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{request_id}.hls",
        f"{request_id}.json",
        f"{request_id}.mp4",
    ]


async def test_a_recording_being_written_is_409_then_plays(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(SyntheticSettings(chunk_frames=4, hang_at_chunk=2), taps=recorder)
    port = running.server.port
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 40}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        request_id = transcript.messages[0]["request_id"]
        busy = await get(port, path_of(request_id))
        assert busy.status == 409, busy
        assert busy.body.startswith(b"recording_in_progress:")
        assert "immutable" not in busy.headers["cache-control"]
        assert_secured(busy, "a 409")
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    assert await trio.to_thread.run_sync(recorder.wait_idle, 10)
    answer = await get(port, path_of(request_id))
    assert answer.status == 200, answer
    # As many frames as were sent before the stop, and recorded.
    frames = json.loads((tmp_path / f"{request_id}.json").read_text())["file"]["frames"]
    assert frames in (4, 8)
    durations = [Fraction(str(s.duration)) for s in m3u8.loads(answer.body.decode()).segments]
    assert sum(durations) == Fraction(frames, 8)


async def test_a_recording_without_video_and_an_unknown_one_are_404(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder)
    port = running.server.port
    request_id = await record(running, recorder, {**START, "extra_params": {"fail_at_chunk": 0}})
    assert not (tmp_path / f"{request_id}.mp4").exists()  # its JSON only
    empty = await get(port, path_of(request_id))
    assert (empty.status, empty.body) == (
        404,
        b"recording_not_found: this recording holds no video\n",
    )
    unknown = await get(port, path_of("video_stream-" + "0" * 32))
    assert unknown.status == 404 and unknown.body.startswith(b"recording_not_found:")
    assert running.server.recordings.conversions == 0


async def test_a_recording_over_the_cap_is_refused(start_server: Any, tmp_path: Path) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder)
    request_id = await record(running, recorder)
    running.server.recordings.max_bytes = 1000
    answer = await get(running.server.port, path_of(request_id))
    assert answer.status == 500
    assert answer.body.startswith(b"recording_too_large:") and b"1000" in answer.body
    assert not (tmp_path / f"{request_id}.hls").exists()


async def test_a_damaged_recording_is_500_and_leaves_nothing(
    start_server: Any, tmp_path: Path
) -> None:
    recorder = Recorder(tmp_path, engine="synthetic", model="synthetic")
    running = await start_server(MUTE, taps=recorder)
    request_id = await record(running, recorder)
    (tmp_path / f"{request_id}.mp4").write_bytes(b"\0\0\0\x10damaged, not an MP4")
    answer = await get(running.server.port, path_of(request_id))
    assert answer.status == 500 and answer.body.startswith(b"recording_unreadable:"), answer
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        f"{request_id}.json",
        f"{request_id}.mp4",
    ]


async def test_a_server_without_recording_serves_none(start_server: Any) -> None:
    running = await start_server(MUTE)
    assert running.server.recordings is None
    answer = await get(running.server.port, path_of("video_stream-" + "0" * 32))
    assert (answer.status, answer.body) == (404, b"recordings are not kept here (--record)\n")


def fragment(seconds: Fraction) -> Fragment:
    return Fragment(0, 1, 1, seconds)


@pytest.mark.parametrize(
    ("durations", "grouped"),
    [
        ([Fraction(1, 2)] * 5, [4, 1]),
        ([Fraction(1, 3)] * 7, [6, 1]),
        ([Fraction(3)] * 2, [1, 1]),  # a chunk longer than a segment is one alone
        ([Fraction(1), Fraction(3), Fraction(1)], [1, 1, 1]),
        ([Fraction(2)], [1]),
    ],
)
def test_fragments_are_grouped_in_segments_of_2_seconds_at_most(
    durations: list[Fraction], grouped: list[int]
) -> None:
    segments = group_segments([fragment(d) for d in durations])
    assert [len(s) for s in segments] == grouped
    assert [f.duration for s in segments for f in s] == durations


@pytest.mark.parametrize(
    ("durations", "target", "extinf"),
    [
        ([Fraction(2), Fraction(1, 2)], 2, ["2", "0.5"]),
        ([Fraction(2, 1), Fraction(1, 3)], 2, ["2", "0.333333"]),
        ([Fraction(5, 2)], 3, ["2.5"]),  # never below a segment's duration
        ([Fraction(1, 24)], 1, ["0.041667"]),
    ],
)
def test_the_playlist_is_a_vod_media_playlist(
    durations: list[Fraction], target: int, extinf: list[str]
) -> None:
    text = playlist(durations)
    lines = text.splitlines()
    assert lines[:5] == [
        "#EXTM3U",
        "#EXT-X-VERSION:7",
        "#EXT-X-INDEPENDENT-SEGMENTS",
        f"#EXT-X-TARGETDURATION:{target}",
        "#EXT-X-PLAYLIST-TYPE:VOD",
    ]
    assert lines[5] == '#EXT-X-MAP:URI="init.mp4"'
    assert [line.removeprefix("#EXTINF:").rstrip(",") for line in lines if "EXTINF" in line] == (
        extinf
    )
    assert lines[-1] == "#EXT-X-ENDLIST"
    assert [s.uri for s in m3u8.loads(text).segments] == [f"{n}.m4s" for n in range(len(durations))]
