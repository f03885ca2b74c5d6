"""The client library (`stream_video`, `remux_to_mp4`), against live servers on loopback:
ours in-process, and a scripted peer (tests/fake_reference.py) that behaves like other
servers of the protocol (the reference, a broken one). The command line is in
test_client_cli.py.
"""

from __future__ import annotations

import argparse
import io
import json
import re
import struct
from functools import partial
from pathlib import Path
from typing import Any

import av
import numpy as np
import pytest
import trio
from trio_websocket import WebSocketConnection, WebSocketRequest, serve_websocket

from tests.fake_reference import (
    VIDEO_START_REF,
    Peer,
    free_port,
    receive_json,
    send_reference_chunk,
    send_session_done,
    sent_interactions,
    start_peer,
)
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from trio_vstream import protocol
from trio_vstream.client import (
    API_KEY_ENV,
    MAX_MESSAGE_SIZE,
    RemuxError,
    ScheduledInteraction,
    StreamConnectError,
    StreamOutcome,
    StreamResult,
    remux_to_mp4,
    stream_video,
)
from trio_vstream.client._cli import _connect_error_line, _finish
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.media.encoding import FragmentedMP4Encoder
from trio_vstream.server.access import AccessPolicy

START = {"prompt": "a red circle moving left", "size": "64x48", "fps": 8}


# ------------------------------------------------------------------- helpers


def mp4_boxes(data: bytes) -> list[tuple[bytes, bytes]]:
    """Top-level ISO BMFF boxes as (type, payload)."""
    boxes = []
    pos = 0
    while pos < len(data):
        size, kind = struct.unpack_from(">I4s", data, pos)
        header = 8
        if size == 1:
            (size,) = struct.unpack_from(">Q", data, pos + 8)
            header = 16
        elif size == 0:
            size = len(data) - pos
        boxes.append((kind, data[pos + header : pos + size]))
        pos += size
    return boxes


def child_box(payload: bytes, *path: bytes) -> bytes:
    for kind in path:
        matches = [body for k, body in mp4_boxes(payload) if k == kind]
        assert matches, f"no {kind!r} box"
        payload = matches[0]
    return payload


def assert_progressive_mp4(path: Path, frames: int) -> None:
    """A plain MP4: moov first (faststart) with real sample tables, no fragments."""
    boxes = mp4_boxes(path.read_bytes())
    kinds = [kind for kind, _ in boxes]
    assert b"moof" not in kinds and b"mfra" not in kinds
    assert kinds.index(b"moov") < kinds.index(b"mdat")
    moov = dict(boxes)[b"moov"]
    assert b"mvex" not in [kind for kind, _ in mp4_boxes(moov)]
    stbl = child_box(moov, b"trak", b"mdia", b"minf", b"stbl")
    stsz = child_box(stbl, b"stsz")
    _version_flags, _uniform_size, sample_count = struct.unpack_from(">III", stsz)
    assert sample_count == frames
    assert child_box(stbl, b"stco") or child_box(stbl, b"co64")


def decode(source: Path | bytes) -> tuple[list[np.ndarray], Any]:
    """Frames (RGB) and the stream's average frame rate."""
    target = io.BytesIO(source) if isinstance(source, bytes) else str(source)
    with av.open(target) as container:
        rate = container.streams.video[0].average_rate
        return [f.to_ndarray(format="rgb24") for f in container.decode(video=0)], rate


def assert_plays(path: Path, frames: int, size: tuple[int, int] = (64, 48), fps: int = 8) -> None:
    decoded, rate = decode(path)
    assert len(decoded) == frames
    assert decoded[0].shape == (size[1], size[0], 3)
    assert rate == fps


def encode_clip(
    chunks: list[np.ndarray], *, fps: int = 8, codec_options: dict[str, str] | None = None
) -> list[bytes]:
    """What a server would put in its binary messages: one per chunk, then the trailer."""
    _, height, width, _ = chunks[0].shape
    encoder = FragmentedMP4Encoder(
        width=width, height=height, fps=fps, codec_options=codec_options or {}
    )
    return [encoder.encode(chunk) for chunk in chunks] + [encoder.close()]


