"""The step batcher under cancellation (issue 20, items 11 and 12): every row it takes is
finished however its batch ends, and a stop that races a batch's result is a stop.

The races are forced, not waited for: the cancels happen inside the batcher's own
synchronous stretch, from the hook it calls when a batch's result is in (``on_batch``,
the server's metrics), so the batcher goes on to take the next rows, or to hand out the
result, before any cancelled session runs its ``except`` branch.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, TypeVar

import pytest
import trio
import trio.testing
from trio_websocket import open_websocket_url

from tests.conftest import Transcript, receive_into
from tests.scheduling.test_batching import Recorder
from trio_vstream.engines.contract import Checkpoint, Chunk, EngineError, GenerationRequest, batched
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings, SyntheticStream
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.progress import EngineProgress
from trio_vstream.server import metrics
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.session.session import SessionConfig

T = TypeVar("T")


async def ends_within(seconds: float, scenario: Callable[[], Awaitable[T]]) -> T:
    """``scenario``'s result, run in an event loop of its own in a worker thread; fails the
    test if it has not ended within ``seconds``.

    The hang these tests guard against is sessions waiting, shielded, for rows nobody
    will finish: no cancel scope of the test's can end that wait, and the test's own
    teardown would hang on it too. Watched from outside, the test fails instead (and
    leaves the stuck thread behind, which only a regression ever does).
    """
    with trio.fail_after(seconds):
        return await trio.to_thread.run_sync(trio.run, scenario, abandon_on_cancel=True)


@pytest.mark.parametrize("session_stopped", [False, True])
async def test_a_batch_cancelled_before_its_thread_starts_still_finishes_its_rows(
    session_stopped: bool,
) -> None:
    """The batcher is cancelled as a batch's result comes in, with the next row ready: it
    takes that row, and ``trio.to_thread.run_sync`` raises ``Cancelled`` at its first
    checkpoint, before a thread starts. The row's session, stopped in the same tick or
    not, must not wait for it forever."""

    async def scenario() -> dict[str, Any]:
        run_batch, got = Recorder(), {}
        run_batch.release.clear()
        run_batch.entered = trio.Event()
        batcher_scope, b_scope = trio.CancelScope(), trio.CancelScope()

        def batch_done(rows: int) -> None:  # a's batch is over; b's row is ready next
            batcher_scope.cancel()
            if session_stopped:
                b_scope.cancel()

        batcher = StepBatcher(1, EngineProgress(), batch_done)

        async def run_batcher() -> None:
            with batcher_scope:
                await batcher.run()

        async def stepper(name: str, scope: trio.CancelScope) -> None:
            member = batcher.join(run_batch, run_batch, lambda: None)
            try:
                with scope:
                    got[name] = await batcher.step(member, (name, 0))
                    return
                got[name] = "cancelled"
            except EngineError as exc:
                got[name] = exc
            finally:
                batcher.leave(member)

        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_batcher)
            nursery.start_soon(stepper, "a", trio.CancelScope())
            await run_batch.entered.wait()  # a's batch runs (max_batch 1), in its thread
            nursery.start_soon(stepper, "b", b_scope)
            await trio.testing.wait_all_tasks_blocked()  # b's row waits for the next batch
            run_batch.release.set()
        assert run_batch.batches == [["a"]]  # b's batch was taken, never run
        assert batcher_scope.cancelled_caught
        return got

    got = await ends_within(10, scenario)
    assert got["a"] == ("a", 1)
    if session_stopped:
        assert got["b"] == "cancelled"
    else:  # it gets an error of its own, saying why
        assert isinstance(got["b"], EngineError)
        assert "cancelled" in str(got["b"]), got["b"]


async def test_a_stop_that_lands_as_its_batch_ends_is_a_stop(nursery: trio.Nursery) -> None:
    """b is stopped as its batch's result comes in, before its ``except trio.Cancelled``
    runs: its row is neither queued nor in flight by then, but done. b's step ends
    cancelled (its result dropped) and a goes on alone; nothing is raised."""
    run_batch, got = Recorder(), {}
    b_scope = trio.CancelScope()

    def batch_done(rows: int) -> None:
        if rows == 2:  # the first batch: a and b
            b_scope.cancel()

    batcher = StepBatcher(8, EngineProgress(), batch_done)
    nursery.start_soon(batcher.run)

    async def stepper(name: str, member: Any, scope: trio.CancelScope) -> None:
        try:
            value = 0
            with scope:
                for _ in range(3):
                    _, value = await batcher.step(member, (name, value))
            got[name] = "cancelled" if scope.cancelled_caught else value
        finally:
            batcher.leave(member)

    # Both join before either steps, so that the first batch waits for both rows.
    a, b = (
        batcher.join(run_batch, run_batch, lambda: None),
        batcher.join(run_batch, run_batch, lambda: None),
    )
    with trio.fail_after(10):
        async with trio.open_nursery() as sessions:
            sessions.start_soon(stepper, "a", a, trio.CancelScope())
            sessions.start_soon(stepper, "b", b, b_scope)
    assert got == {"a": 3, "b": "cancelled"}
    assert sorted(run_batch.batches[0]) == ["a", "b"]
    assert run_batch.batches[1:] == [["a"], ["a"]]


class BatchingEngine(SyntheticEngine):
    """A synthetic engine whose chunks each take one batched step (``max_batch`` 2).

    Every session joins ``batched()`` before any of them steps (so none steps alone),
    and the first batch waits in its thread for ``release``: the test knows which rows
    are in it and which wait behind it when its result comes in.
    """

    max_batch = 2

    def __init__(self, sessions: int) -> None:
        super().__init__(SyntheticSettings(steps=1))
        self.joined = threading.Barrier(sessions, timeout=30)
        self.release = threading.Event()
        self.entered: trio.Event | None = None

    def run_batch(self, rows: Sequence[int]) -> list[int]:
        if self.entered is not None:
            trio.from_thread.run_sync(self.entered.set)
        self.release.wait(timeout=30)
        return [row + 1 for row in rows]

    def open_stream(self, request: GenerationRequest) -> SyntheticStream:
        stream = super().open_stream(request)
        synthetic_chunk = stream.next_chunk

        def next_chunk(checkpoint: Checkpoint) -> Chunk | None:
            with batched(checkpoint, self.run_batch) as step:
                self.joined.wait()
                step(0)
            return synthetic_chunk(checkpoint)

        stream.next_chunk = next_chunk  # type: ignore[method-assign]
        return stream


@pytest.mark.parametrize("sessions", [2, 4])
async def test_cancelling_a_server_as_a_batch_ends_returns_and_logs_no_failure(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture, sessions: int
) -> None:
    """``VideoServer.run`` is cancelled (a second Ctrl-C) as the first batch's result
    comes in. With 4 sessions two more rows wait behind that batch: the batcher takes
    them as it is cancelled (item 11); the first batch's sessions, cancelled while their
    rows were in flight, find them done (item 12). The server returns, and no session's
    stop is logged as an engine failure."""
    batch_run = metrics.ServerMetrics.batch_run
    stop_now: list[trio.CancelScope] = []

    def batch_done(self: metrics.ServerMetrics, rows: int) -> None:
        batch_run(self, rows)
        for scope in stop_now:
            scope.cancel()

    monkeypatch.setattr(metrics.ServerMetrics, "batch_run", batch_done)

    async def scenario() -> None:
        engine = BatchingEngine(sessions)
        engine.entered = trio.Event()
        server = VideoServer(
            engine,
            ServerConfig(host="127.0.0.1", port=0, session=SessionConfig(served_model="s")),
        )
        assert server.batcher is not None
        all_handed_over = trio.Event()
        handed_over = 0
        step = server.batcher.step

        async def counted_step(member: Any, data: Any) -> Any:
            nonlocal handed_over
            handed_over += 1
            if handed_over == sessions:
                all_handed_over.set()
            return await step(member, data)

        monkeypatch.setattr(server.batcher, "step", counted_step)

        async def client() -> None:
            async with open_websocket_url(server.url, max_message_size=2**26) as ws:
                await ws.send_message('{"type": "session.start", "prompt": "p", "size": "64x64"}')
                await receive_into(ws, Transcript())

        async with trio.open_nursery() as nursery:
            await nursery.start(server.run)
            for _ in range(sessions):
                nursery.start_soon(client)
            await all_handed_over.wait()
            await engine.entered.wait()  # the first two rows run; any others wait
            stop_now.append(nursery.cancel_scope)
            engine.release.set()

    caplog.set_level(logging.INFO)
    await ends_within(20, scenario)
    errors = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert errors == [], [r.getMessage() for r in errors]


async def test_rows_still_waiting_when_the_batcher_stops_fail_rather_than_wait() -> None:
    """A row that no batch took before the batcher ended gets an error, and so does any
    row handed over afterwards: a session is never left waiting on a batcher that is
    gone."""

    async def scenario() -> dict[str, Any]:
        run_batch, got = Recorder(), {}
        batcher = StepBatcher(8, EngineProgress())
        a, b = (
            batcher.join(run_batch, run_batch, lambda: None),
            batcher.join(run_batch, run_batch, lambda: None),
        )

        async def step(name: str, member: Any) -> None:
            try:
                got[name] = await batcher.step(member, (name, 0))
            except EngineError as exc:
                got[name] = exc

        async def run_batcher(scope: trio.CancelScope) -> None:
            with scope:
                await batcher.run()

        batcher_scope = trio.CancelScope()
        async with trio.open_nursery() as nursery:
            nursery.start_soon(run_batcher, batcher_scope)
            nursery.start_soon(step, "a", a)
            await trio.testing.wait_all_tasks_blocked()  # a's row waits for b's
            batcher_scope.cancel()  # the batcher ends; a's session goes on
        await step("b", b)
        assert run_batch.batches == []
        return got

    got = await ends_within(10, scenario)
    for name in "ab":
        assert isinstance(got[name], EngineError), got
        assert "stopped" in str(got[name])
