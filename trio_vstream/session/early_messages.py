"""What a client sends while its session prepares, kept for the receive loop: bounded.

Between ``session.start`` and ``video.start`` a session may take a while (an image
fetched, the engine opening its stream). It reads the socket meanwhile, so that a
client that goes away ends it at once, and keeps what arrives (a ping, an
interaction, a stop) for its receive loop, in order.

What is kept is bounded before it is read: at most `EARLY_MESSAGES` messages, and
reading stops once those kept reach the control message limit in bytes
(``--max-control-bytes``), so at most twice that is held (the last one read may bring
up to the limit again). A message over the limit, which the receive loop would only
refuse, is kept as its refusal (``message_too_large``), without its bytes: sixteen
8 MiB messages once held 128 MiB per session. A client that sends more waits, like
any client the server does not read, and is read again after ``video.start``.

A binary message is an input video frame: a session that follows an input video keeps
it as it keeps a control message, up to the frame cap (``input_video``'s 1 MiB) rather
than the control limit, so that a frame sent before ``video.start`` is numbered and taken
as one after it is (so at most the control limit and one frame are held); a frame over
the cap is kept as an `OversizedFrame`, its length only,
for the receive loop to refuse in its place. A session without input video keeps only
the refusal any binary message gets (`binary_refusal`).

Pure: the session reads the socket (`trio_vstream.session.session`); this decides what is
kept, and when to stop reading.
"""

from __future__ import annotations

from collections import deque
from typing import Final

import attrs

from trio_vstream import protocol

EARLY_MESSAGES: Final = 16
"""Control messages kept while a session prepares (in bytes, bounded too)."""


@attrs.frozen
class OversizedFrame:
    """An input frame over the frame cap, received while the session prepared: only its
    length is kept, for the receive loop to number and refuse it."""

    length: int


Early = str | bytes | protocol.ProtocolError | OversizedFrame
"""A message received while the session prepared: as received, or, over its limit, only
the refusal the receive loop will send for it."""


def binary_refusal() -> protocol.ProtocolError:
    """What a binary message gets in a session that asked for no input video."""
    return protocol.ProtocolError(
        protocol.ErrorCode.INVALID_MESSAGE,
        "Binary messages are input video frames, and this session asked for no input_video",
    )


class EarlyMessages:
    """The messages one session received while it prepared, oldest first."""

    def __init__(self, limits: protocol.Limits, frame_bytes: int | None = None) -> None:
        self._limits = limits
        self._frame_bytes = frame_bytes
        """The input video's frame cap; None for a session without input video."""
        self._kept: deque[Early] = deque()
        self._bytes = 0
        """The bytes of the messages kept as received (refusals hold none)."""

    @property
    def full(self) -> bool:
        """Whether to stop reading: as many messages, or bytes, as may be kept."""
        return len(self._kept) >= EARLY_MESSAGES or self._bytes >= self._limits.max_control_bytes

    def keep(self, raw: str | bytes) -> None:
        """Keep a message just read, or only its refusal if it is over the limit."""
        if isinstance(raw, bytes):
            if self._frame_bytes is None:
                self._kept.append(binary_refusal())
            elif len(raw) > self._frame_bytes:
                self._kept.append(OversizedFrame(len(raw)))
            else:
                self._kept.append(raw)
                self._bytes += len(raw)
            return
        limit = self._limits.max_control_bytes
        size = _size_up_to(raw, limit)
        if size > limit:
            self._kept.append(_refusal(raw, self._limits))
        else:
            self._kept.append(raw)
            self._bytes += size

    def __bool__(self) -> bool:
        return bool(self._kept)

    def pop(self) -> Early:
        """The oldest message kept (`IndexError` if none is)."""
        return self._kept.popleft()


def _size_up_to(raw: str | bytes, limit: int) -> int:
    """The message's size in bytes (UTF-8 for text), or any number over ``limit`` once
    it is clearly over: an 8 MiB text is not encoded only to be refused."""
    if isinstance(raw, bytes) or len(raw) > limit:
        return len(raw)
    return len(raw.encode("utf-8", "surrogatepass"))


def _refusal(raw: str | bytes, limits: protocol.Limits) -> protocol.ProtocolError:
    """What the receive loop answers to a message over the control limit, from the
    protocol itself (so the code and the words are the ones any such message gets)."""
    try:
        protocol.parse_control(raw, limits=limits)
    except protocol.ProtocolError as exc:
        return exc.with_traceback(None)  # its frames would keep the message alive
    raise AssertionError("a message over the control limit was accepted")
