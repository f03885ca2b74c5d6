"""Watching from the client: ``watch_video`` and ``python -m trio_vstream watch``.

A viewer sends nothing to start, receives ``watch.start`` and the owner's chunks from a
keyframe chunk on, and saves them like an owner's stream: the saved MP4 decodes on its
own to the owner's frames from the viewer's first chunk. Refusals (a wrong link, a
viewer that fell behind, a missing key) are one line and a non-zero status.
"""

from __future__ import annotations

import json
import re
import threading
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import WebSocketConnection

from tests.client.test_client import KEY, encode_clip, gradient_chunks
from tests.client.test_client_cli import run_cli
from tests.conftest import Transcript, decode_video, is_type, receive_into, receive_until
from tests.fake_reference import Peer, send_reference_chunk, start_peer
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream.client import StreamOutcome, watch_link_url, watch_video
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig, WatchHub
from trio_vstream.server.access import AccessPolicy

CHUNK_FRAMES = 4
CHUNKS = 8
JOIN_AT = 3
"""The viewers join at this chunk: the engine waits there until one is in."""
START = {
    "type": "session.start",
    "prompt": "a red circle",
    "size": "64x48",
    "num_frames": CHUNK_FRAMES * CHUNKS,
    "seed": 7,
}


class GatedStream(InstrumentedStream):
    """Makes chunk ``JOIN_AT`` only once ``gate`` is set: the test's viewer is then in
    before it, whatever the machine's speed."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        engine = self._engine
        assert isinstance(engine, GatedEngine)
        if engine.made == JOIN_AT and not engine.gate.wait(timeout=30):
            raise RuntimeError("the test never opened the gate")
        engine.made += 1
        return super().next_chunk(checkpoint)


class GatedEngine(InstrumentedEngine):
    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.gate = threading.Event()
        self.made = 0

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        inner = super().open_stream(request)
        stream = GatedStream(self, inner._inner)
        self.streams[-1] = stream
        return stream


async def start_gated(start_server: Any, **kwargs: Any) -> Any:
    return await start_server(
        SyntheticSettings(chunk_frames=CHUNK_FRAMES, steps=1), engine_class=GatedEngine, **kwargs
    )


async def owner_until_gate(
    running: Any, ws: WebSocketConnection, owner: Transcript
) -> tuple[dict[str, Any], trio.Event]:
    """Start the owner's session and read its chunks up to the gate. Returns its
    ``video.start`` and an event set when a viewer attaches (the hub says so)."""
    await ws.send_message(json.dumps(START))
    video_start = await receive_until(ws, owner, is_type("video.start"))
    for _ in range(JOIN_AT):
        await receive_until(ws, owner, lambda m: isinstance(m, bytes))
    hub = running.server.watch.hub(video_start["watch_path"].removeprefix(WATCH_PREFIX))
    assert isinstance(hub, WatchHub)
    joined = trio.Event()
    attach = hub.attach

    def attach_and_tell() -> Any:
        viewer = attach()
        joined.set()
        return viewer

    hub.attach = attach_and_tell  # type: ignore[method-assign]
    return video_start, joined


def assert_owners_frames_from_the_gate(saved: bytes, owner: Transcript) -> None:
    """``saved`` decodes on its own to the owner's frames from chunk ``JOIN_AT`` on."""
    mine, theirs = decode_video(saved), decode_video(owner.video_bytes)
    assert theirs.shape[0] == CHUNK_FRAMES * CHUNKS
    assert mine.shape[0] == CHUNK_FRAMES * (CHUNKS - JOIN_AT)
    assert (mine == theirs[CHUNK_FRAMES * JOIN_AT :]).all()


# ------------------------------------------------------------------------ library


