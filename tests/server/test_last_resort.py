"""SIGTERM always ends the process, and a wedged engine never wedges the server (issue 30):
``python -m trio_vstream`` as a supervisor runs it, with engines that hang for good
(`tests.hung_engines`), and `LastResort` itself.

The bounds: after a first SIGTERM the process exits within the drain's bound (the grace
and two close timeouts, `CLOSE_TIMEOUT`) plus `last_resort.MARGIN_SECONDS`; after a second, within
`last_resort.SECOND_SIGNAL_SECONDS`. Each test allows a few seconds more for a loaded
machine to start and end a Python process; what it checks is that the process ends, and
how (its status, its log), not how fast.
"""

from __future__ import annotations

import contextlib
import functools
import json
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO, Any

import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.server.test_cli import URL_LINE, http_status, read_to_terminal
from trio_vstream.server import last_resort
from trio_vstream.server.app import WEDGED_EXIT_STATUS
from trio_vstream.server.last_resort import LastResort

CLOSE_TIMEOUT = 1.0
"""The servers' ``--close-timeout``: the bounds scale with it, and the tests that wait
out a close take a fifth of the default's time."""
GRACE = 0.5
SLACK = 10.0
"""What a loaded 2-core machine may add to a bound (a process start and exit)."""
FIRST_SIGNAL_BOUND = GRACE + 2 * CLOSE_TIMEOUT + last_resort.MARGIN_SECONDS + SLACK
SECOND_SIGNAL_BOUND = last_resort.SECOND_SIGNAL_SECONDS + SLACK
START = {"type": "session.start", "prompt": "a red circle", "size": "32x32", "num_frames": 16}


@contextlib.contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen[str], str, IO[str]]]:
    """The server as a process; its log goes to a file (a pipe nobody reads could fill
    and block the very exit under test)."""
    with tempfile.TemporaryFile("w+") as log:
        process = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "trio_vstream",
                "--port",
                "0",
                "--shutdown-grace",
                str(GRACE),
                "--close-timeout",
                str(CLOSE_TIMEOUT),
                *args,
            ],
            stdout=subprocess.PIPE,
            stderr=log,
            text=True,
        )
        try:
            assert process.stdout is not None
            line = process.stdout.readline()
            match = URL_LINE.search(line)
            assert match, f"no URL in {line!r}"
            yield process, match.group(0), log
        finally:
            if process.poll() is None:
                process.kill()
            process.wait(timeout=10)


def log_text(log: IO[str]) -> str:
    log.seek(0)
    return log.read()


async def signal_twice(process: subprocess.Popen[str], log: IO[str]) -> None:
    """SIGTERM, then once the server has begun its drain (its log says so: it is another
    process, with no event to wait on), SIGTERM again. Trio delivers a signal that comes
    again before the first was handled only once."""
    process.send_signal(signal.SIGTERM)
    with trio.fail_after(10):
        # Polled (ASYNC110): another process's log.
        while "shutting down gracefully" not in log_text(log):  # noqa: ASYNC110
            await trio.sleep(0.02)
    process.send_signal(signal.SIGTERM)


async def exit_within(process: subprocess.Popen[str], seconds: float) -> tuple[int, float]:
    """The process's exit status and how long it took; fails if it is still alive."""
    began = time.monotonic()
    try:
        status = await trio.to_thread.run_sync(functools.partial(process.wait, timeout=seconds))
    except subprocess.TimeoutExpired:
        pytest.fail(f"the process was still running {seconds:.1f} s later")
    return status, time.monotonic() - began


async def session(url: str, start: dict[str, Any]) -> list[dict[str, Any]]:
    received: list[dict[str, Any]] = []
    async with open_websocket_url(url, max_message_size=1 << 26) as ws:
        await ws.send_message(json.dumps(start))
        await read_to_terminal(ws, received)
    return received


def blocked(start: dict[str, Any] = START) -> dict[str, Any]:
    return {**start, "extra_params": {"block_at_chunk": 0}}


# ------------------------------------------------------------------ LastResort


def test_the_last_resort_ends_the_process_at_its_deadline_with_its_status() -> None:
    ended: list[int] = []
    done = threading.Event()

    def exit(status: int) -> None:
        ended.append(status)
        done.set()

    resort = LastResort(stuck=lambda: ["SomeStream.next_chunk"], exit=exit)
    resort.arm(60.0, status=7)
    resort.arm(0.05, status=3)  # the earlier deadline wins
    resort.arm(30.0, status=9)  # a later one changes nothing
    assert done.wait(30)
    assert ended == [3]
    assert resort.fired


