"""`SessionSlots`: running sessions and upgrades' claims against ``--max-sessions``, on a
clock that moves only when the test moves it."""

from __future__ import annotations

import trio
import trio.testing

from trio_vstream.server.slots import CLAIM_SECONDS, SessionSlots


class Running:
    """The server's count of running sessions, as the test sets it."""

    def __init__(self) -> None:
        self.count = 0

    def __call__(self) -> int:
        return self.count


async def test_claims_count_until_every_slot_is_taken(mock_clock: trio.testing.MockClock) -> None:
    running = Running()
    slots = SessionSlots(3, running)
    running.count = 1
    first, second = slots.claim(), slots.claim()
    assert first is not None and second is not None
    assert (slots.claimed, slots.free) == (2, 0)
    assert slots.claim() is None  # one running, two claimed: full


async def test_a_start_turns_its_own_claim_into_its_slot(
    mock_clock: trio.testing.MockClock,
) -> None:
    """One slot, claimed by the upgrade whose start now asks: admitted (its claim is not
    counted against it), and the slot is then the session's, not a claim's too."""
    running = Running()
    slots = SessionSlots(1, running)
    claim = slots.claim()
    assert claim is not None
    assert slots.admit(claim)
    running.count = 1  # the session marks itself running, as Session does at once
    assert (slots.claimed, slots.free) == (0, 0)
    assert slots.claim() is None


async def test_a_start_without_a_claim_finds_the_others_claims(
    mock_clock: trio.testing.MockClock,
) -> None:
    running = Running()
    slots = SessionSlots(1, running)
    assert slots.claim() is not None
    assert not slots.admit(None)  # a start whose claim ran out: the slot is claimed


async def test_a_claim_counts_for_its_window_only(mock_clock: trio.testing.MockClock) -> None:
    running = Running()
    slots = SessionSlots(1, running)
    late = slots.claim()
    assert late is not None
    mock_clock.jump(CLAIM_SECONDS * 0.99)
    assert slots.claim() is None  # still inside the window
    mock_clock.jump(CLAIM_SECONDS * 0.01)
    assert slots.claimed == 0
    fresh = slots.claim()  # the idle upgrade keeps no one out any more
    assert fresh is not None
    assert not slots.admit(late)  # its start finds the slot claimed by another
    assert slots.admit(fresh)


async def test_a_released_claim_frees_its_slot_at_once(
    mock_clock: trio.testing.MockClock,
) -> None:
    """The upgrade's connection ended before its start: its slot is free again."""
    running = Running()
    slots = SessionSlots(1, running)
    claim = slots.claim()
    assert claim is not None
    slots.release(claim)
    assert slots.free == 1
    assert slots.claim() is not None
