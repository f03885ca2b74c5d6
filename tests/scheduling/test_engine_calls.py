"""A hung engine never holds a client: calls stuck outside a checkpoint (issue 20, item 10).

The synthetic engine's ``block_at_chunk`` blocks without a checkpoint until the test
releases it (``engine.blocks``), as a hung CUDA kernel would. Each test checks an order of
events: the client's terminal message arrives while the engine is *still* blocked (the
old server answered only once the call returned: never, here, before the release).
Stall timeouts are 1.5 s, well above any pause of the test process, so that the engine
is blocked before the stall guard can fire.
"""

from __future__ import annotations

import contextlib
import json
import signal
import threading
from collections.abc import AsyncIterator, Callable
from typing import Any

import attrs
import outcome
import pytest
import trio
from prometheus_client.parser import text_string_to_metric_families
from trio_websocket import open_websocket_url

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine, InstrumentedStream
from tests.server.test_cli import read_to_terminal, serving
from tests.server.test_http import http_get
from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.scheduling.engine_calls import AbandonedCalls, EngineCall
from trio_vstream.scheduling.progress import EngineProgress

START = {"type": "session.start", "prompt": "a stuck kernel", "size": "32x32", "num_frames": 16}
SETTINGS = SyntheticSettings(chunk_frames=4)
STALL = "Stall timeout: no generation progress"


def blocked_at(chunk: int) -> dict[str, Any]:
    return {**START, "extra_params": {"block_at_chunk": chunk}}


@contextlib.asynccontextmanager
async def releasing(engine: SyntheticEngine) -> AsyncIterator[None]:
    """Release the engine's blocks on the way out, pass or fail: no thread is left."""
    try:
        yield
    finally:
        engine.blocks.release()


async def until_blocked(engine: SyntheticEngine, count: int = 1) -> None:
    assert await trio.to_thread.run_sync(engine.blocks.wait_blocked, count, 10.0)


def metric(exposition: bytes, name: str) -> float:
    for family in text_string_to_metric_families(exposition.decode()):
        for sample in family.samples:
            if sample.name == name:
                return sample.value
    raise AssertionError(f"{name} not in /metrics")


def assert_stalled(transcript: Transcript) -> None:
    assert [(m["type"], m["code"], m["message"]) for m in transcript.terminal] == [
        ("error", "stall_timeout", STALL)
    ]
    assert transcript.close_code == 1000


@pytest.mark.slow
async def test_the_stall_deadline_answers_while_the_engine_is_still_blocked(
    start_server: Any,
) -> None:
    running = await start_server(SETTINGS, stall_timeout=1.5, close_timeout=30.0)
    engine = running.engine
    transcript = Transcript()
    async with releasing(engine):
        with trio.fail_after(20):  # the old server answered once released: never, here
            async with running.connect() as ws:
                await ws.send_message(json.dumps(blocked_at(0)))
                await receive_into(ws, transcript)
        assert engine.blocks.waiting == 1  # the terminal message and close came first
        assert_stalled(transcript)
    # Released, the call sees its cancellation at its next checkpoint and closes the
    # stream as it returns: the session waited for that, so nothing is left at its end.
    await running.wait_sessions_ended(1)
    assert running.checks_at_end == [{"threads_inside": 0, "unclosed_streams": 0}]
    assert running.engine.streams[0].closed == 1
    assert running.server.stats.streams_open == 0
    assert running.server.stats.worker_threads == 0
    assert not running.server.abandoned_calls.running


async def test_other_sessions_carry_on_beside_a_blocked_one(start_server: Any) -> None:
    running = await start_server(SETTINGS, close_timeout=30.0)
    engine = running.engine
    async with releasing(engine), running.connect() as stuck:
        await stuck.send_message(json.dumps(blocked_at(0)))
        await receive_until(stuck, Transcript(), is_type("video.start"))
        await until_blocked(engine)
        healthy = await running.run_session(START)
        assert engine.blocks.waiting == 1  # all while the other one was blocked
        assert healthy.terminal[0]["type"] == "session.done"
        assert healthy.terminal[0]["chunks"] == 5  # four media chunks and the trailer
    await running.wait_sessions_ended(2)
    assert running.checks_at_end == [{"threads_inside": 0, "unclosed_streams": 0}] * 2


