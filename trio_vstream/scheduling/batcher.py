"""Where a batch is formed: the one task that runs a batching engine's steps together.

For an engine that batches (``max_batch`` > 1), `StepBatcher` is the one task that runs
its steps: each session's worker thread hands its row over (through its checkpoint,
`trio_vstream.scheduling.checkpoint`) and waits for its own result, so a session's
generation loop still awaits its own chunk, while the batcher runs the rows of every
session that is stepping as one call.

A batched forward can hang like any engine call (a wedged GPU). Its call is an
`EngineCall`: once a session whose row it holds is abandoned (its stall guard gave up
on it, and it ended without its call returning), the batcher stops waiting for the
batch, counts it with the server's abandoned calls and is *stuck*: until that thread
returns, a row handed over fails at once with an `EngineError`, since the engine's
batched step cannot be called again while one call of it still runs. When the thread
returns, the batcher takes rows again.
"""

from __future__ import annotations

import copy
import enum
from collections import deque
from collections.abc import Callable, Hashable, Sequence
from typing import Any

import attrs
import trio

from trio_vstream.engines.contract import EngineError, RunBatch, batch_result
from trio_vstream.logsafe import get_logger
from trio_vstream.scheduling.engine_calls import AbandonedCalls, EngineCall
from trio_vstream.scheduling.progress import EngineProgress

logger = get_logger(__name__)


@attrs.define(eq=False)
class BatchMember:
    """A session inside ``batched(checkpoint, run_batch, key)``: the batcher waits for its
    rows, and batches them with the rows of the other members of its ``key``."""

    run_batch: RunBatch[Any, Any]
    key: Hashable
    """Its group: rows of members with equal keys run in one batch (by the ``run_batch``
    of the batch's first row, which the engine made interchangeable within a key)."""
    on_progress: Callable[[], None]
    row: _Row | None = None
    """Its row while waiting or in a running batch; None while it works between steps."""
    abandoned: bool = False
    """Its session ended without its engine call: it will not hand over a row again."""


class _RowState(enum.Enum):
    """Where a row is: always exactly one of these, and each has its own way out when
    its session is stopped (see `StepBatcher.step`)."""

    QUEUED = "queued"
    """In its group's queue, waiting for a batch: a stopped session takes it back."""
    IN_FLIGHT = "in flight"
    """Taken into a batch that has not ended: a stopped session waits for that batch,
    which finishes every row it took, however it ends."""
    DONE = "done"
    """Its result (or its own error) is in and ``done`` is set: a stopped session drops it."""


@attrs.define(eq=False)
class _Row:
    member: BatchMember
    data: Any
    order: int
    """When it was handed over: the oldest waiting row's group runs first."""
    done: trio.Event = attrs.Factory(trio.Event)
    state: _RowState = _RowState.QUEUED
    results: Sequence[Any] = ()
    index: int = 0


