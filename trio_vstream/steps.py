"""How sessions share one engine: the checkpoint an engine calls between steps.

Every step a session's engine takes passes through its `SessionCheckpoint`,
from the engine's worker thread into the Trio thread: that is where a stopped
session's engine is stopped (within one step), where sessions take turns on
the engine's step slots, and where progress is recorded for the stall guard.
`EngineProgress` carries that progress to the sessions queued behind others,
so that waiting in line is never mistaken for a hang.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import trio

from trio_vstream.engines.base import Checkpoint


class EngineProgress:
    """The engine's steps, as seen by the stall guards of sessions queued behind them.

    Server-wide: a session waiting for its turn (for a step slot, or inside the
    engine's ``checkpoint.waiting()``) is queued here, and every step the
    engine takes for any session counts as progress for all queued sessions.
    Used from the Trio thread only.
    """

    def __init__(self) -> None:
        self._queued: dict[object, tuple[Callable[[], None], int]] = {}

    @contextlib.contextmanager
    def queued(self, key: object, on_progress: Callable[[], None]) -> Iterator[None]:
        """While inside, ``on_progress`` runs at every step the engine takes."""
        _, depth = self._queued.get(key, (on_progress, 0))
        self._queued[key] = (on_progress, depth + 1)
        try:
            yield
        finally:
            depth = self._queued[key][1] - 1
            if depth:
                self._queued[key] = (on_progress, depth)
            else:
                del self._queued[key]

    def step_taken(self) -> None:
        for on_progress, _ in list(self._queued.values()):
            on_progress()


class SessionCheckpoint(Checkpoint):
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
    ) -> None:
        self._limiter = limiter
        self._progress = progress
        self._on_progress = on_progress
        self._holding = False
        self._waited = 0.0
        self._waiting_since: float | None = None

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
            trio.from_thread.run(self._step)

    def check_cancelled(self) -> None:
        trio.from_thread.check_cancelled()

    @contextlib.contextmanager
    def waiting(self) -> Iterator[None]:
        trio.from_thread.check_cancelled()
        queued = self._progress.queued(self, self._on_progress)
        trio.from_thread.run_sync(self._enter_queue, queued)
        try:
            yield
        finally:
            trio.from_thread.run_sync(self._leave_queue, queued)

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
