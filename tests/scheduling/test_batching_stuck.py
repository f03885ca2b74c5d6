"""The step batcher when a batched forward hangs (issue 30): the batch is left to its
thread, counted as an abandoned call, and the batcher is *stuck* (rows fail at once,
nothing steps alone) until the forward returns; then it takes rows again.

The sessions are Trio tasks calling the batcher directly (as in `test_batching`), and
the hang is a ``run_batch`` blocked on a ``threading.Event`` the test holds: what a
session's stall guard and close timeout decide in the server is done here by calling
`StepBatcher.member_abandoned`, as `SessionCalls.abandon_detached` does.
"""

from __future__ import annotations

from typing import Any

import pytest
import trio
import trio.testing

from tests.scheduling.test_batching import Recorder
from trio_vstream.engines.contract import EngineError
from trio_vstream.scheduling.batcher import BatchMember, StepBatcher
from trio_vstream.scheduling.engine_calls import AbandonedCalls
from trio_vstream.scheduling.progress import EngineProgress


class Stuck:
    """A batcher with a hung first batch of rows ``a`` and ``b``, ``a`` abandoned."""

    def __init__(self, nursery: trio.Nursery) -> None:
        self.returned = trio.Event()
        """Every abandoned call has returned (told by `AbandonedCalls`)."""
        self.abandoned = AbandonedCalls(on_change=lambda n: n or self.returned.set())
        self.told: list[bool] = []
        self.batcher = StepBatcher(
            4,
            EngineProgress(),
            abandoned=self.abandoned,
            on_stuck=lambda: self.told.append(self.batcher.stuck),
        )
        nursery.start_soon(self.batcher.run)
        self.run_batch = Recorder()
        self.run_batch.release.clear()
        self.run_batch.entered = trio.Event()
        self.results: dict[str, Any] = {}
        self.members: dict[str, BatchMember] = {}
        self.scopes: dict[str, trio.CancelScope] = {}
        self.ended: dict[str, trio.Event] = {}

    def start(self, nursery: trio.Nursery, name: str) -> None:
        member = self.batcher.join(self.run_batch, self.run_batch, lambda: None)
        self.members[name] = member
        self.scopes[name] = scope = trio.CancelScope()
        self.ended[name] = ended = trio.Event()

        async def stepper() -> None:
            try:
                with scope:
                    try:
                        self.results[name] = await self.batcher.step(member, (name, 0))
                    except EngineError as exc:
                        self.results[name] = exc
                    return
                self.results[name] = "cancelled"
            finally:
                self.batcher.leave(member)
                ended.set()

        nursery.start_soon(stepper)

    async def hang(self, nursery: trio.Nursery) -> None:
        """Rows a and b in one batch whose forward hangs; then a is stopped (waits,
        shielded, for its row) and abandoned, as its session's close timeout would."""
        self.start(nursery, "a")
        self.start(nursery, "b")
        await self.run_batch.entered.wait()
        assert sorted(self.run_batch.batches[0]) == ["a", "b"]
        self.scopes["a"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        assert "a" not in self.results  # its row is in flight: it waits for that batch
        self.batcher.member_abandoned(self.members["a"])
        with trio.fail_after(10):
            await self.ended["a"].wait()
            await self.ended["b"].wait()


def is_stuck_error(result: object) -> bool:
    return isinstance(result, EngineError) and "stuck" in str(result)


async def test_a_hung_batch_is_abandoned_and_its_rows_fail(nursery: trio.Nursery) -> None:
    stuck = Stuck(nursery)
    try:
        await stuck.hang(nursery)
        assert stuck.results["a"] == "cancelled"
        assert is_stuck_error(stuck.results["b"]), stuck.results["b"]
        assert stuck.batcher.stuck
        assert stuck.told == [True]
        assert [call.name for call in stuck.abandoned.running] == ["_call_batch"]
        assert stuck.abandoned.total == 1
        assert stuck.batcher.batches == 0  # the hung batch is no batch run
    finally:
        stuck.run_batch.release.set()


async def test_while_stuck_a_new_row_fails_at_once_and_none_steps_alone(
    nursery: trio.Nursery,
) -> None:
    stuck = Stuck(nursery)
    try:
        await stuck.hang(nursery)
        stuck.start(nursery, "c")
        with trio.fail_after(10):
            await stuck.ended["c"].wait()
        assert is_stuck_error(stuck.results["c"]), stuck.results["c"]
        alone = stuck.batcher.join(stuck.run_batch, stuck.run_batch, lambda: None)
        try:
            assert not stuck.batcher.claim_alone(alone)  # the forward is still in use
        finally:
            stuck.batcher.leave(alone)
        assert len(stuck.run_batch.batches) == 1  # nothing else reached the engine
    finally:
        stuck.run_batch.release.set()


async def test_a_row_queued_behind_the_hung_batch_fails_when_it_is_abandoned(
    nursery: trio.Nursery,
) -> None:
    stuck = Stuck(nursery)
    try:
        stuck.start(nursery, "a")
        stuck.start(nursery, "b")
        await stuck.run_batch.entered.wait()
        # A third session's row waits for the next batch, behind the hung one.
        stuck.start(nursery, "c")
        await trio.testing.wait_all_tasks_blocked()
        assert "c" not in stuck.results
        stuck.scopes["a"].cancel()
        await trio.testing.wait_all_tasks_blocked()
        stuck.batcher.member_abandoned(stuck.members["a"])
        with trio.fail_after(10):
            await stuck.ended["c"].wait()
        assert is_stuck_error(stuck.results["c"]), stuck.results["c"]
    finally:
        stuck.run_batch.release.set()


async def test_the_batcher_takes_rows_again_once_the_forward_returns(
    nursery: trio.Nursery,
) -> None:
    stuck = Stuck(nursery)
    await stuck.hang(nursery)
    stuck.run_batch.release.set()  # the forward returns at last
    with trio.fail_after(10):
        await stuck.returned.wait()
    assert not stuck.batcher.stuck
    assert stuck.told == [True, False]
    stuck.run_batch.entered = None
    stuck.start(nursery, "d")
    stuck.start(nursery, "e")
    with trio.fail_after(10):
        await stuck.ended["d"].wait()
        await stuck.ended["e"].wait()
    assert stuck.results["d"] == ("d", 1)
    assert stuck.results["e"] == ("e", 1)
    assert stuck.abandoned.total == 1


async def test_a_session_alone_whose_step_hangs_makes_the_batcher_stuck(
    nursery: trio.Nursery,
) -> None:
    """A member stepping alone runs ``run_batch`` in its own thread (`claim_alone`): if
    its session is abandoned mid-step, no batch may run until that step returns."""
    told: list[bool] = []
    batcher = StepBatcher(4, EngineProgress(), on_stuck=lambda: told.append(batcher.stuck))
    nursery.start_soon(batcher.run)
    run_batch = Recorder()
    member = batcher.join(run_batch, run_batch, lambda: None)
    assert batcher.claim_alone(member)  # its step now runs in its own thread
    batcher.member_abandoned(member)
    assert batcher.stuck and told == [True]
    other = batcher.join(run_batch, run_batch, lambda: None)
    with pytest.raises(EngineError, match="stuck"):
        await batcher.step(other, ("other", 0))
    batcher.leave(member)  # its step returned, and its thread leaves
    assert not batcher.stuck and told == [True, False]
    assert await batcher.step(other, ("other", 0)) == ("other", 1)
    batcher.leave(other)
