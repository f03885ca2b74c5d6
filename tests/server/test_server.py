"""End-to-end behaviour over real loopback WebSockets: protocol, guarantees G1-G5, limits."""

from __future__ import annotations

import base64
import io
import json
import threading
import time
from typing import Any

import av
import numpy as np
import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import (
    Transcript,
    decode_video,
    is_type,
    receive_into,
    receive_until,
    record_stops,
)
from tests.instrumented import (
    MEET_TIMEOUT_S,
    FirstStepMeeting,
    InstrumentedEngine,
    InstrumentedStream,
)
from trio_vstream.engines import SamplingSettings
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "a red circle moving left", "size": "64x48", "fps": 8}


def assert_g1(running: Any, index: int = -1) -> None:
    """At the moment the handler returned: no engine thread inside, every stream closed once."""
    check = running.checks_at_end[index]
    assert check == {"threads_inside": 0, "unclosed_streams": 0}


# --------------------------------------------------------------- happy path


async def test_full_session_streams_chunks_trailer_and_done(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=4))
    transcript = await running.run_session({**START, "num_frames": 10})

    start = transcript.messages[0]
    assert start["type"] == "video.start"
    assert start["format"] == "m4s"
    assert start["request_id"].startswith("video_stream-")
    assert "format" not in start["config"] and start["config"]["prompt"] == START["prompt"]

    # Every chunk: metadata JSON, then exactly one binary frame of that length.
    body = transcript.messages[1:-1]
    metas = body[0::2]
    blobs = body[1::2]
    assert [m["type"] for m in metas] == ["video.chunk_metadata"] * len(metas)
    assert all(isinstance(b, bytes) for b in blobs)
    assert [m["byte_length"] for m in metas] == [len(b) for b in blobs]
    assert [m["kind"] for m in metas] == ["media", "media", "media", "trailer"]
    assert [m["num_frames"] for m in metas] == [4, 4, 2, 0]
    assert [m["generation_chunk_index"] for m in metas] == [0, 1, 2, None]
    assert [m["transport_chunk_index"] for m in metas] == [0, 1, 2, 3]
    assert blobs[0][4:8] == b"ftyp"

    done = transcript.messages[-1]
    assert done == {
        "type": "session.done",
        "request_id": start["request_id"],
        "chunks": 4,
        "stopped": False,
    }
    assert transcript.close_code == 1000

    frames = decode_video(transcript.video_bytes)
    assert len(frames) == 10
    assert frames[0].shape == (48, 64, 3)
    with av.open(io.BytesIO(transcript.video_bytes)) as container:
        assert container.streams.video[0].average_rate == 8

    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "completed"
    assert_g1(running)


async def test_each_chunk_is_decodable_when_it_arrives(start_server: Any) -> None:
    """No frame of chunk k is held back until chunk k+1 (unlike the reference)."""
    running = await start_server(SyntheticSettings(chunk_frames=3))
    transcript = await running.run_session({**START, "num_frames": 9})
    received = b""
    frames_so_far = 0
    for message in transcript.messages:
        if isinstance(message, dict) and message["type"] == "video.chunk_metadata":
            frames_so_far += message["num_frames"]
        elif isinstance(message, bytes):
            received += message
            assert len(decode_video(received)) == frames_so_far


async def test_seconds_times_fps_sets_frame_count(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=8))
    transcript = await running.run_session(
        {"type": "session.start", "prompt": "x", "seconds": "2", "fps": 6, "size": "32x32"}
    )
    assert len(decode_video(transcript.video_bytes)) == 12


async def test_sampling_params_are_lifted_and_echoed(start_server: Any) -> None:
    running = await start_server()
    transcript = await running.run_session(
        {**START, "num_frames": 2, "sampling_params": {"seed": 7, "custom_knob": 3}}
    )
    config = transcript.messages[0]["config"]
    assert config["seed"] == 7
    assert config["extra_params"] == {"custom_knob": 3}
    assert running.engine.streams[0].request.seed == 7
    assert running.engine.streams[0].request.extra_params == {"custom_knob": 3}


async def test_model_family_settings_reach_the_engine_in_its_sampling_settings(
    start_server: Any,
) -> None:
    running = await start_server()
    family = {"guidance_scale_2": 3.0, "true_cfg_scale": 2.0, "boundary_ratio": 0.5}
    await running.run_session(
        {**START, "num_frames": 2, **family, "sampling_params": {"flow_shift": 5.0}}
    )
    request = running.engine.streams[0].request
    assert request.sampling == SamplingSettings(**family, flow_shift=5.0)


