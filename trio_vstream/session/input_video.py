"""A session's input video: frames in from the receive loop, each chunk's window out.

A session that asked for ``input_video`` follows the frames its client sends as binary
messages, one frame each, numbered as they arrive. Three parties touch them:

* the receive loop hands each message to `InputVideo.offer`, which vets its size and
  header at once (no decode: the frame's format and size must be the declared ones) and
  queues it for decoding. It never waits, so a ping or a stop behind a frame is read at
  once;
* a decoder task (`InputVideo.decode_frames`) decodes the queued frames one at a time in
  a worker thread, under the server's image limiter, at most `DECODE_RATE_FACTOR` times
  the declared rate (a burst of a buffer's frames is let through), and only as far
  ahead of the output as the decoded buffer holds (`BUFFER_BYTES`): the rest of the
  `BUFFER_SECONDS` wait compressed, in the queue (`PENDING_BYTES`). A frame the queue
  has no room for drops the oldest, and the output skips past it;
* the generation loop asks for each chunk's `InputVideo.window`: as many frames as the
  chunk will have, one input frame per output frame, on `InputTimeline`'s clock.

Every frame ends in exactly one chunk's ``used`` or ``dropped`` count
(`protocol.InputFrameCounts`), so a client can account for what it sent.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Awaitable, Callable
from fractions import Fraction
from typing import Any, Final

import numpy as np
import trio

from trio_vstream import protocol
from trio_vstream.media.errors import EncodingError
from trio_vstream.media.image_decode import decode_frame, vet_frame
from trio_vstream.media.image_header import ImageHeader
from trio_vstream.protocol import ErrorCode

__all__ = [
    "BUFFER_BYTES",
    "BUFFER_SECONDS",
    "DECODE_RATE_FACTOR",
    "PENDING_BYTES",
    "InputTimeline",
    "InputVideo",
]

BUFFER_SECONDS: Final = 2.0
"""How much decoded input a session keeps ahead of its output, in seconds of input: a
client may send this far ahead (a file streamed, a camera while the engine catches up);
beyond it the oldest frames are dropped and the output skips ahead to the rest."""

BUFFER_BYTES: Final = 64 * 1024 * 1024
"""Decoded frames (at the output's size) kept ahead of the output, at most this many bytes
of them (and at most `BUFFER_SECONDS`): the decoder waits for room, so the rest of the
buffer waits compressed (a 1080p frame is 6 MB decoded, a few hundred KB as JPEG)."""

PENDING_BYTES: Final = 32 * 1024 * 1024
"""Frames received and vetted but not yet decoded, at most this many bytes of them (and
at most `BUFFER_SECONDS` of them): one more drops the oldest."""

DECODE_RATE_FACTOR: Final = 2.0
"""A session decodes at most this many times its declared frame rate, on average: a
client that sends faster only loses frames, never another session's CPU."""


class InputTimeline:
    """The input's clock and its decoded frames: pure, no Trio (tested alone).

    The output consumes the input at its own frame rate: output frame ``m`` of the
    session is made from the input frame under a cursor that moves ``in_fps / out_fps``
    input frames per output frame (so an input at the output's rate is used frame for
    frame). Three things move it otherwise, each counted:

    * **late**: the frame under the cursor has not arrived (the window's wait is over):
      the output frame repeats the last input frame (``reused``), and the cursor waits,
      so the late frame is used when it comes rather than lost;
    * **early**: decoded frames wait for the cursor, at most ``capacity`` of them (the
      decoder waits for room; frames beyond wait compressed in `InputVideo`'s queue). A
      frame dropped from a full queue (`skip`), or one more than ``capacity`` here,
      drops the oldest (``dropped``) and the cursor skips past it, so a client far ahead
      loses its oldest frames, never memory, and the output catches up;
    * **skipped**: frames the cursor passes over (an input faster than the output), or
      that arrive after it passed (``dropped``), or that could not be decoded.
    """

    def __init__(self, in_fps: int, out_fps: int, capacity: int) -> None:
        self._step = Fraction(in_fps, out_fps)
        self._cursor = Fraction(0)
        self._capacity = capacity
        self._frames: dict[int, np.ndarray] = {}
        """Decoded frames at or past the cursor, by index."""
        self._failed: set[int] = set()
        """Frames refused, waiting for the frames before them to resolve."""
        self.received = 0
        """Frames offered so far: the next one's index."""
        self.resolved = 0
        """Frames [0, resolved) are decoded or failed: they resolve in order."""
        self._last: np.ndarray | None = None
        self._last_index: int | None = None
        self._dropped = 0
        """Frames dropped since the last window (reported with the next)."""
        self.ended = False
        """The client sent ``input_video.end``."""

    @property
    def position(self) -> int:
        """The index of the input frame the next output frame is made from."""
        return math.floor(self._cursor)

    @property
    def exhausted(self) -> bool:
        """The input has ended and every frame of it has been used or dropped."""
        return self.ended and self.resolved == self.received and self.position >= self.received

    @property
    def buffered(self) -> int:
        """Decoded frames waiting for the output."""
        return len(self._frames)

    def arrived(self) -> int:
        """A frame message arrived: its index."""
        index = self.received
        self.received += 1
        return index

    def decoded(self, index: int, frame: np.ndarray) -> None:
        """Frame ``index`` is decoded: the oldest frame not yet resolved, refused ones
        aside (frames resolve in the order they arrived)."""
        self._settle()
        self._resolve(index, frame)
        self._settle()

    def refuse(self, index: int) -> None:
        """Frame ``index`` was refused (its header, its size, the decode rate, the
        decoder): resolved as soon as every frame before it is."""
        self._failed.add(index)
        self._settle()

    def skip(self, index: int) -> None:
        """Frame ``index`` is dropped unread because the buffer is full: refused, and the
        output skips past it (and past every frame before it)."""
        self._cursor = max(self._cursor, Fraction(index + 1))
        self.refuse(index)

    def _settle(self) -> None:
        while self.resolved in self._failed:
            self._failed.discard(self.resolved)
            self._resolve(self.resolved, None)

    def _resolve(self, index: int, frame: np.ndarray | None) -> None:
        assert index == self.resolved, (index, self.resolved)  # frames resolve in order
        self.resolved += 1
        if frame is None or index < self.position:
            self._dropped += 1  # refused, or too late: its output frames are made
            return
        self._frames[index] = frame
        while len(self._frames) > self._capacity:
            oldest = min(self._frames)
            del self._frames[oldest]
            self._dropped += 1
            self._cursor = max(self._cursor, Fraction(oldest + 1))

    def due(self, count: int) -> int:
        """The last input frame the next ``count`` output frames are made from."""
        return math.floor(self._cursor + (count - 1) * self._step)

    def ready(self, count: int) -> bool:
        """Whether the next ``count`` output frames' input is all here (or never coming)."""
        return self.resolved > self.due(count) or (self.ended and self.resolved == self.received)

    def take(
        self, count: int, shape: tuple[int, int]
    ) -> tuple[np.ndarray, protocol.InputFrameCounts]:
        """The next ``count`` output frames' input, (count, H, W, 3) uint8, and its counts.

        Call once its wait is over, ready or not: what is missing then is late."""
        first = self.position if self.received else None
        out = np.empty((count, *shape, 3), dtype=np.uint8)
        used = reused = 0
        for j in range(count):
            index = self.position
            if index < self.resolved:
                frame = self._frames.pop(index, None)
                if frame is not None:
                    self._last, self._last_index = frame, index
                    used += 1
                elif index != self._last_index:
                    reused += 1  # refused: nothing of its own to show
                self._cursor += self._step
                # What the cursor passed over unused (an input faster than the output).
                for skipped in [i for i in self._frames if i < self.position]:
                    del self._frames[skipped]
                    self._dropped += 1
            else:
                reused += 1  # late (or past the input's end): the input's clock waits
            if self._last is None:
                out[j] = 0  # no input yet at all: black, counted as reused
            else:
                out[j] = self._last
        dropped, self._dropped = self._dropped, 0
        counts = protocol.InputFrameCounts(
            used=used, dropped=dropped, reused=reused, first=first, last=self._last_index
        )
        return out, counts


def buffer_frames(settings: protocol.InputVideoSettings) -> int:
    """How many frames a session buffers, decoded or not: `BUFFER_SECONDS` of its input."""
    return max(2, math.ceil(settings.fps * BUFFER_SECONDS))


def timeline_capacity(settings: protocol.InputVideoSettings, shape: tuple[int, int]) -> int:
    """How many of them may be decoded at once: within `BUFFER_BYTES`, never fewer than two."""
    frame_bytes = shape[0] * shape[1] * 3
    return max(2, min(buffer_frames(settings), BUFFER_BYTES // frame_bytes))


class InputVideo:
    """One session's input video (see the module's docstring), between its three tasks.

    ``in_thread`` runs the decodes (the session's server-work threads), under
    ``limiter`` (the server's image limiter: every session's decodes share it).
    ``refused`` is told of each frame refused, with the error the client gets.
    """

    def __init__(
        self,
        settings: protocol.InputVideoSettings,
        shape: tuple[int, int],
        out_fps: int,
        *,
        in_thread: Callable[..., Awaitable[Any]],
        limiter: trio.CapacityLimiter,
    ) -> None:
        self.settings = settings
        self._shape = shape
        self._decoded_capacity = timeline_capacity(settings, shape)
        self._timeline = InputTimeline(settings.fps, out_fps, self._decoded_capacity)
        self._in_thread = in_thread
        self._limiter = limiter
        self._capacity = buffer_frames(settings)
        self._pending: deque[tuple[int, bytes, ImageHeader]] = deque()
        self._pending_bytes = 0
        self._changed = trio.Event()
        self._tokens = float(self._capacity)
        self._refilled_at: float | None = None

    # ------------------------------------------------------------ receive loop

    def offer(self, data: bytes) -> protocol.ProtocolError | None:
        """One frame message, vetted now and queued for decoding; never waits. Returns
        the error the client gets for a frame refused, None for one taken."""
        settings = self.settings
        if len(data) > settings.max_frame_bytes:
            return self.oversized(len(data))
        index = self._timeline.arrived()
        try:
            header = vet_frame(data, settings.frame_format, settings.width, settings.height)
        except EncodingError as exc:
            self._refuse(index)
            return protocol.ProtocolError(
                ErrorCode.INVALID_INPUT_FRAME, f"input frame {index} refused: {exc}"
            )
        self._pending.append((index, data, header))
        self._pending_bytes += len(data)
        while self._pending_bytes > PENDING_BYTES or len(self._pending) > self._capacity:
            dropped, old, _ = self._pending.popleft()
            self._pending_bytes -= len(old)
            # Counted, no error: the client is a whole buffer ahead of the output, which
            # skips past what is dropped rather than show a repeated frame for it.
            self._timeline.skip(dropped)
            self._wake()
        self._wake()
        return None

    def oversized(self, length: int) -> protocol.ProtocolError:
        """A frame message of ``length`` bytes, over the cap: numbered, refused unread."""
        index = self._timeline.arrived()
        self._refuse(index)
        return protocol.ProtocolError(
            ErrorCode.MESSAGE_TOO_LARGE,
            f"input frame {index} is {length} bytes, more than the "
            f"{self.settings.max_frame_bytes} allowed",
        )

    def end(self) -> None:
        """``input_video.end``: no more frames will come."""
        self._timeline.ended = True
        self._wake()

    # ------------------------------------------------------------------ decoder

    async def decode_frames(
        self, refused: Callable[[protocol.ProtocolError], Awaitable[None]]
    ) -> None:
        """Decode the queued frames in order, for the session's life (cancel it to end)."""
        while True:
            # Decoded no further ahead of the output than the decoded buffer holds.
            while not self._pending or self._timeline.buffered >= self._decoded_capacity:
                await self._wait()
            index, data, header = self._pending.popleft()
            self._pending_bytes -= len(data)
            if not self._take_token():
                self._refuse(index)  # over the decode rate: counted, like an overflow
                continue
            height, width = self._shape
            try:
                async with self._limiter:
                    frame = await self._in_thread(decode_frame, data, header, width, height)
            except EncodingError as exc:
                self._refuse(index)
                await refused(
                    protocol.ProtocolError(
                        ErrorCode.INVALID_INPUT_FRAME, f"input frame {index} refused: {exc}"
                    )
                )
                continue
            self._timeline.decoded(index, frame)
            self._wake()

    def _take_token(self) -> bool:
        """The decode rate's token bucket: a buffer's frames of burst, refilled at
        `DECODE_RATE_FACTOR` times the declared rate."""
        now = trio.current_time()
        fps = self.settings.fps
        if self._refilled_at is not None:
            refill = (now - self._refilled_at) * fps * DECODE_RATE_FACTOR
            self._tokens = min(float(self._capacity), self._tokens + refill)
        self._refilled_at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    # -------------------------------------------------------------- generation

    @property
    def finished(self) -> bool:
        """The session asked to end with its input (``on_end: "end"``), and it has."""
        return self.settings.on_end == "end" and self._timeline.exhausted

    async def window(self, count: int) -> tuple[np.ndarray, protocol.InputFrameCounts] | None:
        """The next chunk's input: ``count`` frames, once they are here or late; None
        when the session asked to end with its input and it has (before or during the
        wait: an ``input_video.end`` that comes while a chunk waits ends the video).

        The wait is for the frames the window needs that have not arrived, at the
        declared rate, plus ``max_wait_ms``: a camera sending in real time is never
        late, and a client that stops costs each chunk that long at most."""
        if self.finished:
            return None
        timeline = self._timeline
        missing = max(0, timeline.due(count) + 1 - timeline.received)
        deadline = (
            trio.current_time() + missing / self.settings.fps + self.settings.max_wait_seconds
        )
        with trio.move_on_at(deadline):
            while not timeline.ready(count):
                await self._wait()
        if self.finished:
            return None
        taken = timeline.take(count, self._shape)
        self._wake()  # room in the decoded buffer: the decoder may go on
        return taken

    # ----------------------------------------------------------------- helpers

    def _refuse(self, index: int) -> None:
        self._timeline.refuse(index)
        self._wake()

    def _wake(self) -> None:
        self._changed.set()
        self._changed = trio.Event()

    async def _wait(self) -> None:
        await self._changed.wait()
