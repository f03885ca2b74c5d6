"""Attack: memory held by messages sent before ``video.start`` (issue 20, item 9).

While a session prepares (an image fetched, the engine opening its stream, which may
take long), the server keeps reading, so that a close is noticed, and keeps what
arrives for after ``video.start``. It kept 16 messages of any size up to the WebSocket
limit: 16 x 8 MiB = 128 MiB per session, at the cost of one ``session.start``. Now what
is kept is bounded in bytes: reading stops once the messages kept reach the control
message limit (so at most twice it is held), and a message over that limit is kept as
the refusal it will get, ``message_too_large``, without its bytes. Nothing is lost: the
client is read again after ``video.start`` and every message gets its answer, in order.
"""

from __future__ import annotations

import gc
import json
import threading
import tracemalloc
from typing import Any

import trio
import trio.testing

from tests.session.test_session_edges import (
    START,
    ScriptedSocket,
    make_session,
    session_in_background,
)
from trio_vstream import protocol
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.session.session import Outcome

MiB = 1024 * 1024


class SlowToOpen(SyntheticEngine):
    """Opens its stream when the test says so; then 40 ms a chunk, for 100 chunks, so
    that a stop sent after the early messages ends it long before its last chunk."""

    def __init__(self) -> None:
        super().__init__(SyntheticSettings(chunk_frames=4, step_delay=0.01))
        self.go = threading.Event()

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        self.go.wait(timeout=30)
        return super().open_stream(request)


def ping(size: int) -> str:
    """A ``session.ping`` of ``size`` bytes (JSON allows the padding)."""
    message = json.dumps({"type": "session.ping"})
    return message + " " * (size - len(message))


def unread(ws: ScriptedSocket) -> int:
    return ws._incoming.statistics().current_buffer_used


def answers(ws: ScriptedSocket) -> list[Any]:
    """What the session sent after video.start, chunks left out."""
    start = ws.types.index("video.start")
    return [m for m in ws.sent[start + 1 :] if isinstance(m, dict)]


async def test_reading_stops_at_the_control_limit_in_bytes() -> None:
    limit = 1000
    engine = SlowToOpen()
    ws = ScriptedSocket()
    session, _ = make_session(ws, engine, limits=protocol.Limits(max_control_bytes=limit))
    ws.feed({**START, "num_frames": 400})
    for _ in range(16):
        ws.feed(ping(900))
    ws.feed({"type": "session.stop"})
    async with session_in_background(session) as summaries:
        await trio.testing.wait_all_tasks_blocked()  # preparing: the engine is opening
        assert unread(ws) == 17 - 2  # 900 bytes kept, then 1800 >= the limit: it waits
        engine.go.set()
    assert summaries[0].outcome is Outcome.STOPPED
    replies = [m["type"] for m in answers(ws)]
    assert replies == ["session.pong"] * 16 + ["session.done"]  # nothing lost, in order


async def test_messages_over_the_limit_are_kept_as_their_refusal_only() -> None:
    engine = SlowToOpen()
    ws = ScriptedSocket()
    session, _ = make_session(ws, engine)  # the default limit: 128 KiB
    ws.feed({**START, "num_frames": 400})
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for _ in range(16):
            ws.feed(ping(1 * MiB))  # the test keeps no reference: only the socket does
        ws.feed({"type": "session.stop"})
        async with session_in_background(session) as summaries:
            await trio.testing.wait_all_tasks_blocked()
            assert unread(ws) == 1  # all 16 read (the stop waits: 16 messages kept)
            held = tracemalloc.get_traced_memory()[0] - before
            tracemalloc.stop()
            engine.go.set()
    finally:
        tracemalloc.stop()
    assert held < 2 * MiB, f"{held / MiB:.1f} MiB held for 16 MiB of refused messages"
    assert summaries[0].outcome is Outcome.STOPPED
    replies = answers(ws)
    assert [(m["type"], m.get("code")) for m in replies] == [
        ("error", "message_too_large")
    ] * 16 + [("session.done", None)]
    # The same refusal as one sent after video.start.
    assert replies[0]["message"] == "control message too large"