async def test_image_reference_reaches_the_engine_decoded(start_server: Any) -> None:
    image = np.zeros((20, 30, 3), np.uint8)
    image[..., 1] = 200
    buffer = io.BytesIO()
    with av.open(buffer, "w", format="image2pipe") as container:
        stream = container.add_stream("png", rate=1)
        stream.width, stream.height, stream.pix_fmt = 30, 20, "rgb24"
        for packet in stream.encode(av.VideoFrame.from_ndarray(image, format="rgb24")):
            container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode()
    running = await start_server()
    transcript = await running.run_session(
        {**START, "num_frames": 2, "image_reference": {"image_url": url}}
    )
    assert transcript.terminal[0]["type"] == "session.done"
    received = running.engine.streams[0].request.image
    assert received is not None and received.shape == (20, 30, 3)
    assert np.array_equal(received, image)


async def test_codec_options_override_and_bad_ones_are_rejected(start_server: Any) -> None:
    running = await start_server()
    big = {**START, "size": "256x256", "num_frames": 4}
    lossless = await running.run_session(
        {**big, "extra_params": {"video_codec_options": {"qp": "0"}}}
    )
    default = await running.run_session(big)
    assert len(lossless.video_bytes) > 2 * len(default.video_bytes)
    bad = await running.run_session(
        {**START, "num_frames": 4, "extra_params": {"video_codec_options": {"preset": "bogus"}}}
    )
    assert bad.types == ["error"]
    assert bad.terminal[0]["code"] == "invalid_request"
    assert 'video_codec_options.preset: "bogus" is not allowed' in bad.terminal[0]["message"]


# ------------------------------------------------------------ start errors


@pytest.mark.parametrize(
    ("raw", "code", "text"),
    [
        ("{not json", "invalid_json", "Invalid JSON in session.start"),
        ("[1, 2]", "invalid_message", "session.start must be a JSON object"),
        (
            '{"type": "session.ping"}',
            "invalid_message",
            "Expected session.start, got: session.ping",
        ),
        (json.dumps({**START, "format": "webm"}), "invalid_request", "format"),
        (json.dumps({**START, "num_frames": "30"}), "invalid_request", "num_frames"),
        (json.dumps({**START, "num_frames": True}), "invalid_request", "num_frames"),
        (json.dumps({**START, "num_frames": 2.9}), "invalid_request", "num_frames"),
        (json.dumps({"type": "session.start", "promt": "typo"}), "invalid_request", "promt"),
        (json.dumps({**START, "num_inference_steps": 500}), "invalid_request", "200"),
        (json.dumps({**START, "model": "other"}), "model_mismatch", "Model mismatch"),
        (json.dumps({**START, "size": "4000x4000"}), "invalid_request", "width"),
        (
            json.dumps({**START, "image_reference": {"image_url": "http://example.com/x.png"}}),
            "invalid_request",
            "data:image",
        ),
    ],
)
async def test_bad_session_start_gets_one_error_and_a_normal_close(
    start_server: Any, raw: str, code: str, text: str
) -> None:
    running = await start_server()
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(raw)
        await receive_into(ws, transcript)
    assert len(transcript.messages) == 1
    error = transcript.messages[0]
    assert error["type"] == "error" and error["code"] == code
    assert text in error["message"]
    assert transcript.close_code == 1000
    assert running.engine.streams == []  # rejected before any work


async def test_oversized_session_start_is_rejected(start_server: Any) -> None:
    from trio_vstream.protocol import Limits

    running = await start_server(limits=Limits(max_start_bytes=1000))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "user": "x" * 1500}))
        await receive_into(ws, transcript)
    assert transcript.messages == [
        {"type": "error", "code": "message_too_large", "message": "session.start message too large"}
    ]


async def test_start_timeout(start_server: Any) -> None:
    running = await start_server(start_timeout=0.2)
    transcript = Transcript()
    async with running.connect() as ws:
        await receive_into(ws, transcript)
    assert [(m["code"], m["message"]) for m in transcript.json] == [
        ("start_timeout", "Timeout waiting for session.start")
    ]
    assert transcript.close_code == 1000


