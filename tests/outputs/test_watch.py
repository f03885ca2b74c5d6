"""Watch links, through a real server: viewers get the owner's stream from where they
joined, decodable on its own; they cannot steer it; a stalled one slows nobody."""

from __future__ import annotations

import json
import socket
from typing import Any
from urllib.parse import urlsplit

import attrs
import numpy as np
import pytest
import trio
import trio_websocket
from trio_websocket import WebSocketConnection, open_websocket_url

from tests.conftest import (
    CLIENT_MAX_MESSAGE,
    RunningServer,
    Transcript,
    decode_video,
    is_type,
    receive_into,
    receive_until,
)
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig
from trio_vstream.server.access import AccessPolicy

START = {"type": "session.start", "prompt": "a red circle", "size": "64x48", "num_frames": 32}
SLOW = SyntheticSettings(step_delay=0.01, chunk_frames=4, steps=2)


def watch_url(running: RunningServer, watch_path: str) -> str:
    base = urlsplit(running.url)
    return f"ws://{base.netloc}{watch_path}"


def watch(running: RunningServer, watch_path: str, **kwargs: Any) -> Any:
    kwargs.setdefault("max_message_size", CLIENT_MAX_MESSAGE)
    return open_websocket_url(watch_url(running, watch_path), **kwargs)


def binaries(transcript: Transcript) -> list[bytes]:
    return [m for m in transcript.messages if isinstance(m, bytes)]


def chunk_indexes(transcript: Transcript) -> list[int]:
    return [m["transport_chunk_index"] for m in transcript.of_type("video.chunk_metadata")]


