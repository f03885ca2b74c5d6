"""The watch hub without sockets: its queues, the skip and close policy, and what a
viewer's bytes decode to. Chunks are real fMP4 from the encoder."""

from __future__ import annotations

import json
from typing import Any

import numpy as np
import pytest
import trio

from tests.conftest import decode_video
from trio_vstream import protocol
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.outputs.watch import Viewer, WatchConfig, WatchHub, WatchRegistry
from trio_vstream.protocol import ClientProtocol, ClientState, WatchStarted
from trio_vstream.server.metrics import ServerMetrics

FRAMES = 4


def make_chunks(count: int, *, width: int = 64, height: int = 48) -> list[bytes]:
    encoder = FragmentedMP4Encoder(width=width, height=height, fps=8)
    rng = np.random.default_rng(0)
    chunks = []
    for _ in range(count):
        frames = rng.integers(0, 256, (FRAMES, height, width, 3), dtype=np.uint8)
        chunks.append(encoder.encode(frames))
    chunks.append(encoder.close())
    return chunks


CHUNKS = make_chunks(12)
INIT = CHUNKS[0][: CHUNKS[0].index(b"moof") - 4]


def metadata(index: int, data: bytes, kind: str = "media") -> protocol.ChunkMetadata:
    return protocol.ChunkMetadata(
        request_id="r1",
        kind=kind,  # type: ignore[arg-type]
        num_frames=FRAMES if kind == "media" else 0,
        byte_length=len(data),
        generation_chunk_index=index if kind == "media" else None,
        started_event_ids=(),
        active_event_ids=(),
        completed_event_ids=(),
        transport_chunk_index=index,
    )


def session_start() -> protocol.SessionStart:
    return protocol.parse_start(
        json.dumps({"type": "session.start", "prompt": "a cat", "size": "64x48", "user": "u1"})
    )


def open_hub(config: WatchConfig) -> tuple[WatchRegistry, WatchHub, str]:
    registry = WatchRegistry(config, ServerMetrics("m"))
    taps = registry.taps("r1", session_start())
    hub = taps.taps[0]
    assert isinstance(hub, WatchHub)
    path = taps.video_start_fields["watch_path"]
    config_echo = {"prompt": "a cat", "size": "64x48", "user": "u1"}
    hub.started(protocol.VideoStart("r1", "m4s", config_echo, watch_path=path), session_start())
    return registry, hub, path


def feed(hub: WatchHub, first: int, last: int) -> None:
    for index in range(first, last):
        data = CHUNKS[index]
        kind = "trailer" if index == len(CHUNKS) - 1 else "media"
        hub.chunk(metadata(index, data, kind), data, INIT)


def feed_reading(hub: WatchHub, viewer: Viewer, first: int, last: int) -> list[str | bytes]:
    """Chunks ``first`` to ``last`` (excluded), to a viewer that keeps up."""
    got: list[str | bytes] = []
    for index in range(first, last):
        feed(hub, index, index + 1)
        got += drain(viewer)
    return got


def drain(viewer: Viewer) -> list[str | bytes]:
    out: list[str | bytes] = []
    while True:
        try:
            out.extend(viewer.receive_channel.receive_nowait())
        except (trio.WouldBlock, trio.EndOfChannel):
            return out


def as_client(messages: list[str | bytes]) -> tuple[ClientProtocol, list[Any]]:
    """Feeds a viewer's messages through the client's protocol machine (which checks
    every pairing and byte count)."""
    client = ClientProtocol()
    events = [event for message in messages for event in client.receive(message)]
    return client, events


def gauge(registry: WatchRegistry, name: str) -> float:
    value = registry.metrics.registry.get_sample_value(name, {"model": "m"})
    assert value is not None
    return value


async def test_a_viewer_that_skips_resumes_at_a_keyframe_and_still_decodes() -> None:
    registry, hub, _ = open_hub(WatchConfig(queue_chunks=3, max_missed_chunks=4))
    viewer = hub.attach()
    assert viewer is not None
    feed(hub, 0, 5)  # watch.start and chunks 0, 1 fill its queue; 2, 3, 4 are missed
    assert viewer.resync and viewer.missed_in_row == 3
    got = drain(viewer)
    got += feed_reading(hub, viewer, 5, len(CHUNKS))  # it reads again: from 5 on
    hub.ended("completed", protocol.SessionDone("r1", len(CHUNKS), False))
    client, events = as_client(got)
    assert isinstance(events[0], WatchStarted) and client.state is ClientState.STREAMING
    indexes = [e.metadata.transport_chunk_index for e in events if hasattr(e, "data")]
    assert indexes == [0, 1, *range(5, len(CHUNKS))]
    frames = decode_video(b"".join(e.data for e in events if hasattr(e, "data")))
    assert frames.shape[0] == FRAMES * (2 + len(CHUNKS) - 1 - 5)
    assert gauge(registry, "trio_vstream_viewer_chunks_skipped_total") == 3
    assert viewer.kicked is None


async def test_a_viewer_joining_mid_stream_gets_the_init_segment_first() -> None:
    _, hub, _ = open_hub(WatchConfig())
    feed(hub, 0, 3)
    viewer = hub.attach()
    assert viewer is not None
    _, events = as_client(feed_reading(hub, viewer, 3, len(CHUNKS)))
    assert events[0].start.config == {"prompt": "a cat", "size": "64x48"}  # no user
    first = events[2]
    assert first.metadata.transport_chunk_index == 3
    assert first.data == INIT + CHUNKS[3] and first.metadata.byte_length == len(first.data)
    media = b"".join(e.data for e in events if hasattr(e, "data"))
    assert decode_video(media).shape[0] == FRAMES * (len(CHUNKS) - 1 - 3)


