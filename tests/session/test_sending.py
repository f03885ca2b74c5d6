"""`Sender`, over a socket whose peer the test plays: whole messages in order, never cut
by accident, bounded in time, and a closed or broken socket reported, not raised raw.

The clock is virtual (autojump): a peer that never reads costs no wall time.
"""

from __future__ import annotations

import attrs
import pytest
import trio
import trio.testing
from trio_websocket import CloseReason, ConnectionClosed

from trio_vstream import protocol
from trio_vstream.session.sending import REPLIES_WAITING, Sender, SocketBroken


class Peer:
    """The socket: it records what was sent, and holds each frame for which ``hold`` is
    True until ``release()`` (a peer that is not reading), or for good."""

    def __init__(self) -> None:
        self.sent: list[str | bytes] = []
        self.holding = trio.Event()
        self.hold: set[str | bytes] = set()
        self._released = trio.Event()
        self.closed = False

    def release(self) -> None:
        self._released.set()

    async def send_message(self, message: str | bytes, /) -> None:
        if self.closed:
            raise ConnectionClosed(CloseReason(1000, None))
        if message in self.hold:
            self.holding.set()
            await self._released.wait()
        self.sent.append(message)


@attrs.define
class Calls:
    closed: int = 0
    stuck: int = 0


def sender_over(peer: Peer, calls: Calls, timeout: float = 10.0) -> Sender:
    def closed() -> None:
        calls.closed += 1

    def stuck() -> None:
        calls.stuck += 1

    return Sender(peer, timeout=timeout, on_closed=closed, on_stuck=stuck)


async def test_messages_sent_together_are_never_interleaved_with_another_tasks() -> None:
    peer = Peer()
    peer.hold = {b"first-a"}
    sender = sender_over(peer, Calls())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send, b"first-a", b"first-b")
        await peer.holding.wait()  # the first send is mid-way
        nursery.start_soon(sender.send, b"second-a", b"second-b")
        await trio.testing.wait_all_tasks_blocked()
        assert sender.sending
        peer.release()
    assert peer.sent == [b"first-a", b"first-b", b"second-a", b"second-b"]
    assert not sender.sending


async def test_protocol_messages_go_as_their_json_and_bytes_as_they_are() -> None:
    peer = Peer()
    await sender_over(peer, Calls()).send(protocol.Pong(), b"\x00\x01")
    assert peer.sent == [protocol.Pong().to_json(), b"\x00\x01"]


async def test_an_ordinary_cancellation_never_cuts_a_send() -> None:
    peer = Peer()
    peer.hold = {b"chunk"}
    calls = Calls()
    sender = sender_over(peer, calls)
    finished = False
    stop = trio.CancelScope()

    async def send() -> None:
        nonlocal finished
        with stop:
            await sender.send(b"chunk", b"its-tail")
            finished = True

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send)
        await peer.holding.wait()
        stop.cancel()  # a stop, say: the frame on its way is finished
        await trio.testing.wait_all_tasks_blocked()
        peer.release()
    assert peer.sent == [b"chunk", b"its-tail"]
    assert finished  # the cancellation reached the task only after the send
    assert not sender.broken and calls == Calls()


@pytest.mark.parametrize("given", [None, 5.0], ids=["default deadline", "given deadline"])
async def test_a_peer_that_never_reads_breaks_the_socket_at_the_deadline(
    autojump_clock: trio.testing.MockClock, given: float | None
) -> None:
    peer = Peer()
    peer.hold = {b"chunk"}
    calls = Calls()
    sender = sender_over(peer, calls, timeout=30.0)
    began = trio.current_time()
    deadline = None if given is None else began + given
    with pytest.raises(SocketBroken):
        await sender.send(b"chunk", deadline=deadline)
    assert trio.current_time() - began == pytest.approx(30.0 if given is None else given)
    assert sender.broken and calls == Calls(stuck=1)
    # Broken, nothing more is written, not even a message that would go at once.
    with pytest.raises(SocketBroken):
        await sender.send(b"other")
    assert peer.sent == [] and calls == Calls(stuck=1)