async def test_watch_video_from_chunk_3_decodes_to_the_owners_frames(start_server: Any) -> None:
    running = await start_gated(start_server)
    owner = Transcript()
    async with running.connect() as ws:
        video_start, joined = await owner_until_gate(running, ws, owner)
        link = f"ws://127.0.0.1:{running.server.port}{video_start['watch_path']}"
        results = []
        async with trio.open_nursery() as nursery:

            async def viewer() -> None:
                results.append(await watch_video(link))

            nursery.start_soon(viewer)
            with trio.fail_after(10):
                await joined.wait()
            running.engine.gate.set()
            await receive_into(ws, owner)
    (result,) = results
    assert result.outcome is StreamOutcome.COMPLETED and result.watching
    assert result.watch_start is not None and result.video_start is None
    assert result.request_id == video_start["request_id"]
    assert result.seed == 7  # from watch.start's config
    first = result.chunks[0].metadata
    assert first is not None and first.transport_chunk_index == JOIN_AT
    assert result.frames == CHUNK_FRAMES * (CHUNKS - JOIN_AT)
    assert result.done is not None and result.done.chunks == owner.terminal[0]["chunks"]
    assert result.time_to_video_start is not None and result.delivered_fps is not None
    assert_owners_frames_from_the_gate(result.video, owner)


def test_watch_links_are_taken_as_urls_share_links_or_paths() -> None:
    path = f"{WATCH_PREFIX}tok_en-1"
    base = "wss://gpu-box:8443/v1/realtime/video"
    assert watch_link_url(f"ws://h:1{path}", base) == f"ws://h:1{path}"
    assert watch_link_url(path, base) == f"wss://gpu-box:8443{path}"
    share = f"https://gpu-box:8443/?watch={path.replace('/', '%2F')}"
    assert watch_link_url(share, base) == f"wss://gpu-box:8443{path}"
    assert watch_link_url(f"http://h:8000/?watch={path}") == f"ws://h:8000{path}"
    for bad in ("tok_en-1", "//evil.example/x", "http://h/?watch=//evil/x", "ftp://h/x", "ws:///x"):
        with pytest.raises(ValueError, match=re.escape(repr(bad))):
            watch_link_url(bad, base)


# ------------------------------------------------------------------- command line


