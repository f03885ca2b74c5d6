"""A session's pending interactions: bounded, and held for their action window when the
session is a paced camera session.

An interaction is *pending* from the moment the session accepts it (and says
``session.interaction.queued``) until a chunk lists it in ``started_event_ids``: held by
the session, or handed to the engine and not yet started. As in vllm-omni, at most
`protocol.MAX_PENDING_INTERACTIONS` may be pending; the session ends the video request
of the one that finds the queue full (``interaction_queue_full``) rather than drop it.
The count relies on the engine contract: a conforming engine lists every change it was
handed in the ``started_event_ids`` of the next chunk it generates
(`trio_vstream.engines.testing` checks it).

A **paced camera session** (``streaming_buffer_seconds`` set, on an engine that takes
cameras) does not hand its interactions over as they come. Each chunk it generates opens
an *action window* as long as the chunk's media (its frames over the fps), from the
moment the chunk's generation started (or from the last window's deadline, when it
started within a frame of it: the windows keep to the media clock); the next chunk
starts no earlier than the window's end (its deadline) and takes the interactions
received before the deadline, each with `PromptChange.window_offset`: where in the
window it came, as a fraction. An interaction received at or after the deadline waits
for the following chunk. So an engine that places changes can steer a key pressed a
third of the way into a window from a third of the way into the chunk it lands in, and
count a short press for the part of the window it lasted.

When a chunk starts after its deadline (generation slower than real time, or a paused
playback gate), the interactions received between the deadline and that start still
wait for the chunk after it, as in vllm-omni; they apply from that chunk's start
(offset 0.0: they came before its window opened).

Pure: no Trio, no socket. Times are arguments (the session's clock), so what an
interaction's chunk and offset are is decided, and tested, as a table of numbers.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable

import attrs

from trio_vstream import protocol
from trio_vstream.engines.contract import PromptChange

_BELOW_ONE = math.nextafter(1.0, 0.0)


class InteractionQueue:
    """One session's pending interactions (see the module's docstring)."""

    def __init__(
        self, *, windows: bool = False, limit: int = protocol.MAX_PENDING_INTERACTIONS
    ) -> None:
        self.windows = windows
        """A paced camera session: interactions are held for their action window."""
        self.limit = limit
        self._held: deque[tuple[float, PromptChange]] = deque()
        self._handed: set[str] = set()
        self._window: tuple[float, float] | None = None
        """The last generated chunk's action window: (start, length in seconds)."""

    @property
    def pending(self) -> int:
        """Interactions accepted and not yet started: held, or handed to the engine."""
        return len(self._held) + len(self._handed)

    @property
    def full(self) -> bool:
        """Whether an interaction accepted now would be one too many."""
        return self.pending >= self.limit

    def hold(self, change: PromptChange, received: float) -> None:
        """Keep ``change``, received at ``received``, for the chunk whose window it is in
        (a paced camera session's interactions only)."""
        self._held.append((received, change))

    def handed(self, event_id: str) -> None:
        """The engine took the interaction: pending until a chunk starts it."""
        self._handed.add(event_id)

    def started(self, event_ids: Iterable[str]) -> None:
        """A chunk was generated with these interactions: they are pending no more."""
        self._handed.difference_update(event_ids)

    def open_window(self, start: float, seconds: float, *, snap: float = 0.0) -> None:
        """A chunk whose generation began at ``start`` made ``seconds`` of media: its
        action window, until the next chunk starts.

        A chunk that began less than ``snap`` seconds after the last window's deadline
        (the session's one frame: it slept until the deadline and woke a little late)
        opens its window at the deadline itself. Otherwise each wake-up's lateness, a
        few milliseconds, would push every later window back, and a paced camera
        session would generate slower than real time (measured: 0.1 to 0.8%), so that
        its viewer ran out of video now and then. A chunk that began later than that
        (generation slower than real time) opens its window when it began.
        """
        deadline = self.deadline
        if deadline is not None and deadline <= start < deadline + snap:
            start = deadline
        self._window = (start, seconds)

    @property
    def deadline(self) -> float | None:
        """When the next chunk may start (a paced camera session's): the end of the last
        chunk's action window; None before the first chunk."""
        if not self.windows or self._window is None:
            return None
        start, length = self._window
        return start + length

    def drop(self) -> list[PromptChange]:
        """Every interaction still held, in the order received, held no more: the video
        ended, so the chunk each waited for will never start."""
        dropped = [change for _, change in self._held]
        self._held.clear()
        return dropped

    def take(self) -> list[PromptChange]:
        """The held interactions for the chunk about to start, in the order received.

        Before the first chunk, every one held, from the chunk's start (offset 0.0);
        after it, those received before the last window's deadline, each with its
        `PromptChange.window_offset` in that window, in [0, 1). The rest stay held.
        """
        taken: list[PromptChange] = []
        deadline = self.deadline
        while self._held and (deadline is None or self._held[0][0] < deadline):
            received, change = self._held.popleft()
            offset = 0.0
            if self._window is not None and self._window[1] > 0:
                start, length = self._window
                offset = min(max((received - start) / length, 0.0), _BELOW_ONE)
            taken.append(attrs.evolve(change, window_offset=offset))
        return taken
