"""Never wedged: an engine whose calls keep hanging cannot stop the server from serving,
answering or exiting (issue 30).

The synthetic engine's ``block_at_chunk`` blocks a call without a checkpoint, as a hung
CUDA kernel does; each test releases the blocks itself (`releasing`), so no thread
outlives it. Stall timeouts are 1 s: above any pause of the test process, so the engine
is blocked before the stall guard can fire, and short enough for a row of sessions.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import EndedSessions, Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine
from tests.scheduling.test_engine_calls import (
    START,
    assert_stalled,
    blocked_at,
    metric,
    releasing,
    until_blocked,
)
from tests.server.test_http import http_get
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, batched
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.server.app import WEDGED_EXIT_STATUS, ServerConfig, VideoServer
from trio_vstream.session.session import Outcome, SessionConfig

SETTINGS = SyntheticSettings(chunk_frames=4)
UNAVAILABLE = b"engine_unavailable: Engine unavailable: "


async def stall_one(running: Any) -> None:
    """One session blocked at its first chunk: it gets stall_timeout, its call stays stuck.
    Returns once the server has ended the session (and counted its call as abandoned)."""
    stalled = stalled_count(running)
    with trio.fail_after(15):
        assert_stalled(await running.run_session(blocked_at(0)))
        while stalled_count(running) == stalled:
            await running.ended.wait_for(len(running.summaries) + 1)


def stalled_count(running: Any) -> int:
    return sum(1 for s in running.summaries if s.outcome is Outcome.STALLED)


async def refused_upgrade(port: int) -> ConnectionRejected:
    with pytest.raises(ConnectionRejected) as rejected:
        async with open_websocket_url(f"ws://127.0.0.1:{port}/v1/realtime/video"):
            pass
    return rejected.value


@pytest.mark.slow
async def test_stuck_engine_calls_never_starve_the_servers_own_threads(
    start_server: Any,
) -> None:
    """Cause 1 of the issue, confirmed: stuck calls kept their tokens on the one limiter
    that also ran encoder set-up and close. With one session slot that limiter had six;
    the seventh session waited for an encoder forever and its client heard nothing. The
    engine's calls now have a budget of their own."""
    running = await start_server(
        SETTINGS, max_sessions=1, stall_timeout=1.0, close_timeout=0.2, max_stuck_calls=0
    )
    async with releasing(running.engine):
        for _ in range(7):
            await stall_one(running)
        assert len(running.server.abandoned_calls.running) == 7
        assert running.engine.blocks.waiting == 7
        with trio.fail_after(15):
            healthy = await running.run_session(START)
        assert healthy.terminal[0]["type"] == "session.done"
        assert healthy.terminal[0]["chunks"] == 5
        assert running.engine.blocks.waiting == 7  # served while every call stayed stuck


@pytest.mark.slow
async def test_a_wedged_engine_is_refused_before_the_upgrade_and_serves_again_once_it_returns(
    start_server: Any,
) -> None:
    running = await start_server(SETTINGS, stall_timeout=1.0, close_timeout=0.2)
    server, engine = running.server, running.engine
    port = server.port
    assert server.config.max_stuck_calls == 2
    async with releasing(engine):
        await stall_one(running)
        # One stuck call: degraded, not wedged; sessions are still admitted.
        status, body = await http_get(port, "/health")
        assert (status, body.split(b":")[0]) == (200, b"degraded")
        assert not server.wedged
        await stall_one(running)
        assert server.wedged
        status, body = await http_get(port, "/health")
        assert status == 503 and body.startswith(UNAVAILABLE)
        with trio.fail_after(5):  # at once: refused before the upgrade, nothing waits
            rejected = await refused_upgrade(port)
        assert rejected.status_code == 503
        assert rejected.body is not None and rejected.body.startswith(UNAVAILABLE)
        _, exposition = await http_get(port, "/metrics")
        assert metric(exposition, "trio_vstream_engine_wedged_total") == 1
        assert metric(exposition, "trio_vstream_engine_calls_outstanding") == 2
        assert engine.blocks.waiting == 2
        calls = list(server.abandoned_calls.running)
    # Released: the calls return, the server counts them back and admits sessions again.
    with trio.fail_after(10):
        for call in calls:
            await call.returned.wait()
    assert not server.wedged
    assert await http_get(port, "/health") == (200, b"ok\n")
    with trio.fail_after(15):
        healthy = await running.run_session(START)
    assert healthy.terminal[0]["type"] == "session.done"


