"""The soak's leak checks (``bench/_soak/resources.py``): the final snapshot against the
post-warm-up baseline flags one more file descriptor or thread (naming the threads),
RSS growth past the limit, and a session still active; an idle Trio worker thread,
which would count among the threads until Trio's idle timeout, is seen by its name.
"""

from __future__ import annotations

import subprocess
import sys

import attrs
import trio

from bench._soak.resources import (
    Snapshot,
    idle_trio_workers,
    resource_problems,
    thread_names,
)
from bench._soak.settings import RSS_GROWTH_LIMIT_MIB


def _snapshot(threads: int = 3, fds: int = 10, rss_mib: float = 80.0, active: int = 0) -> Snapshot:
    metrics = {"sessions_active": active, "streams_open": 0, "worker_threads": 0}
    return Snapshot(0.0, threads, fds, int(rss_mib * 1024), metrics)


def _flagged(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


def test_leaks_are_flagged_against_the_baseline() -> None:
    base = _snapshot()
    assert resource_problems(base, _snapshot(rss_mib=90.0)) == []
    assert _flagged(resource_problems(base, _snapshot(fds=11)), "file descriptors 10 -> 11")
    assert _flagged(resource_problems(base, _snapshot(threads=4)), "threads 3 -> 4")
    # A thread count that grew names the threads, at the baseline and at the end.
    grown = attrs.evolve(_snapshot(threads=4), thread_names=("Trio thread 3", "python", "python"))
    named = attrs.evolve(base, thread_names=("python",) * 3)
    assert _flagged(
        resource_problems(named, grown),
        "OS threads 3 -> 4 (at the baseline: python x3; at the end: Trio thread 3, python x2)",
    )
    grown = 80.0 + RSS_GROWTH_LIMIT_MIB + 1
    assert _flagged(resource_problems(base, _snapshot(rss_mib=grown)), "RSS grew")
    assert _flagged(resource_problems(base, _snapshot(active=1)), "sessions_active is 1")


IDLE_WORKER = """
import sys, trio
import trio._core._thread_cache as cache
trio.run(trio.to_thread.run_sync, lambda: None)
print("idle", flush=True)  # its worker thread idles, for Trio's 10 s
sys.stdin.readline()
cache.IDLE_TIMEOUT = 0.1  # shortened: after its next job, the worker exits at once
trio.run(trio.to_thread.run_sync, lambda: None)
print("done", flush=True)
sys.stdin.readline()
"""


async def _line(stream: trio.abc.ReceiveStream) -> bytes:
    """The child's next line (a pipe may hand it over in pieces)."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = await stream.receive_some(100)
        if not chunk:
            break
        data += chunk
    return data


async def test_idle_trio_workers_are_seen_by_name_until_they_exit() -> None:
    """The "8 vs 2 threads" flake: an idle Trio worker alive at a measurement. The soak
    sees one by its name, and polls (bounded) until it has exited, which Trio's idle
    timeout does: here shortened for its next wait."""
    process = await trio.lowlevel.open_process(
        [sys.executable, "-c", IDLE_WORKER], stdin=subprocess.PIPE, stdout=subprocess.PIPE
    )
    assert process.stdin is not None and process.stdout is not None
    try:
        with trio.fail_after(30):
            assert await _line(process.stdout) == b"idle\n"
        snapshot = Snapshot.take(process.pid, None)
        assert snapshot.idle_workers == ["Trio thread 0"]
        assert snapshot.thread_names is not None and snapshot.threads == len(snapshot.thread_names)
        assert "Trio thread 0" in snapshot.to_json()["thread_names"]
        await process.stdin.send_all(b"go\n")
        with trio.fail_after(30):
            assert await _line(process.stdout) == b"done\n"
            # Polled (ASYNC110): another process's threads, from /proc, have no event.
            while idle_trio_workers(thread_names(process.pid)):  # noqa: ASYNC110
                await trio.sleep(0.05)
        assert Snapshot.take(process.pid, None).threads == 1
    finally:
        process.kill()
        await process.wait()
    assert thread_names(process.pid) is None  # gone
