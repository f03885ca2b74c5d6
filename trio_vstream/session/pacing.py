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

vllm-omni's ``session.playback`` paces *generation* rather than sending: a session that
set ``streaming_buffer_seconds`` generates at most that far ahead of the playhead its
client reports. `PlaybackGate` is that rule, in the same two parts:

* `PlaybackGate.may_generate` answers "may the next chunk be generated?" from the media
  made so far and the playhead (kept monotonic, clamped to the media made), both told
  to it (`generated`, `report`): pure, so a test is a table of numbers;
* `PlaybackGate.wait` is the thin async part: the producer waits there at a chunk
  boundary until a report opens the gate (or a stop cancels it). The wait is *not*
  progress for the stall guard (as in vllm-omni, a client paused for long keeps its
  session alive with pings), and the session holds nothing of the engine's while it
  lasts: a step slot or a batch row is only held inside ``next_chunk``.

Both may be asked for at once (``pace_to_media_time`` and ``streaming_buffer_seconds``):
each does what it says, the gate before a chunk is generated, the `Pacer` before it is
sent.
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
        if due is not None:
            await sleep_until_keeping_alive(due, keep_alive, wake_every)


async def sleep_until_keeping_alive(
    deadline: float, keep_alive: Callable[[], None], wake_every: float
) -> None:
    """Sleep until ``deadline`` (Trio's clock), calling ``keep_alive()`` as the wait
    starts, at least every ``wake_every`` seconds while it lasts, and at its end: a
    deliberate wait (a paced send, a paced camera session's action window) is progress
    for the stall guard, however long it is. Cancellation (a stop) ends it at once."""
    while (now := trio.current_time()) < deadline:
        keep_alive()
        await trio.sleep_until(min(deadline, now + wake_every))
    keep_alive()


class PlaybackGate:
    """One session's ``streaming_buffer_seconds``: may its next chunk be generated?

    vllm-omni's rule: at a chunk boundary, generation waits while the media generated so
    far is ``buffer_seconds`` or more ahead of the last position reported. The chunk in
    flight may take it past the bound (the check is made before a chunk, never during
    one); with no report at all, generation pauses once it has filled the window.
    Positions that go backwards are ignored; positions beyond the media generated are
    clamped to it (a client cannot report a playhead that runs ahead of the video it
    was sent, and so cannot open the gate for good with one huge number).
    """

    def __init__(self, buffer_seconds: float, fps: int, num_frames: int) -> None:
        self.buffer_seconds = buffer_seconds
        self.fps = fps
        self.num_frames = num_frames
        """The video's length: once it is all made, nothing waits for the playhead."""
        self.frames = 0
        """Frames generated so far."""
        self.position = 0.0
        """The playhead: the furthest position reported, clamped to `generated_seconds`."""
        self._changed = trio.Event()

    @property
    def generated_seconds(self) -> float:
        """Media generated so far, in seconds."""
        return self.frames / self.fps

    @property
    def finished(self) -> bool:
        """Every frame of the video is made: the engine's next call only says so, and
        must not wait for a playhead (it would hold the video's end for nothing)."""
        return self.frames >= self.num_frames

    def may_generate(self) -> bool:
        """Whether the next chunk may be generated now."""
        return self.finished or self.generated_seconds - self.position < self.buffer_seconds

    def generated(self, frames: int) -> None:
        """A chunk of ``frames`` frames was generated."""
        self.frames += frames

    def report(self, position: float) -> None:
        """The client reports its playhead (finite and >= 0: the protocol checked it)."""
        position = min(position, self.generated_seconds)
        if position > self.position:
            self.position = position
            self._changed.set()
            self._changed = trio.Event()

    async def wait(self) -> None:
        """Return once the next chunk may be generated: at once if it may, else at the
        report that opens the gate. Cancellation (a stop) ends the wait."""
        while not self.may_generate():
            await self._changed.wait()
