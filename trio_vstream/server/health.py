"""The wedge check: when the engine counts as wedged, and what ``/health`` answers.

An engine call stuck outside a checkpoint (a hung kernel, a device that stopped
answering) is not waited for: its session ends without it
(``trio_vstream.scheduling.engine_calls``). Such calls usually mean a hung device, on
which new sessions would stall too, so once ``max_stuck_calls`` of them are stuck, or a
batching engine's batched step hangs, the engine counts as wedged: ``/health`` answers
503 and new sessions are refused with ``engine_unavailable`` until enough of them
return, while the sessions already streaming carry on. `EngineHealth` keeps that count
and that state, apart from the listener, so that the rule can be read, and tested, in
one place; what the server then does (a drain and an exit, with ``--exit-when-wedged``)
is the server's.
"""

from __future__ import annotations

from collections.abc import Callable

from trio_vstream.logsafe import get_logger
from trio_vstream.protocol import ErrorCode
from trio_vstream.scheduling.batcher import StepBatcher
from trio_vstream.scheduling.engine_calls import AbandonedCalls
from trio_vstream.server.metrics import ServerMetrics

__all__ = ["EngineHealth"]

logger = get_logger(__name__)


class EngineHealth:
    """Whether the engine is wedged, told by the calls its sessions left behind and by
    the batcher; ``on_wedged`` is called each time it becomes wedged, after the log."""

    def __init__(
        self, max_stuck_calls: int, metrics: ServerMetrics, on_wedged: Callable[[], None]
    ) -> None:
        self.max_stuck_calls = max_stuck_calls
        self._metrics = metrics
        self._on_wedged = on_wedged
        self._wedged = False
        self.abandoned_calls = AbandonedCalls(on_change=self._abandoned_calls_changed)
        """Engine calls still running after their sessions ended (see `answer`)."""
        self.batcher: StepBatcher | None = None
        """A batching engine's batcher, set once it is made (it calls `check`)."""

    @property
    def wedged(self) -> bool:
        """The engine has ``max_stuck_calls`` calls stuck after their sessions ended, or
        its batcher is stuck on a hung batched step (`StepBatcher.stuck`)."""
        return self._wedged

    def _abandoned_calls_changed(self, running: int) -> None:
        """Told by `AbandonedCalls` whenever a call is abandoned or returns: sessions'
        calls and a batcher's hung batch alike."""
        self._metrics.engine_calls_abandoned(self.abandoned_calls.total, running)
        self.check()

    def check(self) -> None:
        """Told whenever the count of stuck calls changes, and by the batcher whenever it
        becomes stuck or takes rows again: a batching engine whose
        batched step hangs can serve nobody, however few calls are stuck."""
        bound = self.max_stuck_calls
        stuck = self.abandoned_calls.stuck
        batcher_stuck = self.batcher is not None and self.batcher.stuck
        wedged = bound > 0 and (stuck >= bound or batcher_stuck)
        if wedged == self._wedged:
            return
        self._wedged = wedged
        if not wedged:
            logger.warning(
                "engine recovered: %d engine call(s) still stuck, below %d; new sessions "
                "are admitted again",
                stuck,
                bound,
            )
            return
        self._metrics.engine_wedged()
        why, names = self.why(), self.abandoned_calls.names()
        if names:  # none yet for a batch: counted just after the batcher is stuck
            why += f" ({', '.join(names)})"
        logger.error(
            "engine wedged: %s; /health answers 503 and new sessions are refused with "
            "engine_unavailable",
            why,
        )
        self._on_wedged()

    def answer(self, *, draining: bool) -> tuple[int, str]:
        """``GET /health``: 200 ``ok``, or 503 and why not.

        503 while draining, and while the engine is wedged (`wedged`: as many engine calls
        stuck after their sessions ended as ``max_stuck_calls``): a thread stuck outside
        a checkpoint usually means a hung device, on which new sessions would stall too.
        A balancer then sends new sessions elsewhere, and an orchestrator's health check
        can restart the server (its drain does not wait for the stuck threads); new
        sessions are refused here meanwhile, while those already streaming carry on.
        Fewer stuck calls than that: 200, ``degraded`` and how many.
        """
        if draining:
            return 503, "draining\n"
        if self._wedged:
            return 503, self.unavailable_body()
        stuck = self.abandoned_calls.stuck
        if stuck:
            return 200, (
                f"degraded: {stuck} engine call(s) stuck after their sessions ended "
                f"(wedged at {self.max_stuck_calls})\n"
            )
        return 200, "ok\n"

    def why(self) -> str:
        """What wedges the engine, for its log and its clients."""
        if self.batcher is not None and self.batcher.stuck:
            return "its batched step is stuck (a forward that never returned)"
        return f"{self.abandoned_calls.stuck} engine call(s) stuck after their sessions ended"

    def unavailable_message(self) -> str:
        """An ``engine_unavailable`` error's message."""
        return f"Engine unavailable: {self.why()}; try another server"

    def unavailable_body(self) -> str:
        """A refusal's HTTP body: the code first, as in the ``error`` message."""
        return f"{ErrorCode.ENGINE_UNAVAILABLE.value}: {self.unavailable_message()}\n"