async def test_wrong_path_is_refused(start_server: Any) -> None:
    from trio_websocket import HandshakeError

    running = await start_server()
    with pytest.raises(HandshakeError):
        async with open_websocket_url(f"ws://127.0.0.1:{running.server.port}/elsewhere"):
            pass


# ----------------------------------------------------------- control plane


async def test_ping_gets_pong_during_generation(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.05, chunk_frames=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 8}))
        await receive_until(ws, transcript, is_type("video.start"))
        await ws.send_message('{"type": "session.ping"}')
        await receive_into(ws, transcript)
    assert transcript.of_type("session.pong")
    assert transcript.terminal[-1]["type"] == "session.done"


async def test_bad_control_messages_get_errors_and_the_session_goes_on(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, chunk_frames=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 12}))
        await receive_until(ws, transcript, is_type("video.start"))
        for raw in (
            "nope",
            "[]",
            '{"type": "session.dance"}',
            '{"type": "session.interaction"}',
            '{"type": "session.interaction", "interaction": {"event": {"prompt": "p"},'
            ' "transition_chunks": 2.5}}',
            '{"type": "session.interaction", "interaction": {"event": {"prompt": "p"},'
            ' "transition_chunks": -1}}',
        ):
            await ws.send_message(raw)
        await receive_into(ws, transcript)
    errors = [(m["code"], m["message"]) for m in transcript.of_type("error")]
    assert errors == [
        ("invalid_json", "Invalid JSON message"),
        ("invalid_message", "WebSocket messages must be JSON objects"),
        ("unknown_type", "Unknown message type: session.dance"),
        ("invalid_message", "session.interaction requires an interaction object"),
        ("invalid_message", "session.interaction transition_chunks must be an integer"),
        ("invalid_message", "session.interaction transition_chunks must be >= 0"),
    ]
    assert transcript.terminal[-1]["type"] == "session.done"
    assert transcript.terminal[-1]["stopped"] is False


async def test_interactions_flow_through_chunk_metadata(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.03, chunk_frames=2, steps=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 16}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(
            json.dumps(
                {
                    "type": "session.interaction",
                    "interaction": {
                        "event_id": "e1",
                        "event": {"prompt": "a blue square"},
                        "transition_chunks": 2.0,
                    },
                }
            )
        )
        await receive_until(ws, transcript, is_type("session.interaction.queued"))
        # The same id again is a conflict; the session goes on.
        await ws.send_message(
            json.dumps(
                {
                    "type": "session.interaction",
                    "interaction": {"event_id": "e1", "event": {"prompt": "again"}},
                }
            )
        )
        await receive_into(ws, transcript)
    queued = transcript.of_type("session.interaction.queued")
    assert queued == [
        {
            "type": "session.interaction.queued",
            "request_id": transcript.messages[0]["request_id"],
            "event_id": "e1",
        }
    ]
    conflict = transcript.of_type("error")
    assert [(e["code"], e["event_id"]) for e in conflict] == [("event_id_conflict", "e1")]
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    started = [m["generation_chunk_index"] for m in media if "e1" in m["started_event_ids"]]
    active = [m["generation_chunk_index"] for m in media if "e1" in m["active_event_ids"]]
    completed = [m["generation_chunk_index"] for m in media if "e1" in m["completed_event_ids"]]
    assert len(started) == 1 and active == started and completed == [started[0] + 1]
    assert running.engine.streams[0].changes[0].transition_chunks == 2


# -------------------------------------------------------------- G1 and G2


@pytest.mark.slow
async def test_stop_ends_within_one_step_with_done(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.05, steps=4, chunk_frames=2))
    stops = record_stops(monkeypatch)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message('{"type": "session.stop"}')
        await receive_into(ws, transcript)
    done = transcript.terminal
    assert len(done) == 1 and done[0]["type"] == "session.done" and done[0]["stopped"] is True
    metas = transcript.of_type("video.chunk_metadata")
    assert {m["kind"] for m in metas} == {"media"}  # no trailer after a stop, as in the reference
    assert done[0]["chunks"] == len(metas)
    assert transcript.close_code == 1000
    # What was sent still decodes, frame for frame.
    sent_frames = sum(m["num_frames"] for m in metas)
    assert len(decode_video(transcript.video_bytes)) == sent_frames
    await running.wait_sessions_ended(1)
    assert running.engine.streams[0].steps_after(stops.times[0]) <= 1  # G2
    assert_g1(running)