def gradient_chunks(count: int, frames: int, width: int = 64, height: int = 48) -> list[np.ndarray]:
    base = np.linspace(0, 255, width * height * 3).reshape(height, width, 3)
    clip = [((base + 10 * i) % 256).astype(np.uint8) for i in range(count * frames)]
    return [np.stack(clip[i * frames : (i + 1) * frames]) for i in range(count)]


def finish(result: StreamResult, **args: Any) -> tuple[int, str, str]:
    """The CLI's reporting (`_finish`) on a result: exit status, stdout, stderr.

    In process, so the CLI's output can be checked against a scripted server without a
    subprocess; nothing is written unless ``output``/``raw`` are given.
    """
    namespace = argparse.Namespace(
        **{"output": None, "raw": None, "json": False, "stop_timeout": 10.0, **args}
    )
    out, err = io.StringIO(), io.StringIO()
    status = _finish(namespace, result, out, err)
    return status, out.getvalue(), err.getvalue()


# ------------------------------------------------------- stream_video in process


async def test_stream_video_gets_the_whole_session_and_remuxes_to_progressive_mp4(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4))
    result = await stream_video(running.url, {**START, "num_frames": 10})

    assert result.outcome is StreamOutcome.COMPLETED
    assert result.done is not None and result.done.stopped is False
    assert result.error is None and result.errors == [] and result.problems == []
    assert result.request_id is not None and result.request_id.startswith("video_stream-")
    kinds = [c.metadata.kind for c in result.chunks if c.metadata is not None]
    assert kinds == ["media", "media", "media", "trailer"]
    assert [c.metadata.transport_chunk_index for c in result.chunks if c.metadata] == [0, 1, 2, 3]
    assert result.frames == 10
    assert (
        result.byte_count
        == len(result.video)
        == sum(c.metadata.byte_length for c in result.chunks if c.metadata)
    )
    assert result.video[4:8] == b"ftyp"
    assert result.close_code == 1000
    assert 0 < result.time_to_video_start <= result.time_to_first_chunk  # type: ignore[operator]
    assert result.delivered_fps is not None and result.delivered_fps > 0
    summary = result.summary()
    assert json.loads(json.dumps(summary)) == summary
    assert summary["frames"] == 10 and summary["chunks"] == 4 and summary["outcome"] == "completed"

    clip = tmp_path / "clip.mp4"
    assert remux_to_mp4(result.video, clip) == 10
    assert_plays(clip, 10)
    assert_progressive_mp4(clip, 10)
    # Lossless copy: the same pictures as the stream itself.
    wire_frames, _ = decode(result.video)
    file_frames, _ = decode(clip)
    assert all(np.array_equal(a, b) for a, b in zip(wire_frames, file_frames, strict=True))


def test_remux_keeps_what_arrived_and_refuses_nothing(tmp_path: Path) -> None:
    blobs = encode_clip(gradient_chunks(3, 4))
    cut = tmp_path / "cut.mp4"
    # No last chunk and no trailer, as after a dropped connection.
    assert remux_to_mp4(b"".join(blobs[:2]), cut) == 8
    assert_plays(cut, 8)
    assert_progressive_mp4(cut, 8)

    for bad in (b"", b"not an mp4 at all" * 10, blobs[-1]):
        with pytest.raises(RemuxError):
            remux_to_mp4(bad, tmp_path / "bad.mp4")
    assert sorted(p.name for p in tmp_path.iterdir()) == ["cut.mp4"]  # no leftovers


