"""`SessionCalls`, without a session or a socket: an engine stream closed exactly once
whoever closes it, engine calls left behind when cancelled (and closed, waited for or
abandoned after), and the server's own work never left behind.

The engine here blocks in its thread on a `threading.Event` the test sets, without a
checkpoint, as a hung kernel would; each test checks what happens while it is blocked.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, cast

import pytest
import trio
import trio.testing

from trio_vstream.engines.contract import Checkpoint, Chunk, GenerationRequest, PromptChange
from trio_vstream.engines.synthetic import SyntheticEngine
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.scheduling.engine_calls import EngineCall
from trio_vstream.scheduling.progress import EngineProgress
from trio_vstream.session.calls import SessionCalls
from trio_vstream.session.resources import ServerCounters, ServerResources, SessionConfig

REQUEST = GenerationRequest(request_id="r1", prompt="p", width=8, height=8, fps=8, num_frames=4)
WAIT = 10.0  # seconds a thread waits for the test before failing it


class Stream:
    """An engine stream that counts its closes; ``next_chunk`` takes a step, then blocks
    (outside a checkpoint) until ``go`` is set."""

    def __init__(self) -> None:
        self.closes = 0
        self.go = threading.Event()
        self.blocked = threading.Event()

    def next_chunk(self, checkpoint: Checkpoint) -> Chunk | None:
        checkpoint()
        self.blocked.set()
        assert self.go.wait(WAIT)
        return None

    def interact(self, change: PromptChange) -> None:
        pass

    def close(self) -> None:
        self.closes += 1


class Engine(SyntheticEngine):
    def __init__(self, stream: Stream) -> None:
        super().__init__()
        self.stream = stream

    def open_stream(self, request: GenerationRequest) -> Any:
        return self.stream


def resources(stream: Stream, step_limiter: trio.CapacityLimiter | None = None) -> ServerResources:
    return ServerResources(
        engine=Engine(stream),
        config=SessionConfig(),
        stats=ServerCounters(),
        step_limiter=step_limiter,
        thread_limiter=trio.CapacityLimiter(4),
        encode_limiter=trio.CapacityLimiter(1),
    )


async def opened(
    stream: Stream, step_limiter: trio.CapacityLimiter | None = None
) -> tuple[ServerResources, SessionCalls]:
    """The resources and calls of a session that has opened ``stream``."""
    res = resources(stream, step_limiter)
    calls = SessionCalls(res)
    assert await calls.open_stream(res.engine, REQUEST) is stream
    assert calls.stream is stream and res.stats.streams_open == 1
    return res, calls


async def wait_in_thread(event: threading.Event) -> None:
    assert await trio.to_thread.run_sync(event.wait, WAIT)


async def leave_behind(
    calls: SessionCalls,
    call: EngineCall[Any],
    started: threading.Event,
    in_thread: Callable[[Any], None] | None = None,
) -> None:
    """Run ``call`` through ``calls``, and cancel the caller once the call's thread has
    ``started``: the caller is back at once, the call still running."""
    caller = trio.CancelScope()

    async def run() -> None:
        with caller:
            await calls.call(call, in_thread)

    async with trio.open_nursery() as nursery:
        nursery.start_soon(run)
        await wait_in_thread(started)
        caller.cancel()


async def test_a_stream_is_closed_exactly_once_whoever_closes_it() -> None:
    stream = Stream()
    res, calls = await opened(stream)
    await calls.close_stream()
    calls.close_stream_soon()
    await calls.close_stream()
    assert stream.closes == 1
    assert calls.stream is None and res.stats.streams_open == 0
    assert calls.stream_closed_at is not None
    assert res.stats.worker_threads == 0


async def test_a_cancelled_engine_call_is_left_running_and_cleans_up_as_it_returns() -> None:
    stream = Stream()
    res = resources(stream)
    calls = SessionCalls(res)
    cleaned: list[str] = []

    def blocked() -> str:
        stream.blocked.set()
        assert stream.go.wait(WAIT)
        return "done"

    call = EngineCall(blocked)
    await leave_behind(calls, call, stream.blocked, lambda r: cleaned.append(r.unwrap()))
    # The caller is back while the thread still blocks: nothing held it.
    assert call.detached and not call.returned.is_set()
    assert res.stats.worker_threads == 0 and cleaned == []
    stream.go.set()
    with trio.fail_after(WAIT):
        await calls.wait_detached()
    assert cleaned == ["done"]  # in its thread, with what it returned


async def test_a_chunk_left_behind_takes_the_stream_and_the_step_slot_with_it() -> None:
    stream = Stream()
    res, calls = await opened(stream, trio.CapacityLimiter(1))
    assert res.step_limiter is not None
    checkpoint = SessionCheckpoint(res.step_limiter, EngineProgress(), lambda: None)
    async with trio.open_nursery() as nursery:
        producer = trio.CancelScope()

        async def produce() -> None:
            with producer:
                await calls.next_chunk(stream, checkpoint)

        nursery.start_soon(produce)
        await wait_in_thread(stream.blocked)  # a step taken: the slot is held
        producer.cancel()
    # The call is the stream's owner now; the session closes nothing of it.
    assert calls.stream is None
    calls.close_stream_soon()
    assert stream.closes == 0 and res.stats.streams_open == 1
    assert res.step_limiter.borrowed_tokens == 1  # a stuck step still counts as a step
    stream.go.set()
    with trio.fail_after(WAIT):
        await calls.wait_detached()
    assert stream.closes == 1 and res.stats.streams_open == 0
    assert calls.stream_closed_at is not None
    assert res.step_limiter.borrowed_tokens == 0


async def test_a_close_that_blocks_holds_nobody_and_is_counted_when_it_returns() -> None:
    stream = Stream()
    res, calls = await opened(stream)
    closing = threading.Event()

    def slow_close() -> None:
        closing.set()
        assert stream.go.wait(WAIT)
        Stream.close(stream)

    stream.close = slow_close  # type: ignore[method-assign]
    calls.close_stream_soon()
    await wait_in_thread(closing)
    assert calls.stream is None and res.stats.streams_open == 1  # not closed yet
    stream.go.set()
    with trio.fail_after(WAIT):
        await calls.wait_detached()
    assert stream.closes == 1 and res.stats.streams_open == 0


async def test_calls_running_at_the_end_are_abandoned_and_counted_until_they_return() -> None:
    stream = Stream()
    res = resources(stream)
    calls = SessionCalls(res)
    call = EngineCall(stream.next_chunk, Checkpoint())
    await leave_behind(calls, call, stream.blocked)
    returned_early = EngineCall(lambda: None)
    with trio.CancelScope() as scope:
        scope.cancel()
        await calls.call(returned_early)  # cancelled before its thread: never ran
    calls.abandon_detached()
    assert res.abandoned_calls.running == {call} and res.abandoned_calls.total == 1
    calls.abandon_detached()  # handed over once
    assert res.abandoned_calls.total == 1
    stream.go.set()
    with trio.fail_after(WAIT):
        await call.returned.wait()
    assert res.abandoned_calls.running == set()


@pytest.mark.parametrize("cancelled", [False, True])
async def test_the_servers_own_work_is_never_left_behind(cancelled: bool) -> None:
    stream = Stream()
    res = resources(stream)
    calls = SessionCalls(res)
    started = threading.Event()
    results: list[str] = []

    def work(word: str) -> str:
        started.set()
        assert stream.go.wait(WAIT)
        return word

    async with trio.open_nursery() as nursery:
        waiter = trio.CancelScope()

        async def call() -> None:
            with waiter:
                results.append(await calls.in_thread(work, "encoded"))

        nursery.start_soon(call)
        await wait_in_thread(started)
        if cancelled:
            waiter.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert results == [] and res.stats.worker_threads == 1  # still waiting for it
        stream.go.set()
    assert results == ["encoded"] and res.stats.worker_threads == 0


async def test_an_encoder_close_that_found_no_free_thread_still_closes() -> None:
    """The close timeout passes while the server's threads are all busy, before the
    close could start: it starts in a thread of its own then, once (an encoder never
    closed kept its x264 threads alive)."""
    res = resources(Stream())
    calls = SessionCalls(res)
    closes: list[str] = []
    closed = threading.Event()

    class Encoder:
        def close(self) -> None:
            closes.append(threading.current_thread().name)
            closed.set()

    holders = [object() for _ in range(int(res.thread_limiter.total_tokens))]
    for holder in holders:
        res.thread_limiter.acquire_on_behalf_of_nowait(holder)
    try:
        assert not await calls.close_encoder(cast(Any, Encoder()), timeout=0.05)
        assert await trio.to_thread.run_sync(closed.wait, WAIT)
    finally:
        for holder in holders:
            res.thread_limiter.release_on_behalf_of(holder)
    await trio.testing.wait_all_tasks_blocked()
    assert closes == ["encoder close"]
    assert res.stats.worker_threads == 0
