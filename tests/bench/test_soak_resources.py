"""The soak's leak checks (``bench/_soak/resources.py``): the final snapshot against the
post-warm-up baseline flags one more file descriptor or thread, RSS growth past the
limit, and a session still active.
"""

from __future__ import annotations

from bench._soak.resources import Snapshot, resource_problems
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
    grown = 80.0 + RSS_GROWTH_LIMIT_MIB + 1
    assert _flagged(resource_problems(base, _snapshot(rss_mib=grown)), "RSS grew")
    assert _flagged(resource_problems(base, _snapshot(active=1)), "sessions_active is 1")
