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

The same mistake has a second door: a message over ``max_message_size`` that
arrives after Close was sent makes trio-websocket send a second Close (1009),
which wsproto refuses the same way (found by ``bench/soak.py``). The patch
also wraps ``_handle_message_event``: once the connection is not ``OPEN``, an
oversized message is dropped without a Close, since one has been sent already.

Drop this module (and its call in ``trio_vstream.server.app``) once a
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
from wsproto.events import BytesMessage, Ping, TextMessage

__all__ = ["LAST_AFFECTED_VERSION", "has_ping_during_close_bug", "patch_ping_during_close"]

LAST_AFFECTED_VERSION: tuple[int, int, int] = (0, 12, 2)
"""The newest trio-websocket release known to answer pings after Close."""

PingHandler = Callable[[WebSocketConnection, Ping], Coroutine[Any, Any, None]]
MessageHandler = Callable[
    [WebSocketConnection, BytesMessage | TextMessage], Coroutine[Any, Any, None]
]


class _Installed:
    """The patch's process-wide state: how many callers want it, and what it replaced."""

    users: int = 0
    originals: dict[str, Any] = {}  # noqa: RUF012 - process-wide on purpose
    wrappers: dict[str, Any] = {}  # noqa: RUF012


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


def _drop_oversized_after_close(original: MessageHandler) -> MessageHandler:
    @functools.wraps(original)
    async def _handle_message_event(
        self: WebSocketConnection, event: BytesMessage | TextMessage
    ) -> None:
        too_large = self._message_size + len(event.data) > self._max_message_size
        if too_large and self._wsproto.state is not ConnectionState.OPEN:
            # A Close went out (or came in) already: a second one (1009) would be refused.
            self._message_size = 0
            self._message_parts = []
            return
        await original(self, event)

    return _handle_message_event


_WRAPPERS: dict[str, Callable[[Any], Any]] = {
    "_handle_ping_event": _skip_pings_after_close,
    "_handle_message_event": _drop_oversized_after_close,
}


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
        for name, wrap in _WRAPPERS.items():
            original = getattr(WebSocketConnection, name)
            wrapper = wrap(original)
            setattr(WebSocketConnection, name, wrapper)
            _Installed.originals[name], _Installed.wrappers[name] = original, wrapper
    _Installed.users += 1
    undone = False

    def undo() -> None:
        nonlocal undone
        if undone:
            return
        undone = True
        _Installed.users -= 1
        if _Installed.users > 0:
            return
        for name, original in _Installed.originals.items():
            # Put the original back only if nobody has replaced our wrapper since.
            if WebSocketConnection.__dict__.get(name) is _Installed.wrappers[name]:
                setattr(WebSocketConnection, name, original)
        _Installed.originals.clear()
        _Installed.wrappers.clear()

    return undo


def _nothing_to_undo() -> None:
    return None