@pytest.mark.slow
async def test_a_call_left_running_is_counted_and_health_says_degraded_until_it_returns(
    start_server: Any,
) -> None:
    running = await start_server(SETTINGS, stall_timeout=1.5, close_timeout=0.2)
    server, engine = running.server, running.engine
    port = server.port
    assert await http_get(port, "/health") == (200, b"ok\n")
    async with releasing(engine):
        with trio.fail_after(20):
            assert_stalled(await running.run_session(blocked_at(0)))
            await running.wait_sessions_ended(1)  # the session ended without its call
        assert engine.blocks.waiting == 1
        (call,) = server.abandoned_calls.running
        # Still the engine's: its thread holds the stream, which stays open till it returns.
        assert running.checks_at_end == [{"threads_inside": 1, "unclosed_streams": 1}]
        # Below --max-stuck-calls (2): degraded, still in rotation (tests/server/test_wedged.py
        # has the wedge itself).
        assert await http_get(port, "/health") == (
            200,
            b"degraded: 1 engine call(s) stuck after their sessions ended (wedged at 2)\n",
        )
        _, exposition = await http_get(port, "/metrics")
        assert metric(exposition, "trio_vstream_engine_calls_abandoned_total") == 1
        assert metric(exposition, "trio_vstream_engine_calls_outstanding") == 1
    with trio.fail_after(10):
        await call.returned.wait()
    assert await http_get(port, "/health") == (200, b"ok\n")
    _, exposition = await http_get(port, "/metrics")
    assert metric(exposition, "trio_vstream_engine_calls_abandoned_total") == 1
    assert metric(exposition, "trio_vstream_engine_calls_outstanding") == 0
    assert engine.streams[0].closed == 1  # by the call's thread, once it had returned
    assert server.stats.streams_open == 0


class BlockingOpenEngine(InstrumentedEngine):
    """``open_stream`` waits on a device that never answers (until released)."""

    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        self.blocks.block()
        return super().open_stream(request)


@pytest.mark.slow
async def test_an_open_stream_that_blocks_gets_the_stall_timeout(start_server: Any) -> None:
    running = await start_server(
        SETTINGS, engine_class=BlockingOpenEngine, stall_timeout=1.5, close_timeout=30.0
    )
    engine = running.engine
    transcript = Transcript()
    async with releasing(engine):
        with trio.fail_after(20):
            async with running.connect() as ws:
                await ws.send_message(json.dumps(START))
                await receive_into(ws, transcript)
        assert engine.blocks.waiting == 1
    assert transcript.types == ["error"]  # no video.start: there was no stream
    assert_stalled(transcript)
    # The stream it opened once released was closed at once: the session waited for that.
    await running.wait_sessions_ended(1)
    assert running.summaries[0].outcome.value == "stalled"
    assert running.checks_at_end == [{"threads_inside": 0, "unclosed_streams": 0}]
    assert running.server.stats.streams_open == 0


@attrs.frozen
class FramesOnAHungDevice:
    """A GPU tensor, as far as the server can tell, whose copy to the host never ends."""

    frames: Any
    block: Callable[[], None]

    def cpu(self) -> FramesOnAHungDevice:
        self.block()
        return self

    def numpy(self) -> Any:
        return self.frames


class HungDeviceEngine(InstrumentedEngine):
    def open_stream(self, request: GenerationRequest) -> InstrumentedStream:  # type: ignore[override]
        stream = super().open_stream(request)
        next_chunk = stream.next_chunk

        def on_device(checkpoint: Checkpoint) -> Chunk | None:
            chunk = next_chunk(checkpoint)
            if chunk is None:
                return None
            return attrs.evolve(chunk, frames=FramesOnAHungDevice(chunk.frames, self.blocks.block))

        stream.next_chunk = on_device  # type: ignore[method-assign]
        return stream


@pytest.mark.slow
async def test_a_copy_from_a_hung_device_does_not_hold_the_client(start_server: Any) -> None:
    running = await start_server(
        SETTINGS, engine_class=HungDeviceEngine, stall_timeout=1.5, close_timeout=30.0
    )
    engine = running.engine
    transcript = Transcript()
    async with releasing(engine):
        with trio.fail_after(20):
            async with running.connect() as ws:
                await ws.send_message(json.dumps(START))
                await receive_into(ws, transcript)
        assert engine.blocks.waiting == 1
    assert transcript.types == ["video.start", "error"]
    assert_stalled(transcript)
    await running.wait_sessions_ended(1)
    assert running.checks_at_end == [{"threads_inside": 0, "unclosed_streams": 0}]


