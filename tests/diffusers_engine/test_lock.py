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

from tests.diffusers_engine.support import (
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


def hold_in_thread(
    lock: SegmentLock,
) -> tuple[threading.Thread, threading.Event, Callable[[], None]]:
    """A thread holding ``lock`` (as a segment would) until the returned ``let_go`` is
    called; the event is set once it holds it."""
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
