"""Watch links while the server drains: a viewer still behind when the last session
ends gets the chunks queued for it and the terminal message, within the drain's bound."""

from __future__ import annotations

import json
from typing import Any

import attrs
import numpy as np
import trio
from trio_websocket import open_websocket_url

from tests.conftest import (
    CLIENT_MAX_MESSAGE,
    EndedSessions,
    RunningServer,
    Transcript,
    is_type,
    receive_into,
    receive_until,
)
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from tests.outputs.test_watch import chunk_indexes, stalled_viewer
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings
from trio_vstream.outputs.watch import WATCH_PREFIX, WatchConfig
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

CHUNKS = 12
SIDE = 256
START = {
    "type": "session.start",
    "prompt": "noise",
    "size": f"{SIDE}x{SIDE}",
    "num_frames": 8 * CHUNKS,
}


class BigNoisyStream(InstrumentedStream):
    """Random 256x256 frames: chunks of a megabyte or more, far beyond what the
    sockets' buffers hold, so a viewer that does not read is left with a queue."""

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        chunk = super().next_chunk(checkpoint)
        if chunk is None:
            return None
        rng = np.random.default_rng(chunk.index)
        frames = rng.integers(0, 256, (8, SIDE, SIDE, 3), dtype=np.uint8)
        return attrs.evolve(chunk, frames=frames)


class BigNoisyEngine(InstrumentedEngine):
    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        inner = super().open_stream(request)
        stream = BigNoisyStream(self, inner._inner)
        self.streams[-1] = stream
        return stream


@attrs.define
class Served:
    server: VideoServer
    engine: BigNoisyEngine
    stopped: trio.Event
    """Set when ``server.run`` has returned: the drain is over."""


async def serve(nursery: trio.Nursery, close_timeout: float) -> Served:
    """A server whose end the test can wait for (the shared fixture cannot tell)."""
    config = ServerConfig(
        host="127.0.0.1",
        port=0,
        shutdown_grace=5.0,
        encode_concurrency=1,
        session=SessionConfig(served_model="synthetic", close_timeout=close_timeout),
        # Room for every chunk: the viewer falls behind without missing one.
        watch=WatchConfig(queue_chunks=2 * CHUNKS, max_missed_chunks=2 * CHUNKS),
    )
    engine = BigNoisyEngine(SyntheticSettings(chunk_frames=8, steps=1))
    server = VideoServer(engine, config)
    stopped = trio.Event()

    async def run(task_status: trio.TaskStatus[VideoServer] = trio.TASK_STATUS_IGNORED) -> None:
        await server.run(task_status=task_status)
        stopped.set()

    await nursery.start(run)
    return Served(server, engine, stopped)


async def owner_session_with_a_stalled_viewer(
    served: Served, nursery: trio.Nursery
) -> tuple[Transcript, Any, Any]:
    """The owner's whole session, with a viewer that read nothing meanwhile: the owner's
    transcript, the viewer's connection, and the session's hub (still holding the
    viewer's queue)."""
    owner = Transcript()
    async with trio_connect(served) as ws:
        await ws.send_message(json.dumps(START))
        video_start = await receive_until(ws, owner, is_type("video.start"))
        path = video_start["watch_path"]
        hub = served.server.watch.hub(path.removeprefix(WATCH_PREFIX))
        running = RunningServer(served.server, served.engine, EndedSessions())
        viewer = await stalled_viewer(running, path, nursery)
        await receive_into(ws, owner)
    assert owner.terminal[0]["type"] == "session.done"
    assert chunk_indexes(owner) == list(range(CHUNKS + 1))  # the media chunks, the trailer
    return owner, viewer, hub


def trio_connect(served: Served) -> Any:
    return open_websocket_url(served.server.url, max_message_size=CLIENT_MAX_MESSAGE)


async def test_a_drain_lets_a_viewer_behind_by_chunks_receive_them_and_the_terminal(
    nursery: trio.Nursery,
) -> None:
    served = await serve(nursery, close_timeout=30.0)
    owner, viewer, hub = await owner_session_with_a_stalled_viewer(served, nursery)
    # The session is over; its viewer is behind by chunks still in its queue.
    assert sum(hub.queued_units()) >= 2, hub.queued_units()

    served.server.shutdown()  # no session runs: the drain goes straight to the viewers
    late = Transcript()
    await receive_into(viewer, late)
    assert late.messages[0]["type"] == "watch.start"
    assert chunk_indexes(late) == list(range(CHUNKS + 1))  # every chunk, none cut off
    assert late.terminal == owner.terminal
    assert late.close_code == 1000
    assert late.video_bytes == owner.video_bytes  # it joined before the first chunk
    # Done once the viewer is: not after the whole close timeout (30 s).
    with trio.fail_after(5):
        await served.stopped.wait()
    assert served.server.watch.connections == 0


async def test_a_viewer_that_never_reads_holds_the_drain_one_close_timeout_at_most(
    nursery: trio.Nursery,
) -> None:
    close_timeout = 0.5
    served = await serve(nursery, close_timeout=close_timeout)
    _, _viewer, hub = await owner_session_with_a_stalled_viewer(served, nursery)
    assert sum(hub.queued_units()) >= 2, hub.queued_units()
    began = trio.current_time()
    served.server.shutdown()
    with trio.fail_after(close_timeout + 5):
        await served.stopped.wait()
    # It waited for the viewer (the close timeout), then cut it off.
    assert trio.current_time() - began >= close_timeout