@pytest.mark.slow
async def test_sigterm_exits_within_the_drain_bound_though_an_engine_call_is_stuck() -> None:
    """The drain's bound holds with a thread that never returns: the session is wound
    down and then ended without its call, the server stops, the process exits 0. (The
    engine is released only by its close, after the server has stopped.)"""
    with serving("--engine", "synthetic", "--shutdown-grace", "0.1") as (process, url, _):
        received: list[dict[str, Any]] = []
        with trio.fail_after(60):  # the old server never answered, nor exited
            async with open_websocket_url(url, max_message_size=1 << 26) as ws:
                await ws.send_message(json.dumps(blocked_at(0)))
                received.append(json.loads(await ws.get_message()))
                process.send_signal(signal.SIGTERM)
                await read_to_terminal(ws, received)
        assert received[0]["type"] == "video.start"
        assert received[-1]["type"] == "error" and received[-1]["code"] == "server_shutdown"
        with trio.fail_after(60):  # the bound is 10.1 s: 0.1 s of grace, two close timeouts
            status = await trio.to_thread.run_sync(process.wait)
        assert status == 0
        assert process.stderr is not None
        log = process.stderr.read()
        assert "next_chunk still running as the session ends" in log


def test_worker_threads_are_daemons_so_a_stuck_one_never_keeps_the_process() -> None:
    def daemon() -> bool:
        return threading.current_thread().daemon

    async def main() -> tuple[bool, bool]:
        ran = await EngineCall(daemon).run(trio.CapacityLimiter(1))
        started = EngineCall(daemon)
        started.start()
        await started.returned.wait()
        assert started.result is not None
        return ran, started.result.unwrap()

    assert trio.run(main) == (True, True)


class NoticingProgress(EngineProgress):
    """Tells when a session queues for a step slot."""

    def __init__(self) -> None:
        super().__init__()
        self.queued_once = trio.Event()

    def queued(self, key: object, on_progress: Callable[[], None]) -> Any:
        self.queued_once.set()
        return super().queued(key, on_progress)


async def test_a_call_left_waiting_for_a_step_slot_stops_waiting() -> None:
    """An abandoned call's waits in the Trio thread run as system tasks, which the
    session's cancellation does not reach: `SessionCheckpoint.cancel` ends them, and
    the engine's checkpoint raises ``Cancelled`` without taking the slot."""
    slots = trio.CapacityLimiter(1)
    await slots.acquire_on_behalf_of("another session")  # and keeps it
    progress = NoticingProgress()
    checkpoint = SessionCheckpoint(slots, progress, lambda: None)
    call = EngineCall(checkpoint)  # the engine's first step: waits for the slot
    async with trio.open_nursery() as nursery:

        async def session() -> None:
            try:
                await call.run(trio.CapacityLimiter(1))
            except trio.Cancelled:
                assert call.detach()
                checkpoint.cancel()
                raise

        nursery.start_soon(session)
        await progress.queued_once.wait()
        nursery.cancel_scope.cancel()
    with trio.fail_after(10):
        await call.returned.wait()
    assert isinstance(call.result, outcome.Error)
    assert isinstance(call.result.error, trio.Cancelled)
    assert slots.borrowed_tokens == 1  # the other session's, still


async def test_the_wait_at_exit_takes_in_a_call_abandoned_before_the_stop() -> None:
    """A process's exit waits (bounded, by its caller) for every abandoned call still
    running, not only those its stop left: a session abandoned just before the stop may
    have a call on its way back, and a thread that wakes in libtorch while the
    interpreter exits aborts the process (SIGABRT, seen once in CI with a hung batch)."""
    release = threading.Event()
    call = EngineCall(release.wait)
    call.start()
    calls = AbandonedCalls()
    calls.add(call, lambda: None)  # abandoned by its session's stall guard, not at a stop
    waited = trio.Event()

    async def wait() -> None:
        await calls.wait_returned()
        waited.set()

    async with trio.open_nursery() as nursery:
        nursery.start_soon(wait)
        await trio.testing.wait_all_tasks_blocked()
        assert not waited.is_set()  # the call still runs
        release.set()
    assert waited.is_set()
    assert not calls.running