@pytest.mark.slow
async def test_cli_watch_saves_the_stream_from_where_it_joined(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_gated(start_server)
    owner = Transcript()
    output = tmp_path / "watched.mp4"
    async with running.connect() as ws:
        video_start, joined = await owner_until_gate(running, ws, owner)

        async def owner_reads_on(_process: trio.Process) -> None:
            await joined.wait()
            running.engine.gate.set()
            await receive_into(ws, owner)

        # The path alone, on --url's server: what video.start's watch_path gives.
        run = await run_cli(
            tmp_path,
            video_start["watch_path"],
            *["--url", running.url, "-o", str(output), "--json"],
            while_running=owner_reads_on,
            command="watch",
        )
    assert run.returncode == 0, run.stderr
    summary = run.summary
    assert summary["watching"] is True and summary["outcome"] == "completed"
    assert summary["request_id"] == video_start["request_id"]
    assert summary["frames"] == summary["output_frames"] == CHUNK_FRAMES * (CHUNKS - JOIN_AT)
    assert summary["chunks"] == CHUNKS - JOIN_AT + 1  # and the trailer
    assert_owners_frames_from_the_gate(output.read_bytes(), owner)
    assert len(running.engine.streams) == 1  # nothing but the owner's session ran


@pytest.mark.slow
async def test_cli_watch_prints_a_human_summary(start_server: Any, tmp_path: Path) -> None:
    running = await start_gated(start_server)
    owner = Transcript()
    async with running.connect() as ws:
        video_start, joined = await owner_until_gate(running, ws, owner)

        async def owner_reads_on(_process: trio.Process) -> None:
            await joined.wait()
            running.engine.gate.set()
            await receive_into(ws, owner)

        link = f"ws://127.0.0.1:{running.server.port}{video_start['watch_path']}"
        run = await run_cli(
            tmp_path,
            link,
            *["-o", str(tmp_path / "w.mp4")],
            while_running=owner_reads_on,
            command="watch",
        )
    assert run.returncode == 0, run.stderr
    rows = dict(
        line.split(None, 1) for line in run.stdout.replace("time to ", "time_to_").splitlines()
    )
    assert rows["outcome"].strip() == "completed"
    assert rows["frames"].strip() == str(CHUNK_FRAMES * (CHUNKS - JOIN_AT))
    assert "time_to_watch.start" in rows


@pytest.mark.slow
async def test_cli_watch_of_a_wrong_link_says_watch_not_found_and_exits_1(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_gated(start_server)
    output = tmp_path / "o.mp4"
    run = await run_cli(
        tmp_path,
        f"{WATCH_PREFIX}no-such-token",
        *["--url", running.url, "-o", str(output)],
        command="watch",
    )
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == [
        "error: server error watch_not_found: no running session at this watch link "
        "(it may have ended)"
    ]
    assert run.stdout == "" and not output.exists()


@pytest.mark.slow
async def test_cli_watch_sends_the_key_which_only_watch_requires_key_needs(
    start_server: Any, tmp_path: Path
) -> None:
    path = f"{WATCH_PREFIX}no-such-token"
    for requires_key in (False, True):
        running = await start_gated(
            start_server,
            access=AccessPolicy(api_keys=(KEY,)),
            watch=WatchConfig(requires_key=requires_key),
        )
        base = [path, "--url", running.url, "-o", str(tmp_path / "o.mp4")]
        keyless = await run_cli(tmp_path, *base, command="watch")
        keyed = await run_cli(tmp_path, *base, "--api-key", KEY, command="watch")
        # Past the handshake, the link itself answers: watch_not_found, status 1.
        assert keyed.returncode == 1 and "watch_not_found" in keyed.stderr, keyed.stderr
        if requires_key:
            assert keyless.returncode == 3, keyless.stderr
            assert keyless.stderr.startswith("error: cannot connect to ")
            assert "401" in keyless.stderr and len(keyless.stderr.splitlines()) == 1
        else:
            assert keyless.returncode == 1 and "watch_not_found" in keyless.stderr
        assert KEY not in keyed.stdout + keyed.stderr


@pytest.mark.slow
async def test_cli_watch_of_a_viewer_too_slow_keeps_what_arrived_and_exits_1(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    blobs = encode_clip(gradient_chunks(2, 3))

    async def server(ws: WebSocketConnection, peer: Peer) -> None:
        await ws.send_message(
            json.dumps(
                {"type": "watch.start", "request_id": "ref-1", "format": "m4s", "config": {}}
            )
        )
        await send_reference_chunk(ws, blobs[0], 0, 3)
        error = {"type": "error", "code": "viewer_too_slow", "message": "too far behind"}
        await ws.send_message(json.dumps(error))
        await ws.aclose()

    peer = await start_peer(nursery, server)
    output = tmp_path / "o.mp4"
    run = await run_cli(tmp_path, peer.url, "-o", str(output), "--json", command="watch")
    assert run.returncode == 1, run.stderr
    assert run.stderr.splitlines() == ["error: server error viewer_too_slow: too far behind"]
    assert run.summary["error"]["code"] == "viewer_too_slow"
    assert run.summary["output_frames"] == 3 and decode_video(output.read_bytes()).shape[0] == 3
    assert peer.received == []  # a viewer sends nothing: no session.start


@pytest.mark.slow
async def test_cli_watch_connection_refused_exits_3(tmp_path: Path) -> None:
    url = "ws://127.0.0.1:9/v1/realtime/video/watch/x"
    run = await run_cli(tmp_path, url, "-o", str(tmp_path / "o.mp4"), command="watch")
    assert run.returncode == 3
    assert run.stderr.startswith(f"error: cannot connect to {url}: ")
    assert len(run.stderr.splitlines()) == 1


@pytest.mark.slow
async def test_cli_watch_usage_errors_exit_2(tmp_path: Path) -> None:
    for args in (["tok"], [f"{WATCH_PREFIX}x"], ["//h/x", "-o", "o.mp4"]):
        run = await run_cli(tmp_path, *args, command="watch")
        assert run.returncode == 2, (args, run.stderr)
        assert run.stderr.startswith("python -m trio_vstream watch: error: ")