@pytest.mark.slow
async def test_a_session_start_after_the_engine_wedged_gets_engine_unavailable(
    start_server: Any,
) -> None:
    """An upgrade accepted before the wedge: its ``session.start`` is refused, coded."""
    running = await start_server(SETTINGS, stall_timeout=1.0, close_timeout=0.2)
    async with releasing(running.engine), running.connect() as early:
        await stall_one(running)
        await stall_one(running)
        assert running.server.wedged
        transcript = Transcript()
        with trio.fail_after(5):
            await early.send_message(json.dumps(START))
            await receive_into(early, transcript)
        assert [(m["type"], m["code"]) for m in transcript.terminal] == [
            ("error", "engine_unavailable")
        ]
        assert transcript.of_type("video.start") == []


@pytest.mark.slow
async def test_a_healthy_session_streams_on_while_the_engine_wedges(start_server: Any) -> None:
    """Running sessions on healthy calls finish: the wedge refuses new ones only. The
    healthy session is paced to media time (6 s of video), so it is still streaming when
    the other one wedges the engine."""
    running = await start_server(SETTINGS, stall_timeout=1.0, close_timeout=0.2, max_stuck_calls=1)
    paced = {**START, "num_frames": 48, "fps": 8, "extra_params": {"pace_to_media_time": True}}
    async with releasing(running.engine), running.connect() as healthy:
        await healthy.send_message(json.dumps(paced))
        transcript = Transcript()
        await receive_until(healthy, transcript, is_type("video.start"))
        await stall_one(running)
        assert running.server.wedged
        assert [s.outcome for s in running.summaries] == [Outcome.STALLED]  # still streaming
        with trio.fail_after(30):
            await receive_into(healthy, transcript)
        assert transcript.terminal[0]["type"] == "session.done"
        assert transcript.terminal[0]["chunks"] == 13  # 12 media chunks and the trailer


@pytest.mark.slow
async def test_exit_when_wedged_drains_and_returns_the_wedged_status() -> None:
    engine = InstrumentedEngine(SETTINGS)
    config = ServerConfig(
        port=0,
        max_stuck_calls=1,
        exit_when_wedged=True,
        shutdown_grace=0.5,
        session=SessionConfig(stall_timeout=1.0, close_timeout=0.2),
    )
    server = VideoServer(engine, config)
    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                async with open_websocket_url(server.url) as ws:
                    await ws.send_message(json.dumps(blocked_at(0)))
                    transcript = Transcript()
                    await receive_into(ws, transcript)
                assert_stalled(transcript)
                # run() returns by itself: the drain began when the call was abandoned.
        assert server.exit_status == WEDGED_EXIT_STATUS
        assert server.wedged
        assert engine.blocks.waiting == 1  # the stuck call did not hold the drain
    finally:
        engine.blocks.release()


async def test_without_exit_when_wedged_the_server_keeps_running(start_server: Any) -> None:
    running = await start_server(SETTINGS, stall_timeout=1.0, close_timeout=0.2, max_stuck_calls=1)
    async with releasing(running.engine):
        await stall_one(running)
        await until_blocked(running.engine)
        assert running.server.wedged
        assert not running.server.shutting_down
        assert running.server.exit_status == 0


