"""Timeouts on a virtual clock: no sockets, no threads, so MockClock's autojump is exact."""

from __future__ import annotations

import json

import trio
import trio.testing
from trio_websocket import ConnectionClosed, wrap_client_stream, wrap_server_stream

from trio_vstream.engines.synthetic import SyntheticEngine
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig


async def test_default_start_timeout_is_ten_seconds(autojump_clock: trio.testing.MockClock) -> None:
    server = VideoServer(SyntheticEngine(), ServerConfig(session=SessionConfig()))
    client_stream, server_stream = trio.testing.memory_stream_pair()
    received: list[dict[str, object]] = []
    async with trio.open_nursery() as nursery:

        async def serve_one() -> None:
            request = await wrap_server_stream(nursery, server_stream)
            await server.serve_websocket(request)

        nursery.start_soon(serve_one)
        ws = await wrap_client_stream(nursery, client_stream, "test", "/v1/realtime/video")
        began = trio.current_time()
        try:
            while True:
                received.append(json.loads(await ws.get_message()))
        except ConnectionClosed as closed:  # how the reading ends (a loop: not pytest.raises)
            assert closed.reason.code == 1000  # noqa: PT017
        elapsed = trio.current_time() - began
        nursery.cancel_scope.cancel()
    assert received == [
        {"type": "error", "code": "start_timeout", "message": "Timeout waiting for session.start"}
    ]
    assert 10.0 <= elapsed < 10.5