class NoisyStream(InstrumentedStream):
    """Random frames: chunks of a few hundred KiB, which socket buffers cannot hide."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        rng = np.random.default_rng(chunk.index)
        frames = rng.integers(0, 256, (8, 128, 128, 3), dtype=np.uint8)
        return attrs.evolve(chunk, frames=frames)


class NoisyEngine(InstrumentedEngine):
    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        inner = super().open_stream(request)
        stream = NoisyStream(self, inner._inner)
        self.streams[-1] = stream
        return stream


async def stalled_viewer(
    running: RunningServer, watch_path: str, nursery: trio.Nursery
) -> WebSocketConnection:
    """A viewer that reads nothing after the handshake: a tiny receive buffer, and
    trio-websocket stops reading the socket once one message waits for the caller."""
    sock = trio.socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
    await sock.connect(("127.0.0.1", running.server.port))
    return await trio_websocket.wrap_client_stream(
        nursery,
        trio.SocketStream(sock),
        "127.0.0.1",
        watch_path,
        message_queue_size=1,
        max_message_size=CLIENT_MAX_MESSAGE,
    )


async def test_owner_and_healthy_viewers_get_every_chunk_and_a_stalled_viewer_is_closed(
    start_server: Any, nursery: trio.Nursery
) -> None:
    config = WatchConfig(max_viewers=3, queue_chunks=2, max_missed_chunks=3)
    running = await start_server(
        SyntheticSettings(chunk_frames=8, steps=1),
        engine_class=NoisyEngine,
        watch=config,
        close_timeout=30.0,  # time for the stalled viewer to take its last message
    )
    start = {**START, "size": "128x128", "num_frames": 8 * 24}
    owner, healthy = Transcript(), [Transcript(), Transcript()]
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        path = video_start["watch_path"]
        assert path.startswith(WATCH_PREFIX) and len(path) > len(WATCH_PREFIX) + 40
        stalled = await stalled_viewer(running, path, nursery)
        async with (
            watch(running, path) as one,
            watch(running, path) as two,
            trio.open_nursery() as readers,
        ):
            readers.start_soon(receive_into, one, healthy[0])
            readers.start_soon(receive_into, two, healthy[1])
            # The owner reads on: nothing waits for the stalled viewer.
            await receive_into(ws, owner)
    assert owner.terminal[-1]["type"] == "session.done"
    assert chunk_indexes(owner) == list(range(25))  # 24 media chunks and the trailer
    hub_gone = running.server.watch.hub(path.removeprefix(WATCH_PREFIX))
    assert hub_gone is None  # forgotten with its session

    for viewer in healthy:
        assert viewer.messages[0]["type"] == "watch.start"
        assert viewer.close_code == 1000
        assert viewer.terminal == owner.terminal
        first = chunk_indexes(viewer)[0]
        assert chunk_indexes(viewer) == list(range(first, 25))
        owner_chunks, viewer_chunks = binaries(owner), binaries(viewer)
        # The first is the init segment and the owner's chunk; then the same bytes.
        assert viewer_chunks[1:] == owner_chunks[first + 1 :]
        if first > 0:
            init = owner_chunks[0][: len(viewer_chunks[0]) - len(owner_chunks[first])]
            assert viewer_chunks[0] == init + owner_chunks[first]

    # The stalled viewer, reading at last: a well-formed prefix, then why it was closed.
    late = Transcript()
    await receive_into(stalled, late)
    assert late.messages[0]["type"] == "watch.start"
    assert late.terminal == [late.messages[-1]]
    assert late.messages[-1]["code"] == "viewer_too_slow", late.messages[-1]
    assert late.close_code == 1000
    metas = late.of_type("video.chunk_metadata")
    pairs = late.messages[1:-1]
    assert len(pairs) == 2 * len(metas) < 2 * 24
    for meta, data in zip(pairs[::2], pairs[1::2], strict=True):
        assert meta["type"] == "video.chunk_metadata" and meta["byte_length"] == len(data)
    metrics = running.server.metrics.exposition().decode()
    assert 'trio_vstream_viewers_dropped_total{model="synthetic"} 1.0' in metrics


async def test_a_viewer_joining_after_chunk_3_decodes_to_the_owners_frames(
    start_server: Any,
) -> None:
    running = await start_server(SLOW)
    owner, viewer = Transcript(), Transcript()
    # What is not the viewers' business: who the user is, free-form parameters.
    start = {**START, "user": "alice@example.org", "extra_params": {"note": "secret"}}
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        for _ in range(3):  # three chunks, metadata and bytes
            await receive_until(ws, owner, lambda m: isinstance(m, bytes))
        async with (
            watch(running, video_start["watch_path"]) as watcher,
            trio.open_nursery() as readers,
        ):
            readers.start_soon(receive_into, watcher, viewer)
            await receive_into(ws, owner)
    config = dict(video_start["config"])
    assert config.pop("user") and config.pop("extra_params")
    assert viewer.messages[0] == {
        "type": "watch.start",
        "request_id": video_start["request_id"],
        "format": video_start["format"],
        "config": config,
    }
    assert config["prompt"] == "a red circle"
    first = chunk_indexes(viewer)[0]
    assert first >= 3
    assert viewer.terminal == owner.terminal and owner.terminal[0]["type"] == "session.done"
    frames_per_chunk = SLOW.chunk_frames
    mine, theirs = decode_video(viewer.video_bytes), decode_video(owner.video_bytes)
    assert mine.shape[0] == 32 - first * frames_per_chunk > 0
    np.testing.assert_array_equal(mine, theirs[first * frames_per_chunk :])


async def test_a_viewers_control_messages_are_refused_and_its_pings_answered(
    start_server: Any,
) -> None:
    running = await start_server(SLOW)
    owner, viewer = Transcript(), Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        async with watch(running, video_start["watch_path"]) as watcher:
            await receive_until(watcher, viewer, is_type("watch.start"))
            await watcher.send_message(json.dumps({"type": "session.stop"}))
            event = {"event_id": "v1", "event": {"prompt": "a blue square"}}
            await watcher.send_message(
                json.dumps({"type": "session.interaction", "interaction": event})
            )
            await watcher.send_message(json.dumps({"type": "session.ping"}))
            await watcher.send_message("{not json")
            await receive_until(watcher, viewer, is_type("session.pong"))
            async with trio.open_nursery() as readers:
                readers.start_soon(receive_into, watcher, viewer)
                await receive_into(ws, owner)
    refusals = viewer.of_type("error")
    assert [(e["code"], e.get("event_id")) for e in refusals[:2]] == [
        ("read_only", None),
        ("read_only", "v1"),
    ]
    assert refusals[2]["code"] == "invalid_json"
    assert all(e["request_id"] == video_start["request_id"] for e in refusals)
    # The owner's session went on untouched: complete, and never told of the viewer.
    assert owner.terminal == [
        {
            "type": "session.done",
            "request_id": video_start["request_id"],
            "chunks": 9,
            "stopped": False,
        }
    ]
    assert not owner.of_type("error") and not owner.of_type("session.interaction.queued")
    assert running.engine.streams[0].changes == []
    assert viewer.terminal[-1] == owner.terminal[0] and viewer.close_code == 1000


async def test_a_viewer_leaving_changes_nothing_for_the_session(start_server: Any) -> None:
    running = await start_server(SLOW)
    owner = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        async with watch(running, video_start["watch_path"]) as watcher:
            await receive_until(watcher, Transcript(), lambda m: isinstance(m, bytes))
            metrics = running.server.metrics.exposition().decode()
            assert 'trio_vstream_viewers_active{model="synthetic"} 1.0' in metrics
        await receive_into(ws, owner)
    assert owner.terminal[0]["type"] == "session.done" and not owner.terminal[0]["stopped"]
    assert len(binaries(owner)) == 9


async def test_watch_links_end_with_their_session_and_cannot_be_guessed(
    start_server: Any,
) -> None:
    running = await start_server(SLOW, watch=WatchConfig(max_viewers=1))
    owner = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        path = video_start["watch_path"]
        async with watch(running, path) as first:
            await receive_until(first, Transcript(), is_type("watch.start"))
            busy = Transcript()
            async with watch(running, path) as second:
                await receive_into(second, busy)
            assert [(m["type"], m["code"]) for m in busy.json] == [("error", "server_busy")]
        guessed = Transcript()
        async with watch(running, path[:-1] + ("A" if path[-1] != "A" else "B")) as wrong:
            await receive_into(wrong, guessed)
        assert [m["code"] for m in guessed.json] == ["watch_not_found"]
        await receive_into(ws, owner)
    late = Transcript()
    async with watch(running, path) as after:
        await receive_into(after, late)
    assert [m["code"] for m in late.json] == ["watch_not_found"]
    assert late.close_code == 1000


async def test_watching_off_means_no_watch_path(start_server: Any) -> None:
    running = await start_server(SLOW, watch=WatchConfig(max_viewers=0))
    transcript = await running.run_session(START)
    assert "watch_path" not in transcript.messages[0]
    assert transcript.terminal[0]["type"] == "session.done"


async def test_with_api_keys_the_token_is_the_capability_unless_keys_are_required(
    start_server: Any,
) -> None:
    key = "watch-key-1"
    for requires_key in (False, True):
        running = await start_server(
            SLOW,
            access=AccessPolicy(api_keys=(key,)),
            watch=WatchConfig(requires_key=requires_key),
        )
        headers = [(b"authorization", f"Bearer {key}".encode())]
        owner = Transcript()
        async with running.connect(extra_headers=headers) as ws:
            await ws.send_message(json.dumps(START))
            video_start = await receive_until(ws, owner, is_type("video.start"))
            path = video_start["watch_path"]
            if requires_key:
                with pytest.raises(trio_websocket.HandshakeError) as refused:
                    async with watch(running, path):
                        raise AssertionError("a keyless viewer got in")
                assert getattr(refused.value, "status_code", None) == 401
                async with watch(running, path, extra_headers=headers) as keyed:
                    await receive_until(keyed, Transcript(), is_type("watch.start"))
            else:
                async with watch(running, path) as keyless:
                    await receive_until(keyless, Transcript(), is_type("watch.start"))
            await receive_into(ws, owner)
        assert owner.terminal[0]["type"] == "session.done"
