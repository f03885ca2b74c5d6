"""The server's sessions while they run: how many, the drain, the memory after them.

Shutdown is a drain, for rolling restarts behind a load balancer: no session
is admitted any more (``/health`` and WebSocket upgrades answer 503 before
anything is accepted, so the balancer retries elsewhere), running sessions
finish their videos, and only those still running when the grace period ends
are wound down with ``server_shutdown``; after that, what is left is aborted.
Viewers of watch links get one close timeout more (within that bound) to receive
what was queued for them and their session's terminal message. An engine call stuck
outside a checkpoint is not waited for (``trio_vstream.scheduling.engine_calls``): its
session ends without it, so the drain keeps its bound and the process exits.

`RunningSessions` holds what that needs: the sessions now running (each added for its
whole run), a way to wait until none is, and the last ones' summaries for ``/stats``.
The same bookkeeping tells when the server has been idle long enough to give freed
memory back to the system. Refusing new sessions while draining is the listener's
(``trio_vstream.server.routing``, ``trio_vstream.server.app``).
"""

from __future__ import annotations

from collections import deque
from collections.abc import Awaitable, Callable, Collection

import trio

from trio_vstream.logsafe import get_logger
from trio_vstream.protocol import ErrorCode
from trio_vstream.server import memory
from trio_vstream.session.session import Outcome, Session, SessionSummary

__all__ = ["IDLE_BEFORE_TRIM", "RECENT_SESSIONS", "RunningSessions"]

logger = get_logger(__name__)

RECENT_SESSIONS = 256
"""Finished sessions kept for /stats."""
IDLE_BEFORE_TRIM = 10.0
"""Seconds without sessions before freed memory is given back to the system."""


class RunningSessions:
    """The sessions a server runs now, and the summaries of the last ones that ended."""

    def __init__(self) -> None:
        self._sessions: set[Session] = set()
        self._changed = trio.Event()
        self._recent: deque[SessionSummary] = deque(maxlen=RECENT_SESSIONS)
        self._became_idle = trio.Event()
        self._last_idle = 0.0

    def __len__(self) -> int:
        """Every session, from its upgrade to its end (waiting ones included)."""
        return len(self._sessions)

    @property
    def running(self) -> int:
        """Sessions that count against ``max_sessions``: admitted at their ``session.start``
        and not only closing their socket. An upgrade still waiting for its
        ``session.start`` holds a connection slot, not a session slot (only a short claim
        on one: ``trio_vstream.server.slots``)."""
        return sum(1 for session in self._sessions if session.admitted and not session.finishing)

    @property
    def waiting(self) -> int:
        """Upgrades still waiting for their ``session.start`` (or their turn)."""
        return sum(1 for session in self._sessions if not session.admitted)

    @property
    def recent(self) -> Collection[SessionSummary]:
        """The last `RECENT_SESSIONS` sessions that ended, oldest first."""
        return self._recent

    async def run(
        self, session: Session, on_end: Callable[[SessionSummary], None] | None = None
    ) -> None:
        """Run ``session``, counted here until it ends; then keep its summary and hand it
        to ``on_end``."""
        self._sessions.add(session)
        try:
            summary = await session.run()
        finally:
            self._sessions.discard(session)
            self._changed.set()
            self._changed = trio.Event()
        self._recent.append(summary)
        if on_end is not None:
            on_end(summary)
        if not self._sessions:
            self._last_idle = trio.current_time()
            self._became_idle.set()

    async def wait_none(self) -> None:
        """Return once no session runs."""
        while self._sessions:
            await self._changed.wait()

    async def drain(
        self,
        grace: float,
        close_timeout: float,
        viewers_closed: Callable[[], Awaitable[None]],
        relays_closed: Callable[[], Awaitable[None]] | None = None,
    ) -> None:
        """Let running sessions finish within the grace, and viewers relayed to other
        servers' sessions (``relays_closed``) too; then wind down the rest, abort
        stragglers, and let viewers receive their last chunks (``viewers_closed``).
        Takes at most ``grace + 2 * close_timeout``."""
        # The drain's bound: the grace, then a close timeout to wind down, one to abort.
        bound = trio.current_time() + grace + 2 * close_timeout
        logger.info(
            "draining: no new sessions; %d running get %g s to finish", len(self._sessions), grace
        )
        with trio.move_on_after(grace):
            await self.wait_none()
            if relays_closed is not None:
                # A relayed viewer watches a session that runs on: a rolling restart of
                # the server it came through should not cut it while the grace lasts.
                await relays_closed()
        if self._sessions:
            logger.warning(
                "grace over: %d session(s) still running end with server_shutdown",
                len(self._sessions),
            )
            for session in list(self._sessions):
                session.shutdown()
            with trio.move_on_after(close_timeout):
                await self.wait_none()
            for session in list(self._sessions):
                session.abort(
                    Outcome.SHUTDOWN, (ErrorCode.SERVER_SHUTDOWN, "Server is shutting down")
                )
            with trio.move_on_after(close_timeout):
                await self.wait_none()
        # Viewers may still be sending what was queued for them and the terminal
        # message (a viewer a few chunks behind): a close timeout more for them, never
        # past the bound, so the drain stays within what docs/server.md promises.
        with trio.move_on_at(min(trio.current_time() + close_timeout, bound)):
            await viewers_closed()

    async def return_memory_when_idle(self) -> None:
        """Give freed memory back to the system once no session has run for a while.

        Not at once when the last session ends: the next session would fault it all
        back in, which showed up as tens of milliseconds on its first chunk.
        """
        while True:
            await self._became_idle.wait()
            self._became_idle = trio.Event()
            await trio.sleep_until(self._last_idle + IDLE_BEFORE_TRIM)
            if not self._sessions and trio.current_time() >= self._last_idle + IDLE_BEFORE_TRIM:
                # On the event loop: it takes milliseconds and nothing is streaming, while
                # a worker thread would linger for Trio's idle-thread timeout afterwards.
                memory.return_free_memory()
