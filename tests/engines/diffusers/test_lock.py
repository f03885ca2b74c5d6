"""The segment lock (``trio_vstream.engines.diffusers._lock``): whole segments in turn,
a waiting session stoppable at once, cleanup deferred rather than waited for.

The first tests drive `SegmentLock` alone with threads and events (no pipeline, so they
run without the ``diffusers`` extra); the last one checks the same on the engine.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest

from tests.engines.diffusers.support import (
    GATE_TIMEOUT,
    Probe,
    Stopped,
    StopWhenTold,
    no_stop,
    request,
    run_all,
)
from trio_vstream.engines.diffusers import SegmentLock

STOP_WITHIN = 0.3
"""How soon a waiting session must see a stop: the lock polls every 0.05 s; the rest is
slack for a loaded machine."""


def hold_in_thread(lock: SegmentLock) -> Callable[[], None]:
    """A thread holding ``lock`` (as a segment would) until the returned ``let_go`` is
    called; it holds the lock when this returns."""
    holding = threading.Event()
    release = threading.Event()

    def segment() -> None:
        with lock.held(no_stop):
            holding.set()
            release.wait(GATE_TIMEOUT)

    thread = threading.Thread(target=segment)
    thread.start()
    assert holding.wait(5)

    def let_go() -> None:
        release.set()
        thread.join(5)
        assert not thread.is_alive()

    return let_go


def test_a_second_segment_waits_queued_until_the_first_lets_go() -> None:
    lock = SegmentLock()
    let_go = hold_in_thread(lock)
    checkpoint = StopWhenTold()
    entered = threading.Event()

    def second() -> None:
        with lock.held(checkpoint):
            entered.set()

    waiter = threading.Thread(target=second)
    waiter.start()
    assert checkpoint.queued.wait(5)  # marked as queued, so not taken for stalled
    assert not entered.is_set()
    let_go()
    assert entered.wait(5)
    waiter.join(5)
    assert not lock.locked


def test_a_waiting_segment_stops_at_once_and_never_takes_the_lock() -> None:
    lock = SegmentLock()
    let_go = hold_in_thread(lock)
    checkpoint = StopWhenTold()
    outcome: dict[str, Any] = {}

    def second() -> None:
        try:
            with lock.held(checkpoint):
                outcome["entered"] = True
        except Stopped:
            outcome["stopped_at"] = time.monotonic()

    waiter = threading.Thread(target=second)
    waiter.start()
    assert checkpoint.queued.wait(5)
    stop_sent = time.monotonic()
    checkpoint.stop.set()
    waiter.join(5)
    assert outcome.keys() == {"stopped_at"}
    assert outcome["stopped_at"] - stop_sent < STOP_WITHIN
    assert lock.locked  # still the first segment's
    let_go()
    assert not lock.locked


class ParkWhenQueued(StopWhenTold):
    """A waiting session the test can hold still: once queued, its first
    ``check_cancelled`` sets ``parked`` and blocks until ``unpark`` is set (then raises
    `Stopped` if ``stop`` is set by then). So the test decides which waiter wakes first:
    everyone else runs while this one is parked."""

    def __init__(self) -> None:
        super().__init__()
        self.parked = threading.Event()
        self.unpark = threading.Event()

    def check_cancelled(self) -> None:
        if self.queued.is_set() and not self.parked.is_set():
            self.parked.set()
            self.unpark.wait(GATE_TIMEOUT)
        super().check_cancelled()


def segment_in_thread(
    lock: SegmentLock,
    name: str,
    checkpoint: StopWhenTold,
    served: list[str],
    *,
    then: threading.Event | None = None,
) -> tuple[threading.Thread, dict[str, Any]]:
    """A session's segment in a thread: ``name`` goes into ``served`` once it holds the
    lock (and ``then`` is set); the returned dict says ``stopped`` if its checkpoint
    stopped it instead."""
    outcome: dict[str, Any] = {}

    def segment() -> None:
        try:
            with lock.held(checkpoint):
                served.append(name)
                if then is not None:
                    then.set()
        except Stopped:
            outcome["stopped"] = True

    thread = threading.Thread(target=segment, name=name)
    thread.start()
    return thread, outcome


def test_waiters_are_served_in_order_of_arrival_whoever_wakes_first() -> None:
    """A waits first but is held still (parked) when the holder lets go, while B and C,
    queued after it, are free to wake; D arrives after the lock was let go. A poll-and-
    grab lock serves whoever wakes first (B or C) or whoever arrives while it is free
    (D), so with three or more sessions one of them can lose every time. FIFO: the lock
    goes to A as the holder lets go, and B, C, D follow in the order they came."""
    lock = SegmentLock()
    let_go = hold_in_thread(lock)
    served: list[str] = []
    a = ParkWhenQueued()
    threads = [segment_in_thread(lock, "A", a, served)[0]]
    assert a.parked.wait(5)  # A is queued and held still
    for name in ("B", "C"):
        checkpoint = StopWhenTold()
        threads.append(segment_in_thread(lock, name, checkpoint, served)[0])
        assert checkpoint.queued.wait(5)
    let_go()
    d = StopWhenTold()
    # D queues (FIFO: the lock is already A's) or takes it at once (a lock that lets a
    # newcomer in ahead of the queue): either sets d.queued.
    threads.append(segment_in_thread(lock, "D", d, served, then=d.queued)[0])
    assert d.queued.wait(5)
    a.unpark.set()
    for thread in threads:
        thread.join(5)
        assert not thread.is_alive()
    assert served == ["A", "B", "C", "D"]
    assert not lock.locked


def test_a_stopped_waiter_leaves_the_queue_and_the_others_are_served_in_order() -> None:
    lock = SegmentLock()
    let_go = hold_in_thread(lock)
    served: list[str] = []
    checkpoints = {name: StopWhenTold() for name in "ABC"}
    threads = {}
    for name, checkpoint in checkpoints.items():
        threads[name] = segment_in_thread(lock, name, checkpoint, served)
        assert checkpoint.queued.wait(5)
    checkpoints["B"].stop.set()  # stopped while queued: it leaves at once
    threads["B"][0].join(5)
    assert threads["B"][1] == {"stopped": True}
    assert served == [] and lock.locked  # still the holder's
    let_go()
    for thread, _ in threads.values():
        thread.join(5)
        assert not thread.is_alive()
    assert served == ["A", "C"]
    assert not lock.locked


def test_a_waiter_stopped_as_the_lock_is_handed_to_it_passes_it_on() -> None:
    """The hand-over is never lost: A is handed the lock while it is parked, then finds
    itself stopped; it leaves, and the lock goes on to B, queued behind it."""
    lock = SegmentLock()
    let_go = hold_in_thread(lock)
    served: list[str] = []
    a = ParkWhenQueued()
    thread_a, outcome_a = segment_in_thread(lock, "A", a, served)
    assert a.parked.wait(5)
    b = StopWhenTold()
    thread_b, outcome_b = segment_in_thread(lock, "B", b, served)
    assert b.queued.wait(5)
    let_go()  # the lock goes to A, parked
    a.stop.set()
    a.unpark.set()
    for thread in (thread_a, thread_b):
        thread.join(5)
        assert not thread.is_alive()
    assert outcome_a == {"stopped": True} and outcome_b == {}
    assert served == ["B"]
    assert not lock.locked
    with lock.held(no_stop):  # and it is free for the next one
        assert lock.locked


def test_deferred_work_runs_at_once_when_free_and_after_the_segment_when_held() -> None:
    lock = SegmentLock()
    order: list[str] = []
    lock.run_soon(lambda: order.append("free"))
    assert order == ["free"] and not lock.locked

    let_go = hold_in_thread(lock)
    lock.run_soon(lambda: order.append("deferred"))  # returns without waiting
    assert order == ["free"]
    let_go()  # the holder runs it as it lets go
    assert order == ["free", "deferred"]
    assert not lock.locked


def test_failing_deferred_work_is_logged_and_the_lock_let_go(
    caplog: pytest.LogCaptureFixture,
) -> None:
    lock = SegmentLock()

    def fails() -> None:
        raise RuntimeError("boom")

    with caplog.at_level(logging.ERROR, logger="trio_vstream.engines.diffusers"):
        lock.run_soon(fails)
    assert "deferred cleanup failed" in caplog.text
    assert not lock.locked
    with lock.held(no_stop):
        assert lock.locked


def test_a_session_waiting_for_the_pipeline_can_be_stopped(
    models: SimpleNamespace, make_engine: Any
) -> None:
    engine = make_engine(models.t2v)
    gate = threading.Event()
    probe = Probe(engine.model.pipe, gate=gate)  # the busy segment's first step waits
    busy = engine.open_stream(request(num_frames=5, num_inference_steps=20))
    holder = threading.Thread(target=run_all, args=(busy,))
    holder.start()
    try:
        assert probe.wait_for_forwards(1, timeout=5)  # the busy segment holds the pipeline
        waiting = engine.open_stream(request(prompt="another session"))
        checkpoint = StopWhenTold()
        outcome: dict[str, Any] = {}

        def wait_for_the_pipeline() -> None:
            try:
                waiting.next_chunk(checkpoint)
            except Stopped:
                outcome["stopped_at"] = time.monotonic()
            finally:
                waiting.close()

        waiter = threading.Thread(target=wait_for_the_pipeline)
        waiter.start()
        assert checkpoint.queued.wait(5)
        stop_sent = time.monotonic()
        checkpoint.stop.set()
        waiter.join(5)
        assert holder.is_alive()  # the other segment still holds the pipeline...
        assert outcome["stopped_at"] - stop_sent < STOP_WITHIN  # ...yet this one stopped
        assert {thread for _, thread in probe.forwards} == {holder.ident}
    finally:
        gate.set()
        holder.join(timeout=30)
        probe.remove()
    assert len(probe.forwards) == 20 and len(probe.decodes) == 1
