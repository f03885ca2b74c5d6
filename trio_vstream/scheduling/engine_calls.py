"""Blocking calls a session can stop waiting for: a stuck thread never holds a client.

An engine runs in worker threads and hears of a cancellation only at its checkpoints
(`trio_vstream.scheduling.checkpoint`). A call that blocks without reaching one (a hung
CUDA kernel, a stuck VAE decode, ``open_stream`` waiting for a device, a GPU tensor's
copy to the host) cannot be interrupted: Python cannot stop a thread. What the server can do is stop
waiting for it. An `EngineCall` runs one such call in a worker thread that the caller
may leave behind:

* `EngineCall.run` uses ``trio.to_thread.run_sync(..., abandon_on_cancel=True)``: a
  cancelled caller returns at once, while the engine still sees the cancellation at its
  next checkpoint (``trio.from_thread.check_cancelled`` raises in an abandoned thread).
  `EngineCall.start` starts a call that takes no checkpoint (a stream's ``close``) in a
  thread at once: starting cannot be cancelled, so the call is never skipped.
* `EngineCall.detach` then hands the call what its caller would have done once it
  returned (close the stream it was using, give back its step slot): done in its
  thread right after it returns, never while it runs, since an engine never has two
  calls of one stream at once, and then in the Trio thread. If the call has returned
  already, ``detach`` says so and the caller does that itself, as usual.
* `EngineCall.returned` is set once the thread is done, detached work included: a
  session waits on it when it can afford to (see `trio_vstream.session.session`), and counts
  what is still running when it ends as abandoned.

Worker threads are daemon threads (Trio's thread cache makes them so), so one still
stuck when the server has stopped does not keep the process from exiting.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable
from typing import Any, Generic, TypeVar, cast

import outcome
import trio

from trio_vstream.logsafe import get_logger

logger = get_logger(__name__)

T = TypeVar("T")


class EngineCall(Generic[T]):
    """One blocking call, run once in a worker thread that its caller may leave behind."""

    def __init__(self, fn: Callable[..., T], *args: Any) -> None:
        self._fn = fn
        self._args = args
        self._name = getattr(fn, "__qualname__", repr(fn))
        self._token = trio.lowlevel.current_trio_token()
        self._lock = threading.Lock()
        self._done = False
        """The call has returned (under the lock: decides who does the detached work)."""
        self._in_thread: Callable[[outcome.Outcome[T]], None] | None = None
        self._in_trio: list[Callable[[], None]] = []
        self.started = False
        """A thread runs (or ran) the call: set before the thread can run (see `run`)."""
        self.detached = False
        """The caller left the running call behind (`detach`)."""
        self.returned = trio.Event()
        """Set, in the Trio thread, once the call has returned and its detached work is done."""
        self.result: outcome.Outcome[T] | None = None
        """What the call returned or raised (for `start`: read it once `returned` is set)."""
        self.cpu_seconds = 0.0
        """CPU time its thread spent in the call (``time.thread_time``), once it returned:
        what the server reports as the engine's own cost (see `ServerCounters`)."""

    @property
    def name(self) -> str:
        """What is being called, for logs (``SyntheticStream.next_chunk``, say)."""
        return self._name

    async def run(self, limiter: trio.CapacityLimiter) -> T:
        """Call in a worker thread and return its result; when cancelled, return at once.

        A cancellation before the thread starts (while waiting for ``limiter``) leaves
        ``started`` False: the call never ran. After that, the thread goes on without
        its caller, who may `detach` it.
        """
        result = await trio.to_thread.run_sync(
            self._call,
            abandon_on_cancel=True,
            # Told when the thread is about to start; see _NoticingLimiter.
            limiter=cast(trio.CapacityLimiter, _NoticingLimiter(limiter, self)),
            thread_name=f"engine call {self._name}",
        )
        return result.unwrap()

    def start(self) -> None:
        """Start the call in a worker thread now; `returned` tells when it is done.

        For calls that take no checkpoint (they cannot reach Trio from their thread):
        unlike `run`, starting cannot be cancelled, so a ``close`` is never skipped.
        """
        self.started = True
        trio.lowlevel.start_thread_soon(
            self._call, lambda _result: None, name=f"engine call {self._name}"
        )

    def detach(
        self,
        in_thread: Callable[[outcome.Outcome[T]], None] | None = None,
        in_trio: Callable[[], None] | None = None,
    ) -> bool:
        """Leave the call running; True if it was still running (from the Trio thread).

        Then ``in_thread`` runs in its thread as soon as it returns (given what it
        returned or raised, which nobody else reads), and ``in_trio`` in the Trio thread
        after that. False: the call never started or has returned already, and
        nothing is handed over (the caller does what is needed itself).
        """
        with self._lock:
            if not self.started or self._done:
                return False
            self._in_thread = in_thread
            self.detached = True
        if in_trio is not None:
            self._in_trio.append(in_trio)
        return True

    def when_returned(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` in the Trio thread once the call has returned (at once if it has)."""
        if self.returned.is_set():
            callback()
        else:
            self._in_trio.append(callback)

    def _call(self) -> outcome.Outcome[T]:
        """The worker thread: the call, then whatever a detach handed over."""
        began = time.thread_time()
        result = outcome.capture(self._fn, *self._args)
        self.cpu_seconds = time.thread_time() - began
        with self._lock:
            self._done = True
            in_thread = self._in_thread
        self.result = result
        if in_thread is not None:
            try:
                in_thread(result)
            except Exception:
                logger.exception("after %s returned: cleanup failed", self._name)
        # After the run has finished there is nobody left to tell.
        with contextlib.suppress(trio.RunFinishedError):
            self._token.run_sync_soon(self._returned_in_trio)
        return result

    def _returned_in_trio(self) -> None:
        for callback in self._in_trio:
            try:
                callback()
            except Exception:  # never into the run loop: that would crash the server
                logger.exception("after %s returned: cleanup failed", self._name)
        self._in_trio.clear()
        self.returned.set()


class _NoticingLimiter:
    """The caller's limiter, noting when ``trio.to_thread.run_sync`` may start its thread.

    ``run_sync`` checks for cancellation, acquires the limiter and starts the thread,
    with no checkpoint between the last two: once the limiter is acquired the thread
    runs, whatever happens to the caller. That is when the call may outlive its
    caller, and the only moment a caller can tell from outside.
    """

    def __init__(self, limiter: trio.CapacityLimiter, call: EngineCall[Any]) -> None:
        self._limiter = limiter
        self._call = call

    async def acquire_on_behalf_of(self, borrower: object) -> None:
        await self._limiter.acquire_on_behalf_of(borrower)
        self._call.started = True

    def release_on_behalf_of(self, borrower: object) -> None:
        self._limiter.release_on_behalf_of(borrower)


class AbandonedCalls:
    """Engine calls whose sessions ended without them, while they still run; server-wide,
    used from the Trio thread. ``/health`` and ``/metrics`` report them."""

    def __init__(self, on_change: Callable[[int], None] = lambda running: None) -> None:
        self.running: set[EngineCall[Any]] = set()
        """Still running now."""
        self.total = 0
        """Abandoned ever."""
        self._on_change = on_change
        """Told how many are running whenever that changes (the server's wedge check)."""
        self._at_stop: set[EngineCall[Any]] = set()
        """Of ``running``, those left only because the server stopped (see `add`)."""

    @property
    def stuck(self) -> int:
        """How many of ``running`` are known to hang: each was waited for (a stall
        timeout, then a close timeout) before it was abandoned. What makes an engine
        wedged (``--max-stuck-calls``)."""
        return len(self.running) - len(self._at_stop)

    def add(
        self, call: EngineCall[Any], on_return: Callable[[], None], *, at_stop: bool = False
    ) -> None:
        """Count ``call`` until it returns; then ``on_return`` (in the Trio thread).

        ``at_stop``: it is left because the server itself stops (a second signal, the
        end of a drain) without waiting its close timeout for it. It still runs, and is
        counted and named as such, but says nothing of the engine: a call that was only
        slow to return is not `stuck`.
        """
        if call in self.running:
            return
        self.total += 1
        self.running.add(call)
        if at_stop:
            self._at_stop.add(call)

        def returned() -> None:
            self.running.discard(call)
            self._at_stop.discard(call)
            on_return()
            self._on_change(len(self.running))

        call.when_returned(returned)
        if call in self.running:  # not returned already (then it was told above)
            self._on_change(len(self.running))

    async def wait_returned(self) -> None:
        """Return once every call still running has returned, however it was left: one
        left because the server stopped was only mid-step, as far as anyone knows, and one
        abandoned just before the stop may be on its way back (a hung batch abandoned,
        its rows failed). Unbounded: the caller bounds it, as a call that hangs for good
        never returns."""
        for call in list(self.running):
            await call.returned.wait()

    def names(self) -> list[str]:
        """What each running call is, for the log of a server that is stuck."""
        return sorted(call.name for call in self.running)
