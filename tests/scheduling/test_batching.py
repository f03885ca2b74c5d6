"""The step batcher: sessions' steps run as one batch, and each session still gets its own.

Each "session" here is a Trio task running an engine-like loop in a worker thread,
stepping through ``batched(checkpoint, run_batch)`` exactly as an engine does; rows are
numbers and a step adds one, so every result says whose row it was and how far it got.
"""

from __future__ import annotations

import gc
import threading
import traceback
import weakref
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import pytest
import trio
import trio.testing

from trio_vstream.engines.contract import EngineError, batched
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.checkpoint import SessionCheckpoint
from trio_vstream.scheduling.progress import EngineProgress


class Recorder:
    """A ``run_batch`` over (session, value) rows that records every batch it runs."""

    def __init__(self, fail: Callable[[Any], Exception | None] = lambda row: None) -> None:
        self.batches: list[list[str]] = []
        self.fail = fail
        self.release = threading.Event()
        self.release.set()
        self.entered: trio.Event | None = None

    def __call__(self, rows: Sequence[tuple[str, int]]) -> list[Any]:
        self.batches.append([name for name, _ in rows])
        if self.entered is not None:
            trio.from_thread.run_sync(self.entered.set)
        self.release.wait()
        return [self.fail((name, v)) or (name, v + 1) for name, v in rows]


def stepping(
    run_batch: Recorder,
    name: str,
    steps: int,
    barrier: threading.Barrier | None = None,
    key: Hashable = None,
) -> Callable[[SessionCheckpoint], int]:
    """A session's engine work: ``steps`` batched steps (under ``key``, by default the
    ``run_batch`` itself), returning the final value."""

    def work(checkpoint: SessionCheckpoint) -> int:
        value = 0
        with batched(checkpoint, run_batch, key) as step:
            if barrier is not None:
                barrier.wait()  # every session has joined before anyone steps
            for _ in range(steps):
                got_name, value = step((name, value))
                assert got_name == name
        return value

    return work


async def session(
    batcher: StepBatcher | None,
    work: Callable[[SessionCheckpoint], int],
    results: dict[str, Any],
    name: str,
    scope: trio.CancelScope | None = None,
) -> None:
    checkpoint = SessionCheckpoint(None, EngineProgress(), lambda: None, batcher)
    try:
        with scope or trio.CancelScope():
            results[name] = await trio.to_thread.run_sync(work, checkpoint)
            return
        results[name] = "cancelled"
    except Exception as exc:
        results[name] = exc


async def test_sessions_stepping_together_run_as_one_batch(nursery: trio.Nursery) -> None:
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    run_batch, results = Recorder(), {}
    barrier = threading.Barrier(4)
    async with trio.open_nursery() as sessions:
        for name in "abcd":
            sessions.start_soon(
                session, batcher, stepping(run_batch, name, 5, barrier), results, name
            )
    assert results == dict.fromkeys("abcd", 5)  # each got its own five steps
    assert [sorted(batch) for batch in run_batch.batches] == [list("abcd")] * 5
    assert (batcher.batches, batcher.rows) == (5, 20)


async def test_rows_of_equal_keys_batch_together_whatever_their_run_batch(
    nursery: trio.Nursery,
) -> None:
    """Each session hands over a run_batch of its own, under one key: their rows run as
    one batch, by the run_batch of the batch's first row (the key says they are
    interchangeable)."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    own = {name: Recorder() for name in "ab"}
    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)
    async with trio.open_nursery() as sessions:
        for name in "ab":
            work = stepping(own[name], name, 3, barrier, key=("step", 4))
            sessions.start_soon(session, batcher, work, results, name)
    assert results == {"a": 3, "b": 3}
    batches = own["a"].batches + own["b"].batches
    assert [sorted(batch) for batch in batches] == [["a", "b"]] * 3
    assert (batcher.batches, batcher.rows) == (3, 6)


async def test_rows_of_different_keys_never_share_a_batch(nursery: trio.Nursery) -> None:
    """One run_batch, two keys: the rows of each key run apart."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    run_batch, results = Recorder(), {}
    barrier = threading.Barrier(4)
    async with trio.open_nursery() as sessions:
        for name, key in (("a", 1), ("b", 2), ("c", 1), ("d", 2)):
            work = stepping(run_batch, name, 3, barrier, key=("step", key))
            sessions.start_soon(session, batcher, work, results, name)
    assert results == dict.fromkeys("abcd", 3)
    # Both members of a key join before either steps: every batch is a key's pair.
    batches = sorted(tuple(sorted(batch)) for batch in run_batch.batches)
    assert batches == [("a", "c")] * 3 + [("b", "d")] * 3