class HangingBatches(SyntheticEngine):
    """A synthetic engine that batches (``max_batch`` 2): each chunk takes one batched
    step. While ``hold`` is set, two sessions meet (``joined``) before their first step,
    so their rows run as one batch, and that batch's forward blocks outside any
    checkpoint until ``release``; a lone row, or any row after ``hold`` is cleared,
    steps at once."""

    max_batch = 2

    def __init__(self) -> None:
        super().__init__(SyntheticSettings(steps=1, chunk_frames=4))
        self.hold = True
        self.joined = threading.Barrier(2, timeout=30)
        self.release = threading.Event()
        self.entered: trio.Event | None = trio.Event()

    def run_batch(self, rows: Sequence[int]) -> list[int]:
        if len(rows) > 1 and self.hold:
            if self.entered is not None:
                trio.from_thread.run_sync(self.entered.set)
            self.release.wait()
        return [row + 1 for row in rows]

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        stream = super().open_stream(request)
        synthetic_chunk = stream.next_chunk
        first = [self.hold]

        def next_chunk(checkpoint: Checkpoint) -> Chunk | None:
            with batched(checkpoint, self.run_batch) as step:
                if first.pop() if first else False:
                    self.joined.wait()
                step(0)
            return synthetic_chunk(checkpoint)

        stream.next_chunk = next_chunk  # type: ignore[method-assign]
        return stream


class HungForward:
    """A test hook's switch for an engine's forward (`wedged_by_a_hung_batch`): while
    held, a forward of two sessions' rows hangs until `release`, and a session's forward
    alone waits until both sessions are stepping through the server's batching
    (`meeting`), so that the first cannot finish its video before the second shares a
    batch with it: opening its stream is not enough, as a loaded machine showed, where
    the second took longer to prepare than the first took to make its whole video."""

    def __init__(self) -> None:
        self._held = True
        self._released = threading.Event()
        self._both_in = threading.Event()
        self._stepping: set[int] = set()
        self._lock = threading.Lock()

    def forward(self, batched: bool) -> None:
        """Call at the start of the engine's forward (from its thread)."""
        if not self._held:
            return
        if batched:
            self._released.wait()  # outside any checkpoint, as a hung kernel
        else:
            self._both_in.wait(timeout=30)

    def meeting(self, monkeypatch: pytest.MonkeyPatch) -> None:
        """Count the sessions whose engines enter the server's batching from now on (a
        session's checkpoint's `batched_steps`, where its rows go to the batcher)."""
        batched_steps = SessionCheckpoint.batched_steps

        def counted(checkpoint: SessionCheckpoint, run_batch: Any, key: Any) -> Any:
            with self._lock:
                self._stepping.add(id(checkpoint))
                if len(self._stepping) >= 2:
                    self._both_in.set()
            return batched_steps(checkpoint, run_batch, key)

        monkeypatch.setattr(SessionCheckpoint, "batched_steps", counted)

    def release(self) -> None:
        self._held = False
        self._released.set()
        self._both_in.set()


async def serve_batching(
    nursery: trio.Nursery, engine: Any, served_model: str, stall_timeout: float
) -> tuple[VideoServer, EndedSessions]:
    """A server of ``engine`` (one that batches), with a short close timeout, for
    `wedged_by_a_hung_batch`; and its ended sessions."""
    session = SessionConfig(
        stall_timeout=stall_timeout, close_timeout=0.2, served_model=served_model
    )
    config = ServerConfig(host="127.0.0.1", port=0, session=session)
    ended = EndedSessions()
    server = VideoServer(engine, config, on_session_end=lambda summary: ended.record(summary, {}))
    assert server.batcher is not None
    await nursery.start(server.run)
    return server, ended


