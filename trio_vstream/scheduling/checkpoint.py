"""The checkpoint a session hands its engine: where a stopped session's engine stops.

Every step a session's engine takes passes through its `SessionCheckpoint`, from the
engine's worker thread into the Trio thread: that is where a stopped session's engine
is stopped (within one step), where sessions take turns on the engine's step slots,
and where progress is recorded for the stall guard (`trio_vstream.scheduling.progress`).
It is a `BatchRunner` too: a batching engine's steps (``trio_vstream.engines.batched``)
go from here to the server's `StepBatcher` (`trio_vstream.scheduling.batcher`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Awaitable, Callable, Hashable, Iterator
from typing import Any, TypeVar, cast

import trio

from trio_vstream.engines.contract import (
    BatchRunner,
    Checkpoint,
    In,
    Out,
    RunBatch,
    batch_result,
)
from trio_vstream.scheduling.batcher import BatchMember, StepBatcher, stuck_error
from trio_vstream.scheduling.progress import EngineProgress

T = TypeVar("T")


class SessionCheckpoint(Checkpoint, BatchRunner):
    """The ``checkpoint`` a session hands its engine, called from the worker thread.

    A step (``checkpoint()``) raises ``trio.Cancelled`` once the producer is
    cancelled, which is what stops the engine within one step; otherwise it
    counts as progress, for this session and for the sessions queued behind
    it. With an engine step limit it also hands the engine's step slots round
    fairly: a session that holds a slot gives it up at every step where
    another session is waiting, and ``trio.CapacityLimiter`` serves waiters
    first come, first served. One round trip to the Trio thread per step,
    small beside a denoising step.
    """

    def __init__(
        self,
        limiter: trio.CapacityLimiter | None,
        progress: EngineProgress,
        on_progress: Callable[[], None],
        batcher: StepBatcher | None = None,
    ) -> None:
        self._limiter = limiter
        self._progress = progress
        self._on_progress = on_progress
        self._batcher = batcher
        self._holding = False
        self._waited = 0.0
        self._waiting_since: float | None = None
        self._cancelled = False
        self._waits: set[trio.CancelScope] = set()
        self._members: set[BatchMember] = set()
        """Its memberships of the batcher (in ``batched_steps()``), kept in the Trio thread."""

    def take_waited(self) -> float:
        """Seconds spent queued (step slots, ``waiting()``) since the last call."""
        waited, self._waited = self._waited, 0.0
        return waited

    def __call__(self) -> None:
        trio.from_thread.check_cancelled()
        if self._limiter is None:
            # No turns to take: a plain call on the event loop is enough, and cheaper
            # than running a task there.
            trio.from_thread.run_sync(self._progressed)
        else:
            trio.from_thread.run(self._interruptible, self._step)
            trio.from_thread.check_cancelled()  # no step after a wait that `cancel` ended

    def check_cancelled(self) -> None:
        trio.from_thread.check_cancelled()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        trio.from_thread.check_cancelled()
        if self._batcher is not None and self._batcher.stuck:
            # What it would wait for (a lock that a hung batch holds, say) may never come.
            raise stuck_error()
        queued = self._progress.queued(self, self._on_progress)
        trio.from_thread.run_sync(self._enter_queue, queued)
        try:
            yield
        finally:
            trio.from_thread.run_sync(self._leave_queue, queued)

    @contextlib.contextmanager
    def batched_steps(
        self, run_batch: RunBatch[In, Out], key: Hashable
    ) -> Iterator[Callable[[In], Out]]:
        """`BatchRunner`'s side (what `trio_vstream.engines.batched` enters): the rows go
        to the server's `StepBatcher`, grouped by ``key``; without a batcher (an engine
        with ``max_batch`` 1) each row runs alone, as a step."""
        batcher = self._batcher
        if batcher is None:  # the engine steps alone

            def alone(row: In) -> Out:
                self()
                return batch_result(run_batch([row]), 0, 1)

            yield alone
            return
        trio.from_thread.check_cancelled()
        member = trio.from_thread.run_sync(self._join, batcher, run_batch, key)

        def step(row: In) -> Out:
            trio.from_thread.check_cancelled()
            if trio.from_thread.run_sync(batcher.claim_alone, member):
                # Nobody to batch with: the row runs here, as an unbatched step would,
                # without two hand-overs to and from the batcher's thread.
                return batch_result(run_batch([row]), 0, 1)
            result = trio.from_thread.run(self._interruptible, batcher.step, member, row)
            trio.from_thread.check_cancelled()  # None: the wait was ended by `cancel`
            return cast(Out, result)

        try:
            yield step
        finally:
            trio.from_thread.run_sync(self._leave, batcher, member)

    def _join(
        self, batcher: StepBatcher, run_batch: RunBatch[Any, Any], key: Hashable
    ) -> BatchMember:
        member = batcher.join(run_batch, key, self._on_progress)
        self._members.add(member)
        return member

    def _leave(self, batcher: StepBatcher, member: BatchMember) -> None:
        self._members.discard(member)
        batcher.leave(member)

    def abandoned(self) -> None:
        """The session ended while its engine call still ran (`SessionCalls.abandon_detached`):
        tell the batcher, for which a step of this session's that is still running (its
        row in a batch, or its step alone) has hung."""
        if self._batcher is not None:
            for member in list(self._members):
                self._batcher.member_abandoned(member)

    def cancel(self) -> None:
        """The session left its engine call behind (`trio_vstream.scheduling.engine_calls`): end the
        call's waits in the Trio thread now, and any it would start later.

        Such a call runs with ``abandon_on_cancel=True``, so its ``trio.from_thread.run``
        waits (for a step slot, for a batch) run as system tasks, which the session's
        cancellation does not reach. ``trio.from_thread.check_cancelled`` still raises
        in its thread, and does so right after a wait ended here.
        """
        self._cancelled = True
        for scope in self._waits:
            scope.cancel()

    async def _interruptible(self, wait: Callable[..., Awaitable[T]], *args: Any) -> T | None:
        """``await wait(*args)``, unless `cancel` ends it first (then None)."""
        with trio.CancelScope() as scope:
            if self._cancelled:
                scope.cancel()
            self._waits.add(scope)
            try:
                return await wait(*args)
            finally:
                self._waits.discard(scope)
        return None

    def _enter_queue(self, queued: contextlib.AbstractContextManager[None]) -> None:
        queued.__enter__()
        self._waiting_since = trio.current_time()

    def _leave_queue(self, queued: contextlib.AbstractContextManager[None]) -> None:
        queued.__exit__(None, None, None)
        if self._waiting_since is not None:
            self._waited += trio.current_time() - self._waiting_since
            self._waiting_since = None

    async def _step(self) -> None:
        limiter = self._limiter
        if limiter is not None:
            # The limiter is only touched from the Trio thread.
            if self._holding and limiter.statistics().tasks_waiting:
                limiter.release_on_behalf_of(self)
                self._holding = False
            if not self._holding:
                began = trio.current_time()
                with self._progress.queued(self, self._on_progress):
                    await limiter.acquire_on_behalf_of(self)
                self._waited += trio.current_time() - began
                self._holding = True
        self._progressed()

    def _progressed(self) -> None:
        self._on_progress()
        self._progress.step_taken()

    def release(self) -> None:
        """Give the slot back when the engine call returns (from the Trio thread)."""
        if self._holding and self._limiter is not None:
            self._limiter.release_on_behalf_of(self)
            self._holding = False
