"""`SegmentLock`: whole segments, one at a time, on the pipeline every session shares.

A plain lock would not do: a session waiting for it must stay stoppable, must not be
taken for stalled by the server while another session's segment makes progress, and
cleanup that must not run during a segment (unloading a LoRA) must not make a closing
stream wait for one either.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

from trio_vstream.engines.base import Checkpoint
from trio_vstream.logsafe import get_logger

logger = get_logger(__package__)  # the engine's one logger, whichever module logs

_LOCK_POLL_SECONDS = 0.05
"""The longest a session waiting for the pipeline goes without checking for a
stop (so a stop reaches it within this time)."""


class SegmentLock:
    """Serialises whole segments on the shared pipeline; waits cancellably.

    A session waiting for the lock is queued behind the holder
    (``checkpoint.waiting()``) and polls ``checkpoint.check_cancelled()``, so it
    can be stopped while it waits, takes no step slot of the server's, and is
    not taken for stalled while the holder makes progress.

    Work that must not run during a segment but must not wait for one
    (unloading the LoRA of a stream that closes while another session's
    segment runs) is deferred: the holder runs it when it lets go.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._held = False
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
        with self._cond:
            self._deferred.append(work)
            if self._held:
                return
            self._held = True
        self._release()

    def _try_take(self) -> bool:
        with self._cond:
            if self._held:
                return False
            self._held = True
            return True

    def _acquire(self, checkpoint: Checkpoint) -> None:
        checkpoint.check_cancelled()
        if self._try_take():
            return
        with checkpoint.waiting():
            while True:
                checkpoint.check_cancelled()
                with self._cond:
                    if not self._held:
                        self._held = True
                        return
                    self._cond.wait(timeout=_LOCK_POLL_SECONDS)

    def _release(self) -> None:
        while True:
            try:
                self._run_deferred()
            finally:
                with self._cond:
                    self._held = False
                    self._cond.notify_all()
            with self._cond:
                if not self._deferred or self._held:
                    return  # nothing came in meanwhile, or the new holder runs it
                self._held = True

    def _run_deferred(self) -> None:
        while True:
            with self._cond:
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
        with self._cond:
            return self._held
