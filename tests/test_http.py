"""The plain-HTTP side of the port: /health and /metrics beside the WebSocket endpoint."""

from __future__ import annotations

import json
import time
from typing import Any

import pytest
import trio

from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}


async def http_get(port: int, path: str, method: str = "GET") -> tuple[int, bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"{method} {path} HTTP/1.1\r\nHost: t\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), body


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
    status, body = await http_get(running.server.port, "/metrics")
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


async def test_shutdown_stops_accepting_connections_at_once(start_server: Any) -> None:
    running = await start_server(SyntheticSettings(hang_at_chunk=0), shutdown_grace=0.5)
    async with running.connect() as ws:
        await ws.send_message(json.dumps(START))
        await ws.get_message()  # video.start
        running.server.shutdown()
        await trio.sleep(0.05)
        try:
            await trio.open_tcp_stream("127.0.0.1", running.server.port)
        except OSError:
            pass
        else:
            raise AssertionError("still accepting connections during shutdown")


async def test_freed_memory_goes_back_only_after_an_idle_while(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    from trio_vstream import memory, server

    trims: list[float] = []
    real_trim = memory.return_free_memory

    def counting_trim() -> None:
        trims.append(time.monotonic())
        real_trim()

    monkeypatch.setattr(memory, "return_free_memory", counting_trim)
    monkeypatch.setattr(server, "IDLE_BEFORE_TRIM", 0.5)
    running = await start_server()
    await running.run_session(START)
    await running.wait_sessions_ended(1)
    ended = time.monotonic()
    await running.run_session(START)  # a second session inside the idle window
    await running.wait_sessions_ended(2)
    second_ended = time.monotonic()
    await trio.sleep(0.2)
    assert trims == []
    with trio.fail_after(5):
        while not trims:
            await trio.sleep(0.05)
    assert len(trims) == 1
    assert trims[0] - second_ended >= 0.4 and trims[0] - ended >= 0.4
