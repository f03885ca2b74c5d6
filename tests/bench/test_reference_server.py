"""``bench/_reference_server.py``, the reference handler's stand-in for throughput
comparisons: it speaks the protocol the harness's client expects (a whole session, pings,
a stop), and a SIGTERM ends it with status 0, as the harness stops servers."""

from __future__ import annotations

import sys
from pathlib import Path

import trio

from bench._client import SessionClient, run_clients, run_one
from bench._output import now
from bench._server import Endpoint, ServerProcess
from trio_vstream import protocol

REPO = Path(__file__).resolve().parents[2]


async def test_the_stand_in_serves_sessions_pings_and_stops(tmp_path: Path) -> None:
    server = ServerProcess(
        [sys.executable, "-m", "bench._reference_server", "--port", "0",
         "--engine-arg", "chunk_frames=4"],
        tmp_path / "reference.log",
    )  # fmt: skip
    with trio.fail_after(60):
        url = await server.start(timeout=30)
    try:
        endpoint = Endpoint.parse(url)
        whole = SessionClient(endpoint, protocol.start_message("x", size="64x48", num_frames=10))
        stopped = SessionClient(endpoint, protocol.start_message("x", size="64x48", num_frames=400))
        done = trio.Event()

        async def body() -> None:
            with trio.fail_after(30):
                await whole.finished.wait()

        async def ping_then_stop() -> None:
            # Pings while two more chunks come, then a stop: every ping sent before the
            # stop is answered before session.done (the stand-in handles them in order).
            async with trio.open_nursery() as nursery:
                nursery.start_soon(stopped.ping_every, 0.005, done)
                for _ in range(2):
                    await stopped.wait_chunk_since(now())
                done.set()
            await stopped.stop()

        await run_clients([whole], body, 30)
        await run_one(stopped, 30, ping_then_stop)
    finally:
        status = await server.stop()
    assert whole.problem is None and stopped.problem is None
    # 10 frames in chunks of 4: 4 + 4 + 2, then the trailer, then session.done.
    assert [frames for _, frames, _ in whole.arrivals] == [4, 4, 2]
    assert whole.terminal == "session.done" and whole.stopped is False
    assert stopped.pings_sent >= 1 and len(stopped.pings) == stopped.pings_sent
    assert stopped.terminal == "session.done" and stopped.stopped is True
    assert stopped.frames < 400
    assert status == 0
