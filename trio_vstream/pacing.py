"""Pacing: when a session may send a chunk, from its media time and the time now.

vllm-omni's ``extra_params.pace_to_media_time`` (`protocol.Pacing`) asks the server to
send the video at the pace it plays, not as fast as it is made: chunk k goes out no
earlier than its media time, counted from the first chunk's send, less
``pacing_lead_seconds``. A model slower than real time falls behind that clock; once a
chunk is more than ``pacing_max_lag_seconds`` late, the clock is moved up to it, so a
model that recovers does not then burst to catch up.

Two parts, so that the rule is decided (and tested) without a clock:

* `Pacer.due` is the rule: given a chunk's media time and the time now, when may it
  go? Pure: the time is an argument, never read, so a test is a table of numbers;
* `Pacer.wait` is the thin async part: it asks `due` with Trio's clock and sleeps
  until then. The wait is deliberate, not a stall, so it keeps the session's stall
  guard quiet while it lasts (``keep_alive``).

Issue 22 (vllm-omni's ``session.playback``) lands here. Its reports add one input to
the rule, the playhead the client says it has shown (kept monotonic, clamped to the
media made so far), and one question: may the next chunk be *generated*, given the
media made and ``streaming_buffer_seconds``? That is a second pure calculator beside
`Pacer`, fed by the receive loop, with a wait that a report ends as time ends
`Pacer.wait`.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from trio_vstream import protocol


class Pacer:
    """One paced session's media clock, and the rule for when each chunk may go."""

    def __init__(self, pacing: protocol.Pacing) -> None:
        self.pacing = pacing
        self.origin: float | None = None
        """The time (on the caller's clock) at which media time 0 was, or would have
        been, sent. None until the first chunk is asked about."""

    def due(self, media_time: float, now: float) -> float | None:
        """When the chunk whose first frame is at ``media_time`` (seconds into the video)
        may be sent, on the clock that ``now`` is read from: at or before ``now`` means
        at once.

        None when this chunk sets the media clock, and so goes at once: the first chunk,
        or one that fell more than ``max_lag_seconds`` behind. Asked again for the same
        chunk while it waits, the answer is the same.
        """
        pacing = self.pacing
        if self.origin is None or now > self.origin + media_time + pacing.max_lag_seconds:
            self.origin = now - media_time
            return None
        return self.origin + media_time - pacing.lead_seconds

    async def wait(
        self, media_time: float, keep_alive: Callable[[], None], wake_every: float
    ) -> None:
        """Sleep until the chunk at ``media_time`` is due (Trio's clock).

        A chunk that waits calls ``keep_alive()`` as it starts waiting, at least every
        ``wake_every`` seconds while it waits, and once due: the wait is deliberate, so
        it counts as progress for the stall guard. A chunk that sets the clock does not
        wait, and does not call it. Cancellation (a stop) ends the wait.
        """
        due = self.due(media_time, trio.current_time())
        if due is None:
            return
        while (now := trio.current_time()) < due:
            keep_alive()
            await trio.sleep_until(min(due, now + wake_every))
        keep_alive()