async def test_interactions_are_sent_at_their_media_time_and_reach_the_chunks(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    result = await stream_video(
        running.url,
        {**START, "num_frames": 30},
        interactions=[
            ScheduledInteraction(at=0.3, prompt="a blue square", transition_chunks=0),
            ScheduledInteraction(at=0.15, prompt="a green circle", transition_chunks=1),
        ],
    )
    assert result.outcome is StreamOutcome.COMPLETED and result.errors == []
    records = result.interactions
    assert [r.interaction.prompt for r in records] == ["a green circle", "a blue square"]
    assert [r.event_id for r in records] == ["interaction-1", "interaction-2"]
    # 2 frames at 8 fps: 0.25 s a chunk, so 0.15 s is reached by the first, 0.3 s by the second.
    assert [r.sent_media_time for r in records] == [0.25, 0.5]
    for record in records:
        assert record.sent_at is not None and record.queued_at is not None
        assert record.queued_at >= record.sent_at and record.not_sent is None
    first, second = (r.started_in_chunk for r in records)
    assert first is not None and second is not None and first <= second
    changes = running.engine.streams[0].changes
    assert [(c.event_id, c.prompt, c.transition_chunks) for c in changes] == [
        ("interaction-1", "a green circle", 1),
        ("interaction-2", "a blue square", 0),
    ]


async def test_an_error_answering_a_control_message_does_not_end_the_session(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    result = await stream_video(
        running.url,
        {**START, "num_frames": 16},
        interactions=[
            ScheduledInteraction(at=0.05, prompt="blue", event_id="same"),
            ScheduledInteraction(at=0.1, prompt="green", event_id="same"),
        ],
    )
    assert [(e.code, e.event_id) for e in result.errors] == [("event_id_conflict", "same")]
    assert result.error is None
    assert result.outcome is StreamOutcome.COMPLETED and result.frames == 16


async def test_stop_event_ends_with_session_done_and_a_playable_partial_video(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, steps=2, chunk_frames=2))
    stop = trio.Event()

    def on_chunk(chunk: Any, result: StreamResult) -> None:
        if result.frames >= 4:
            stop.set()

    result = await stream_video(
        running.url, {**START, "num_frames": 400}, on_chunk=on_chunk, stop_event=stop
    )
    assert result.outcome is StreamOutcome.STOPPED
    assert result.done is not None and result.done.stopped is True
    assert result.stop_requested_at is not None and not result.stop_timed_out
    assert 4 <= result.frames < 400
    clip = tmp_path / "stopped.mp4"
    assert remux_to_mp4(result.video, clip) == result.frames
    assert_plays(clip, result.frames)
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "stopped"


async def test_abort_event_drops_the_connection_at_once(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.05, chunk_frames=2))
    abort = trio.Event()
    aborted_at: list[float] = []

    def on_chunk(chunk: Any, result: StreamResult) -> None:
        aborted_at.append(trio.current_time())
        abort.set()

    result = await stream_video(
        running.url, {**START, "num_frames": 400}, on_chunk=on_chunk, abort_event=abort
    )
    # At once, not after the session: its 200 chunks of 4 steps of 50 ms take 40 s. The
    # bound leaves room for a pause of the whole test process.
    assert trio.current_time() - aborted_at[0] < 5.0
    assert result.outcome is StreamOutcome.ABORTED and result.done is None
    assert result.frames == 2 and len(result.binary_messages) >= 1
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "disconnected"


async def test_stop_before_the_session_exists_abandons_the_attempt(start_server: Any) -> None:
    running = await start_server()
    stop = trio.Event()
    stop.set()
    result = await stream_video(running.url, {**START, "num_frames": 4}, stop_event=stop)
    assert result.outcome is StreamOutcome.ABORTED
    assert result.messages == [] and result.start_sent_at is None
    assert running.engine.streams == []


async def test_server_error_is_the_outcome(start_server: Any) -> None:
    running = await start_server()
    result = await stream_video(running.url, {**START, "model": "someone-else"})
    assert result.outcome is StreamOutcome.ERROR
    assert result.error is not None and result.error.code == "model_mismatch"
    assert "someone-else" in result.error.message
    assert result.chunks == [] and result.video == b""
    assert result.close_code == 1000