async def test_without_a_batcher_each_row_runs_alone() -> None:
    run_batch, results = Recorder(), {}
    async with trio.open_nursery() as sessions:
        for name in "ab":
            sessions.start_soon(session, None, stepping(run_batch, name, 3), results, name)
    assert results == {"a": 3, "b": 3}
    assert sorted(run_batch.batches) == [["a"]] * 3 + [["b"]] * 3


async def test_max_batch_is_respected_and_sessions_take_turns(nursery: trio.Nursery) -> None:
    """Rows run oldest first: with 5 sessions and batches of 2, a row handed over waits
    for at most two batches. The sessions are Trio tasks calling the batcher directly, so
    every row is handed over before the next batch is chosen (no thread timing)."""
    batcher = StepBatcher(2, EngineProgress())
    nursery.start_soon(batcher.run)
    run_batch = Recorder()
    waited: dict[str, list[int]] = {name: [] for name in "abcde"}

    async def stepper(name: str) -> None:
        member = batcher.join(run_batch, run_batch, lambda: None)
        try:
            value = 0
            for _ in range(4):
                handed_over = batcher.batches
                _, value = await batcher.step(member, (name, value))
                waited[name].append(batcher.batches - handed_over)
        finally:
            batcher.leave(member)
        assert value == 4

    async with trio.open_nursery() as sessions:
        for name in "abcde":
            sessions.start_soon(stepper, name)
    assert max(len(batch) for batch in run_batch.batches) == 2
    assert sum(len(batch) for batch in run_batch.batches) == 20
    assert max(max(counts) for counts in waited.values()) == 3, waited  # 2 before, 1 its own


async def test_a_new_session_joins_the_running_batch_at_the_next_step(
    nursery: trio.Nursery,
) -> None:
    """A short video started while a long one runs is done long before the long one."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    run_batch, results = Recorder(), {}
    run_batch.entered = trio.Event()
    order: list[str] = []

    async def then_record(name: str, steps: int) -> None:
        await session(batcher, stepping(run_batch, name, steps), results, name)
        order.append(name)

    async with trio.open_nursery() as sessions:
        sessions.start_soon(then_record, "long", 200)
        await run_batch.entered.wait()  # the long video is stepping
        sessions.start_soon(then_record, "short", 3)
    assert results == {"long": 200, "short": 3}
    assert order == ["short", "long"]
    joined = [i for i, batch in enumerate(run_batch.batches) if "short" in batch]
    assert all(sorted(run_batch.batches[i]) == ["long", "short"] for i in joined)


async def test_a_stopped_session_takes_its_waiting_row_back_at_once(
    nursery: trio.Nursery, monkeypatch: pytest.MonkeyPatch
) -> None:
    batcher = StepBatcher(1, EngineProgress())
    nursery.start_soon(batcher.run)
    b_handed_over = trio.Event()
    step = batcher.step

    async def handing_over(member: Any, data: Any) -> Any:
        if data[0] == "b":
            b_handed_over.set()  # its row is queued before this task next waits
        return await step(member, data)

    monkeypatch.setattr(batcher, "step", handing_over)
    run_batch, results = Recorder(), {}
    run_batch.release.clear()
    run_batch.entered = trio.Event()
    scope = trio.CancelScope()
    b_ended = trio.Event()

    async def b() -> None:
        await session(batcher, stepping(run_batch, "b", 2), results, "b", scope)
        b_ended.set()

    async with trio.open_nursery() as sessions:
        sessions.start_soon(session, batcher, stepping(run_batch, "a", 2), results, "a")
        try:
            await run_batch.entered.wait()  # a's first step runs, and holds the batch
            sessions.start_soon(b)
            # b's row waits behind a's batch (b's thread hands it over: no task to wait
            # for, so not wait_all_tasks_blocked, which could stop b before it stepped).
            await b_handed_over.wait()
            scope.cancel()
            with trio.fail_after(10):
                await b_ended.wait()  # b's row was only waiting: b ends while a's step runs
            assert not run_batch.release.is_set()
        finally:
            run_batch.release.set()
    assert results == {"a": 2, "b": "cancelled"}
    assert run_batch.batches == [["a"], ["a"]]


async def test_a_session_stopped_mid_step_waits_for_that_step_only(nursery: trio.Nursery) -> None:
    """Its row's result is dropped, it leaves, and the others go on without it."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    run_batch, results = Recorder(), {}
    barrier = threading.Barrier(2)
    scope = trio.CancelScope()
    async with trio.open_nursery() as sessions:
        sessions.start_soon(session, batcher, stepping(run_batch, "a", 5, barrier), results, "a")
        run_batch.release.clear()
        run_batch.entered = trio.Event()
        sessions.start_soon(
            session, batcher, stepping(run_batch, "b", 5, barrier), results, "b", scope
        )
        await run_batch.entered.wait()  # the first batch, with both rows, is running
        scope.cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert "b" not in results  # b waits for the step its row is in
        run_batch.entered = None
        run_batch.release.set()
    assert results == {"a": 5, "b": "cancelled"}
    assert sorted(run_batch.batches[0]) == ["a", "b"]
    assert run_batch.batches[1:] == [["a"]] * 4  # nobody waits for b's next row


