"""The plain-HTTP side of the port: the page, /health, /v1/models, /stats and /metrics."""

from __future__ import annotations

import json
import time
import types
from typing import Any

import pytest
import trio
import trio.testing
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import ConnectionRejected

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings, SyntheticStream

START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}


async def http_get_with_headers(
    port: int, path: str, method: str = "GET"
) -> tuple[int, dict[str, str], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *header_lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in header_lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    status, _, body = await http_get_with_headers(port, path, method)
    return status, body


async def test_health_and_status_codes(start_server: Any) -> None:
    running = await start_server()
    port = running.server.port
    assert await http_get(port, "/health") == (200, b"ok\n")
    assert (await http_get(port, "/nowhere"))[0] == 404
    assert (await http_get(port, "/v1/realtime/video"))[0] == 426
    assert (await http_get(port, "/health", method="POST"))[0] == 405


async def test_malformed_request_gets_400_and_server_keeps_serving(start_server: Any) -> None:
    running = await start_server()
    stream = await trio.open_tcp_stream("127.0.0.1", running.server.port)
    async with stream:
        await stream.send_all(b"\x16\x03\x01 not http at all\r\n\r\n")
        reply = await stream.receive_some()
    assert reply.startswith(b"HTTP/1.1 400")
    assert await http_get(running.server.port, "/health") == (200, b"ok\n")


async def test_metrics_report_sessions_and_stream_close_times(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(chunk_frames=2))
    await running.run_session(START)
    await running.wait_sessions_ended(1)
    status, body = await http_get(running.server.port, "/stats")
    assert status == 200
    metrics = json.loads(body)
    assert metrics["sessions_total"] == 1
    assert metrics["sessions_active"] == 0
    assert metrics["streams_open"] == 0
    assert metrics["worker_threads"] == 0
    assert metrics["chunks_sent"] == 3  # two media chunks and the trailer
    assert metrics["rss_bytes"] > 0
    (session,) = metrics["recent_sessions"]
    assert session["outcome"] == "completed"
    assert session["started_at"] <= session["stream_closed_at"] <= session["ended_at"]
    assert session["ended_at"] <= metrics["monotonic"]


BURN_S = 0.02


class _BurningEngine(InstrumentedEngine):
    """Spends `BURN_S` of its thread's CPU at the start of every ``next_chunk``."""

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk

        def burning(checkpoint: Checkpoint) -> Chunk | None:
            end = time.thread_time() + BURN_S
            while time.thread_time() < end:
                pass
            return next_chunk(checkpoint)

        stream.next_chunk = burning  # type: ignore[method-assign]
        return stream


async def test_stats_count_the_engines_cpu_and_not_its_waits(start_server: Any) -> None:
    """``engine_cpu_seconds``: the CPU the engine's calls took (what the benchmark leaves
    out of the server's cost), not their wall time (here mostly sleeping steps)."""
    running = await start_server(
        SyntheticSettings(chunk_frames=2, steps=1, step_delay=0.2), engine_class=_BurningEngine
    )
    port = running.server.port
    assert json.loads((await http_get(port, "/stats"))[1])["engine_cpu_seconds"] == 0
    cpu = time.process_time()
    await running.run_session(START)  # 4 frames: two chunks, then the call that ends it
    await running.wait_sessions_ended(1)
    cpu = time.process_time() - cpu
    engine = json.loads((await http_get(port, "/stats"))[1])["engine_cpu_seconds"]
    assert engine >= 3 * BURN_S
    assert engine <= cpu  # a thread's CPU is part of the process's; 0.4 s slept is not


@pytest.mark.slow
async def test_stats_tell_waiting_upgrades_from_running_sessions(start_server: Any) -> None:
    """An upgrade that has not sent ``session.start`` holds no session slot: ``/stats``
    counts it in ``sessions_waiting``, not in ``sessions_running`` (what counts against
    ``--max-sessions``); ``sessions_active`` is both."""
    running = await start_server(SyntheticSettings(step_delay=0.01, chunk_frames=4))

    async def stats() -> dict[str, Any]:
        status, body = await http_get(running.server.port, "/stats")
        assert status == 200
        return dict(json.loads(body))

    async with running.connect() as ws:
        with trio.fail_after(5):
            while (seen := await stats())["sessions_active"] == 0:
                await trio.testing.wait_all_tasks_blocked()
        assert (seen["sessions_waiting"], seen["sessions_running"]) == (1, 0)
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        await receive_until(ws, Transcript(), is_type("video.start"))
        seen = await stats()
        assert (seen["sessions_active"], seen["sessions_waiting"], seen["sessions_running"]) == (
            1,
            0,
            1,
        )
        await ws.send_message(json.dumps({"type": "session.stop"}))
    await running.wait_sessions_ended(1)
    seen = await stats()
    assert (seen["sessions_active"], seen["sessions_waiting"], seen["sessions_running"]) == (
        0,
        0,
        0,
    )


async def test_a_draining_server_answers_503_and_lets_running_sessions_finish(
    start_server: Any,
) -> None:
    running = await start_server(SyntheticSettings(step_delay=0.01, chunk_frames=4))
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 40}))
        await receive_until(ws, transcript, is_type("video.start"))
        running.server.shutdown()
        with trio.fail_after(5):
            while not running.server.draining:
                await trio.testing.wait_all_tasks_blocked()
        assert await http_get(running.server.port, "/health") == (503, b"draining\n")
        with pytest.raises(ConnectionRejected) as rejected:
            async with running.connect():
                pass
        assert rejected.value.status_code == 503
        await receive_into(ws, transcript)
    assert transcript.terminal == [
        {
            "type": "session.done",
            "request_id": transcript.json[0]["request_id"],
            "chunks": 11,  # ten media chunks and the trailer
            "stopped": False,
        }
    ]
    await running.wait_sessions_ended(1)
    assert len(running.summaries) == 1  # the refused upgrade never became a session