async def test_a_rejected_request_prints_only_the_servers_error(
    start_server: Any, tmp_path: Path
) -> None:
    running = await start_server()
    result = await stream_video(
        running.url,
        {**START, "model": "someone-else"},
        interactions=[ScheduledInteraction(at=1.0, prompt="blue")],
    )
    assert result.outcome is StreamOutcome.ERROR and result.error is not None
    status, out, err = finish(result, output=tmp_path / "never.mp4")
    assert status == 1
    assert out == ""  # no summary of dashes
    assert err.splitlines() == [f"error: server error model_mismatch: {result.error.message}"]
    assert list(tmp_path.iterdir()) == []
    assert result.rejected
    # --json is for programs: they still get the whole object.
    status, out, _ = finish(result, json=True)
    summary = json.loads(out)
    assert status == 1 and summary["outcome"] == "error" and summary["seed"] is None
    assert summary["interactions"][0]["not_sent"] == "the server rejected the session"


class SeedReportingEngine(InstrumentedEngine):
    """Streams that tell the server their seed, as the diffusers engine's do."""

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        stream.seed = stream._inner.seed  # type: ignore[attr-defined]
        return stream


@pytest.mark.parametrize(("start", "seed"), [({}, 0), ({"seed": 7}, 7)])
async def test_the_seed_the_server_used_is_in_the_summary(
    start_server: Any, start: dict[str, Any], seed: int
) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=4), engine_class=SeedReportingEngine
    )
    result = await stream_video(running.url, {**START, "num_frames": 4, **start})
    assert result.seed == seed  # with no seed asked for, the one the engine chose (0)
    assert result.summary()["seed"] == seed
    status, out, _ = finish(result)
    assert status == 0 and re.search(rf"^seed +{seed}$", out, re.MULTILINE), out


async def test_a_full_server_is_a_server_error(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(hang_at_chunk=0), max_sessions=1)
    stop, admitted = trio.Event(), trio.Event()

    def on_message(message: protocol.ServerMessage, _: StreamResult) -> None:
        if isinstance(message, protocol.VideoStart):
            admitted.set()  # the one session slot is taken

    async with trio.open_nursery() as nursery:
        nursery.start_soon(
            partial(stream_video, running.url, START, stop_event=stop, on_message=on_message)
        )
        await admitted.wait()
        refused = await stream_video(running.url, START)
        stop.set()
    assert refused.outcome is StreamOutcome.ERROR
    assert refused.error is not None and refused.error.code == "server_busy"


async def test_connection_refused_raises_a_connect_error() -> None:
    url = f"ws://127.0.0.1:{free_port()}/v1/realtime/video"
    with pytest.raises(StreamConnectError) as info:
        await stream_video(url, START, connect_timeout=5)
    assert url in str(info.value) and "refused" in str(info.value).lower()
    assert info.value.status_code is None  # no HTTP answer at all


# ------------------------------------------------------------------ API keys

KEY = "k-3f9a"
"""The key of the keyed servers below; never to be printed by the client."""
REFUSED_401 = (
    "the server refused the request: 401 \u2014 a valid API key is required "
    f"(--api-key or {API_KEY_ENV})"
)