class StepBatcher:
    """Runs the steps of every session of one engine as batches, from one task.

    Rows gather per key (what the engine hands over with its batched step: any
    hashable, the ``run_batch`` itself by default), and a batch runs the ``run_batch``
    its first row came with. A batch
    runs once every member of its key has handed over its next row,
    or once ``max_batch`` rows wait; the rows that waited longest go first, so
    with more sessions than ``max_batch`` they take turns, and a new session's
    row joins at the next step. A session that is stopped while its row waits
    takes it back; while its row is in a running batch, it waits for that one
    step to end (its result is dropped), so a stop takes effect within one step
    and nothing of the session is left in use after it. The batched call runs
    in a worker thread of its own, outside the sessions' thread limit, which
    the waiting sessions' threads hold.

    Every row taken into a batch is finished, however the batch ends (an engine
    error, the batcher cancelled, or the batch abandoned as hung), and every row
    still waiting when the batcher stops, or becomes stuck, is failed: a session
    never waits for a row that nobody will finish.

    A batch is abandoned, and the batcher stuck (`stuck`), when the session of a row
    in it is abandoned (`member_abandoned`): that session waited its stall timeout
    and then its close timeout for the step, so the forward has hung. The batched
    call is then left to its thread, counted in ``abandoned`` (``/health``, the
    server's wedge check) until it returns. When the batcher task is cancelled (the
    server stops) while a batch runs, the call is left too, counted as left at a stop
    (`AbandonedCalls.add`), which wedges nothing. So the batcher task never
    waits for a thread, and neither does anything waiting for it. A member left
    stepping alone (`claim_alone`) whose session is abandoned makes it stuck too,
    until that step returns.
    """

    def __init__(
        self,
        max_batch: int,
        progress: EngineProgress,
        on_batch: Callable[[int], None] = lambda rows: None,
        abandoned: AbandonedCalls | None = None,
        on_stuck: Callable[[], None] = lambda: None,
    ) -> None:
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._progress = progress
        self._on_batch = on_batch
        """Told each batch's row count (the server's metrics)."""
        self._members: dict[Hashable, set[BatchMember]] = {}
        """The members inside, per key. A key is forgotten with its last member: an
        engine may make a new key (a shape, a closure) per stream or per chunk."""
        self._queues: dict[Hashable, deque[_Row]] = {}
        """The rows waiting, per key. Only keys with a row waiting have a queue, so no
        key (nor the ``run_batch`` of its rows) is kept longer than its rows."""
        self._changed = trio.Event()
        self._abandoned = abandoned if abandoned is not None else AbandonedCalls()
        """Where a hung batch's call is counted until it returns (the server's)."""
        self._thread = trio.CapacityLimiter(1)
        self._handed_over = 0
        self._batch_scope: trio.CancelScope | None = None
        """The running batch's wait, while one runs: cancelled to abandon it (see
        `member_abandoned`)."""
        self._stuck_on: object | None = None
        """What hangs: a batch's `EngineCall`, or a `BatchMember` stepping alone; None when
        the batcher takes rows."""
        self._on_stuck = on_stuck
        """Told whenever `stuck` changes (the server's wedge check)."""
        self._stopped = False
        """The batching task has ended (the server is stopping): no row will run."""
        self._alone: BatchMember | None = None
        """A member running its own step in its thread (see `claim_alone`): no batch runs
        meanwhile, so ``run_batch`` is never called from two threads at once."""
        self.batches = 0
        """Batched calls run so far."""
        self.rows = 0
        """Rows run so far (``rows / batches`` is the mean batch size)."""

    async def run(self) -> None:
        """The batching task: runs until cancelled (with the server's sessions)."""
        try:
            while True:
                rows = self._next_batch()
                if rows is None:
                    await self._changed.wait()
                    self._changed = trio.Event()
                    continue
                await self._run_batch(rows)
        finally:
            # Rows handed over meanwhile will never run: their sessions get an error
            # rather than wait, and any row handed over later gets it at once.
            self._stopped = True
            waiting = [row for queue in self._queues.values() for row in queue]
            self._queues.clear()
            for row in waiting:
                _finish(row, [_stopped_error()], 0)

    @property
    def stuck(self) -> bool:
        """A step of the engine hangs (a batch, or a member's step alone, abandoned):
        rows fail at once until it returns."""
        return self._stuck_on is not None

    def member_abandoned(self, member: BatchMember) -> None:
        """``member``'s session ended while its engine call still ran (from the Trio
        thread). It will not step again: its group no longer waits for its rows. If a
        step of its hangs (its row in the running batch, or its step alone), the batcher
        is stuck until that returns, and the batch is abandoned."""
        member.abandoned = True
        self._drop(member)
        if member is self._alone:
            self._become_stuck(member, f"a step alone of {_name(member.run_batch)}")
        elif member.row is not None and member.row.state is _RowState.IN_FLIGHT:
            self._become_stuck(None, f"a batched step of {_name(member.run_batch)}")
            if self._batch_scope is not None:
                self._batch_scope.cancel()  # `_run_batch` abandons its call

    def _become_stuck(self, on: object | None, what: str) -> None:
        was_stuck = self._stuck_on is not None
        if not was_stuck:
            logger.error(
                "%s hangs: its session was abandoned; rows fail at once until it returns",
                what,
            )
        self._stuck_on = on if on is not None else self._stuck_on or _PENDING
        waiting = [row for queue in self._queues.values() for row in queue]
        self._queues.clear()
        for row in waiting:
            _finish(row, [stuck_error()], 0)
        if not was_stuck:
            self._on_stuck()

    def _unstick(self, on: object) -> None:
        if self._stuck_on is on:
            self._stuck_on = None
            if on is not _PENDING:
                logger.warning("the engine's hung step returned: rows are taken again")
            self._changed.set()
            self._on_stuck()

    # -- called from sessions' threads through trio.from_thread

    def join(
        self, run_batch: RunBatch[Any, Any], key: Hashable, on_progress: Callable[[], None]
    ) -> BatchMember:
        """A member for a session entering ``batched()`` with ``run_batch`` and ``key``:
        its rows batch with those of every member of an equal key."""
        member = BatchMember(run_batch, key, on_progress)
        self._members.setdefault(key, set()).add(member)
        return member

    def claim_alone(self, member: BatchMember) -> bool:
        """Whether ``member`` may run its next step itself, now: it is the only session
        stepping, nothing waits, no batch runs and no other member has a claim. Batching
        one row would only add two thread hand-overs per step. A claim lasts until the
        member's next step or its leaving, and counts as a step taken (progress), like a
        batch."""
        self._release_alone(member)
        alone = (
            self._alone is None  # another group's only member may be stepping alone
            and self._stuck_on is None
            and self._batch_scope is None  # no batch runs
            and not self._queues
            and self._members.get(member.key) == {member}
        )
        if alone:
            self._alone = member
            self.batches += 1
            self.rows += 1
            self._on_batch(1)
            member.on_progress()
            self._progress.step_taken()
        return alone

    def _release_alone(self, member: BatchMember) -> None:
        if self._alone is member:
            self._alone = None
            self._unstick(member)
            self._changed.set()  # a row that arrived meanwhile may now run

    def leave(self, member: BatchMember) -> None:
        self._release_alone(member)
        self._drop(member)

    def _drop(self, member: BatchMember) -> None:
        members = self._members.get(member.key)
        if members is not None and member in members:
            members.discard(member)
            if not members:
                del self._members[member.key]
            self._changed.set()  # the batch may have been waiting for this member

    async def step(self, member: BatchMember, data: Any) -> Any:
        if self._stopped:
            raise _stopped_error()
        if self._stuck_on is not None:
            raise stuck_error()
        self._handed_over += 1
        row = _Row(member, data, self._handed_over)
        member.row = row
        self._queues.setdefault(member.key, deque()).append(row)
        self._changed.set()
        try:
            with self._progress.queued(member, member.on_progress):
                await row.done.wait()
        except trio.Cancelled:
            # The row may have moved on between the cancel and this line (its batch
            # taken, or even ended, meanwhile): act on where it is now.
            if row.state is _RowState.QUEUED:
                self._unqueue(row)
            elif row.state is _RowState.IN_FLIGHT:
                # Bounded: `_run_batch` finishes its rows however the batch ends, and
                # a hung one ends once one of its sessions is abandoned (each has a
                # stall guard) or the batcher stops (the server's shutdown).
                with trio.CancelScope(shield=True):
                    await row.done.wait()
            # _RowState.DONE: its result came in after the stop, and is dropped.
            self.leave(member)
            raise
        return batch_result(row.results, row.index, len(row.results))

    # -- the batching task

    def _unqueue(self, row: _Row) -> None:
        queue = self._queues[row.member.key]
        queue.remove(row)
        if not queue:
            del self._queues[row.member.key]
        row.member.row = None

    def _next_batch(self) -> list[_Row] | None:
        """The rows of the next batch, taken from their queue, or None when no group is
        ready."""
        if self._alone is not None or self._stuck_on is not None:
            return None
        ready: list[Hashable] = []
        for key, queue in self._queues.items():
            members = self._members.get(key, set())
            if len(queue) >= self.max_batch or all(m.row is not None for m in members):
                ready.append(key)
        if not ready:
            return None
        oldest = min(ready, key=lambda key: self._queues[key][0].order)
        queue = self._queues[oldest]
        rows = [queue.popleft() for _ in range(min(self.max_batch, len(queue)))]
        if not queue:
            del self._queues[oldest]
        for row in rows:
            row.state = _RowState.IN_FLIGHT
        return rows

    async def _run_batch(self, rows: list[_Row]) -> None:
        run_batch = rows[0].member.run_batch  # the key's rows' are interchangeable
        call = EngineCall(_call_batch, run_batch, [row.data for row in rows])
        results: Sequence[Any] | None = None
        try:
            with trio.CancelScope() as self._batch_scope:
                try:
                    results = await call.run(self._thread)
                except Exception as exc:  # the whole batch failed: every row fails with it
                    results = [_row_error(exc) for _ in rows]
        finally:
            self._batch_scope = None
            if results is None:
                results = self._left_behind(call, len(rows))
            else:
                self.batches += 1
                self.rows += len(rows)
                self._on_batch(len(rows))
                for row in rows:
                    row.member.on_progress()
                self._unstick(_PENDING)  # it returned before it could be abandoned
            for index, row in enumerate(rows):
                _finish(row, results, index)
        self._progress.step_taken()

    def _left_behind(self, call: EngineCall[Sequence[Any]], count: int) -> list[Exception]:
        """The rows' errors for a batch the batcher stopped waiting for: abandoned as hung
        (`member_abandoned`), or the batcher cancelled (the server stops)."""
        if not call.started:
            # Cancelled before its thread started (to_thread.run_sync raises Cancelled
            # at its first checkpoint): the batch never ran.
            self._unstick(_PENDING)
            return [_cancelled_error() for _ in range(count)]
        if self._stuck_on is None:
            # The batcher itself is cancelled (the server stops) while the batch runs: it
            # is left, not known to hang, and no batch will run after it anyway.
            self._abandoned.add(call, lambda: None, at_stop=True)
            return [_stopped_error() for _ in range(count)]
        self._become_stuck(call, f"the batched step {call.name}")
        self._abandoned.add(call, lambda: self._unstick(call))
        return [stuck_error() for _ in range(count)]