async def test_disconnect_stops_engine_and_closes_stream(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.05, steps=4, chunk_frames=2))
    stops = record_stops(monkeypatch)
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        await receive_until(ws, Transcript(), is_type("video.chunk_metadata"))
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "disconnected"
    assert running.engine.streams[0].steps_after(stops.times[0]) <= 1
    assert_g1(running)
    assert running.server.stats.streams_open == 0
    assert running.server.stats.worker_threads == 0


async def test_stall_guard_aborts_a_hung_engine(start_server: Any) -> None:
    running = await start_server(
        SyntheticSettings(hang_at_chunk=1, chunk_frames=2), stall_timeout=0.3
    )
    transcript = await running.run_session({**START, "num_frames": 10})
    errors = transcript.terminal
    assert len(errors) == 1
    assert errors[0]["code"] == "stall_timeout"
    assert errors[0]["message"] == "Stall timeout: no generation progress"
    assert transcript.close_code == 1000
    await running.wait_sessions_ended(1)
    assert_g1(running)


@pytest.mark.slow
async def test_pings_keep_a_silent_engine_alive(start_server: Any) -> None:
    # The timeout is well above the ping interval, so that a pause of the whole test
    # process (a full garbage collection, say) cannot pass for a stall.
    running = await start_server(SyntheticSettings(hang_at_chunk=0), stall_timeout=1.5)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 10}))
        await receive_until(ws, transcript, is_type("video.start"))
        for _ in range(10):  # 3 s of a hung engine, well past the 1.5 s stall timeout
            await ws.send_message('{"type": "session.ping"}')
            await receive_until(ws, transcript, is_type("session.pong"))
            await trio.sleep(0.3)  # the client's ping interval: time passing is the test
        await ws.send_message('{"type": "session.stop"}')
        await receive_into(ws, transcript)
    assert not transcript.of_type("error")
    assert len(transcript.of_type("session.pong")) == 10
    assert transcript.terminal == [
        {
            "type": "session.done",
            "request_id": transcript.messages[0]["request_id"],
            "chunks": 0,
            "stopped": True,
        }
    ]


@pytest.mark.slow
async def test_slow_engine_without_client_messages_is_not_a_stall(start_server: Any) -> None:
    """Each chunk takes 2 s, past the 1.5 s stall timeout, but its steps (0.1 s each)
    are progress. The timeout stays well above a step, so that a pause of the whole
    test process cannot pass for a stall."""
    running = await start_server(
        SyntheticSettings(step_delay=0.1, steps=20, chunk_frames=1), stall_timeout=1.5
    )
    transcript = await running.run_session({**START, "num_frames": 2})
    assert transcript.terminal[0]["type"] == "session.done"
    assert len(decode_video(transcript.video_bytes)) == 2


# ---------------------------------------------------------------------- G3


class SignalsClose(InstrumentedEngine):
    """Says (to a test's thread) when a session's stream has been closed."""

    def __init__(self, settings: SyntheticSettings) -> None:
        super().__init__(settings)
        self.stream_closed = threading.Event()

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        close = stream.close

        def closing() -> None:
            close()
            self.stream_closed.set()

        stream.close = closing  # type: ignore[method-assign]
        return stream


async def test_chunks_made_before_an_engine_failure_are_still_sent(start_server: Any) -> None:
    """The engine makes chunks 0 and 1, then fails at chunk 2, while no chunk has been
    encoded yet (the test holds every encode slot). What the engine made is the user's
    video so far: both chunks arrive, then the error."""
    running = await start_server(
        SyntheticSettings(fail_at_chunk=2, chunk_frames=2, steps=1), engine_class=SignalsClose
    )
    limiter = running.server._resources.encode_limiter
    holders = [object() for _ in range(int(limiter.total_tokens))]
    for holder in holders:
        await limiter.acquire_on_behalf_of(holder)
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 10}))
        # The engine failed (and its stream was closed) before anything was encoded.
        assert await trio.to_thread.run_sync(running.engine.stream_closed.wait, 20)
        for holder in holders:
            limiter.release_on_behalf_of(holder)
        await receive_into(ws, transcript)
    media = [m for m in transcript.of_type("video.chunk_metadata") if m["kind"] == "media"]
    assert [m["generation_chunk_index"] for m in media] == [0, 1]
    assert len(decode_video(transcript.video_bytes)) == 4
    assert transcript.terminal[-1]["code"] == "generation_failed"
    assert transcript.close_code == 1000