def test_a_disarmed_last_resort_ends_nothing() -> None:
    ended: list[int] = []
    resort = LastResort(exit=ended.append)
    # Held across both, the watcher's lock keeps it from looking at the deadline in
    # between, however long the two calls take under load (a re-entrant lock).
    with resort._changed:
        resort.arm(0.2)
        resort.disarm()
    assert resort.seconds_left() == float("inf")
    # The watcher thread waits on a condition with no deadline now: it never wakes to exit.
    assert resort._thread is not None
    resort._thread.join(timeout=1.0)
    assert resort._thread.is_alive() and ended == [] and not resort.fired


def test_a_wait_on_the_way_out_ends_a_second_before_the_deadline_never_below_zero() -> None:
    """`LastResort.allow` bounds the waits at exit (the recordings, the steps a stop left
    mid-way): a negative bound would make ``trio.move_on_after`` raise instead."""
    resort = LastResort(exit=lambda status: None)
    assert resort.allow(5.0) == 5.0  # unarmed: nothing to leave room for
    with resort._changed:  # the watcher cannot fire while the bounds are read
        resort.arm(60.0)
        assert resort.allow(5.0) == 5.0
        assert 58.0 <= resort.allow(100.0) <= 59.0
        resort.arm(0.5)  # less than the second kept back
        assert resort.allow(5.0) == 0.0
        resort.disarm()


# ------------------------------------------------------- the scenario


@pytest.mark.slow
async def test_a_server_whose_engine_keeps_hanging_answers_everyone_and_ends_on_sigterm() -> None:
    """The issue's scenario: one session slot, eight sessions blocked at their first chunk,
    then a normal one. Before, sessions 7, 8 and the normal one heard nothing, and SIGTERM
    (twice) did not end the process."""
    with serving(
        "--engine", "synthetic", "--max-sessions", "1", "--stall-timeout", "2",
        "--no-exit-when-wedged",
    ) as (process, url, log):  # fmt: skip
        for _ in range(2):
            with trio.fail_after(15):
                assert (await session(url, blocked()))[-1]["code"] == "stall_timeout"
        # Two stuck calls wedge the engine (--max-stuck-calls 2) once the second session
        # has ended: what a balancer's health check sees (another process: polled).
        with trio.fail_after(10):
            while await http_status(url, "/health") != 503:  # noqa: ASYNC110
                await trio.sleep(0.02)
        for start in [blocked()] * 6 + [START]:  # sessions 3 to 8, then a normal one
            with trio.fail_after(5), pytest.raises(ConnectionRejected) as rejected:
                await session(url, start)
            assert rejected.value.status_code == 503
            assert (rejected.value.body or b"").startswith(b"engine_unavailable: ")
        process.send_signal(signal.SIGTERM)
        status, _ = await exit_within(process, FIRST_SIGNAL_BOUND)
        assert status == 0
        assert "engine wedged: 2 engine call(s) stuck" in log_text(log)


@pytest.mark.slow
async def test_exit_when_wedged_ends_the_process_with_status_69_by_itself() -> None:
    with serving(
        "--engine", "synthetic", "--stall-timeout", "1", "--max-stuck-calls", "1",
        "--exit-when-wedged",
    ) as (process, url, log):  # fmt: skip
        with trio.fail_after(15):
            received = await session(url, blocked())
        assert received[-1]["code"] == "stall_timeout"
        status, _ = await exit_within(process, FIRST_SIGNAL_BOUND)
        assert status == WEDGED_EXIT_STATUS
        assert "(--exit-when-wedged)" in log_text(log)


# ------------------------------------------- what would keep the process alive


@pytest.mark.slow
async def test_sigterm_ends_the_process_though_the_engines_close_hangs() -> None:
    """The server stops within its drain; then the engine's close blocks for good, and the
    last resort ends the process at the hard deadline, saying what was stuck."""
    with serving("--engine", "tests.hung_engines:synthetic_whose_close_hangs") as (
        process,
        _,
        log,
    ):
        process.send_signal(signal.SIGTERM)
        status, _ = await exit_within(process, FIRST_SIGNAL_BOUND)
        assert status == last_resort.FAILURE_STATUS
        text = log_text(log)
        assert "the process did not exit in time" in text
        assert "_CloseHangs.close" in text or "in close" in text  # the stack of the hang


