"""Sessions over in-memory WebSockets, on a virtual clock that only the test moves.

For the rules of playback pacing (``streaming_buffer_seconds``, ``session.playback``):
whether the engine was asked for a chunk, and when, must be decided without wall time.
The clock is trio's ``MockClock`` at rate 0 (the ``mock_clock`` fixture): it stands
still until the test jumps it, so a session's time-outs never fire by accident and an
interaction's time of receipt is the one the test chose. `settle` waits until nothing
can move any more (no engine or encoder thread running, every task blocked): what the
session does next then depends only on what the test sends, or on the clock.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import attrs
import trio
import trio.testing
from trio_websocket import (
    ConnectionClosed,
    WebSocketConnection,
    wrap_client_stream,
    wrap_server_stream,
)

from tests.instrumented import InstrumentedEngine
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig, SessionSummary

FPS = 8
CHUNK_FRAMES = 4
CHUNK_SECONDS = CHUNK_FRAMES / FPS
"""Each chunk of the harness's engine is half a second of media."""

START: dict[str, Any] = {
    "type": "session.start",
    "prompt": "a red circle",
    "size": "32x32",
    "fps": FPS,
    "num_frames": 400,
}


async def settle() -> None:
    """Wait until nothing moves: no worker thread running, and every task blocked."""
    while True:
        await trio.testing.wait_all_threads_completed()
        await trio.testing.wait_all_tasks_blocked()
        if trio.testing.active_thread_count() == 0:
            return


@attrs.define
class Client:
    """One client's WebSocket, and everything it has received (read by a task of its own)."""

    ws: WebSocketConnection
    messages: list[Any] = attrs.field(factory=list)
    closed: bool = False

    @property
    def json(self) -> list[dict[str, Any]]:
        return [m for m in self.messages if isinstance(m, dict)]

    def of_type(self, kind: str) -> list[dict[str, Any]]:
        return [m for m in self.json if m["type"] == kind]

    @property
    def chunks(self) -> list[dict[str, Any]]:
        return [m for m in self.of_type("video.chunk_metadata") if m["kind"] == "media"]

    @property
    def terminal(self) -> list[dict[str, Any]]:
        return [m for m in self.json if m["type"] in ("session.done", "error")]

    async def send(self, message: dict[str, Any]) -> None:
        await self.ws.send_message(json.dumps(message))

    async def playback(self, position: Any) -> None:
        await self.send({"type": "session.playback", "position_seconds": position})

    async def camera(self, event_id: str, x: float = 1.0) -> None:
        """A velocity camera, as the page sends one per key press."""
        await self.send(
            {
                "type": "session.interaction",
                "interaction": {
                    "event_id": event_id,
                    "event": {
                        "multi_modal_data": {
                            "camera": {
                                "mode": "velocity",
                                "data": {"translation": [x, 0, 0], "rotation": [0, 0, 0, 1]},
                            }
                        }
                    },
                },
            }
        )

    async def read(self) -> None:
        try:
            while True:
                raw = await self.ws.get_message()
                self.messages.append(json.loads(raw) if isinstance(raw, str) else raw)
        except ConnectionClosed:
            self.closed = True


@attrs.define
class Harness:
    engine: InstrumentedEngine
    nursery: trio.Nursery
    server: VideoServer = attrs.field(init=False)
    summaries: list[SessionSummary] = attrs.field(factory=list)
    _ended: trio.Event = attrs.field(factory=trio.Event)

    def session_ended(self, summary: SessionSummary) -> None:
        self.summaries.append(summary)
        self._ended.set()
        self._ended = trio.Event()

    async def ended(self, count: int = 1) -> None:
        """Wait until ``count`` sessions have ended, then `settle`. (A session's end
        waits for its engine stream's close, which runs in a thread `settle` cannot
        see, started as it is without ``trio.to_thread``.)"""
        while len(self.summaries) < count:
            await self._ended.wait()
        await settle()

    async def connect(self, start: dict[str, Any] | None = None, **fields: Any) -> Client:
        """A new session: connected, its ``session.start`` sent (START with ``fields``)."""
        client_stream, server_stream = trio.testing.memory_stream_pair()

        async def serve_one() -> None:
            request = await wrap_server_stream(self.nursery, server_stream)
            await self.server.serve_websocket(request)

        self.nursery.start_soon(serve_one)
        ws = await wrap_client_stream(self.nursery, client_stream, "test", "/v1/realtime/video")
        client = Client(ws)
        self.nursery.start_soon(client.read)
        await client.send({**(start or START), **fields})
        return client

    def stream(self, index: int = 0) -> Any:
        return self.engine.streams[index]


@asynccontextmanager
async def harness(
    engine_class: type[InstrumentedEngine] = InstrumentedEngine,
    settings: SyntheticSettings | None = None,
    **session: Any,
) -> AsyncIterator[Harness]:
    """A server (never listening) whose sessions the test opens with `Harness.connect`."""
    session.setdefault("served_model", "synthetic")
    engine = engine_class(settings or SyntheticSettings(chunk_frames=CHUNK_FRAMES, steps=2))
    async with trio.open_nursery() as nursery:
        found = Harness(engine, nursery)
        found.server = VideoServer(
            engine,
            ServerConfig(session=SessionConfig(**session)),
            on_session_end=found.session_ended,
        )
        if found.server.batcher is not None:  # as `VideoServer.run` starts it
            nursery.start_soon(found.server.batcher.run)
        yield found
        nursery.cancel_scope.cancel()
