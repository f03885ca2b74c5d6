"""500 LL-HLS viewers of one session through nginx's cache, on this machine: real nginx,
configured by the shipped deploy/nginx.conf (rendered: addresses, paths, the cache's
directory), in front of one real server on all of its ``server`` lines.

The viewers are Trio tasks of this process (`bench._hls.HlsViewer`, which the ``hls``
benchmark runs too), each a small HTTP/1.1 client on one keep-alive connection that
follows the playlist as a low-latency player does: one plain load, then a blocking
reload for the part after its last (``_HLS_msn``/``_HLS_part``) and a GET of each new
part, until ``EXT-X-ENDLIST``. What must hold:

- every viewer gets every part, in order, none missed, and its init segment and parts
  are byte for byte what the session's owner got over its WebSocket (the same SHA-256
  for all 500); a few viewers' bytes decode, every frame;
- the server serves each part at most twice, and each blocking reload's query at most
  twice, however many viewers asked: nginx's access log says which requests reached it
  (``upstream=`` not ``-``), and the cache answered the rest;
- a WebSocket viewer of the same watch link, at the same time, still gets its video
  (the link itself stays outside the cache).

The session: the synthetic engine, 64x48 at 16 fps, 64 frames in 8-frame chunks (eight
parts of 0.5 s in two segments of 2 s), each chunk 4 steps of 0.1 s: a little faster than real
time, so that the viewers wait at the live edge, where the crowd's requests meet.
Bounded: each viewer's loop in requests, the whole crowd by a deadline.
"""

from __future__ import annotations

import re
from collections import Counter
from pathlib import Path
from typing import Final

import m3u8
import pytest
import trio

from bench._hls import (
    HlsViewer,
    KeepAliveClient,
    decoded_frames,
    open_files,
    open_files_short_of,
    origin_requests,
    parts_origin_counts,
)
from bench._nginx import NGINX_CONF, read_requests, render_nginx_conf
from tests.server.test_deploy_nginx import CONDITION, Cluster, needs_nginx, open_cluster
from trio_vstream.client import StreamOutcome, StreamResult, stream_video, watch_video
from trio_vstream.outputs.hls import FIRST_MSN, HlsSettings, HlsWindow
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig
from trio_vstream.server.app import VIDEO_PATH

VIEWERS: Final = 500
FPS: Final = 16
CHUNK_FRAMES: Final = 8
FRAMES: Final = 64
PARTS: Final = FRAMES // CHUNK_FRAMES
SERVER_ARGS: Final = (
    "--engine-arg",
    "step_delay=0.1",
    "--engine-arg",
    f"chunk_frames={CHUNK_FRAMES}",
)
"""After test_deploy_nginx's own server flags (step_delay=0.05, chunk_frames=8): the last
of a repeated ``--engine-arg`` wins."""
DECODED: Final = 3
"""Viewers whose bytes PyAV decodes (each decodes the same bytes as every other: the
digests say so)."""
MAX_REQUESTS: Final = 4 * PARTS + 20
"""A viewer's bound: a load, an init segment, and per part a reload and the part, with
room for reloads answered before a new part (a segment's end, the session's)."""
CROWD_DEADLINE: Final = 45.0
"""Seconds for the session and all its viewers (about 5 s of it on an idle machine)."""
ORIGIN_LIMIT: Final = 2


def owner_media(result: StreamResult) -> bytes:
    """The owner's media chunks, one after the other (the first begins with the init
    segment; the trailer is no part)."""
    kinds = [c.metadata.kind if c.metadata else None for c in result.chunks]
    return b"".join(
        data for kind, data in zip(kinds, result.binary_messages, strict=True) if kind == "media"
    )


