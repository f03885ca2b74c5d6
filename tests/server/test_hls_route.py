"""A watch link's Low-Latency HLS playlist, through a real server: ``video.start`` names it
(``hls_path``), plain GETs serve the playlist, the init segment, the parts and the
segments, byte for byte the owner's chunks; FFmpeg's HLS demuxer decodes every frame; a
blocking reload waits for the next part; the same access as the watch link, and the
same relay to the owning node in a fleet."""

from __future__ import annotations

import json
from typing import Any

import av
import m3u8
import pytest
import trio

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.security.raw_http import Response, request
from trio_vstream.cli import build_parser
from trio_vstream.engines import EngineConfigError
from trio_vstream.engines.interfaces import max_chunk_frames
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.outputs.hls import FIRST_MSN, HlsSettings
from trio_vstream.outputs.watch import HLS_MARKER, WatchConfig
from trio_vstream.server.access import AccessPolicy
from trio_vstream.server.fleet import FleetConfig

# 32 frames at 8 fps in chunks of 4 (0.5 s): parts of 0.5 s in segments of at most 1 s.
START = {"type": "session.start", "prompt": "a cat", "size": "64x48", "fps": 8, "num_frames": 32}
CHUNKS = SyntheticSettings(chunk_frames=4, steps=1, step_delay=0.01)
HLS = WatchConfig(hls=HlsSettings(segment_seconds=1.0))


async def get(port: int, path: str, *headers: tuple[str, str]) -> Response:
    return await request(port, path, [("Host", f"127.0.0.1:{port}"), *headers])


def media_chunks(transcript: Transcript, init: bytes) -> list[bytes]:
    """The owner's media chunks, the first without the init segment in front."""
    kinds = [m["kind"] for m in transcript.of_type("video.chunk_metadata")]
    binaries = [m for m in transcript.messages if isinstance(m, bytes)]
    chunks = [data for kind, data in zip(kinds, binaries, strict=True) if kind == "media"]
    assert chunks[0].startswith(init)
    return [chunks[0][len(init) :], *chunks[1:]]


async def test_the_playlist_serves_the_owners_own_chunks_and_ffmpeg_plays_them(
    start_server: Any,
) -> None:
    running = await start_server(CHUNKS, watch=HLS)
    port = running.server.port
    owner = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        hls_path = video_start["hls_path"]
        assert hls_path == f"{video_start['watch_path']}{HLS_MARKER}index.m3u8"
        # A blocking reload for the first part waits for it, then lists it.
        first = await get(port, f"{hls_path}?_HLS_msn={FIRST_MSN}&_HLS_part=0")
        assert first.status == 200, first.body
        assert first.headers["content-type"].startswith("application/vnd.apple.mpegurl")
        listed = m3u8.loads(first.body.decode())
        assert listed.segments[0].parts[0].uri == f"part/{FIRST_MSN}.0.m4s"
        await receive_into(ws, owner)
    assert owner.json[-1]["type"] == "session.done"
    final = await get(port, hls_path)
    assert final.status == 200
    playlist = m3u8.loads(final.body.decode())
    assert playlist.is_endlist
    base = hls_path.rsplit("/", 1)[0]
    init = await get(port, f"{base}/{playlist.segment_map[0].uri}")
    assert init.status == 200 and "immutable" in init.headers["cache-control"]
    # Every segment is the owner's chunks, and every part listed one of them, byte for
    # byte (parts are listed for the last few segments only).
    chunks = media_chunks(owner, init.body)
    segments = [(await get(port, f"{base}/{segment.uri}")).body for segment in playlist.segments]
    assert b"".join(segments) == b"".join(chunks)
    parts = [part for segment in playlist.segments for part in segment.parts]
    assert parts
    served = [(await get(port, f"{base}/{part.uri}")).body for part in parts]
    assert served == chunks[-len(parts) :]
    # The playlist's durations are the chunks' frames at 8 fps, exactly.
    assert sum(segment.duration for segment in playlist.segments) == START["num_frames"] / 8
    # FFmpeg's HLS demuxer, through PyAV, decodes every frame.
    url = f"http://127.0.0.1:{port}{hls_path}"

    def decode() -> int:
        with av.open(url) as container:
            return sum(1 for _ in container.decode(video=0))

    assert await trio.to_thread.run_sync(decode) == START["num_frames"]


