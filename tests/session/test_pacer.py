"""`Pacer`, without a server: when each chunk of a paced session may go, as numbers in
and numbers out, and its wait on a virtual clock. (tests/session/test_pacing.py checks the
same rule end to end, through a real server.)"""

from __future__ import annotations

import pytest
import trio
import trio.testing

from trio_vstream import protocol
from trio_vstream.session.pacing import Pacer

PACING = protocol.Pacing(lead_seconds=0.5, max_lag_seconds=2.0)


def test_the_first_chunk_starts_the_media_clock_and_goes_at_once() -> None:
    pacer = Pacer(PACING)
    assert pacer.due(0.0, now=100.0) is None
    assert pacer.origin == 100.0


def test_each_chunk_is_due_at_its_media_time_less_the_lead() -> None:
    pacer = Pacer(PACING)
    pacer.due(0.0, now=100.0)
    # Made faster than real time: chunk k (1 s of video each) waits for its media time.
    assert pacer.due(1.0, now=100.1) == 100.5
    assert pacer.due(2.0, now=100.2) == 101.5
    assert pacer.due(2.0, now=101.0) == 101.5  # asked again while it waits: the same


def test_a_chunk_made_late_goes_at_once_and_the_next_ones_catch_up() -> None:
    pacer = Pacer(PACING)
    pacer.due(0.0, now=100.0)
    due = pacer.due(1.0, now=102.9)  # 1.9 s late: within the 2 s allowed
    assert due is not None and due <= 102.9
    assert pacer.origin == 100.0  # the clock stays: later chunks may go early to catch up
    assert pacer.due(2.0, now=103.0) == 101.5


def test_a_chunk_too_far_behind_moves_the_clock_so_that_no_burst_follows() -> None:
    pacer = Pacer(PACING)
    pacer.due(0.0, now=100.0)
    assert pacer.due(1.0, now=103.5) is None  # 2.5 s late: past max_lag_seconds
    assert pacer.origin == 102.5  # as if media time 1.0 had been due now
    assert pacer.due(2.0, now=103.6) == 104.0  # paced again from there, not at once


def test_with_no_lead_or_lag_a_chunk_goes_exactly_at_its_media_time() -> None:
    pacer = Pacer(protocol.Pacing(lead_seconds=0.0, max_lag_seconds=0.0))
    pacer.due(0.0, now=10.0)
    assert pacer.due(0.25, now=10.25) == 10.25  # on time is not late
    assert pacer.due(0.5, now=10.75) is None  # any later is


async def test_a_wait_lasts_until_the_chunk_is_due_and_keeps_the_session_alive(
    autojump_clock: trio.testing.MockClock,
) -> None:
    pacer = Pacer(protocol.Pacing(lead_seconds=0.0, max_lag_seconds=2.0))
    alive: list[float] = []

    def keep_alive() -> None:
        alive.append(trio.current_time())

    start = trio.current_time()
    await pacer.wait(0.0, keep_alive, wake_every=3.0)
    assert alive == [] and trio.current_time() == start  # the first chunk: no wait at all
    await pacer.wait(10.0, keep_alive, wake_every=3.0)
    assert trio.current_time() == pytest.approx(start + 10.0)
    # As it began, every 3 s while it waited, and once due.
    assert [t - start for t in alive] == pytest.approx([0.0, 3.0, 6.0, 9.0, 10.0])


async def test_a_cancelled_wait_ends_at_once(autojump_clock: trio.testing.MockClock) -> None:
    pacer = Pacer(PACING)
    await pacer.wait(0.0, lambda: None, wake_every=1.0)
    start = trio.current_time()
    with trio.move_on_after(1.5):  # a stop, 1.5 s into a 99.5 s wait
        await pacer.wait(100.0, lambda: None, wake_every=1.0)
    assert trio.current_time() == pytest.approx(start + 1.5)