async def test_an_interrupted_send_breaks_the_socket_without_calling_it_stuck() -> None:
    peer = Peer()
    peer.hold = {b"chunk"}
    calls = Calls()
    sender = sender_over(peer, calls)
    outcome: list[BaseException] = []
    async with trio.open_nursery() as nursery:

        async def send() -> None:
            try:
                await sender.send(b"chunk")
            except SocketBroken as exc:
                outcome.append(exc)

        nursery.start_soon(send)
        await peer.holding.wait()
        sender.interrupt()
    assert len(outcome) == 1
    assert sender.broken and calls == Calls()  # before its deadline: the owner's decision
    assert peer.sent == []


async def test_inside_a_scope_the_owner_cancels_a_broken_send_unwinds_with_it(
    autojump_clock: trio.testing.MockClock,
) -> None:
    """The session's case: its ``on_stuck`` aborts the session, whose tasks then leave by
    cancellation, not by an exception each would have to catch."""
    peer = Peer()
    peer.hold = {b"chunk"}
    reached = False
    with trio.CancelScope() as session:
        sender = Sender(peer, timeout=1.0, on_closed=session.cancel, on_stuck=session.cancel)
        await sender.send(b"chunk")
        reached = True
    assert session.cancelled_caught and not reached and sender.broken


async def test_a_closed_connection_is_reported_by_every_send_that_finds_it() -> None:
    peer = Peer()
    peer.closed = True
    calls = Calls()
    sender = sender_over(peer, calls)
    for expected in (1, 2):
        with pytest.raises(SocketBroken):
            await sender.send(b"chunk")
        assert calls == Calls(closed=expected)
    assert not sender.broken  # closed, not cut mid-frame


async def test_a_reply_waits_for_no_send_and_goes_before_the_next_one() -> None:
    peer = Peer()
    peer.hold = {b"chunk"}
    sender = sender_over(peer, Calls())
    async with trio.open_nursery() as nursery:
        nursery.start_soon(sender.send_replies)
        nursery.start_soon(sender.send, b"chunk", b"its-tail")
        await peer.holding.wait()
        nursery.start_soon(sender.send, b"next", b"next-tail")  # waiting for the socket
        await trio.testing.wait_all_tasks_blocked()
        with trio.fail_after(1):  # queued at once, while the chunk holds the socket
            await sender.reply(protocol.Pong())
        assert sender.replies_waiting == 1
        peer.release()
        await trio.testing.wait_all_tasks_blocked()
        nursery.cancel_scope.cancel()
    # Never between a chunk's two messages; ahead of the send that was waiting.
    assert peer.sent == [b"chunk", b"its-tail", protocol.Pong().to_json(), b"next", b"next-tail"]
    assert sender.replies_waiting == 0


async def test_replies_wait_for_room_beyond_their_bound_and_never_on_a_broken_socket() -> None:
    peer = Peer()
    peer.hold = {b"chunk"}
    sender = sender_over(peer, Calls())
    queued = 0

    async def reply_all() -> None:
        nonlocal queued
        for _ in range(REPLIES_WAITING + 1):
            await sender.reply(protocol.Pong())
            queued += 1

    async def send_chunk() -> None:
        with pytest.raises(SocketBroken):
            await sender.send(b"chunk")

    async with trio.open_nursery() as nursery:
        nursery.start_soon(send_chunk)
        await peer.holding.wait()
        nursery.start_soon(reply_all)
        await trio.testing.wait_all_tasks_blocked()
        assert queued == REPLIES_WAITING  # the one more waits for room
        sender.interrupt()  # broken: nothing more will go, so nothing waits for room
    assert queued == REPLIES_WAITING + 1
    assert sender.broken and peer.sent == []
