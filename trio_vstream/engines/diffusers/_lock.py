"""`SegmentLock`: whole segments, one at a time, on the pipeline every session shares.

A plain lock would not do: a session waiting for it must stay stoppable, must not be
taken for stalled by the server while another session's segment makes progress, and
cleanup that must not run during a segment (unloading a LoRA) must not make a closing
stream wait for one either. And it must be fair: the sessions waiting are served in the
order they came. A lock that lets whoever wakes first (or whoever arrives while it is
free) take it can pass one session over every time while three or more take turns, and
the stall guard never catches that, since a queued session counts the others' progress
as its own.
"""

from __future__ import annotations

import contextlib
import threading
from collections import deque
from collections.abc import Callable, Iterator

from trio_vstream.engines.contract import Checkpoint
from trio_vstream.logsafe import get_logger

logger = get_logger(__package__)  # the engine's one logger, whichever module logs

_LOCK_POLL_SECONDS = 0.05
"""The longest a session waiting for the pipeline goes without checking for a
stop (so a stop reaches it within this time)."""


class SegmentLock:
    """Serialises whole segments on the shared pipeline, first come first served;
    waits cancellably.

    A session waiting for the lock is queued behind the holder
    (``checkpoint.waiting()``) with a ticket of its own (an event) at the back of a
    FIFO queue, and polls ``checkpoint.check_cancelled()`` while it waits for it, so it
    can be stopped while it waits, takes no step slot of the server's, and is not taken
    for stalled while the holder makes progress. Letting go hands the lock straight to
    the first ticket in the queue: the lock is never free while anyone waits, so
    neither a waiter that wakes first nor a newcomer can overtake. A waiter that is
    stopped leaves the queue; if the lock was handed to it in the meantime, it passes
    the lock on as it leaves, so no hand-over is lost.

    Work that must not run during a segment but must not wait for one
    (unloading the LoRA of a stream that closes while another session's
    segment runs) is deferred: the holder runs it when it lets go.
    """

    def __init__(self) -> None:
        self._mutex = threading.Lock()
        self._held = False
        """Whether someone holds the lock (or it was handed to a waiter not yet awake).
        Invariant: never False while ``_waiters`` is not empty."""
        self._waiters: deque[threading.Event] = deque()
        """The waiting sessions' tickets, in order of arrival; a ticket is set when the
        lock is handed to its owner."""
        self._deferred: list[Callable[[], None]] = []

    @contextlib.contextmanager
    def held(self, checkpoint: Checkpoint) -> Iterator[None]:
        """Hold the lock for a segment."""
        self._acquire(checkpoint)
        try:
            self._run_deferred()
            yield
        finally:
            self._release()

    def run_soon(self, work: Callable[[], None]) -> None:
        """Run ``work`` under the lock: now if it is free, else when the holder lets go."""
        with self._mutex:
            self._deferred.append(work)
            if self._held:
                return
            self._held = True
        self._release()

    def _acquire(self, checkpoint: Checkpoint) -> None:
        checkpoint.check_cancelled()
        with self._mutex:
            if not self._held:  # free, so nobody waits (the invariant): take it
                self._held = True
                return
            ticket = threading.Event()
            self._waiters.append(ticket)
        try:
            with checkpoint.waiting():
                while not ticket.is_set():
                    checkpoint.check_cancelled()
                    ticket.wait(_LOCK_POLL_SECONDS)
        except BaseException:
            self._leave(ticket)
            raise

    def _leave(self, ticket: threading.Event) -> None:
        """A stopped waiter goes: out of the queue, or, if the lock was handed to it
        meanwhile, on to the next waiter."""
        with self._mutex:
            if not ticket.is_set():
                self._waiters.remove(ticket)
                return
        self._release()

    def _release(self) -> None:
        while True:
            try:
                self._run_deferred()
            finally:
                with self._mutex:
                    if self._waiters:
                        self._waiters.popleft().set()  # still held: now the next one's
                    else:
                        self._held = False
            with self._mutex:
                if not self._deferred or self._held:
                    return  # nothing came in meanwhile, or the new holder runs it
                self._held = True

    def _run_deferred(self) -> None:
        while True:
            with self._mutex:
                if not self._deferred:
                    return
                work = self._deferred.pop(0)
            try:
                work()
            except Exception:
                logger.exception("diffusers engine: deferred cleanup failed")

    @property
    def locked(self) -> bool:
        """Whether a segment (or deferred work) holds the lock now; for diagnostics."""
        with self._mutex:
            return self._held