def _finish(row: _Row, results: Sequence[Any], index: int) -> None:
    """Hand a row its result: from now on it is done, whoever waits for it."""
    row.results, row.index = results, index
    row.state = _RowState.DONE
    row.member.row = None  # now, not when its task wakes: the next batch waits for it
    row.done.set()


def _call_batch(run_batch: RunBatch[Any, Any], data: list[Any]) -> Sequence[Any]:
    results = run_batch(data)
    if len(results) != len(data):
        raise EngineError(f"run_batch returned {len(results)} results for {len(data)} rows")
    return results


def _row_error(exc: Exception) -> Exception:
    """One row's own copy of the exception that failed its whole batch.

    Each row's session raises its error in its own thread: one object raised in several
    threads at once gathers all their tracebacks into one, mixed. The copy keeps the
    type (an engine may catch, say, an out-of-memory error around its step) and the
    message (what the client is told), and is chained from the original, whose traceback
    shows where the batch failed. One that cannot be rebuilt from its arguments becomes
    an `EngineError` with its text.
    """
    try:
        own = copy.copy(exc)
    except Exception:
        own = None
    if own is None or own is exc or type(own) is not type(exc):
        own = EngineError(str(exc) or type(exc).__name__)
    own.__traceback__ = None
    own.__cause__ = exc
    return own


def _cancelled_error() -> EngineError:
    """A row's error when its batch never ran. Its session sees it only if the session
    was not stopped itself (a stopped one ends with its own cancellation)."""
    return EngineError("the batched step was cancelled before it ran: the server is stopping")


def stuck_error() -> EngineError:
    """A row's error while a step of the engine hangs (see `StepBatcher.stuck`)."""
    return EngineError(
        "the engine's batched step is stuck (a forward that never returned): "
        "no step can run until it does"
    )


def _name(fn: Callable[..., Any]) -> str:
    return getattr(fn, "__qualname__", repr(fn))


_PENDING = object()
"""`StepBatcher._stuck_on` between a member's abandonment and its batch's abandonment
(`_run_batch` replaces it with the batch's call)."""


def _stopped_error() -> EngineError:
    """A row's error when the batcher is gone: nothing would ever run it."""
    return EngineError("the step batcher has stopped: the server is stopping")
