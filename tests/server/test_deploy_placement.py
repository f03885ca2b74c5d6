"""Placement respects capacity behind a stock load balancer: real nginx, configured by the
shipped deploy/nginx.conf, in front of three real servers with two session slots each.

A server with no free session slot answers a new session's upgrade with HTTP 503, and
nginx tries the next server (``proxy_next_upstream ... http_503``): a session is refused
only when every server is full, and then the client reads why (``server_busy``) in the
503's body that nginx passes on. Viewers of watch links hold connections on their
session's server but no session slot, so they neither keep sessions out of a server with
room nor let one into a server without.

Viewers are opened on their session's own server, found by trying each backend's port
(the others answer ``watch_not_found``), not through nginx: which backend a watch link
reaches through the balancer is another matter. The cluster, the sessions and the log
reading are `tests.server.test_deploy_nginx`'s; its docstring says how the tests wait.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path
from typing import Final

import attrs
import pytest
import trio

from tests.server.test_deploy_nginx import (
    BACKENDS,
    CONDITION,
    SHORT,
    Backend,
    Cluster,
    Session,
    all_set,
    backend_stats,
    needs_nginx,
    open_cluster,
    open_one_by_one,
    wait_for_active,
)
from trio_vstream.client import StreamOutcome, StreamResult, watch_video

SLOTS: Final = 2
"""Each server's --max-sessions: six slots in the cluster."""
LONGER: Final = 240
"""Frames of a session that outlives everything the test does meanwhile (6 s): the
others opened one by one, the viewers found on their servers."""
MEDIUM: Final = 96
"""Frames of a session that outlives the moment every slot is full (2.4 s), then ends
well before the long ones."""


@attrs.define
class Viewer:
    """A viewer of one session's watch link, on the session's own server."""

    session: Session
    joined: trio.Event = attrs.field(factory=trio.Event)
    """Set at ``watch.start``, or when no server served the link (so no one waits)."""
    backend: Backend | None = None
    result: StreamResult | None = None

    async def run(self, cluster: Cluster) -> None:
        """Try each server until one serves the link: the others end at once with
        ``watch_not_found``; the owner's stream runs to the session's end."""
        start = self.session.video_start
        assert start is not None and start.watch_path is not None, self.session.describe()
        try:
            for backend in cluster.backends:

                def on_message(_: object, result: StreamResult, backend: Backend = backend) -> None:
                    if result.watch_start is not None and not self.joined.is_set():
                        self.backend = backend
                        self.joined.set()

                url = f"ws://127.0.0.1:{backend.port}{start.watch_path}"
                result = await watch_video(url, on_message=on_message)
                if result.watch_start is not None:
                    self.result = result
                    return
                assert result.error is not None, result.summary()
                assert result.error.code == "watch_not_found", result.summary()
        finally:
            self.joined.set()

    def assert_watched(self) -> None:
        """Watched from where it joined to the session's own end."""
        result = self.result
        assert result is not None, f"no server served {self.session.name}'s watch link"
        assert result.outcome is StreamOutcome.COMPLETED, result.summary()
        assert 0 < result.frames <= self.session.frames, result.summary()


async def watch(
    nursery: trio.Nursery, cluster: Cluster, session: Session, count: int
) -> list[Viewer]:
    """``count`` viewers of ``session``, each once it has joined on the session's server."""
    viewers = [Viewer(session) for _ in range(count)]
    for viewer in viewers:
        nursery.start_soon(viewer.run, cluster)
        with trio.fail_after(CONDITION):
            await viewer.joined.wait()
        assert viewer.backend is not None, f"no server served {session.name}'s watch link"
    return viewers


async def owner(cluster: Cluster, session: Session) -> Backend:
    """The server running ``session``: the one that serves its watch link (to a viewer
    that joins and leaves at once)."""
    viewer = Viewer(session)
    with trio.fail_after(CONDITION):
        async with trio.open_nursery() as nursery:
            nursery.start_soon(viewer.run, cluster)
            await viewer.joined.wait()
            nursery.cancel_scope.cancel()
    assert viewer.backend is not None, f"no server served {session.name}'s watch link"
    return viewer.backend


async def refused_session(cluster: Cluster, name: str) -> Session:
    """A session whose upgrade must find every server full: run to its end (at once)."""
    session = Session(name, SHORT)
    with trio.fail_after(CONDITION):
        await session.run(cluster.url(name))
    return session


