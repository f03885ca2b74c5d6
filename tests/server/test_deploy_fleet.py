"""A fleet as separate hosts on this machine: three servers on 127.0.0.2, .3 and .4 (each
a host of its own, as far as nginx and the servers can tell), behind one nginx rendered
from the shipped deploy/nginx.conf, configured as docs/deploying.md ("Several boxes")
tells users to: each server named (``--node-name``) and given the whole fleet's list
(``--peer``, its own entry included: the same line on every host).

What must hold, through nginx whichever server it picks:
- six of six viewers of a session get its video, though nginx sends most of them to
  servers that do not run it (they are relayed to the owner);
- a rolling restart, one server after another with viewers attached, loses no session
  and no viewer's ending;
- a killed server's sessions are gone, a link to them answers ``watch_not_found`` at
  once, and new sessions and viewers still work on the others.

Helpers: nginx's rendering and process are bench/_nginx.py's (the fleet benchmark runs
the same setup), sessions through nginx test_deploy_nginx's.
"""

from __future__ import annotations

import contextlib
import signal
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Final

import attrs
import pytest
import trio

from bench import run as bench
from bench._nginx import free_port, read_access_log, running_nginx
from tests.server.test_deploy_nginx import (
    CONDITION,
    LONG,
    SERVER_START,
    SHORT,
    Backend,
    Cluster,
    Session,
    all_set,
    http_get,
    needs_nginx,
    open_one_by_one,
    server_command,
)
from trio_vstream.client import StreamOutcome, StreamResult, watch_video

HOSTS: Final = ("127.0.0.2", "127.0.0.3", "127.0.0.4")
"""Three hosts, as the servers and nginx see them: each its own loopback address."""


@attrs.define
class Fleet:
    cluster: Cluster
    commands: list[list[str]]
    logs: Path
    started: list[bench.ServerProcess]
    """Every server process started, restarted ones included: `open_fleet` stops them
    all on the way out."""

    def watch_url(self, watch_path: str) -> str:
        return f"ws://127.0.0.1:{self.cluster.port}{watch_path}"

    async def restart(self, n: int) -> None:
        """SIGTERM to server ``n`` (it drains), then the same command again, as systemd's
        ``restart`` does; back once it answers /health."""
        backend = self.cluster.backends[n]
        with trio.fail_after(CONDITION * 2):
            assert await backend.server.stop(grace=CONDITION * 2) == 0, backend.server.log_tail()
        server = bench.ServerProcess(self.commands[n], self.logs / f"server-{n}-again.log")
        self.started.append(server)
        await server.start(timeout=SERVER_START)
        self.cluster.backends[n] = Backend(server, backend.port, backend.host)
        status, body = await http_get(backend.port, "/health", backend.host)
        assert status == 200, body

    def entered_through(self, viewer: Viewer) -> str:
        """The server nginx sent ``viewer`` to, from nginx's access log."""
        name = viewer.url.rsplit("?viewer=", 1)[1]
        return read_access_log(self.cluster.prefix / "access.log", "viewer")[name].served_by

    async def relayed(self) -> int:
        """Viewers relayed by every server, from their own /metrics."""
        total = 0
        for backend in self.cluster.backends:
            status, body = await http_get(backend.port, "/metrics", backend.host)
            assert status == 200, body
            for line in body.decode().splitlines():
                if line.startswith("trio_vstream_viewers_relayed_total{"):
                    total += int(float(line.rsplit(" ", 1)[1]))
        return total


@contextlib.asynccontextmanager
async def open_fleet(tmp_path: Path, *extra: str) -> AsyncIterator[Fleet]:
    """The three hosts' servers, named and told of each other, then nginx in front."""
    ports = [free_port(host) for host in HOSTS]
    names = [f"host{n}" for n in range(len(HOSTS))]
    peers = [
        arg
        for name, host, port in zip(names, HOSTS, ports, strict=True)
        for arg in ("--peer", f"{name}={host}:{port}")
    ]
    commands = [
        server_command("--host", host, "--port", str(port), "--node-name", name, *peers, *extra)
        for name, host, port in zip(names, HOSTS, ports, strict=True)
    ]
    servers = [
        bench.ServerProcess(command, tmp_path / f"server-{n}.log")
        for n, command in enumerate(commands)
    ]
    try:
        async with trio.open_nursery() as nursery:
            for server in servers:
                nursery.start_soon(server.start, SERVER_START)
        backends = [
            Backend(server, port, host)
            for server, host, port in zip(servers, HOSTS, ports, strict=True)
        ]
        async with running_nginx(tmp_path, [(b.host, b.port) for b in backends]) as nginx:
            cluster = Cluster(backends, nginx.port, nginx.prefix)
            yield Fleet(cluster, commands, tmp_path, servers)
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for server in servers:  # restarted ones too (Fleet.started)
                    nursery.start_soon(server.stop, 10.0)