async def test_memory_stays_bounded_with_many_stalled_viewers() -> None:
    config = WatchConfig(max_viewers=500, queue_chunks=2, max_missed_chunks=3)
    registry, hub, _ = open_hub(config)
    stalled = [hub.attach() for _ in range(499)]
    healthy = hub.attach()
    assert healthy is not None and all(v is not None for v in stalled)
    assert hub.attach() is None  # the 501st
    assert gauge(registry, "trio_vstream_viewers_active") == 500
    got: list[str | bytes] = []
    for index in range(len(CHUNKS)):
        feed(hub, index, index + 1)
        got += drain(healthy)
        # Never more than the queue holds, each; the chunks' bytes are shared, not copied.
        assert max(hub.queued_units()) <= config.queue_chunks
        held = {
            id(item)
            for v in stalled
            if v is not None
            for unit in v.receive_channel._state.data  # type: ignore[attr-defined]
            for item in unit
            if isinstance(item, bytes)
        }
        assert len(held) <= 2
    hub.ended("completed", protocol.SessionDone("r1", len(CHUNKS), False))
    assert all(v is not None and v.kicked is not None for v in stalled)
    assert all(v.kicked.code == "viewer_too_slow" for v in stalled if v and v.kicked)
    assert healthy.kicked is None
    _, events = as_client(got)
    assert [e.metadata.transport_chunk_index for e in events if hasattr(e, "data")] == list(
        range(len(CHUNKS))
    )
    assert gauge(registry, "trio_vstream_viewers_dropped_total") == 499
    for viewer in [*stalled, healthy]:
        assert viewer is not None
        hub.detach(viewer)
    assert gauge(registry, "trio_vstream_viewers_active") == 0


async def test_a_kick_brings_the_send_in_progress_to_its_close_timeout() -> None:
    _, hub, _ = open_hub(WatchConfig(queue_chunks=1, max_missed_chunks=1))
    viewer = hub.attach()
    assert viewer is not None
    # Stands for the handler's send, stuck: no await in it is the point (ASYNC100).
    with trio.CancelScope() as scope:  # noqa: ASYNC100
        viewer.send_scope = scope
        feed(hub, 0, 1)  # the queue still holds watch.start: chunk 0 is missed
    assert viewer.kicked is not None
    assert scope.deadline <= trio.current_time() + 5.0


async def test_the_registry_forgets_a_hub_when_its_session_ends() -> None:
    registry, hub, path = open_hub(WatchConfig())
    token = path.rsplit("/", 1)[1]
    assert registry.hub(token) is hub and len(token) >= 43  # 32 random bytes
    hub.ended("stopped", protocol.SessionDone("r1", 0, True))
    assert registry.hub(token) is None and hub.attach() is None


@pytest.mark.parametrize("enabled", [True, False])
async def test_watching_off_gives_no_taps_and_no_watch_path(enabled: bool) -> None:
    registry = WatchRegistry(WatchConfig(max_viewers=4 if enabled else 0), ServerMetrics("m"))
    taps = registry.taps("r1", session_start())
    assert bool(taps.taps) is enabled
    assert ("watch_path" in taps.video_start_fields) is enabled


def test_the_client_protocol_reads_a_watch_start_and_keeps_read_only_errors_non_fatal() -> None:
    client = ClientProtocol()
    [event] = client.receive(protocol.WatchStart("r1", "m4s", {"prompt": "a cat"}).to_json())
    assert isinstance(event, WatchStarted) and client.watch_start == event.start
    assert client.state is ClientState.STREAMING and client.video_start is None
    refusal = protocol.Error(protocol.ErrorCode.READ_ONLY, "read-only", request_id="r1")
    [error] = client.receive(refusal.to_json())
    assert not error.ends_session and client.state is ClientState.STREAMING
    assert client.ping() == protocol.PING_MESSAGE
    slow = protocol.Error(protocol.ErrorCode.VIEWER_TOO_SLOW, "behind", request_id="r1")
    [error] = client.receive(slow.to_json())
    assert error.ends_session and client.state is ClientState.FAILED


async def test_with_keyframes_every_few_chunks_a_joiner_waits_for_the_next_one() -> None:
    encoder = FragmentedMP4Encoder(width=64, height=48, fps=8, keyframe_interval=3)
    rng = np.random.default_rng(1)
    chunks = [
        encoder.encode(rng.integers(0, 256, (FRAMES, 48, 64, 3), dtype=np.uint8)) for _ in range(7)
    ]
    encoder.close()
    init = encoder.init_segment or b""
    _, hub, _ = open_hub(WatchConfig())
    viewer = hub.attach()
    hub.chunk(metadata(0, chunks[0]), chunks[0], init)
    late = hub.attach()
    assert viewer is not None and late is not None
    got: list[str | bytes] = []
    for index in range(1, 7):
        hub.chunk(metadata(index, chunks[index]), chunks[index], init)
        got += drain(late)
    _, events = as_client(got)
    received = [e for e in events if hasattr(e, "data")]
    # Chunks 1 and 2 begin mid-GOP: it joins at 3, the next keyframe, init segment first.
    assert [e.metadata.transport_chunk_index for e in received] == [3, 4, 5, 6]
    assert received[0].data == init + chunks[3]
    assert decode_video(b"".join(e.data for e in received)).shape[0] == 4 * FRAMES
    assert late.missed_in_row == 0  # waiting to join is not falling behind
