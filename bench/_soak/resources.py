"""The server process seen from /proc and /stats: threads, file descriptors, RSS, its
sockets, and the leak checks against the post-warm-up baseline.

Leaks show only in the process as a whole (a thread pool that grows, a socket never
closed), not in any one session, so they are read from outside, the way an operator
would; the checks are pure functions of two snapshots.
"""

from __future__ import annotations

import os
import socket
import struct
from collections import Counter
from collections.abc import Sequence
from typing import Any, Final

import attrs
import trio

from bench._output import now
from bench._server import os_threads
from bench._soak.settings import FD_GROWTH_LIMIT, RSS_GROWTH_LIMIT_MIB, THREAD_GROWTH_LIMIT


def _rss_kib(pid: int) -> int | None:
    """VmRSS from /proc/PID/status (the thread count there is ``bench._server``'s)."""
    try:
        with open(f"/proc/{pid}/status") as status:
            for line in status:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    return None


TRIO_IDLE_WORKER: Final = "Trio thread "
"""How a worker thread of Trio's thread cache is named while it idles: its OS name
(``/proc/PID/task/TID/comm``) is set to a job's name while it runs one (``engine call
...`` for the server's engine calls) and back to ``Trio thread N`` after it."""
TRIO_IDLE_TIMEOUT_S: Final = 10.0
"""How long an idle Trio worker waits for another job before it exits
(``trio._core._thread_cache.IDLE_TIMEOUT``): until then it counts among the process's
threads, so a thread count read sooner than that after the last job says nothing."""


def thread_names(pid: int) -> list[str] | None:
    """The OS names of the process's threads, sorted (None if it is gone)."""
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return None
    names: list[str] = []
    for tid in tasks:
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as comm:
                names.append(comm.read().strip())
        except OSError:
            continue  # it exited meanwhile
    return sorted(names)


def idle_trio_workers(names: Sequence[str] | None) -> list[str]:
    """The idle Trio worker threads among ``names`` (`TRIO_IDLE_WORKER`)."""
    return [name for name in names or () if name.startswith(TRIO_IDLE_WORKER)]


def describe_threads(names: Sequence[str] | None) -> str:
    """Thread names for a report: each name once, with a count where there are more."""
    if names is None:
        return "unknown"
    counts = Counter(names)
    return ", ".join(f"{name} x{count}" if count > 1 else name for name, count in counts.items())


def socket_inodes(pid: int) -> set[int] | None:
    """Inodes of the sockets the process holds open (None if it is gone)."""
    inodes: set[int] = set()
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return None
    for name in names:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(int(target[8:-1]))
    return inodes


def server_side_inode(server_port: int, client_port: int) -> int | None:
    """The inode of the server's socket for the connection from ``client_port``, from
    /proc/net/tcp (0 there means no process holds it, or it is not accepted yet)."""
    try:
        with open("/proc/net/tcp") as table:
            next(table)
            for line in table:
                fields = line.split()
                local, remote = fields[1].split(":"), fields[2].split(":")
                if int(local[1], 16) != server_port or int(remote[1], 16) != client_port:
                    continue
                if socket.inet_ntoa(struct.pack("=I", int(local[0], 16))) != "127.0.0.1":
                    continue
                if int(fields[9]):  # not an earlier connection's TIME_WAIT on the same ports
                    return int(fields[9])
    except (OSError, ValueError, IndexError, StopIteration):
        pass
    return None


@attrs.frozen
class Snapshot:
    """The server process's resources at one moment."""

    at: float
    threads: int | None
    fds: int | None
    rss_kib: int | None
    metrics: dict[str, Any] | None
    thread_names: tuple[str, ...] | None = None
    """The threads' OS names (`thread_names`), read with ``threads``."""

    @classmethod
    def take(cls, pid: int, metrics: dict[str, Any] | None) -> Snapshot:
        try:
            fds: int | None = len(os.listdir(f"/proc/{pid}/fd"))
        except OSError:
            fds = None
        keys = ("sessions_active", "streams_open", "worker_threads", "threads_alive", "rss_bytes")
        subset = {k: metrics.get(k) for k in keys} if metrics else None
        names = thread_names(pid)
        threads = os_threads(pid)
        return cls(
            now(), threads, fds, _rss_kib(pid), subset, tuple(names) if names is not None else None
        )

    @property
    def idle_workers(self) -> list[str]:
        """Idle Trio worker threads alive (`idle_trio_workers`)."""
        return idle_trio_workers(self.thread_names)

    def to_json(self) -> dict[str, Any]:
        return {
            "threads": self.threads,
            "thread_names": describe_threads(self.thread_names),
            "fds": self.fds,
            "rss_mib": round(self.rss_kib / 1024, 1) if self.rss_kib is not None else None,
            "metrics": self.metrics,
        }


def idle_problems(metrics: dict[str, Any] | None) -> list[str]:
    if metrics is None:
        return ["GET /stats failed"]
    return [
        f"/stats {key} is {metrics.get(key)}, expected 0"
        for key in ("sessions_active", "streams_open", "worker_threads")
        if metrics.get(key) != 0
    ]


def resource_problems(baseline: Snapshot, final: Snapshot) -> list[str]:
    """Leaks: the final snapshot against the baseline, with the thresholds above."""
    problems = idle_problems(final.metrics)
    if None in (baseline.fds, final.fds, baseline.threads, final.threads):
        problems.append("could not read the server's /proc entries")
        return problems
    assert baseline.fds is not None and final.fds is not None
    assert baseline.threads is not None and final.threads is not None
    if final.fds - baseline.fds > FD_GROWTH_LIMIT:
        problems.append(f"open file descriptors {baseline.fds} -> {final.fds}")
    if final.threads - baseline.threads > THREAD_GROWTH_LIMIT:
        problems.append(
            f"OS threads {baseline.threads} -> {final.threads} (at the baseline: "
            f"{describe_threads(baseline.thread_names)}; at the end: "
            f"{describe_threads(final.thread_names)})"
        )
    if baseline.rss_kib is not None and final.rss_kib is not None:
        growth = (final.rss_kib - baseline.rss_kib) / 1024
        if growth > RSS_GROWTH_LIMIT_MIB:
            problems.append(
                f"RSS grew {growth:.1f} MiB ({baseline.rss_kib / 1024:.1f} -> "
                f"{final.rss_kib / 1024:.1f} MiB), limit {RSS_GROWTH_LIMIT_MIB:.0f} MiB"
            )
    return problems


class SocketWatch:
    """Tells when the server has closed its socket of a connection: one scan of
    /proc/PID/fd every 50 ms serves every waiter."""

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self._waiters: dict[int, trio.Event] = {}
        self._wake = trio.Event()

    async def run(self) -> None:
        while True:
            if not self._waiters:
                await self._wake.wait()
                self._wake = trio.Event()
            held = socket_inodes(self.pid)
            for inode, event in list(self._waiters.items()):
                if held is None or inode not in held:
                    event.set()
                    del self._waiters[inode]
            await trio.sleep(0.05)

    async def wait_closed(self, inode: int) -> None:
        event = self._waiters.setdefault(inode, trio.Event())
        self._wake.set()
        await event.wait()