async def wedged_by_a_hung_batch(
    server: VideoServer,
    start: dict[str, Any],
    release: Callable[[], None],
    ended: Callable[[int], Awaitable[None]],
) -> None:
    """The scenario of a hung batched forward, on a server whose engine batches and hangs
    once two sessions' rows share a forward, until ``release()``: two clients get
    stall_timeout; once their sessions have ended (``ended(2)``), the batcher is stuck
    and the server wedged by that one call (503 before the upgrade, /health 503); once
    the forward returns, it serves again."""
    assert server.batcher is not None

    async def stalled_client(got: list[Transcript]) -> None:
        async with open_websocket_url(server.url, max_message_size=2**26) as ws:
            await ws.send_message(json.dumps(start))
            transcript = Transcript()
            await receive_into(ws, transcript)
            got.append(transcript)

    try:
        got: list[Transcript] = []
        with trio.fail_after(60):
            async with trio.open_nursery() as clients:
                clients.start_soon(stalled_client, got)
                clients.start_soon(stalled_client, got)
            await ended(2)  # each after its close timeout: its call abandoned
        for transcript in got:
            assert_stalled(transcript)
        assert server.batcher.stuck
        assert server.wedged
        # The sessions' own calls return once the batch is abandoned (their rows fail);
        # the batched forward stays stuck, one call, and wedges the server by itself.
        with trio.fail_after(10):
            for call in list(server.abandoned_calls.running):
                if call.name != "_call_batch":
                    await call.returned.wait()
        assert [call.name for call in server.abandoned_calls.running] == ["_call_batch"]
        assert server.wedged
        status, body = await http_get(server.port, "/health")
        assert status == 503 and body.startswith(UNAVAILABLE)
        assert b"batched step is stuck" in body
        with trio.fail_after(5):
            rejected = await refused_upgrade(server.port)
        assert rejected.status_code == 503
        (call,) = server.abandoned_calls.running
        _, exposition = await http_get(server.port, "/metrics")
        assert metric(exposition, "trio_vstream_engine_calls_outstanding") == 1
        abandoned = metric(exposition, "trio_vstream_engine_calls_abandoned_total")
        assert abandoned == server.abandoned_calls.total >= 1
    finally:
        release()
    with trio.fail_after(30):
        await call.returned.wait()
    assert not server.batcher.stuck
    assert not server.wedged
    assert await http_get(server.port, "/health") == (200, b"ok\n")
    _, exposition = await http_get(server.port, "/metrics")
    assert metric(exposition, "trio_vstream_engine_calls_outstanding") == 0
    transcript = Transcript()
    with trio.fail_after(60):
        async with open_websocket_url(server.url, max_message_size=2**26) as ws:
            await ws.send_message(json.dumps(start))
            await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"


@pytest.mark.slow
async def test_a_hung_batched_forward_wedges_the_server_until_it_returns(
    nursery: trio.Nursery,
) -> None:
    """On an engine that batches (synthetic, ``max_batch`` 2); the same on the built-in
    model (tests/engines/test_shapes_wedged.py) and on a diffusers family that batches
    (tests/engines/diffusers/test_batching.py)."""
    engine = HangingBatches()
    server, ended = await serve_batching(nursery, engine, "synthetic", stall_timeout=1.0)

    def release() -> None:
        engine.hold = False
        engine.release.set()

    await wedged_by_a_hung_batch(server, START, release, ended.wait_for)


async def test_calls_left_because_the_server_stops_wedge_nothing(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """The server's run is cancelled (a second signal) while two sessions' calls are in
    their threads: nothing waited a close timeout for them, so they are left, counted as
    running, but not known to hang. Two of them used to reach the wedge bound, and the
    stop was logged as an engine wedged (an ERROR, the wedge counter)."""
    engine = InstrumentedEngine(SETTINGS)
    server = VideoServer(engine, ServerConfig(port=0, session=SessionConfig(stall_timeout=30.0)))
    assert server.config.max_stuck_calls == 2

    async def client() -> None:
        async with open_websocket_url(server.url) as ws:
            await ws.send_message(json.dumps(blocked_at(0)))
            await receive_into(ws, Transcript())

    try:
        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                await nursery.start(server.run)
                nursery.start_soon(client)
                nursery.start_soon(client)
                await until_blocked(engine, 2)
                nursery.cancel_scope.cancel()
        assert len(server.abandoned_calls.running) == 2
        assert server.abandoned_calls.stuck == 0
        assert not server.wedged
        assert metric(server.metrics.exposition(), "trio_vstream_engine_wedged_total") == 0
        assert [r.getMessage() for r in caplog.records if "wedged" in r.getMessage()] == []
    finally:
        engine.blocks.release()