@pytest.mark.slow
async def test_engine_failure_reaches_the_client_and_spares_other_sessions(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    running = await start_server(
        SyntheticSettings(fail_at_chunk=1, chunk_frames=2, step_delay=0.01)
    )
    failing = Transcript()
    healthy: dict[str, Transcript] = {}

    async def healthy_session() -> None:
        # This session's chunk 1 fails too, so it asks for a single chunk.
        healthy["t"] = await running.run_session({**START, "num_frames": 2})

    async with trio.open_nursery() as nursery:
        nursery.start_soon(healthy_session)
        async with running.connect() as ws:
            await ws.send_message(json.dumps({**START, "num_frames": 10}))
            await receive_into(ws, failing)
    error = failing.terminal
    assert len(error) == 1 and error[0]["code"] == "generation_failed"
    assert "synthetic engine failure at chunk 1" in error[0]["message"]
    assert error[0]["request_id"] == failing.messages[0]["request_id"]
    assert len(failing.of_type("video.chunk_metadata")) == 1  # chunk 0 arrived first
    assert failing.close_code == 1000
    assert healthy["t"].terminal[0]["type"] == "session.done"
    assert any(failing.messages[0]["request_id"] in r.getMessage() for r in caplog.records)
    # The server still serves.
    again = await running.run_session({**START, "num_frames": 2})
    assert again.terminal[0]["type"] == "session.done"
    await running.wait_sessions_ended(3)
    assert all(c == {"threads_inside": 0, "unclosed_streams": 0} for c in running.checks_at_end)


async def test_a_bug_in_the_session_is_contained(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_vstream import protocol

    running = await start_server(SyntheticSettings(chunk_frames=2))

    def broken_to_json(self: Any) -> str:
        raise RuntimeError("serialiser bug")

    monkeypatch.setattr(protocol.ChunkMetadata, "to_json", broken_to_json)
    transcript = await running.run_session({**START, "num_frames": 4})
    assert [(m["type"], m.get("code")) for m in transcript.terminal] == [
        ("error", "internal_error")
    ]
    assert transcript.close_code == 1000
    monkeypatch.undo()
    again = await running.run_session({**START, "num_frames": 2})
    assert again.terminal[0]["type"] == "session.done"
    await running.wait_sessions_ended(2)
    assert_g1(running, 0)


async def test_engine_returning_bad_frames_is_a_generation_error(start_server: Any) -> None:
    running = await start_server()
    original = running.engine.open_stream

    def open_stream(request: Any) -> Any:
        stream = original(request)
        inner = stream._inner
        real = inner._render
        inner._render = lambda first, count, colour: real(first, count, colour)[..., :2]
        return stream

    running.engine.open_stream = open_stream  # type: ignore[method-assign]
    transcript = await running.run_session({**START, "num_frames": 4})
    error = transcript.terminal[0]
    assert error["code"] == "generation_failed"
    assert "expected (T, 48, 64, 3) uint8" in error["message"]


# ---------------------------------------------------------------------- G5


@pytest.mark.slow
async def test_client_that_stops_reading_stalls_generation_not_memory(start_server: Any) -> None:
    # Lossless 320x240 chunks are large, so socket buffers fill after a few.
    running = await start_server(SyntheticSettings(chunk_frames=8), stall_timeout=1.0)
    start = {
        **START,
        "size": "320x240",
        "num_frames": 2000,
        "extra_params": {"video_codec_options": {"qp": "0"}},
    }
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        await receive_until(ws, Transcript(), is_type("video.chunk_metadata"))
        # Stop reading; the session must end by the stall guard.
        await running.wait_sessions_ended(1, timeout=15)
    summary = running.summaries[0]
    assert summary.outcome.value == "stalled"
    generated = len(running.engine.streams[0].step_times) // 5  # 4 steps + final checkpoint
    assert generated <= summary.chunks_sent + 3
    assert summary.chunks_sent < 2000 // 8
    assert_g1(running)


# --------------------------------------------------------- admission, etc.


async def test_server_busy_when_full(start_server: Any) -> None:
    """A full server refuses the upgrade itself, so that a balancer can try another: HTTP
    503 with Retry-After, and the server_busy error as JSON for a client to read."""
    running = await start_server(SyntheticSettings(hang_at_chunk=0), max_sessions=1)
    async with running.connect() as first:
        await first.send_message(json.dumps({**START, "num_frames": 10}))
        await receive_until(first, Transcript(), is_type("video.start"))
        with pytest.raises(ConnectionRejected) as refused:
            async with running.connect():
                pass
        rejected = refused.value
        headers = {name.decode(): value.decode() for name, value in rejected.headers}
        assert rejected.status_code == 503
        assert headers["retry-after"] == "1"
        assert headers["content-type"] == "application/json"
        assert json.loads(rejected.body or b"") == {
            "type": "error",
            "code": "server_busy",
            "message": "Server busy: 1 sessions running; try again later",
        }
        await first.send_message('{"type": "session.stop"}')
        await receive_into(first, Transcript())
    await running.wait_sessions_ended(1)
    assert len(running.summaries) == 1  # the refused upgrade never became a session


async def test_steps_of_concurrent_sessions_take_turns(start_server: Any) -> None:
    running = await start_server(
        SyntheticSettings(step_delay=0.01, steps=3, chunk_frames=1, concurrency=1)
    )
    # Both streams ask for their first step together: else, under load, one session can
    # make its whole video before the other has connected, and there are no turns to see.
    running.engine.meet = FirstStepMeeting(2)
    results: list[Transcript] = []

    async def one() -> None:
        results.append(await running.run_session({**START, "num_frames": 6}))

    async with trio.open_nursery() as nursery:
        nursery.start_soon(one)
        nursery.start_soon(one)
    assert all(t.terminal[0]["type"] == "session.done" for t in results)
    a, b = (s.step_times for s in running.engine.streams)
    # Interleaved: each session ran steps while the other was between its first and last.
    assert a[0] < b[-1] and b[0] < a[-1]
    overlapping = sum(1 for t in a if b[0] < t < b[-1])
    assert overlapping >= 3


@pytest.mark.parametrize("slots", [1, 3])
async def test_encoders_share_the_cpu_through_a_server_wide_limit(
    start_server: Any, monkeypatch: pytest.MonkeyPatch, slots: int
) -> None:
    from trio_vstream.session import delivery as delivery_module

    sessions = 4
    running = await start_server(SyntheticSettings(chunk_frames=4), encode_concurrency=slots)
    limiter = running.server._resources.encode_limiter
    changed = threading.Condition()
    busy = 0
    most = 0
    met = False
    real_encode = delivery_module.encode_chunk

    def queued_for_a_slot() -> int:
        return int(trio.from_thread.run_sync(limiter.statistics).tasks_waiting)

    def meet() -> None:
        """The first encodes wait until every session's first chunk is being encoded or
        waits for a slot: as many encodes then overlap as the limit lets (all four, were
        there no limit), whatever the machine's load."""
        nonlocal met
        deadline = time.monotonic() + MEET_TIMEOUT_S
        while True:
            waiting = queued_for_a_slot()
            with changed:
                if met or busy + waiting >= sessions:
                    met = True
                    changed.notify_all()
                    return
                assert time.monotonic() < deadline, f"{busy} encoding, {waiting} waiting"
                changed.wait(timeout=0.01)  # a slot's queue changes without telling us

    def counting_encode(*args: Any) -> Any:
        nonlocal busy, most
        with changed:
            busy += 1
            most = max(most, busy)
            changed.notify_all()
        try:
            meet()
            return real_encode(*args)
        finally:
            with changed:
                busy -= 1

    monkeypatch.setattr(delivery_module, "encode_chunk", counting_encode)
    results: list[Transcript] = []

    async def one() -> None:
        results.append(await running.run_session({**START, "num_frames": 24}))

    async with trio.open_nursery() as nursery:
        for _ in range(sessions):
            nursery.start_soon(one)
    assert all(len(decode_video(t.video_bytes)) == 24 for t in results)
    assert most == slots


@pytest.mark.slow
async def test_graceful_shutdown_ends_running_sessions(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.02, chunk_frames=2))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 1000}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        running.server.shutdown()
        await receive_into(ws, transcript)
    terminal = transcript.terminal
    assert len(terminal) == 1
    assert terminal[0]["type"] == "error" and terminal[0]["code"] == "server_shutdown"
    assert transcript.of_type("video.chunk_metadata")
    assert len(decode_video(transcript.video_bytes)) == sum(
        m["num_frames"] for m in transcript.of_type("video.chunk_metadata")
    )
    assert transcript.close_code == 1000
    await running.wait_sessions_ended(1)
    assert_g1(running)