async def test_stream_video_sends_the_api_key_as_a_bearer_token(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    result = await stream_video(running.url, {**START, "num_frames": 4}, api_key=KEY)
    assert result.outcome is StreamOutcome.COMPLETED and result.frames == 4
    assert KEY not in json.dumps(result.summary())

    for key in (None, "not-the-key"):
        with pytest.raises(StreamConnectError) as info:
            await stream_video(running.url, START, api_key=key)
        assert info.value.status_code == 401
        assert "401 \u2014 a valid API key is required" in str(info.value)
        assert "not-the-key" not in str(info.value)
    assert running.engine.streams[1:] == []  # no session started without the key


@pytest.mark.parametrize("key", ["", "two words", "line\r\nX-Injected: 1", "cl\u00e9"])
async def test_a_key_that_cannot_be_a_header_is_refused_before_connecting(key: str) -> None:
    # Nothing listens at this port: the check must come before any connection attempt.
    url = f"ws://127.0.0.1:{free_port()}/v1/realtime/video"
    with pytest.raises(ValueError, match="the API key must be") as info:
        await stream_video(url, START, api_key=key)
    assert not key or key not in str(info.value)


@pytest.mark.parametrize(
    ("status", "meaning"),
    [
        (403, "403 \u2014 forbidden (the server's Origin check, or a proxy's rule)"),
        (
            503,
            "503 \u2014 the server is unavailable (draining, wedged, or at its connection "
            "cap); try again or another server",
        ),
        (500, "the server rejected the WebSocket handshake with HTTP 500"),
    ],
    ids=["403", "503", "500"],
)
async def test_a_refused_handshake_is_one_line_naming_the_status(
    nursery: trio.Nursery, status: int, meaning: str
) -> None:
    async def handler(request: WebSocketRequest) -> None:
        await request.reject(status, body=b"no\n")

    server = await nursery.start(
        partial(serve_websocket, handler, "127.0.0.1", 0, ssl_context=None)
    )
    url = f"ws://127.0.0.1:{server.port}/v1/realtime/video"
    with pytest.raises(StreamConnectError) as info:
        await stream_video(url, START)
    assert info.value.status_code == status
    line = _connect_error_line(info.value)
    assert line == f"cannot connect to {url}: " + (
        meaning if status == 500 else f"the server refused the request: {meaning}"
    )
    assert "--api-key" not in line  # the key hint is for 401 only


# ------------------------------------------------------------ other servers


async def test_reference_style_server_and_a_chunk_bigger_than_a_mebibyte(
    nursery: trio.Nursery, tmp_path: Path
) -> None:
    # Lossless noise: a single chunk well over trio-websocket's 1 MiB default.
    rng = np.random.default_rng(0)
    noise = [rng.integers(0, 256, (8, 240, 320, 3), dtype=np.uint8)]
    blobs = encode_clip(noise, codec_options={"qp": "0"})
    assert len(blobs[0]) > 1024 * 1024

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 8)
        await send_reference_chunk(ws, blobs[1], 0, 0)
        await ws.send_message(
            json.dumps(
                {"type": "session.done", "request_id": "ref-1", "chunks": 2, "stopped": False}
            )
        )

    peer = await start_peer(nursery, reference)
    result = await stream_video(peer.url, {"prompt": "noise", "seed": 3, "size": "320x240"})
    assert peer.received == [
        {"type": "session.start", "prompt": "noise", "seed": 3, "size": "320x240"}
    ]
    assert result.outcome is StreamOutcome.COMPLETED and result.problems == []
    assert result.binary_messages == blobs
    assert [c.metadata.transport_chunk_index for c in result.chunks if c.metadata] == [-1, -1]
    clip = tmp_path / "noise.mp4"
    assert remux_to_mp4(result.video, clip) == 8
    assert_plays(clip, 8, size=(320, 240))
    assert MAX_MESSAGE_SIZE >= 256 * 1024 * 1024


async def test_reference_error_without_code_is_understood(nursery: trio.Nursery) -> None:
    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(json.dumps({"type": "error", "message": "Invalid session.start: x"}))

    peer = await start_peer(nursery, reference)
    result = await stream_video(peer.url, START)
    assert result.outcome is StreamOutcome.ERROR
    assert result.error is not None and result.error.code == "invalid_request"


async def test_a_server_that_ignores_stop_is_given_up_on(nursery: trio.Nursery) -> None:
    blobs = encode_clip(gradient_chunks(1, 4))

    async def deaf(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 4)
        while True:
            await receive_json(ws, peer)

    peer = await start_peer(nursery, deaf)
    stop = trio.Event()
    result = await stream_video(
        peer.url,
        START,
        on_chunk=lambda chunk, result: stop.set(),
        stop_event=stop,
        stop_timeout=0.3,
    )
    assert result.outcome is StreamOutcome.ABORTED and result.stop_timed_out
    assert result.stop_requested_at is not None and result.ended_at is not None
    assert 0.3 <= result.ended_at - result.stop_requested_at < 2.5
    assert peer.received[1:] == [{"type": "session.stop"}]
    assert result.frames == 4 and result.binary_messages == blobs[:1]