@pytest.mark.slow
async def test_sigterm_ends_the_process_though_the_engine_left_a_thread_running() -> None:
    with serving("--engine", "tests.hung_engines:synthetic_with_a_stuck_thread") as (
        process,
        _,
        log,
    ):
        process.send_signal(signal.SIGTERM)
        status, _ = await exit_within(process, FIRST_SIGNAL_BOUND)
        assert status == last_resort.FAILURE_STATUS
        assert "engine's own worker" in log_text(log)


@pytest.mark.slow
async def test_a_second_sigterm_ends_the_process_within_seconds() -> None:
    with serving("--engine", "tests.hung_engines:synthetic_whose_close_hangs") as (
        process,
        url,
        log,
    ):
        with trio.fail_after(15):
            async with open_websocket_url(url) as ws:  # a session, blocked for good
                await ws.send_message(json.dumps(blocked()))
                json.loads(await ws.get_message())  # video.start
                await signal_twice(process, log)
                status, _ = await exit_within(process, SECOND_SIGNAL_BOUND)
        assert status == last_resort.FAILURE_STATUS  # the engine's close hung: the last resort
        assert "stopping now" in log_text(log)


# ----------------------------------------------------- a hung batched forward


@pytest.mark.slow
@pytest.mark.parametrize("max_batch", [2, 4])
@pytest.mark.parametrize("signals", [1, 2])
async def test_sigterm_ends_the_process_with_a_hung_batched_forward(
    max_batch: int, signals: int
) -> None:
    """Two sessions of the built-in model meet in a batch, whose forward hangs for good:
    both get stall_timeout on time, then SIGTERM ends the process cleanly (status 0, no
    last resort needed): the batcher's call is abandonable."""
    with serving(
        "--engine", "tests.hung_engines:shapes_whose_batches_hang",
        "--engine-arg", f"max_batch={max_batch}", "--stall-timeout", "2",
        "--no-exit-when-wedged",
    ) as (process, url, log):  # fmt: skip
        start = {**START, "num_frames": 480}
        results: list[list[dict[str, Any]]] = []

        async def one() -> None:
            results.append(await session(url, start))

        with trio.fail_after(30):
            async with trio.open_nursery() as nursery:
                nursery.start_soon(one)
                nursery.start_soon(one)
        assert [r[-1]["code"] for r in results] == ["stall_timeout"] * 2
        if signals == 1:
            process.send_signal(signal.SIGTERM)
        else:
            await signal_twice(process, log)
        bound = FIRST_SIGNAL_BOUND if signals == 1 else SECOND_SIGNAL_BOUND
        status, _ = await exit_within(process, bound)
        text = log_text(log)
        assert "the process did not exit in time" not in text, text
        assert status == 0, text[-6000:]  # -6: an abort at exit (see the log's end)


@pytest.mark.slow
async def test_a_second_signal_waits_for_a_step_in_flight_before_the_process_exits(
    tmp_path: Path,
) -> None:
    """A second signal does not wait for the sessions' steps, but the process does, a
    little, before it closes the engine and exits: a step cut by the interpreter's exit
    killed the process (libtorch: "terminate called without an active exception",
    status -6). Here the batched step is still waiting when the server has stopped; it
    is let go then, and must have returned before the process ended, which ends 0."""
    with serving(
        "--engine", "tests.hung_engines:shapes_whose_batches_wait",
        "--engine-arg", "max_batch=2", "--engine-arg", f"markers={tmp_path}",
        "--no-exit-when-wedged",
    ) as (process, url, log):  # fmt: skip
        start = {**START, "num_frames": 480}
        async with trio.open_nursery() as nursery:
            for _ in range(2):
                nursery.start_soon(session_until_closed, url, start)
            with trio.fail_after(30):
                # Polled (ASYNC110): another process's file.
                while not (tmp_path / "entered").exists():  # noqa: ASYNC110
                    await trio.sleep(0.02)
            await signal_twice(process, log)
            with trio.fail_after(10):
                while "stopping now" not in log_text(log):  # noqa: ASYNC110
                    await trio.sleep(0.02)
            (tmp_path / "release").touch()
            status, _ = await exit_within(process, SECOND_SIGNAL_BOUND)
            nursery.cancel_scope.cancel()
        text = log_text(log)
        assert (tmp_path / "returned").exists(), text
        assert "terminate called" not in text
        assert "the process did not exit in time" not in text
        assert status == 0


async def session_until_closed(url: str, start: dict[str, Any]) -> None:
    """A session whose server may go away under it (the test stops it)."""
    with contextlib.suppress(Exception):
        await session(url, start)
