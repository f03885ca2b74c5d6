"""The engine's progress, as the stall guards of queued sessions see it.

A session waiting for its turn (a step slot, a batch, a lock inside the engine) makes
no progress of its own, yet it is not hung: the engine is busy with other sessions.
`EngineProgress` counts every step the engine takes, for any session, as progress
for every session queued behind it, so that waiting in line is never mistaken for a
hang, while an engine that makes no progress at all is still caught.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator


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