async def test_connection_lost_midstream_is_disconnected(nursery: trio.Nursery) -> None:
    blobs = encode_clip(gradient_chunks(1, 4))

    async def crashing(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 4)
        await ws.aclose(code=1011, reason="boom")

    peer = await start_peer(nursery, crashing)
    result = await stream_video(peer.url, START)
    assert result.outcome is StreamOutcome.DISCONNECTED
    assert result.close_code == 1011 and result.frames == 4


async def test_interactions_wait_for_media_time_when_generation_beats_real_time(
    nursery: trio.Nursery,
) -> None:
    # 4 chunks of 2 frames at 8 fps, all sent at once: a 1 s video delivered in no time.
    # Wall-clock timing sent only the 0 s interaction; media time sends each as soon as
    # the video has reached it, and the one past the end is reported as never sent.
    blobs = encode_clip(gradient_chunks(4, 2), fps=8)

    async def fast(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)  # no fps in config: read from the stream
        for index, blob in enumerate(blobs[:-1]):
            await send_reference_chunk(ws, blob, index, 2)
        await send_reference_chunk(ws, blobs[-1], 0, 0)
        await send_session_done(ws, chunks=5)
        for _ in range(3):
            await receive_json(ws, peer)
        await ws.aclose()

    peer = await start_peer(nursery, fast)
    result = await stream_video(
        peer.url,
        START,
        interactions=[
            ScheduledInteraction(at=2.0, prompt="never"),
            ScheduledInteraction(at=0.6, prompt="blue"),
            ScheduledInteraction(at=0.5, prompt="green"),
            ScheduledInteraction(at=0.0, prompt="at once"),
        ],
    )
    assert sent_interactions(peer) == [
        ("interaction-1", "at once"),
        ("interaction-2", "green"),
        ("interaction-3", "blue"),
    ]
    assert result.outcome is StreamOutcome.COMPLETED and result.frame_rate == 8
    assert result.media_time == 1.0
    # Sent at the first chunk boundary at or after their time: 0, 0.5, then 0.75 for 0.6.
    assert [r.sent_media_time for r in result.interactions] == [0.0, 0.5, 0.75, None]
    assert [r.not_sent for r in result.interactions] == [None, None, None, "the video ended at 1 s"]

    status, out, err = finish(result)
    assert status == 0
    assert err.splitlines() == [
        'warning: interaction-4 "never" (at 2 s) not sent: the video ended at 1 s'
    ]
    assert re.search(r"^interactions +4 planned, 3 sent, 0 queued$", out, re.MULTILINE), out
    assert re.search(r"^seed +unknown$", out, re.MULTILINE), out  # the reference's echo
    status, out, _ = finish(result, json=True)
    summary = json.loads(out)
    assert summary["seed"] is None
    assert [(i["sent_media_s"], i["not_sent"]) for i in summary["interactions"]] == [
        (0.0, None),
        (0.5, None),
        (0.75, None),
        (None, "the video ended at 1 s"),
    ]