async def test_a_failed_row_fails_only_its_session(nursery: trio.Nursery) -> None:
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)

    def fail(row: tuple[str, int]) -> Exception | None:
        return ValueError("row b broke") if row == ("b", 2) else None

    run_batch, results = Recorder(fail), {}
    barrier = threading.Barrier(3)
    async with trio.open_nursery() as sessions:
        for name in "abc":
            sessions.start_soon(
                session, batcher, stepping(run_batch, name, 4, barrier), results, name
            )
    assert results["a"] == 4 and results["c"] == 4
    assert isinstance(results["b"], ValueError) and str(results["b"]) == "row b broke"


async def test_a_batch_that_raises_fails_every_row_in_it(nursery: trio.Nursery) -> None:
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)

    def broken(rows: Sequence[tuple[str, int]]) -> list[Any]:
        raise RuntimeError("out of memory")

    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)
    async with trio.open_nursery() as sessions:
        for name in "ab":
            work = stepping(broken, name, 2, barrier)  # type: ignore[arg-type]
            sessions.start_soon(session, batcher, work, results, name)
    assert [str(results[name]) for name in "ab"] == ["out of memory"] * 2


async def test_a_wrong_number_of_results_is_an_engine_error(nursery: trio.Nursery) -> None:
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    results: dict[str, Any] = {}
    await session(batcher, stepping(lambda rows: [], "a", 1), results, "a")  # type: ignore[arg-type]
    assert isinstance(results["a"], EngineError)
    assert str(results["a"]) == "run_batch returned 0 results for 1 rows"


def test_max_batch_must_be_positive() -> None:
    with pytest.raises(ValueError, match="max_batch must be >= 1"):
        StepBatcher(0, EngineProgress())


