"""Session slots (``--max-sessions``): the running sessions, and the short claims of
upgrades on their way to their ``session.start``.

A session takes its slot when its ``session.start`` arrives, not at its upgrade, so that
idle upgrades cannot keep real clients out. Yet a full server must refuse the upgrade
itself (an HTTP 503, before anything is accepted), or a balancer cannot try another
server; and an upgrade it accepts must find a slot at its ``session.start``, or a
session the balancer could have placed elsewhere is lost to ``server_busy``. Two
upgrades that both saw the last slot free would both be accepted, and one of them lost.

So an accepted upgrade holds a `Claim` on a slot for `CLAIM_SECONDS`: claims count
against the limit when an upgrade is decided, and at the ``session.start`` the session's
own claim becomes its slot (`SessionSlots.admit`), never counted twice. An upgrade idle
beyond the window counts no more: idle connections keep a real client out for that long
at most (and connections are bounded on their own: ``trio_vstream.server.connections``).
If its ``session.start`` comes later and finds no slot, it gets ``server_busy`` then.

Every check and its mark happen without a checkpoint between them: one event loop, so
no other upgrade or start can come between.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs
import trio

__all__ = ["CLAIM_SECONDS", "Claim", "SessionSlots"]

CLAIM_SECONDS = 2.0
"""How long an accepted upgrade holds a session slot for its ``session.start``: well
above what a client takes to send it after the handshake (one round trip), and short
enough that idle upgrades cannot keep real clients out for longer than that."""


@attrs.define(eq=False)
class Claim:
    """An accepted upgrade's hold on one session slot, until ``deadline`` (Trio's clock)
    or until it is released: at its ``session.start``, or when its connection ends."""

    deadline: float
    released: bool = False


class SessionSlots:
    """``limit`` session slots, taken by the running sessions (``running``, counted by the
    server) and by the claims of upgrades not yet started."""

    def __init__(
        self, limit: int, running: Callable[[], int], *, window: float = CLAIM_SECONDS
    ) -> None:
        self.limit = limit
        self._running = running
        self._window = window
        self._claims: list[Claim] = []

    @property
    def claimed(self) -> int:
        """Claims held now: those released, or past their window, are forgotten here."""
        now = trio.current_time()
        self._claims = [c for c in self._claims if not c.released and c.deadline > now]
        return len(self._claims)

    @property
    def free(self) -> int:
        """Slots neither running a session nor claimed."""
        return self.limit - self._running() - self.claimed

    def claim(self) -> Claim | None:
        """A claim on a free slot, for an upgrade about to be accepted; None when every
        slot runs a session or is claimed (the upgrade is refused)."""
        if self.free <= 0:
            return None
        claim = Claim(trio.current_time() + self._window)
        self._claims.append(claim)
        return claim

    def release(self, claim: Claim | None) -> None:
        """The claim's upgrade started, or its connection ended: the claim counts no more."""
        if claim is not None:
            claim.released = True

    def admit(self, claim: Claim | None) -> bool:
        """At a ``session.start``: may its session take a slot now? Its own claim, if it
        has one, is given up first, so that it is not counted twice: a claim still held
        is always a free slot. True: the caller counts the session as running before its
        next checkpoint (``Session.admitted``)."""
        self.release(claim)
        return self.free > 0