@pytest.mark.parametrize(
    ("config_fps", "request_fps", "sent_media_time", "not_sent"),
    [
        (4, None, 0.5, None),
        (None, 4, 0.5, None),
        (None, None, None, "the frame rate is unknown"),
    ],
)
async def test_media_time_without_stream_timing_uses_the_announced_fps(
    nursery: trio.Nursery,
    config_fps: int | None,
    request_fps: int | None,
    sent_media_time: float | None,
    not_sent: str | None,
) -> None:
    config: dict[str, Any] = {"prompt": "x"} if config_fps is None else {"fps": config_fps}
    opaque = b"not an MP4 the client can read timing from"

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(
            json.dumps(
                {"type": "video.start", "request_id": "ref-1", "format": "m4s", "config": config}
            )
        )
        await send_reference_chunk(ws, opaque, 0, 2)
        if sent_media_time is not None:
            await receive_json(ws, peer)  # the interaction, sent before anything else
        await send_session_done(ws, chunks=1)
        await ws.aclose()

    peer = await start_peer(nursery, reference)
    start = {"prompt": "x"} if request_fps is None else {"prompt": "x", "fps": request_fps}
    result = await stream_video(
        peer.url, start, interactions=[ScheduledInteraction(at=0.5, prompt="blue")]
    )
    assert result.outcome is StreamOutcome.COMPLETED
    (record,) = result.interactions
    assert record.sent_media_time == sent_media_time
    assert len(sent_interactions(peer)) == (sent_media_time is not None)
    if not_sent is None:
        assert record.not_sent is None
    else:
        assert record.not_sent is not None and record.not_sent.startswith(not_sent)
        assert f"not sent: {not_sent}" in finish(result)[2]


async def test_an_interaction_the_server_rejects_is_a_warning_with_its_code(
    nursery: trio.Nursery,
) -> None:
    blobs = encode_clip(gradient_chunks(1, 2))

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await receive_json(ws, peer)  # interaction-1, due at 0 s
        # The reference's wording, without a code: the client maps it.
        await ws.send_message(
            json.dumps(
                {
                    "type": "error",
                    "message": "Failed to apply interaction: bad prompt",
                    "event_id": "interaction-1",
                }
            )
        )
        await send_reference_chunk(ws, blobs[0], 0, 2)
        await send_reference_chunk(ws, blobs[1], 0, 0)
        await send_session_done(ws, chunks=2)
        await ws.aclose()

    peer = await start_peer(nursery, reference)
    result = await stream_video(
        peer.url, START, interactions=[ScheduledInteraction(at=0, prompt="blue")]
    )
    assert result.outcome is StreamOutcome.COMPLETED and result.error is None
    (record,) = result.interactions
    assert record.error is not None and record.error.code == "interaction_failed"
    status, _, err = finish(result)
    assert status == 0
    assert err.splitlines() == [
        'warning: interaction-1 "blue" (at 0 s) rejected by the server: '
        "interaction_failed: Failed to apply interaction: bad prompt"
    ]


async def test_interactions_after_a_stop_are_reported_as_not_sent(nursery: trio.Nursery) -> None:
    blobs = encode_clip(gradient_chunks(1, 2), fps=8)

    async def reference(ws: WebSocketConnection, peer: Peer) -> None:
        await receive_json(ws, peer)
        await ws.send_message(VIDEO_START_REF)
        await send_reference_chunk(ws, blobs[0], 0, 2)
        assert (await receive_json(ws, peer))["type"] == "session.stop"
        await send_reference_chunk(ws, blobs[1], 0, 0)
        await send_session_done(ws, chunks=2, stopped=True)
        await ws.aclose()

    peer = await start_peer(nursery, reference)
    stop = trio.Event()
    result = await stream_video(
        peer.url,
        START,
        interactions=[ScheduledInteraction(at=3, prompt="later")],
        on_chunk=lambda chunk, result: stop.set(),
        stop_event=stop,
    )
    assert result.outcome is StreamOutcome.STOPPED
    assert finish(result)[2].splitlines() == [
        'warning: interaction-1 "later" (at 3 s) not sent: the session was stopped at 0.25 s'
    ]
    assert result.interactions[0].not_sent == "the session was stopped at 0.25 s"


def test_a_scheduled_interaction_needs_a_prompt_or_a_camera() -> None:
    from trio_vstream.values import Camera

    with pytest.raises(ValueError, match="a prompt, a camera, or both"):
        ScheduledInteraction(at=1.0)
    camera = Camera("velocity", (0.0, 0.0, 0.05), (0.0, 0.0, 0.0, 1.0))
    both = ScheduledInteraction(at=1.0, prompt="a road", camera=camera)
    assert both.describe() == '"a road" + camera velocity:0,0,0.05:0,0,0,1'