async def test_freed_memory_goes_back_only_after_an_idle_while(
    mock_clock: trio.testing.MockClock, start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """On a clock that moves only when the test moves it, so the second session starts
    inside the idle while however loaded the machine (on the wall clock, connecting it
    could take the whole while, and a trim come between the sessions)."""
    from trio_vstream.server import memory
    from trio_vstream.server import running as sessions

    trims: list[float] = []
    trimmed = trio.Event()
    real_trim = memory.return_free_memory

    def counting_trim() -> None:  # called on the event loop
        trims.append(trio.current_time())
        trimmed.set()
        real_trim()

    monkeypatch.setattr(memory, "return_free_memory", counting_trim)
    monkeypatch.setattr(sessions, "IDLE_BEFORE_TRIM", 0.5)
    running = await start_server()
    await running.run_session(START)
    await running.wait_sessions_ended(1)
    mock_clock.jump(0.4)  # idle, but not for the whole while
    await running.run_session(START)  # a second session inside the idle window
    await running.wait_sessions_ended(2)
    second_ended = trio.current_time()
    mock_clock.jump(0.4)  # 0.8 s idle in all, 0.4 s of it since the second session
    await trio.testing.wait_all_tasks_blocked()
    assert trims == []  # none between the two sessions, none yet after the second
    mock_clock.jump(0.1)
    await trimmed.wait()
    # One trim, an idle while after the second session.
    assert trims == [pytest.approx(second_ended + 0.5)]


@pytest.mark.slow
async def test_metrics_are_prometheus_text_with_the_model_label(start_server: Any) -> None:
    running = await start_server(
        SyntheticSettings(chunk_frames=2, steps=2, concurrency=1), served_model="demo"
    )
    await running.run_session(START)  # completes: 2 media chunks of 2 frames
    transcript = Transcript()
    async with running.connect() as ws:  # and one stopped after its first chunk
        await ws.send_message(json.dumps({**START, "num_frames": 400}))
        await receive_until(ws, transcript, is_type("video.chunk_metadata"))
        await ws.send_message(json.dumps({"type": "session.stop"}))
        await receive_into(ws, transcript)
    await running.wait_sessions_ended(2)
    status, headers, body = await http_get_with_headers(running.server.port, "/metrics")
    assert status == 200
    assert headers["content-type"].startswith("text/plain; version=")
    families = {f.name: f for f in text_string_to_metric_families(body.decode())}

    def value(family: str, sample: str, **labels: str) -> float:
        matches = [
            s.value
            for s in families[family].samples
            if s.name == sample and all(s.labels.get(k) == v for k, v in labels.items())
        ]
        assert len(matches) == 1, (family, sample, labels, families[family].samples)
        return matches[0]

    for family in families.values():
        if family.name.startswith("trio_vstream_"):
            assert all(s.labels.get("model") == "demo" for s in family.samples), family
    assert value("trio_vstream_sessions_active", "trio_vstream_sessions_active") == 0
    ended = "trio_vstream_sessions_ended"
    assert value(ended, ended + "_total", outcome="completed") == 1
    assert value(ended, ended + "_total", outcome="stopped") == 1
    frames = value("trio_vstream_frames_sent", "trio_vstream_frames_sent_total")
    assert frames == 4 + sum(m["num_frames"] for m in transcript.of_type("video.chunk_metadata"))
    sent_bytes = value("trio_vstream_bytes_sent", "trio_vstream_bytes_sent_total")
    assert sent_bytes > len(transcript.video_bytes)
    for name, count in (
        ("trio_vstream_video_start_seconds", 2),
        ("trio_vstream_first_chunk_seconds", 2),
        ("trio_vstream_stop_to_done_seconds", 1),
    ):
        assert value(name, name + "_count") == count, name
        assert families[name].type == "histogram"
        assert value(name, name + "_bucket", le="0.01") <= count  # buckets start in ms
    chunks = value("trio_vstream_encode_seconds", "trio_vstream_encode_seconds_count")
    assert chunks >= 3
    for name in (
        "trio_vstream_engine_chunk_seconds",
        "trio_vstream_engine_queue_wait_seconds",
        "trio_vstream_encode_queue_wait_seconds",
    ):
        assert value(name, name + "_count") >= 3, name
    assert value(
        "trio_vstream_video_start_seconds", "trio_vstream_video_start_seconds_sum"
    ) <= value("trio_vstream_first_chunk_seconds", "trio_vstream_first_chunk_seconds_sum")


async def test_models_lists_the_served_model_with_defaults_and_limits(start_server: Any) -> None:
    running = await start_server(served_model="demo")
    status, headers, body = await http_get_with_headers(running.server.port, "/v1/models")
    assert status == 200 and headers["content-type"] == "application/json"
    models = json.loads(body)
    assert models["object"] == "list"
    (model,) = models["data"]
    assert model["id"] == "demo" and model["object"] == "model"
    assert model["owned_by"] == "trio_vstream" and isinstance(model["created"], int)
    extension = model["trio_vstream"]
    assert extension["engine"] == "synthetic"
    assert extension["endpoint"] == "/v1/realtime/video"
    assert extension["video_defaults"] == {"width": 256, "height": 256, "fps": 24, "num_frames": 48}
    assert extension["limits"]["max_width"] == 1920
    assert extension["limits"]["max_control_bytes"] == 128 * 1024
    assert extension["interaction_kinds"] == ["prompt"]
    assert extension["max_batch"] == 1  # the synthetic engine steps each session alone
    assert extension["live_defaults"] == {}  # it suggests nothing for live sessions
    assert extension["live_input_chunk_frames"] is None  # nor for a camera's


class _LiveEngine(InstrumentedEngine):
    live_settings = types.MappingProxyType({"num_inference_steps": 2, "guidance_scale": 1.0})
    live_input_chunk_frames = 2


async def test_models_lists_what_the_engine_suggests_for_live_sessions(start_server: Any) -> None:
    running = await start_server(engine_class=_LiveEngine)
    status, _, body = await http_get_with_headers(running.server.port, "/v1/models")
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert model["trio_vstream"]["live_defaults"] == {
        "num_inference_steps": 2,
        "guidance_scale": 1.0,
    }
    assert model["trio_vstream"]["live_input_chunk_frames"] == 2


class _CameraEngine(InstrumentedEngine):
    interaction_kinds = frozenset({"prompt", "camera"})


class _LabEngine(InstrumentedEngine):
    """An engine written before interaction kinds: it declares none."""

    def __getattribute__(self, name: str) -> Any:
        if name == "interaction_kinds":
            raise AttributeError(name)
        return super().__getattribute__(name)


@pytest.mark.parametrize(
    ("engine_class", "kinds"), [(_CameraEngine, ["camera", "prompt"]), (_LabEngine, ["prompt"])]
)
async def test_models_lists_the_engines_interaction_kinds(
    start_server: Any, engine_class: type[InstrumentedEngine], kinds: list[str]
) -> None:
    running = await start_server(engine_class=engine_class)
    status, _, body = await http_get_with_headers(running.server.port, "/v1/models")
    assert status == 200
    (model,) = json.loads(body)["data"]
    assert model["trio_vstream"]["interaction_kinds"] == kinds


async def test_the_page_and_its_files_are_served_and_nothing_else(start_server: Any) -> None:
    running = await start_server()
    port = running.server.port
    status, headers, body = await http_get_with_headers(port, "/")
    assert status == 200 and headers["content-type"] == "text/html; charset=utf-8"
    assert b"<html" in body.lower()
    status, headers, _ = await http_get_with_headers(port, "/static/player.js")
    assert status == 200 and headers["content-type"].startswith("text/javascript")
    for path in (
        "/static/../server.py",
        "/static/..%2fserver.py",
        "/static/.hidden.js",
        "/static/__init__.py",
        "/static/missing.js",
        "/static/",
    ):
        assert (await http_get(port, path))[0] == 404, path
