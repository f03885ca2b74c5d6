"""The last resort: a process asked to stop exits by a hard deadline, whatever is stuck.

The server's drain is bounded (`trio_vstream.server.app`), engine calls are abandonable
(`trio_vstream.scheduling.engine_calls`) and every shielded wait has a deadline. But a stop also
runs code the server does not own: an engine's ``close`` (freeing a model on a wedged
device may block in the driver), a non-daemon thread an engine started (the interpreter
joins those at exit), a recording still being written. Any of them could keep a process
alive after SIGTERM, which is what a supervisor can least afford: systemd then waits for
``TimeoutStopSec`` and Kubernetes for its grace, and neither can start the replacement on
the device meanwhile.

`LastResort` is a daemon thread with a deadline. `arm` sets it (the earliest deadline
armed wins); if the process is still alive when it passes, the thread logs what is still
running (the names of the threads alive, the engine calls stuck, and every thread's
stack through `faulthandler`) and ends the process with ``os._exit``, which runs no
``atexit`` handler and joins no thread: the one way out that nothing can hold. A process
that exits in time never hears from it.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import sys
import threading
import time
from collections.abc import Callable

from trio_vstream.logsafe import get_logger

logger = get_logger("trio_vstream")

MARGIN_SECONDS = 5.0
"""Added to the drain's own bound for the first signal: the engine's close and the
interpreter's exit after the server has stopped."""
SECOND_SIGNAL_SECONDS = 3.0
"""After a second signal: the server stops at once, and the process exits within this."""
FAILURE_STATUS = 1
"""The exit status of a process the last resort ended (unless its arming said otherwise)."""


class LastResort:
    """Ends the process at a hard deadline once armed; never before, never unarmed."""

    def __init__(
        self,
        stuck: Callable[[], list[str]] = list,
        exit: Callable[[int], None] = os._exit,
    ) -> None:
        self.stuck = stuck
        """What the server knows is stuck (engine calls), named in the last log line."""
        self._exit = exit
        """``os._exit``; a test's stand-in records the status instead."""
        self._changed = threading.Condition()
        self._deadline: float | None = None
        self._status = FAILURE_STATUS
        self._thread: threading.Thread | None = None
        self.fired = False

    def arm(self, seconds: float, status: int = FAILURE_STATUS, why: str = "stopping") -> None:
        """End the process ``seconds`` from now unless it has exited by then; an earlier
        deadline armed before stays. ``status``: the exit status it ends with then."""
        deadline = time.monotonic() + seconds
        with self._changed:
            if self._deadline is not None and self._deadline <= deadline:
                return
            self._deadline = deadline
            self._status = status
            self._changed.notify_all()
            if self._thread is None:
                self._thread = threading.Thread(
                    target=self._watch, name="trio_vstream last resort", daemon=True
                )
                self._thread.start()
        logger.info("%s: the process ends within %.1f s, whatever is still running", why, seconds)

    def seconds_left(self) -> float:
        """Seconds until the deadline; infinity while unarmed."""
        with self._changed:
            if self._deadline is None:
                return float("inf")
            return max(0.0, self._deadline - time.monotonic())

    def allow(self, seconds: float) -> float:
        """At most ``seconds`` for one more wait on the way out, ending a second before
        the deadline (never below 0), so that what follows it still has its turn."""
        return min(seconds, max(0.0, self.seconds_left() - 1.0))

    def disarm(self) -> None:
        """Leave the process alone (an in-process caller that goes on living)."""
        with self._changed:
            self._deadline = None
            self._changed.notify_all()

    def _watch(self) -> None:
        with self._changed:
            while True:
                if self._deadline is None:
                    self._changed.wait()
                    continue
                left = self._deadline - time.monotonic()
                if left <= 0:
                    break
                self._changed.wait(left)
            status = self._status
        self.fired = True
        self._report()
        self._exit(status)

    def _report(self) -> None:
        """Say what kept the process: one line, then every thread's stack."""
        try:
            names = sorted(
                thread.name
                for thread in threading.enumerate()
                if thread is not threading.current_thread()
            )
            stuck = self.stuck()
            logger.error(
                "the process did not exit in time; ending it now. Engine calls stuck: %s. "
                "Threads alive: %s. Their stacks follow.",
                ", ".join(stuck) or "none",
                ", ".join(names),
            )
            for handler in (*logger.handlers, *logging.getLogger().handlers):
                handler.flush()
            faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
            sys.stderr.flush()
        except Exception:  # the exit must happen, whatever the report does
            pass