def assert_refused_busy(session: Session) -> None:
    """Refused before any upgrade, with the server's own server_busy (nginx passed the
    last server's 503 on, with its JSON body), not nginx's own error page."""
    result = session.result
    assert result is not None, session.describe()
    assert result.outcome is StreamOutcome.ERROR and result.rejected, session.describe()
    assert result.error is not None and result.error.code == "server_busy", session.describe()
    assert result.video_start is None and result.frames == 0, session.describe()


async def sessions_total(cluster: Cluster) -> int:
    return sum([(await backend_stats(b))["sessions_total"] for b in cluster.backends])


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(120)
async def test_only_the_upgrade_that_finds_every_server_full_is_refused(tmp_path: Path) -> None:
    """Uneven sessions and their viewers. Six sessions fill the six slots (a long and a
    medium one on each server, viewers on the long ones); the seventh upgrade is tried on
    every server, each answers 503, and the client reads server_busy. When the medium
    ones end, the next wave finds the freed slots at once: refusals leave no server out
    of rotation. Every session but the one is served, to its end."""
    async with open_cluster(tmp_path, server_args=("--max-sessions", str(SLOTS))) as cluster:
        before = await sessions_total(cluster)
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                longs = await open_one_by_one(
                    nursery, cluster, [f"long-{n}" for n in range(BACKENDS)], LONGER
                )
                mediums = await open_one_by_one(
                    nursery, cluster, [f"medium-{n}" for n in range(BACKENDS)], MEDIUM
                )
                await wait_for_active(cluster, [SLOTS] * BACKENDS)
                full = await refused_session(cluster, "full")
                viewers: list[Viewer] = []
                for count, session in enumerate(longs, start=1):
                    viewers += await watch(nursery, cluster, session, count)
                await all_set(s.ended for s in mediums)
                shorts = await open_one_by_one(
                    nursery, cluster, [f"short-{n}" for n in range(BACKENDS)], SHORT
                )
        assert_refused_busy(full)
        served = longs + mediums + shorts
        for session in served:
            session.assert_completed()
        for viewer in viewers:
            viewer.assert_watched()
        assert await sessions_total(cluster) - before == len(served)

        log = await cluster.logged(s.name for s in [*served, full])
        refused = log.pop("full")
        assert refused.status == 503, refused
        assert sorted(refused.upstreams) == sorted(b.address for b in cluster.backends), refused
        assert refused.upstream_statuses == ("503",) * BACKENDS, refused
        assert all(e.status == 101 for e in log.values()), log
        # Each server ran a long, a medium and a short one: the freed slots were found.
        per_server = Counter(e.served_by for e in log.values())
        assert per_server == {b.address: 3 for b in cluster.backends}, log
        # Each long session's viewers were on its own server, which counted none of them.
        for viewer in viewers:
            assert viewer.backend is not None
            assert log[viewer.session.name].served_by == viewer.backend.address, log


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(120)
async def test_a_server_full_of_viewers_with_a_free_slot_still_gets_sessions(
    tmp_path: Path,
) -> None:
    """Two servers full of sessions, the third with one session and more viewers than
    the others have connections: the next session goes to the third server, where the
    slot is; the one after that finds every server full and is refused."""
    async with open_cluster(tmp_path, server_args=("--max-sessions", str(SLOTS))) as cluster:
        with trio.fail_after(90):
            async with trio.open_nursery() as nursery:
                first = await open_one_by_one(
                    nursery, cluster, [f"long-{n}" for n in range(2 * BACKENDS - 1)], LONGER
                )
                active = [(await backend_stats(b))["sessions_active"] for b in cluster.backends]
                assert sorted(active) == [1, 2, 2], active
                roomy = cluster.backends[active.index(1)]
                lonely = [s for s in first if await owner(cluster, s) is roomy]
                assert len(lonely) == 1, [s.name for s in lonely]
                viewers = await watch(nursery, cluster, lonely[0], 6)
                assert (await backend_stats(roomy))["sessions_running"] == 1
                last = await open_one_by_one(nursery, cluster, ["last"], MEDIUM)
                await wait_for_active(cluster, [SLOTS] * BACKENDS)
                full = await refused_session(cluster, "full")
        assert_refused_busy(full)
        for session in first + last:
            session.assert_completed()
        for viewer in viewers:
            viewer.assert_watched()
        log = await cluster.logged(s.name for s in [*first, *last, full])
        assert log["last"].served_by == roomy.address, log
        # Any server nginx offered it first was full, and said so.
        assert all(status == "503" for status in log["last"].upstream_statuses[:-1]), log
        assert log["full"].upstream_statuses == ("503",) * BACKENDS, log
