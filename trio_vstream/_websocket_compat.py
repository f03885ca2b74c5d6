"""A workaround for trio-websocket answering pings after it has sent Close.

trio-websocket's reader task answers every Ping with a Pong. If a client's
ping reaches the server after the server has sent its Close frame (the two
frames cross on the wire, or the ping lands while ``aclose()`` is sending
Close), wsproto is in state ``LOCAL_CLOSING`` and refuses to send the Pong
with ``LocalProtocolError``. That exception escapes the reader task and tears
down the connection's nursery: the close handshake is abandoned, the Close
frame may never go out, and the server logs a failed connection. This is
trio-websocket issue #184
(https://github.com/python-trio/trio-websocket/issues/184); the upstream fix,
PR #198 (https://github.com/python-trio/trio-websocket/pull/198), is not in a
release yet.

RFC 6455 (sections 5.5.1 to 5.5.3) lets an endpoint that has sent Close stop
answering pings: after Close it sends no further frames. So
:func:`patch_ping_during_close` wraps
``WebSocketConnection._handle_ping_event``: a ping that arrives while the
connection is no longer ``OPEN`` is dropped; every other ping goes to the
original handler unchanged.

Drop this module (and its call in ``trio_vstream.server``) once a
trio-websocket release carries the fix, and raise the ``trio-websocket`` floor
in ``pyproject.toml`` to that release.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Coroutine
from importlib import metadata
from typing import Any

from trio_websocket import WebSocketConnection
from wsproto.connection import ConnectionState
from wsproto.events import Ping

__all__ = ["LAST_AFFECTED_VERSION", "has_ping_during_close_bug", "patch_ping_during_close"]

LAST_AFFECTED_VERSION: tuple[int, int, int] = (0, 12, 2)
"""The newest trio-websocket release known to answer pings after Close."""

PingHandler = Callable[[WebSocketConnection, Ping], Coroutine[Any, Any, None]]


class _Installed:
    """The patch's process-wide state: how many callers want it, and what it replaced."""

    users: int = 0
    original: PingHandler | None = None
    wrapper: PingHandler | None = None


def has_ping_during_close_bug(version: str | None = None) -> bool:
    """Whether this trio-websocket ``version`` (default: the installed one) has issue #184.

    True for releases up to and including :data:`LAST_AFFECTED_VERSION`. A
    version that cannot be read or parsed also counts as affected: the patch
    only skips pongs that wsproto would refuse anyway, so it is harmless where
    the bug is already fixed.
    """
    if version is None:
        try:
            version = metadata.version("trio-websocket")
        except metadata.PackageNotFoundError:
            return True
    match = re.match(r"\d+(?:\.\d+)*", version)
    if match is None:
        return True
    release = tuple(int(part) for part in match.group().split("."))
    return release[:3] <= LAST_AFFECTED_VERSION


def _skip_pings_after_close(original: PingHandler) -> PingHandler:
    @functools.wraps(original)
    async def _handle_ping_event(self: WebSocketConnection, event: Ping) -> None:
        # Close has been sent (LOCAL_CLOSING), received (REMOTE_CLOSING), or both
        # (CLOSED): no Pong is owed, and wsproto would refuse to send one.
        if self._wsproto.state is not ConnectionState.OPEN:
            return
        await original(self, event)

    return _handle_ping_event


def patch_ping_during_close() -> Callable[[], None]:
    """Stop trio-websocket from answering pings once the connection is not OPEN.

    Idempotent: the handler is wrapped once, however often this is called.
    Returns a function that takes this call's request back; the original
    handler returns when every caller has taken theirs back (the server calls
    this at import and never does, so tests can patch and unpatch around it
    freely). Does nothing, and returns a no-op, on trio-websocket releases
    without the bug.
    """
    if not has_ping_during_close_bug():
        return _nothing_to_undo
    if _Installed.users == 0:
        original: PingHandler = WebSocketConnection._handle_ping_event
        wrapper = _skip_pings_after_close(original)
        WebSocketConnection._handle_ping_event = wrapper  # type: ignore[method-assign]
        _Installed.original, _Installed.wrapper = original, wrapper
    _Installed.users += 1
    undone = False

    def undo() -> None:
        nonlocal undone
        if undone:
            return
        undone = True
        _Installed.users -= 1
        if _Installed.users > 0 or _Installed.original is None:
            return
        # Put the original back only if nobody has replaced our wrapper since.
        if WebSocketConnection.__dict__.get("_handle_ping_event") is _Installed.wrapper:
            WebSocketConnection._handle_ping_event = _Installed.original  # type: ignore[method-assign]
        _Installed.original = _Installed.wrapper = None

    return undo


def _nothing_to_undo() -> None:
    return None
