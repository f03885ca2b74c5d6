"""Control replies overtake media: a client that reads slowly still gets its pongs and
interaction answers between chunks, and a stop behind a ping is acted on at once.

The client is `SlowReader`: a `ScriptedSocket` that takes only as many messages as the
test lets it read; a send beyond them waits, as a send to a client that stopped reading
does once the socket's buffers are full. Nothing is synchronised by sleeping: the test
waits until nothing can move (`settle`), then lets the client read.
"""

from __future__ import annotations

import math
import threading
from typing import Any

import trio

from tests.session.playback_harness import settle
from tests.session.test_session_edges import (
    START,
    ScriptedSocket,
    make_session,
    session_in_background,
)
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.session.endings import Outcome

STALL = 10.0
"""The sessions' stall timeout: far beyond what a test takes, short enough that a failing
one ends soon (its client reads nothing more)."""
PING = {"type": "session.ping"}
STOP = {"type": "session.stop"}


class SlowReader(ScriptedSocket):
    """A client that reads ``reads`` messages, then only as many more as `read` allows."""

    def __init__(self, reads: float) -> None:
        super().__init__()
        self.reads = reads
        self._more = trio.Event()

    def read(self, count: float = math.inf) -> None:
        self.reads += count
        self._more.set()
        self._more = trio.Event()

    async def send_message(self, data: str | bytes) -> None:
        while self.reads <= 0:
            await self._more.wait()
        self.reads -= 1
        await super().send_message(data)


class ClosingEngine(SyntheticEngine):
    """Tells the test when a stream is closed (from the thread that closes it)."""

    def __init__(self) -> None:
        super().__init__(SyntheticSettings(chunk_frames=4))
        self.closed = threading.Event()

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        stream = super().open_stream(request)
        close = stream.close

        def closing() -> None:
            close()
            self.closed.set()

        stream.close = closing  # type: ignore[method-assign]
        return stream


def prompt(event_id: str) -> dict[str, Any]:
    return {
        "type": "session.interaction",
        "interaction": {"event_id": event_id, "event": {"prompt": "a blue square"}},
    }


async def test_replies_go_between_chunks_ahead_of_chunks_waiting_for_the_socket() -> None:
    ws = SlowReader(reads=2)  # video.start and chunk 0's metadata; its bytes wait
    session, _ = make_session(ws, stall_timeout=STALL)
    ws.feed({**START, "num_frames": 40})
    with trio.fail_after(30):
        async with session_in_background(session):
            await ws.wait_until(lambda sent: len(sent) == 2)
            ws.feed(PING)
            ws.feed(prompt("p1"))
            ws.feed(PING)
            await settle()  # the engine has made the chunks after it; they wait
            ws.read(1)  # chunk 0's bytes go; the first reply then waits for the client
            await settle()  # chunk 1 is encoded meanwhile, ready to go
            ws.read()
            await ws.wait_until(lambda sent: sum(1 for m in sent if isinstance(m, bytes)) >= 3)
            ws.feed(STOP)
    assert ws.types[:7] == [
        "video.start",
        "video.chunk_metadata",
        "<binary>",  # the chunk being sent when the ping came: finished, metadata and bytes
        "session.pong",  # then every reply, in order, before the chunks that waited
        "session.interaction.queued",
        "session.pong",
        "video.chunk_metadata",
    ]
    assert ws.types[7] == "<binary>"
    assert ws.sent[-1]["type"] == "session.done"


async def test_a_stop_behind_a_ping_is_acted_on_while_the_pong_waits_for_the_socket() -> None:
    ws = SlowReader(reads=2)  # video.start and chunk 0's metadata; its bytes wait
    engine = ClosingEngine()
    session, _ = make_session(ws, engine, stall_timeout=STALL)
    ws.feed({**START, "num_frames": 40})
    with trio.fail_after(30):
        async with session_in_background(session) as summaries:
            await ws.wait_until(lambda sent: len(sent) == 2)
            ws.feed(PING)
            ws.feed(STOP)
            # The stop is read and acted on while the client reads nothing: the engine
            # stops and its stream is closed, with the pong still waiting to go.
            assert await trio.to_thread.run_sync(engine.closed.wait, STALL / 2)
            await settle()
            assert ws.types == ["video.start", "video.chunk_metadata"]
            ws.read()
    assert ws.types == [
        "video.start",
        "video.chunk_metadata",
        "<binary>",
        "session.pong",
        "session.done",
    ]
    assert ws.sent[-1]["stopped"] is True
    assert summaries[0].outcome is Outcome.STOPPED