@attrs.define
class Viewer:
    """One viewer of a watch link through nginx."""

    url: str
    result: StreamResult | None = None
    joined: trio.Event = attrs.field(factory=trio.Event)
    """Set at ``watch.start``, or when it ended without one (so no one waits)."""
    ended: trio.Event = attrs.field(factory=trio.Event)

    async def run(self) -> None:
        def on_message(_message: object, result: StreamResult) -> None:
            if result.watch_start is not None:
                self.joined.set()

        try:
            self.result = await watch_video(self.url, on_message=on_message)
        finally:
            self.joined.set()
            self.ended.set()

    def assert_saw_the_end(self, session: Session) -> None:
        """Frames from where it joined, then the owner's own ``session.done``."""
        result = self.result
        assert result is not None
        assert result.outcome is StreamOutcome.COMPLETED, (result.outcome, result.error)
        assert result.watch_start is not None
        assert 0 < result.frames <= session.frames, result.frames
        assert result.done is not None and result.done.stopped is False
        assert result.close_code == 1000, result.close_code
        assert not result.problems, result.problems


async def watch_path_of(session: Session) -> str:
    assert session.video_start is not None, session.describe()
    path = session.video_start.watch_path
    assert path is not None
    return path


def start_viewers(
    nursery: trio.Nursery, fleet: Fleet, path: str, count: int, name: str = "viewer"
) -> list[Viewer]:
    """``count`` viewers through nginx, each named in its URL's query (which the server
    ignores and nginx's log shows)."""
    viewers = [Viewer(f"{fleet.watch_url(path)}?viewer={name}-{n}") for n in range(count)]
    for viewer in viewers:
        nursery.start_soon(viewer.run)
    return viewers


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(120)
async def test_six_viewers_through_nginx_all_get_the_video(tmp_path: Path) -> None:
    async with open_fleet(tmp_path) as fleet, trio.open_nursery() as nursery:
        (session,) = await open_one_by_one(nursery, fleet.cluster, ["owner"], LONG)
        path = await watch_path_of(session)
        assert path.split("/")[-2] in {"host0", "host1", "host2"}, path
        viewers = start_viewers(nursery, fleet, path, 6)
        await all_set([session.ended, *(v.ended for v in viewers)])
        session.assert_completed()
        for viewer in viewers:
            viewer.assert_saw_the_end(session)
        # least_conn sends the first viewer away from the owner (it has the session's
        # connection): at least that one was relayed.
        assert await fleet.relayed() >= 1


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(180)
async def test_a_rolling_restart_with_viewers_attached_loses_nothing(tmp_path: Path) -> None:
    async with open_fleet(tmp_path) as fleet, trio.open_nursery() as nursery:
        names = [f"before-{n}" for n in range(len(HOSTS))]
        sessions = await open_one_by_one(nursery, fleet.cluster, names, LONG)
        viewers: list[Viewer] = []
        for session in sessions:
            viewers += start_viewers(nursery, fleet, await watch_path_of(session), 2)
        await all_set(v.joined for v in viewers)
        later: list[Session] = []
        for n in range(len(HOSTS)):
            await fleet.restart(n)
            # Each restarted server takes sessions again, and nginx finds it.
            (one,) = await open_one_by_one(nursery, fleet.cluster, [f"after-{n}"], SHORT)
            later.append(one)
        await all_set([s.ended for s in sessions + later] + [v.ended for v in viewers])
        for session in sessions + later:
            session.assert_completed()
        for viewer, session in zip(viewers, [s for s in sessions for _ in range(2)], strict=True):
            viewer.assert_saw_the_end(session)


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(120)
async def test_a_killed_server_loses_its_sessions_and_nothing_else(tmp_path: Path) -> None:
    async with open_fleet(tmp_path) as fleet, trio.open_nursery() as nursery:
        doomed, survivor = await open_one_by_one(
            nursery, fleet.cluster, ["doomed", "survivor"], LONG
        )
        doomed_path, survivor_path = await watch_path_of(doomed), await watch_path_of(survivor)
        owner = int(doomed_path.split("/")[-2].removeprefix("host"))
        survivor_viewers = start_viewers(nursery, fleet, survivor_path, 3, "survivor")
        doomed_viewers = start_viewers(nursery, fleet, doomed_path, 3, "doomed")
        await all_set(v.joined for v in survivor_viewers + doomed_viewers)
        fleet.cluster.backends[owner].process.send_signal(signal.SIGKILL)
        await all_set([doomed.ended, *(v.ended for v in doomed_viewers)])
        assert doomed.result is not None and doomed.result.outcome is not StreamOutcome.COMPLETED
        for viewer in doomed_viewers:
            assert viewer.result is not None
            assert viewer.result.outcome is not StreamOutcome.COMPLETED
        # A link to the dead server's session: watch_not_found at once, wherever it lands.
        late = start_viewers(nursery, fleet, doomed_path, 2, "late")
        await all_set(v.ended for v in late)
        for viewer in late:
            assert viewer.result is not None
            assert viewer.result.error is not None, viewer.result
            assert viewer.result.error.code == "watch_not_found", viewer.result.error
        # New sessions still find room on the others, and the survivor runs to its end.
        (fresh,) = await open_one_by_one(nursery, fleet.cluster, ["fresh"], SHORT)
        await all_set([survivor.ended, fresh.ended, *(v.ended for v in survivor_viewers)])
        survivor.assert_completed()
        fresh.assert_completed()
        # A viewer's connection that went through the killed server went with it; every
        # other one saw the survivor to its end.
        killed = fleet.cluster.backends[owner].address
        for viewer in survivor_viewers:
            if fleet.entered_through(viewer) == killed:
                assert viewer.result is not None and viewer.result.close_code == 1006
            else:
                viewer.assert_saw_the_end(survivor)
