"""The send discipline of one WebSocket: whole messages, in order, never cut on a whim.

A session's tasks all write to one socket: the deliverer its chunks, the receive loop
its pongs and interaction answers, the session's end its terminal message. `Sender`
is the one way they do, and it keeps five promises:

* **whole and in order**: messages handed over together (a chunk's metadata and its
  bytes) go out back to back, never interleaved with another task's;
* **replies overtake media**: a control reply (`Sender.reply`: a pong, an interaction's
  answer) is queued, not sent by the task that has it, so the receive loop never waits
  for the socket and reads a ``session.stop`` behind a ping at once. Queued replies go
  out, in the order queued, at the next boundary between sends, before whatever send
  comes next (the next chunk's, the terminal message): ahead of chunks that were waiting
  for the socket, never between a chunk's metadata and its bytes. A WebSocket message
  is one frame here, written whole (trio-websocket sends a message as a single frame,
  and a frame cannot be cut into), so a reply waits at most for the send in progress:
  one chunk (its metadata and its bytes). The queue holds `REPLIES_WAITING`; beyond
  that `Sender.reply` waits for room (a client that sends faster than it reads is held
  back, as it was by the socket before). `Sender.send_replies` is the task that sends
  them when no other send is under way;
* **never cut by accident**: a send is shielded, so ordinary cancellation (a stop, the
  end of the receive loop) never leaves half a frame on the wire, which would corrupt
  the stream for good. Only `Sender.interrupt` cuts a send, on purpose (the session is
  aborted), and then the socket is **broken**: nothing more is written to it, not even
  a close frame;
* **bounded**: every send has an absolute deadline (by default, the timeout from when
  it began), the last resort against a peer that never reads. Past it the socket is
  broken and the owner hears ``on_stuck``;
* a closed connection is reported once per send that finds it (``on_closed``),
  whichever task sends.

A send that cannot go on leaves with `SocketBroken` after a checkpoint: inside a
cancelled scope (the session's, aborted by the owner's callback) that checkpoint
raises ``Cancelled`` instead, so the task unwinds with the rest of the session.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable
from typing import NoReturn, Protocol

import trio
from trio_websocket import ConnectionClosed

REPLIES_WAITING = 16
"""How many control replies may wait for the socket before `Sender.reply` waits too."""


class SocketBroken(Exception):
    """A send was interrupted mid-frame, or could not go on: nothing more can be written."""


class MessageSocket(Protocol):
    """What `Sender` needs of a WebSocket (``trio_websocket.WebSocketConnection``)."""

    async def send_message(self, message: str | bytes, /) -> None: ...


class Message(Protocol):
    """A protocol message: it knows its JSON text."""

    def to_json(self) -> str: ...


class Sender:
    """Every write to one WebSocket, under the discipline above."""

    def __init__(
        self,
        ws: MessageSocket,
        *,
        timeout: float,
        on_closed: Callable[[], None],
        on_stuck: Callable[[], None],
    ) -> None:
        """``timeout``: a send's deadline when it is given none. ``on_closed``: the peer
        closed the connection. ``on_stuck``: a send ran past its deadline (the peer
        stopped reading). Both are called from the sending task, before it leaves."""
        self._ws = ws
        self._timeout = timeout
        self._on_closed = on_closed
        self._on_stuck = on_stuck
        self._lock = trio.Lock()
        self._active: set[trio.CancelScope] = set()
        self._replies: deque[Message] = deque()
        """Control replies waiting for the socket, oldest first (`reply`)."""
        self._replies_changed = trio.Event()
        self.broken = False
        """A send was cut (or ran out of time) mid-message: the socket is left alone."""

    @property
    def sending(self) -> bool:
        """Whether a send is in progress (stuck, if nothing else moves)."""
        return bool(self._active)

    def interrupt(self) -> None:
        """Cut the sends in progress now (the socket is then broken)."""
        for scope in self._active:
            scope.cancel()

    @property
    def replies_waiting(self) -> int:
        """Control replies queued and not yet sent."""
        return len(self._replies)

    async def reply(self, message: Message) -> None:
        """Queue a control reply: it goes out before the next send's messages, or by
        `send_replies` when none comes (see the module's docstring). Returns at once,
        unless `REPLIES_WAITING` replies are already waiting: then once one has gone.
        Dropped when the socket is broken (nothing more is written to it)."""
        await trio.lowlevel.checkpoint()
        while len(self._replies) >= REPLIES_WAITING and not self.broken:
            await self._replies_changed.wait()
        if not self.broken:
            self._replies.append(message)
            self._notify_replies()

    async def send_replies(self) -> None:
        """Send the queued replies as they come, for as long as the socket takes them:
        the owner's task, beside the others that send. Returns when the socket is broken
        or closed (``Cancelled`` in an aborted scope, as `send`)."""
        while True:
            while not self._replies:
                await self._replies_changed.wait()
            try:
                await self.send()  # nothing of its own: the replies go first
            except SocketBroken:
                return

    def _notify_replies(self) -> None:
        self._replies_changed.set()
        self._replies_changed = trio.Event()

    async def send(self, *messages: Message | bytes, deadline: float | None = None) -> None:
        """Send the replies waiting, then messages back to back, by ``deadline`` (an
        absolute Trio time).

        Raises `SocketBroken` (or ``Cancelled``, see the module's docstring) when the
        socket is broken, or closed by the peer: ``messages`` may then have gone out in
        part, but never a part of a frame.
        """
        async with self._lock:
            if self.broken:
                await self._leave()
            if deadline is None:
                deadline = trio.current_time() + self._timeout
            closed = False
            with trio.CancelScope(shield=True, deadline=deadline) as scope:
                self._active.add(scope)
                try:
                    while self._replies:  # queued before these messages: they go first
                        await self._ws.send_message(self._replies[0].to_json())
                        self._replies.popleft()
                        self._notify_replies()
                    for message in messages:
                        data = message if isinstance(message, bytes) else message.to_json()
                        await self._ws.send_message(data)
                except ConnectionClosed:
                    closed = True
                finally:
                    self._active.discard(scope)
            if closed:
                self._on_closed()
                await self._leave()
            if scope.cancelled_caught:
                self.broken = True
                self._notify_replies()  # nothing waits for room that will never come
                if trio.current_time() >= deadline:
                    self._on_stuck()
                await self._leave()

    async def _leave(self) -> NoReturn:
        """After a send that cannot go on: leave quietly."""
        await trio.lowlevel.checkpoint()  # raises Cancelled inside an aborted scope
        raise SocketBroken  # outside one (a session finishing), the caller gives up quietly