async def test_an_unknown_link_and_a_hostile_resource_get_404(start_server: Any) -> None:
    running = await start_server(CHUNKS, watch=HLS)
    port = running.server.port
    session = await running.run_session(START)
    base = session.json[0]["hls_path"].rsplit("/", 1)[0]
    unknown = await get(port, f"/v1/realtime/video/watch/{'t' * 43}{HLS_MARKER}index.m3u8")
    assert unknown.status == 404
    assert json.loads(unknown.body)["code"] == "watch_not_found"
    for hostile in ["../index.m3u8", "part/../../x", "seg/-1.m4s", "init.mp4/..", "%2e%2e"]:
        answer = await get(port, f"{base}/{hostile}")
        assert answer.status in (400, 404), (hostile, answer.status)
    repeated = await get(port, f"{base}/index.m3u8?_HLS_msn=0&_HLS_msn=1")
    assert repeated.status == 400
    crowded = await get(port, f"{base}/index.m3u8?" + "&".join(f"f{n}=1" for n in range(50)))
    assert crowded.status == 400
    # The watch link itself is still a WebSocket endpoint to a plain GET.
    plain = await get(port, session.json[0]["watch_path"])
    assert plain.status == 426


async def test_a_playlist_goes_when_its_linger_is_over(start_server: Any) -> None:
    running = await start_server(CHUNKS, watch=WatchConfig(hls=HlsSettings(linger=0.0)))
    session = await running.run_session(START)
    gone = await get(running.server.port, session.json[0]["hls_path"])
    assert gone.status == 404


async def test_no_playlist_when_hls_is_off(start_server: Any) -> None:
    running = await start_server(CHUNKS, watch=WatchConfig(hls=None))
    session = await running.run_session(START)
    assert "hls_path" not in session.json[0]
    assert "watch_path" in session.json[0]


async def test_a_link_that_needs_a_key_is_kept_out_of_shared_caches(start_server: Any) -> None:
    keys = AccessPolicy(api_keys=("secret",))
    running = await start_server(
        CHUNKS, access=keys, watch=WatchConfig(requires_key=True, hls=HlsSettings())
    )
    port = running.server.port
    bearer = ("Authorization", "Bearer secret")
    session = await running.run_session(START, extra_headers=[bearer])
    hls_path = session.json[0]["hls_path"]
    assert (await get(port, hls_path)).status == 401
    answer = await get(port, hls_path, bearer)
    assert answer.status == 200
    assert "public" not in answer.headers["cache-control"]
    assert "private" in answer.headers["cache-control"]


async def test_a_playlist_on_another_node_is_relayed_from_its_owner(start_server: Any) -> None:
    owner = await start_server(CHUNKS, watch=HLS, fleet=FleetConfig(node_name="a"))
    relay = await start_server(
        CHUNKS,
        watch=HLS,
        fleet=FleetConfig(node_name="b", peers={"a": ("127.0.0.1", owner.server.port)}),
    )
    session = await owner.run_session(START)
    hls_path = session.json[0]["hls_path"]
    assert hls_path.startswith("/v1/realtime/video/watch/a/")
    direct = await get(owner.server.port, hls_path)
    relayed = await get(relay.server.port, hls_path)
    assert relayed.status == direct.status == 200
    assert relayed.body == direct.body
    assert relayed.headers["cache-control"] == direct.headers["cache-control"]
    playlist = m3u8.loads(direct.body.decode())
    base = hls_path.rsplit("/", 1)[0]
    part = playlist.segments[-1].parts[0].uri
    assert (await get(relay.server.port, f"{base}/{part}")).body == (
        await get(owner.server.port, f"{base}/{part}")
    ).body
    # A node nobody knows: the same 404 as an unknown link, at once.
    unknown = await get(relay.server.port, hls_path.replace("/watch/a/", "/watch/zz/"))
    assert unknown.status == 404


def test_the_command_line_sets_or_turns_off_the_playlists() -> None:
    parser = build_parser()
    on = parser.parse_args(["serve", "--hls-segment-seconds", "4", "--hls-linger", "0"])
    assert (on.hls, on.hls_segment_seconds, on.hls_linger) == (True, 4.0, 0.0)
    assert parser.parse_args(["serve", "--no-hls"]).hls is False
    for bad in (
        ["--hls-segment-seconds", "0"],
        ["--hls-linger", "-1"],
        ["--hls-part-seconds", "inf"],
    ):
        with pytest.raises(SystemExit):
            parser.parse_args(["serve", *bad])


async def test_the_part_target_is_the_engines_longest_chunk(start_server: Any) -> None:
    # 4 frames at 8 fps: the engine's chunks are 0.5 s, so no part may be longer.
    running = await start_server(CHUNKS, watch=HLS)
    session = await running.run_session(START)
    body = (await get(running.server.port, session.json[0]["hls_path"])).body.decode()
    assert "#EXT-X-PART-INF:PART-TARGET=0.5" in body
    assert "PART-HOLD-BACK=1.5" in body


def test_an_engine_that_says_a_bad_longest_chunk_fails_at_start() -> None:
    for bad in (0, -3, 2.5, True, "8"):
        odd = SyntheticEngine()
        odd.max_chunk_frames = bad  # type: ignore[assignment]
        with pytest.raises(EngineConfigError, match="max_chunk_frames"):
            max_chunk_frames(odd)
    assert max_chunk_frames(SyntheticEngine(SyntheticSettings(chunk_frames=6))) == 6