async def watch_through_the_cache(
    cluster: Cluster, viewers: list[HlsViewer], websocket: list[StreamResult]
) -> StreamResult:
    """The session, its HLS viewers and one WebSocket viewer, all started at its
    ``video.start``; back once every one of them is done."""
    fields = {"prompt": "a crowd", "size": "64x48", "fps": FPS, "num_frames": FRAMES, "seed": 7}
    url = f"ws://127.0.0.1:{cluster.port}{VIDEO_PATH}?session=owner"
    async with trio.open_nursery() as nursery:

        async def watch(path: str) -> None:
            websocket.append(await watch_video(f"ws://127.0.0.1:{cluster.port}{path}"))

        def on_message(_message: object, result: StreamResult) -> None:
            start = result.video_start
            if start is None or viewers:
                return
            assert start.hls_path is not None and start.watch_path is not None, start
            for n in range(VIEWERS):
                viewer = HlsViewer(f"v{n}", "127.0.0.1", cluster.port, start.hls_path, MAX_REQUESTS)
                viewers.append(viewer)
                nursery.start_soon(viewer.run)
            nursery.start_soon(watch, start.watch_path)

        return await stream_video(url, fields, on_message=on_message)


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(120)
async def test_500_viewers_through_the_cache_cost_the_server_a_request_or_two_per_part(
    tmp_path: Path,
) -> None:
    viewers: list[HlsViewer] = []
    websocket: list[StreamResult] = []
    wanted = VIEWERS + 256  # and this process's own files
    if (short := open_files_short_of(wanted)) is not None:
        pytest.skip(short)
    with open_files(wanted):
        async with open_cluster(tmp_path, backends=1, server_args=SERVER_ARGS) as cluster:
            with trio.fail_after(CROWD_DEADLINE):
                owner = await watch_through_the_cache(cluster, viewers, websocket)
            log = read_requests(cluster.prefix / "access.log")
            # What an operator sees: the cache's answer in a header; a request with
            # credentials is never the cache's.
            probe = KeepAliveClient("127.0.0.1", cluster.port)
            with trio.fail_after(CONDITION):
                cached = await probe.get(f"{viewers[0].base}/init.mp4")
                keyed = await probe.get(
                    f"{viewers[0].base}/init.mp4", [("Authorization", "Bearer any")]
                )
                await probe.aclose()

    assert owner.outcome is StreamOutcome.COMPLETED and owner.frames == FRAMES, owner.summary()
    assert len(viewers) == VIEWERS
    failed = [(v.name, v.failure) for v in viewers if not v.complete]
    assert not failed, f"{len(failed)} viewers incomplete, e.g. {failed[:5]}"
    places = viewers[0].places
    segments = range(FIRST_MSN, FIRST_MSN + 2)
    assert places == [(msn, index) for msn in segments for index in range(PARTS // 2)], places
    assert all(v.places == places for v in viewers)
    # Byte for byte the owner's: one digest for every viewer, the owner's.
    media = owner_media(owner)
    digests = Counter(v.digest() for v in viewers)
    assert digests == {viewers[0].digest(): VIEWERS}
    assert viewers[0].media() == media
    for viewer in viewers[:DECODED]:
        assert await trio.to_thread.run_sync(decoded_frames, viewer.media()) == FRAMES
    (watcher,) = websocket
    assert watcher.outcome is StreamOutcome.COMPLETED and watcher.frames > 0, watcher.summary()

    # The server's share, from nginx's log: at most twice each part, and each blocking
    # reload's query; the cache answered everything else.
    prefix = viewers[0].base + "/"
    per_part = parts_origin_counts(log, prefix, places)
    assert all(1 <= n <= ORIGIN_LIMIT for n in per_part.values()), per_part
    origin = origin_requests(log, prefix)
    reloads = {path: n for path, n in origin.items() if "_HLS_msn=" in path}
    assert reloads and max(reloads.values()) <= ORIGIN_LIMIT, reloads
    mine = [e for e in log if e.path.startswith(prefix)]
    hits = sum(e.cache == "HIT" for e in mine)
    assert hits >= VIEWERS * PARTS, Counter(e.cache for e in mine)
    # The live playlist without _HLS_msn (each viewer's first load) is kept a second:
    # 500 viewers joining at once cost the server a request or two, not 500.
    plain = [e for e in mine if e.path == viewers[0].playlist_path]
    assert len(plain) == VIEWERS
    assert sum(e.reached_a_backend for e in plain) <= ORIGIN_LIMIT, Counter(e.cache for e in plain)
    assert sum(v.requests for v in viewers) == len(mine)
    assert cached.status == keyed.status == 200 and cached.body == viewers[0].init
    assert cached.headers["x-cache-status"] == "HIT", cached.headers
    assert keyed.headers["x-cache-status"] == "BYPASS", keyed.headers


# --------------------------------------------------------------------------------------
# The HLS location, read off the shipped file (no nginx needed)
# --------------------------------------------------------------------------------------

HLS_LOCATION: Final = "location ~ ^/v1/realtime/video/watch/.+/hls/ {"


def block_directives(block: str) -> dict[str, str]:
    """A block's directives, each name's value (the block is flat: no nested braces)."""
    found: dict[str, str] = {}
    for line in block.splitlines():
        line = line.strip()
        if line and not line.startswith("#"):
            name, _, value = line.rstrip(";").partition(" ")
            assert name not in found, f"{name} twice"
            found[name] = value.strip()
    return found


def seconds(value: str) -> float:
    assert value.endswith("s"), value
    return float(value[:-1])


def test_the_shipped_config_caches_hls_as_the_server_answers() -> None:
    text = NGINX_CONF.read_text()
    assert text.count(HLS_LOCATION) == 1
    hls = block_directives(text.split(HLS_LOCATION, 1)[1].split("}", 1)[0])
    assert hls["proxy_pass"] == "http://trio_vstream_watch"
    zone = hls["proxy_cache"]
    assert re.search(rf"^\s*proxy_cache_path \S+ .*keys_zone={zone}:", text, re.MULTILINE)
    # Blocking reloads are cached per query; nginx caches only what it buffers.
    assert hls["proxy_cache_key"].endswith("$request_uri")  # the path and the query
    assert hls["proxy_buffering"] == "on"
    # The lock outlasts the server's longest hold: 3 x TARGETDURATION with the default
    # settings (a blocking reload, a GET of the hinted part), plus nginx's 500 ms poll.
    window = HlsWindow(HlsSettings(), max_part_seconds=WatchConfig().hls_part_seconds)
    hold = 3 * m3u8.loads(window.playlist()).target_duration
    assert hls["proxy_cache_lock"] == "on"
    assert seconds(hls["proxy_cache_lock_timeout"]) > hold + 0.5, hold
    assert seconds(hls["proxy_cache_lock_age"]) > hold, hold
    # Never the cache's: upgrades, credentials.
    for name in ("proxy_cache_bypass", "proxy_no_cache"):
        assert hls[name].split() == ["$http_upgrade", "$http_authorization"]
    # A blocking reload's 503 (a stalled stream) is not retried, nor a server's failure.
    assert "http_503" not in hls["proxy_next_upstream"].split()
    assert hls["proxy_ignore_client_abort"] == "on"
    assert hls["add_header"] == "X-Cache-Status $upstream_cache_status always"


@pytest.mark.parametrize(
    ("path", "hls"),
    [
        (f"{WATCH_PREFIX}{'t' * 43}/hls/index.m3u8", True),
        (f"{WATCH_PREFIX}box2-gpu0/{'t' * 43}/hls/part/3.1.m4s", True),
        (f"{WATCH_PREFIX}{'t' * 43}", False),  # the link itself: WebSocket viewers
        (f"{WATCH_PREFIX}box2-gpu0/{'t' * 43}", False),
        ("/v1/realtime/video", False),
    ],
)
def test_the_hls_location_takes_hls_paths_only(path: str, hls: bool) -> None:
    """The location's regex (PCRE in nginx, the same in Python for this one)."""
    pattern = HLS_LOCATION.split()[2]
    assert bool(re.search(pattern, path)) is hls


def test_the_renderer_moves_the_cache_and_says_when_it_cannot(tmp_path: Path) -> None:
    shipped = NGINX_CONF.read_text()
    rendered = render_nginx_conf(
        shipped, listen_port=8000, backend_ports=[9001], prefix=tmp_path, fewer_backends=True
    )
    assert f"proxy_cache_path {tmp_path}/hls-cache " in rendered
    # Nothing left under /var for nginx to write (an unprivileged test could not).
    lines = [line for line in rendered.splitlines() if not line.strip().startswith("#")]
    assert not [line for line in lines if "/var/" in line or "/run/" in line]
    moved = shipped.replace("/var/cache/nginx/trio-vstream ", "/srv/cache ")
    with pytest.raises(ValueError, match="proxy_cache_path"):
        render_nginx_conf(
            moved, listen_port=8000, backend_ports=[9001], prefix=tmp_path, fewer_backends=True
        )
