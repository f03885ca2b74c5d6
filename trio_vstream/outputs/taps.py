"""Followers of a session's output: what viewers and recordings are built on.

A session tells its taps what it sent, as it sends it: the ``video.start``, every
chunk's metadata and bytes, each interaction, and how it ended. The calls come from
the event loop, between the session's own sends, so a tap must never block and never
raise: it takes what it needs and queues it for its own task or thread (a bounded
queue, dropping or closing its follower when that falls behind). That is the whole
contract that keeps a slow viewer or a full disk from ever slowing the session: the
session does not wait for its taps, and a tap that fails is logged and dropped.

The server decides which taps a session gets (`TapFactory`), once the request is
valid and before ``video.start``, which may carry fields the taps add (a watch link).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any, Protocol

import attrs

from trio_vstream import protocol
from trio_vstream.logsafe import get_logger

logger = get_logger(__name__)


class SessionTap(Protocol):
    """One follower of one session. Every method is called on the event loop, must return
    at once, and should not raise (if it does, the session logs it and drops the tap)."""

    def started(self, video_start: protocol.VideoStart, start: protocol.SessionStart) -> None:
        """``video.start`` was sent; ``start`` is the request as validated."""

    def chunk(self, metadata: protocol.ChunkMetadata, data: bytes, init_segment: bytes) -> None:
        """A chunk's metadata and binary message were sent. ``init_segment`` is the fMP4
        init segment, which the first media chunk's ``data`` begins with: a follower that
        joins later needs it before any other chunk."""

    def interaction(
        self, event_id: str, message: protocol.Interaction, error: protocol.Error | None
    ) -> None:
        """An interaction arrived (now): queued for the engine, or refused with ``error``."""

    def interaction_refused(self, event_id: str, error: protocol.Error) -> None:
        """An interaction `interaction` reported as queued was refused when it was handed
        to the engine, with ``error`` (sent to the client now). Only a paced camera
        session holds interactions until their chunk starts, so only it refuses late."""

    def ended(self, outcome: str, terminal: protocol.SessionDone | protocol.Error | None) -> None:
        """The session is over: ``outcome`` as in the session summary, and the terminal
        message sent to the client (or that would have been, had the client stayed)."""


@attrs.frozen
class SessionTaps:
    """What a `TapFactory` gives one session."""

    taps: Sequence[SessionTap] = ()
    video_start_fields: dict[str, Any] = attrs.field(factory=dict)
    """Extra ``video.start`` fields (this project's extensions, such as ``watch_path``)."""


TapFactory = Callable[[str, protocol.SessionStart], SessionTaps]
"""``factory(request_id, start)``: the taps of a session about to send ``video.start``."""


class TapSet:
    """A session's taps, each call guarded: a tap that raises is logged and dropped, so a
    bug in a follower never fails the session it follows."""

    def __init__(self, request_id: str, taps: Sequence[SessionTap]) -> None:
        self._request_id = request_id
        self._taps = list(taps)

    def __bool__(self) -> bool:
        return bool(self._taps)

    def call(self, method: str, *args: Any) -> None:
        for tap in list(self._taps):
            try:
                getattr(tap, method)(*args)
            except Exception:
                logger.exception(
                    "session %s: %s tap failed in %s; dropping it",
                    self._request_id,
                    type(tap).__name__,
                    method,
                )
                self._taps.remove(tap)


def open_taps(
    factory: TapFactory | None, request_id: str, start: protocol.SessionStart
) -> SessionTaps:
    """A session's followers, from the server's factory; none if that fails (logged): a
    viewer or a recording is never a reason to refuse the session itself."""
    if factory is None:
        return SessionTaps()
    try:
        return factory(request_id, start)
    except Exception:
        logger.exception("session %s: could not open its taps", request_id)
        return SessionTaps()