async def test_a_session_alone_steps_in_its_own_thread(nursery: trio.Nursery) -> None:
    """Nobody to batch with: no hand-over to the batcher's thread and back (which cost a
    lone session about 8 % of its frames per second); still counted as batches of one."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    threads: list[int] = []

    def run_batch(rows: Sequence[tuple[str, int]]) -> list[Any]:
        threads.append(threading.get_ident())
        return [(name, v + 1) for name, v in rows]

    def work(checkpoint: SessionCheckpoint) -> int:
        threads.clear()
        value = stepping(run_batch, "a", 6)(checkpoint)  # type: ignore[arg-type]
        assert threads == [threading.get_ident()] * 6
        return value

    results: dict[str, Any] = {}
    await session(batcher, work, results, "a")
    assert results == {"a": 6}
    assert (batcher.batches, batcher.rows) == (6, 6)


async def test_a_per_stream_run_batch_is_not_kept_after_its_sessions(
    nursery: trio.Nursery,
) -> None:
    """An engine may hand ``batched()`` a new function per stream (a closure over the
    stream's state): once the stream's sessions are gone, the batcher keeps none of them,
    nor what they hold."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)

    async def two_sessions_with_their_own_closure(stopped: bool) -> weakref.ref[Any]:
        def run_batch(rows: Sequence[tuple[str, int]]) -> list[Any]:
            return [(name, v + 1) for name, v in rows]

        scope = trio.CancelScope()

        async def stepper(member: Any, steps: int, scope: trio.CancelScope) -> None:
            try:
                with scope:
                    for value in range(steps):
                        await batcher.step(member, ("s", value))
            finally:
                batcher.leave(member)

        # Two members, so that rows go through the batcher's queue (one alone would not).
        first, second = (
            batcher.join(run_batch, run_batch, lambda: None),
            batcher.join(run_batch, run_batch, lambda: None),
        )
        async with trio.open_nursery() as sessions:
            sessions.start_soon(stepper, first, 3, scope)
            if stopped:  # its row waits for the other's, and is taken back by a stop
                await trio.testing.wait_all_tasks_blocked()
                scope.cancel()
            else:
                sessions.start_soon(stepper, second, 3, trio.CancelScope())
        batcher.leave(second)
        return weakref.ref(run_batch)

    closures = [await two_sessions_with_their_own_closure(n % 2 == 1) for n in range(6)]
    gc.collect()
    assert [ref() for ref in closures] == [None] * 6
    assert batcher.rows == 3 * 3 * 2  # the three stopped pairs ran no row


async def test_one_claim_to_step_alone_at_a_time_across_run_batch_groups(
    nursery: trio.Nursery,
) -> None:
    """Two groups (two ``run_batch`` functions), one session in each: while one steps
    alone in its own thread, the other may not claim that too (which would overwrite the
    first claim, and let batches run beside it); its row waits for the batcher, which
    runs it once the first claim ends."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    run_a, run_b = Recorder(), Recorder()
    a, b = batcher.join(run_a, run_a, lambda: None), batcher.join(run_b, run_b, lambda: None)
    assert batcher.claim_alone(a)  # a's row runs in a's thread now
    assert not batcher.claim_alone(b)
    got: dict[str, Any] = {}

    async def step_b() -> None:
        got["b"] = await batcher.step(b, ("b", 0))

    nursery.start_soon(step_b)
    await trio.testing.wait_all_tasks_blocked()
    assert run_b.batches == [] and not got  # no batch beside a's own step
    assert not batcher.claim_alone(a)  # a's next step: b's row waits, so a queues too
    batcher.leave(a)
    with trio.fail_after(10):
        while "b" not in got:
            await trio.testing.wait_all_tasks_blocked()
    assert got["b"] == ("b", 1)
    assert run_b.batches == [["b"]]


async def test_each_row_of_a_failed_batch_gets_its_own_exception(nursery: trio.Nursery) -> None:
    """One exception object raised in several sessions' threads at once would gather all
    their tracebacks, mixed: each row raises its own copy (same type and message, so the
    engine and the client see what they did), chained from the batch's exception."""
    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)
    raised: list[Exception] = []

    def broken(rows: Sequence[tuple[str, int]]) -> list[Any]:
        raised.append(RuntimeError("out of memory"))
        raise raised[-1]

    results: dict[str, Any] = {}
    barrier = threading.Barrier(3)
    async with trio.open_nursery() as sessions:
        for name in "abc":
            work = stepping(broken, name, 1, barrier)  # type: ignore[arg-type]
            sessions.start_soon(session, batcher, work, results, name)
    errors = [results[name] for name in "abc"]
    assert len(raised) == 1  # one batch
    assert len({id(error) for error in errors}) == 3
    for error in errors:
        assert type(error) is RuntimeError and str(error) == "out of memory"
        assert error.__cause__ is raised[0]
        frames = [frame.name for frame in traceback.extract_tb(error.__traceback__)]
        assert frames.count("batch_result") == 1, frames  # its own raise only


async def test_a_failed_batch_exception_that_cannot_be_copied_becomes_an_engine_error(
    nursery: trio.Nursery,
) -> None:
    """Rebuilding this one from its arguments fails (a keyword-only one): each row gets
    an `EngineError` of its own with the same text, chained from it."""

    class Odd(Exception):
        def __init__(self, code: int, *, where: str) -> None:
            super().__init__(f"odd {code} at {where}")

    batcher = StepBatcher(8, EngineProgress())
    nursery.start_soon(batcher.run)

    def broken(rows: Sequence[tuple[str, int]]) -> list[Any]:
        raise Odd(7, where="the VAE")

    results: dict[str, Any] = {}
    barrier = threading.Barrier(2)
    async with trio.open_nursery() as sessions:
        for name in "ab":
            work = stepping(broken, name, 1, barrier)  # type: ignore[arg-type]
            sessions.start_soon(session, batcher, work, results, name)
    a, b = results["a"], results["b"]
    assert a is not b
    for error in (a, b):
        assert type(error) is EngineError and str(error) == "odd 7 at the VAE"
        assert isinstance(error.__cause__, Odd)
