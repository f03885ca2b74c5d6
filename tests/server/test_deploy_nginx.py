"""Scale-out behind a stock load balancer: real nginx, configured by deploy/nginx.conf, in
front of three real server processes; and the systemd unit's command line, run for real.

The nginx configuration under test is the shipped file itself, rendered: only the listen
address, the three backend ports, ``user``, ``worker_processes``, the pid file, the log
paths and nginx's temporary directories are swapped for the test's own (see
`render_nginx_conf` in bench/_nginx.py, which the fleet benchmark runs the same way). So
what passes here is what an operator copies, and an edit that breaks WebSocket proxying,
least_conn or the retry on 503 fails here.

Which backend served a session is read twice, independently: from each server's own
``GET /stats`` (``sessions_active``, ``sessions_total``) and from nginx's access log, whose
shipped format records every backend tried for a request and its status ("upstream=A, B
ustatus=503, 101": A was draining, B served). Each session's URL carries its name in the
query string, which the server ignores and the log shows.

Sessions overlap on purpose (synthetic engine, 0.2 s per 8-frame chunk, 1.2 or 4 s a
video), and are opened one after another, each once the previous one has its
``video.start``: nginx has then counted every earlier one, and where least_conn puts the
next is decided, not a race (six sessions: exactly 2/2/2). Waits are for conditions,
each with a deadline; nothing sleeps to let something happen.

nginx comes from Debian (``apt-get install nginx``, done by .ci/run); without
/usr/sbin/nginx the nginx tests skip.
"""

from __future__ import annotations

import contextlib
import json
import re
import shlex
import signal
import subprocess
import sys
from collections import Counter
from collections.abc import AsyncIterator, Iterable, Sequence
from pathlib import Path
from typing import Any, Final

import attrs
import pytest
import trio

from bench import run as bench
from bench._nginx import (
    NGINX,
    NGINX_CONF,
    LogEntry,
    free_port,
    nginx_command,
    read_access_log,
    render_nginx_conf,
    running_nginx,
)
from trio_vstream.client import StreamConnectError, StreamOutcome, StreamResult, stream_video
from trio_vstream.outputs.watch import WATCH_PREFIX
from trio_vstream.protocol import VideoStart
from trio_vstream.server.access import key_subprotocol
from trio_vstream.server.app import VIDEO_PATH
from trio_vstream.session.session import SessionConfig

REPO: Final = Path(__file__).resolve().parents[2]
SYSTEMD_UNIT: Final = REPO / "deploy" / "trio-vstream@.service"

needs_nginx = pytest.mark.skipif(
    not NGINX.exists(),
    reason="no /usr/sbin/nginx: `apt-get install nginx` (Debian's package; .ci/run does it)",
)

BACKENDS: Final = 3
SHUTDOWN_GRACE: Final = 30.0
"""The servers' default: far longer than any session here, so a drained session that
fails to complete is a bug, not a grace that ran out."""
STEP_DELAY: Final = 0.05
CHUNK_FRAMES: Final = 8
"""4 steps of 50 ms per 8-frame chunk: 0.2 s a chunk, cheap on a 2-core machine (the
steps are sleeps and the frames are 32x32)."""
LONG: Final = 160
"""Frames of a session that must still be running when a backend is signalled: 4 s."""
SHORT: Final = 48
"""Frames of a session that must end early (1.2 s): started after the signal, or the one
whose end leaves a backend idle."""
FPS: Final = 8
SERVER_START: Final = 60.0
"""Seconds for a server process to print its URL (importing torch on a busy machine)."""
CONDITION: Final = 15.0
"""Deadline for any one condition this test waits for."""

# --------------------------------------------------------------------------------------
# The cluster: three servers and nginx
# --------------------------------------------------------------------------------------


@attrs.define
class Backend:
    server: bench.ServerProcess
    port: int
    host: str = "127.0.0.1"

    @property
    def address(self) -> str:
        """As nginx's $upstream_addr writes it."""
        return f"{self.host}:{self.port}"

    @property
    def process(self) -> trio.Process:
        assert self.server.process is not None
        return self.server.process


@attrs.define
class Cluster:
    backends: list[Backend]
    port: int
    prefix: Path

    def url(self, session: str) -> str:
        return f"ws://127.0.0.1:{self.port}{VIDEO_PATH}?session={session}"

    def access_log(self) -> dict[str, LogEntry]:
        """The WebSocket requests logged so far, by session name."""
        return read_access_log(self.prefix / "access.log", "session")

    async def logged(self, sessions: Iterable[str]) -> dict[str, LogEntry]:
        """The access log's entries for these sessions, once nginx has written them all
        (it writes a WebSocket request's line when its connection closes)."""
        wanted = set(sessions)
        with trio.fail_after(CONDITION):
            # Polled (ASYNC110): nginx's log file, with no event to wait on.
            while not wanted <= (entries := self.access_log()).keys():  # noqa: ASYNC110
                await trio.sleep(0.05)
        return {name: entries[name] for name in sorted(wanted)}

    def error_log(self) -> str:
        path = self.prefix / "error.log"
        return path.read_text(errors="replace")[-4000:] if path.exists() else ""

    def server_logs(self) -> str:
        return "\n".join(f"--- {b.address}\n{b.server.log_tail(15)}" for b in self.backends)


def server_command(*extra: str) -> list[str]:
    return [
        sys.executable,
        "-m",
        "trio_vstream",
        "serve",
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--engine",
        "synthetic",
        "--engine-arg",
        f"step_delay={STEP_DELAY}",
        "--engine-arg",
        f"chunk_frames={CHUNK_FRAMES}",
        "--encode-concurrency",
        "1",
        "--shutdown-grace",
        str(SHUTDOWN_GRACE),
        *extra,
    ]


@contextlib.asynccontextmanager
async def open_cluster(
    tmp_path: Path, *, backends: int = BACKENDS, server_args: Sequence[str] = ()
) -> AsyncIterator[Cluster]:
    """Three servers on ports of their own choosing, then nginx in front of them, rendered
    from the shipped configuration with those ports. Everything is stopped on the way out,
    failures included.

    ``backends=1`` starts one server and lists it on all three of the shipped ``server``
    lines (nginx accepts repeats): for checks that are about what nginx passes through,
    not about spreading, at a third of the cost. ``server_args`` go to every server."""
    servers = [
        bench.ServerProcess(server_command(*server_args), tmp_path / f"server-{n}.log")
        for n in range(backends)
    ]
    try:
        urls: list[str] = [""] * backends

        async def start(n: int) -> None:
            urls[n] = await servers[n].start(timeout=SERVER_START)

        async with trio.open_nursery() as nursery:
            for n in range(backends):
                nursery.start_soon(start, n)
        started = [
            Backend(server, bench.Endpoint.parse(url).port)
            for server, url in zip(servers, urls, strict=True)
        ]
        lines = [("127.0.0.1", started[n % len(started)].port) for n in range(BACKENDS)]
        async with running_nginx(tmp_path, lines) as nginx:
            yield Cluster(started, nginx.port, nginx.prefix)
    finally:
        with trio.CancelScope(shield=True):
            async with trio.open_nursery() as nursery:
                for server in servers:
                    nursery.start_soon(server.stop, 10.0)


async def http_get(port: int, path: str, host: str = "127.0.0.1") -> tuple[int, bytes]:
    """One plain GET on ``host``; the status and the body."""
    stream = await trio.open_tcp_stream(host, port)
    data = bytearray()
    async with stream:
        request = f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: close\r\n\r\n"
        await stream.send_all(request.encode())
        with contextlib.suppress(trio.BrokenResourceError):
            while chunk := await stream.receive_some(65536):
                data += chunk
    head, _, body = bytes(data).partition(b"\r\n\r\n")
    return int(head.split(b" ", 2)[1]), body


async def upgrade_head(
    port: int, origin: str, *headers: str, host: str | None = None
) -> tuple[int, str]:
    """The status and response head nginx answers to a browser's WebSocket upgrade from
    ``origin`` (plus ``headers``, ``"Name: value"``; ``host`` for the Host header, by
    default nginx's own address); the connection is dropped before any session starts."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    head = bytearray()
    async with stream:
        request = (
            f"GET {VIDEO_PATH}?session=origin-check HTTP/1.1\r\n"
            f"Host: {host or f'127.0.0.1:{port}'}\r\n"
            "Upgrade: websocket\r\nConnection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
            f"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\nOrigin: {origin}\r\n"
            + "".join(f"{header}\r\n" for header in headers)
            + "\r\n"
        )
        await stream.send_all(request.encode())
        while b"\r\n\r\n" not in head and (chunk := await stream.receive_some(4096)):
            head += chunk
    text = bytes(head).partition(b"\r\n\r\n")[0].decode("latin-1")
    return int(text.split(" ", 2)[1]), text


async def upgrade_status(port: int, origin: str, host: str | None = None) -> int:
    """The status nginx answers to a browser's WebSocket upgrade from ``origin``."""
    status, _ = await upgrade_head(port, origin, host=host)
    return status


async def backend_stats(backend: Backend) -> dict[str, Any]:
    """The server's own /stats, on its own port (not through nginx)."""
    status, body = await http_get(backend.port, "/stats", backend.host)
    assert status == 200, body
    stats: dict[str, Any] = json.loads(body)
    return stats


async def wait_for_active(cluster: Cluster, expected: Sequence[int]) -> None:
    """Until each backend reports this many running sessions in its /stats."""
    seen: list[int] = []
    with trio.move_on_after(CONDITION):
        while True:
            seen = [(await backend_stats(b))["sessions_active"] for b in cluster.backends]
            if seen == list(expected):
                return
            await trio.sleep(0.05)
    raise AssertionError(f"sessions_active per backend {seen}, expected {list(expected)}")


# --------------------------------------------------------------------------------------
# Sessions through nginx
# --------------------------------------------------------------------------------------


@attrs.define
class Session:
    """One client session through nginx and what became of it."""

    name: str
    frames: int
    started: trio.Event = attrs.field(factory=trio.Event)
    """Set at ``video.start``, or when the session ended without one (so no one waits)."""
    streaming: trio.Event = attrs.field(factory=trio.Event)
    """Set at the first media chunk, or when the session ended without one."""
    ended: trio.Event = attrs.field(factory=trio.Event)
    result: StreamResult | None = None
    failure: str | None = None
    """Why no connection was made at all (StreamConnectError)."""
    video_start: VideoStart | None = None
    """The session's ``video.start`` (its ``watch_path``), once it came."""

    async def run(self, url: str) -> None:
        def on_message(_message: object, result: StreamResult) -> None:
            if result.video_start is not None:
                self.video_start = result.video_start
                self.started.set()

        def on_chunk(_chunk: object, result: StreamResult) -> None:
            if result.frames > 0:
                self.streaming.set()

        fields = {
            "prompt": f"a lighthouse for {self.name}",
            "size": "32x32",
            "fps": FPS,
            "num_frames": self.frames,
            "seed": 7,
        }
        try:
            self.result = await stream_video(url, fields, on_message=on_message, on_chunk=on_chunk)
        except StreamConnectError as exc:
            self.failure = str(exc)
        finally:
            self.started.set()
            self.streaming.set()
            self.ended.set()

    def describe(self) -> str:
        if self.result is None:
            return f"{self.name}: no connection ({self.failure})"
        r = self.result
        return (
            f"{self.name}: {r.outcome} frames={r.frames}/{self.frames} close={r.close_code} "
            f"error={r.error} problems={r.problems}"
        )

    def assert_completed(self) -> None:
        """The whole video, ended by ``session.done`` (not stopped) and a normal close."""
        result = self.result
        assert result is not None, self.describe()
        assert result.outcome is StreamOutcome.COMPLETED, self.describe()
        assert result.done is not None and result.done.stopped is False, self.describe()
        assert result.frames == self.frames, self.describe()
        assert result.error is None and not result.errors, self.describe()
        assert result.close_code == 1000, self.describe()
        assert not result.problems, self.describe()


async def open_one_by_one(
    nursery: trio.Nursery, cluster: Cluster, names: Iterable[str], frames: int
) -> list[Session]:
    """Start sessions in the nursery one after another, each once the previous one has its
    ``video.start``: nginx's least_conn then sees every earlier session as a connection,
    and the spread it makes is exact rather than a race."""
    sessions = []
    for name in names:
        session = Session(name, frames)
        sessions.append(session)
        nursery.start_soon(session.run, cluster.url(name))
        with trio.fail_after(CONDITION):
            await session.started.wait()
        assert session.result is None or session.result.video_start is not None, session.describe()
    return sessions


async def all_set(events: Iterable[trio.Event]) -> None:
    """Until every event is set, within the deadline for a condition."""
    with trio.fail_after(CONDITION):
        for event in events:
            await event.wait()


# --------------------------------------------------------------------------------------
# The tests
# --------------------------------------------------------------------------------------


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(60)
def test_the_shipped_config_passes_nginx_t(tmp_path: Path) -> None:
    """``nginx -t`` on the shipped file, rendered: a syntax slip fails here, in a second."""
    conf = tmp_path / "nginx.conf"
    conf.write_text(
        render_nginx_conf(
            NGINX_CONF.read_text(),
            listen_port=free_port(),
            backend_ports=[8001, 8002, 8003],
            prefix=tmp_path,
        )
    )
    done = subprocess.run(
        nginx_command(conf, tmp_path, "-t"), capture_output=True, text=True, timeout=30
    )
    assert done.returncode == 0, done.stderr


def test_the_shipped_config_has_what_scale_out_needs() -> None:
    """The settings docs/deploying.md promises, read off the file (no nginx needed)."""
    text = NGINX_CONF.read_text()
    # Each directive's first value: the server block's, before any location's own (the
    # HLS location buffers, and retries no 503: test_deploy_hls_cache.py).
    directives: dict[str, str] = {}
    for line in text.splitlines():
        if line.strip() and not line.strip().startswith("#"):
            name, _, value = line.strip().rstrip(";").partition(" ")
            directives.setdefault(name, value.strip() or name)
    assert "least_conn;" in text
    assert directives["proxy_http_version"] == "1.1"
    assert "proxy_set_header Upgrade $http_upgrade;" in text
    assert "proxy_set_header Connection $connection_upgrade;" in text
    assert directives["proxy_buffering"] == "off"
    assert "http_503" in directives["proxy_next_upstream"].split()
    stall = SessionConfig().stall_timeout
    for name in ("proxy_read_timeout", "proxy_send_timeout"):
        value = directives[name]
        assert value.endswith("s") and float(value[:-1]) > stall, (name, value, stall)
    # A full server's 503 takes it out of no rotation (test_deploy_placement.py), and
    # watch links' viewers are counted apart from the sessions.
    sessions = text.split("upstream trio_vstream {", 1)[1].split("}", 1)[0]
    assert re.findall(r"^\s*server \S+ (.*);$", sessions, re.MULTILINE) == ["max_fails=0"] * 3
    assert f"location {WATCH_PREFIX} {{\n            proxy_pass http://trio_vstream_watch;" in text


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(100)
async def test_least_conn_spreads_sessions_over_the_backends(tmp_path: Path) -> None:
    """least_conn where round robin would differ: of three sessions, one per backend, the
    short one ends, and the next session goes to the backend it left idle (round robin
    would send it to the first one again). Then the spread: six sessions streaming at
    once, two on each server by the servers' own count and by nginx's log."""
    async with open_cluster(tmp_path) as cluster:
        before = [(await backend_stats(b))["sessions_total"] for b in cluster.backends]
        with trio.fail_after(60):
            async with trio.open_nursery() as nursery:
                sessions = await open_one_by_one(nursery, cluster, ["long-0"], LONG)
                sessions += await open_one_by_one(nursery, cluster, ["short"], SHORT)
                sessions += await open_one_by_one(nursery, cluster, ["long-1"], LONG)
                await wait_for_active(cluster, [1] * BACKENDS)
                await all_set([sessions[1].ended])
                sessions += await open_one_by_one(
                    nursery, cluster, [f"long-{n}" for n in range(2, 6)], LONG
                )
                await wait_for_active(cluster, [2] * BACKENDS)
        for session in sessions:
            session.assert_completed()

        log = await cluster.logged(s.name for s in sessions)
        assert all(e.status == 101 and e.upstream_statuses == ("101",) for e in log.values())
        idle = log["short"].served_by
        assert log["long-2"].served_by == idle, log
        longs = Counter(e.served_by for name, e in log.items() if name != "short")
        assert longs == {b.address: 2 for b in cluster.backends}, log
        # The servers' own count agrees: 2 each, and the short session's server 3.
        after = [(await backend_stats(b))["sessions_total"] for b in cluster.backends]
        served = {b.address: a - n for b, a, n in zip(cluster.backends, after, before, strict=True)}
        assert served == {address: 2 + (address == idle) for address in served}, served

        # The player page, served through nginx, may open sessions through it: the Host
        # nginx passes on keeps its port, so the page's origin is the server's own.
        assert await upgrade_status(cluster.port, f"http://127.0.0.1:{cluster.port}") == 101
        assert await upgrade_status(cluster.port, "http://elsewhere.example") == 403
        # A page whose DNS name was re-pointed at nginx's address (DNS rebinding): nginx
        # passes its Host on, and the server refuses it before the upgrade.
        rebound = f"rebind.attacker.example:{cluster.port}"
        assert await upgrade_status(cluster.port, f"http://{rebound}", host=rebound) == 421


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(100)
async def test_sigterm_to_a_backend_mid_stream_loses_no_session(tmp_path: Path) -> None:
    """A rolling restart's step: the drained server's running sessions complete, and
    sessions started during its drain complete on the other two (nginx retries the 503)."""
    async with open_cluster(tmp_path) as cluster:
        victim = cluster.backends[0]
        with trio.fail_after(80):
            async with trio.open_nursery() as nursery:
                running = await open_one_by_one(
                    nursery, cluster, [f"running-{n}" for n in range(2 * BACKENDS)], LONG
                )
                await wait_for_active(cluster, [2] * BACKENDS)
                await all_set(s.streaming for s in running)  # mid-stream: video arriving

                victim.process.send_signal(signal.SIGTERM)
                with trio.fail_after(CONDITION):
                    # Polled (ASYNC110): another process, with no event to wait on.
                    while (await http_get(victim.port, "/health"))[0] != 503:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                # Enough new sessions that least_conn must offer the draining server one:
                # after two land elsewhere, it has the fewest connections.
                during = await open_one_by_one(
                    nursery, cluster, [f"during-{n}" for n in range(4)], SHORT
                )
                assert victim.process.poll() is None, (
                    "the drained server exited before the sessions meant for its drain had "
                    "started; the test proves nothing on a machine this slow\n"
                    + cluster.server_logs()
                )
        problems = [s.describe() for s in running + during if s.result is None]
        assert not problems, problems
        for session in running + during:
            session.assert_completed()

        with trio.fail_after(CONDITION):
            status = await victim.process.wait()
        assert status == 0, victim.server.log_tail()

        log = await cluster.logged(s.name for s in running + during)
        on_victim = sorted(name for name, e in log.items() if e.served_by == victim.address)
        assert len(on_victim) == 2 and all(n.startswith("running-") for n in on_victim), log
        retried = [
            e
            for name, e in log.items()
            if name.startswith("during-")
            and e.upstreams[0] == victim.address
            and e.upstream_statuses[0] == "503"
        ]
        assert retried, f"no session met the draining server's 503:\n{log}"
        assert all(e.status == 101 for e in log.values()), log


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(100)
async def test_sigkill_to_a_backend_drops_its_sessions_and_new_ones_succeed(
    tmp_path: Path,
) -> None:
    async with open_cluster(tmp_path) as cluster:
        victim = cluster.backends[1]
        with trio.fail_after(80):
            async with trio.open_nursery() as nursery:
                running = await open_one_by_one(
                    nursery, cluster, [f"running-{n}" for n in range(2 * BACKENDS)], LONG
                )
                await wait_for_active(cluster, [2] * BACKENDS)

                await all_set(s.streaming for s in running)  # mid-stream: video arriving

                victim.process.kill()
                with trio.fail_after(CONDITION):
                    await victim.process.wait()
                # Its two clients see their connections end (the others have seconds of
                # video to go). nginx has then let go of the dead server's connections, so
                # least_conn offers it the next session first: refused, and retried.
                with trio.fail_after(CONDITION):
                    # Polled (ASYNC110): any two of the sessions' events, one Event each.
                    while sum(s.ended.is_set() for s in running) < 2:  # noqa: ASYNC110
                        await trio.sleep(0.05)
                after = await open_one_by_one(
                    nursery, cluster, [f"after-{n}" for n in range(3)], SHORT
                )
        for session in after:
            session.assert_completed()

        log = await cluster.logged(s.name for s in running + after)
        assert not any(log[s.name].served_by == victim.address for s in after), log
        first = log["after-0"]
        assert first.upstreams[0] == victim.address, log
        assert first.upstream_statuses[0] == "502", log  # nginx's status for "refused"
        dropped = [s for s in running if log[s.name].served_by == victim.address]
        assert len(dropped) == 2, log
        for session in running:
            if session in dropped:
                result = session.result
                assert result is not None, session.describe()
                assert result.outcome is StreamOutcome.DISCONNECTED, session.describe()
                assert result.done is None and result.error is None, session.describe()
                assert result.close_code != 1000, session.describe()
                assert 0 < result.frames < session.frames, session.describe()
            else:
                session.assert_completed()


@pytest.mark.nginx
@needs_nginx
@pytest.mark.timeout(60)
async def test_api_keys_pass_through_nginx(tmp_path: Path) -> None:
    """One server started with --api-key, behind the shipped config: nginx forwards the
    client's ``Authorization`` header and a browser's ``Sec-WebSocket-Protocol`` key entry
    unchanged, and the server's 401 (with its ``WWW-Authenticate``) back; it does not
    retry a 401 on another backend as it does a 503."""
    key = "nginx-key-91d0"
    fields = {"prompt": "a key", "size": "32x32", "fps": FPS, "num_frames": 16}
    public = ("--allowed-hosts", "video.example.org")
    async with open_cluster(
        tmp_path, backends=1, server_args=("--api-key", key, *public)
    ) as cluster:
        with trio.fail_after(CONDITION):
            with pytest.raises(StreamConnectError) as refused:
                await stream_video(cluster.url("no-key"), fields)
            result = await stream_video(cluster.url("keyed"), fields, api_key=key)
            own = f"http://127.0.0.1:{cluster.port}"
            status, head = await upgrade_head(cluster.port, own)
            browser_status, browser_head = await upgrade_head(
                cluster.port,
                own,
                f"Sec-WebSocket-Protocol: trio-vstream, {key_subprotocol(key)}",
            )
            # The page at its public name (in the servers' --allowed-hosts), which nginx
            # passes on in Host.
            public_status, public_head = await upgrade_head(
                cluster.port,
                "http://video.example.org",
                f"Sec-WebSocket-Protocol: trio-vstream, {key_subprotocol(key)}",
                host="video.example.org",
            )
        assert refused.value.status_code == 401, refused.value
        assert result.outcome is StreamOutcome.COMPLETED and result.frames == 16, result.summary()
        assert status == 401, head
        assert 'www-authenticate: bearer realm="trio_vstream"' in head.lower(), head
        assert browser_status == 101, browser_head
        assert "sec-websocket-protocol: trio-vstream\r\n" in browser_head.lower() + "\r\n"
        assert public_status == 101, public_head
        log = await cluster.logged(["no-key", "keyed"])
        assert log["no-key"].status == 401 and log["no-key"].upstream_statuses == ("401",), log
        assert log["keyed"].status == 101, log


# --------------------------------------------------------------------------------------
# The systemd unit
# --------------------------------------------------------------------------------------


def _unit_settings() -> tuple[dict[str, list[str]], dict[str, str]]:
    """The unit's [Service] settings (a key may repeat) and its Environment= defaults."""
    settings: dict[str, list[str]] = {}
    # systemd joins a line ending in a backslash to the next, the backslash a space.
    text = SYSTEMD_UNIT.read_text().replace("\\\n", " ")
    for line in text.splitlines():
        if line and not line.startswith(("#", "[")) and "=" in line:
            key, value = line.split("=", 1)
            settings.setdefault(key, []).append(value)
    environment = dict(value.split("=", 1) for value in settings["Environment"])
    return settings, environment


def test_the_systemd_unit_drains_before_systemd_kills() -> None:
    settings, environment = _unit_settings()
    assert settings["KillSignal"] == ["SIGTERM"]
    assert settings["Restart"] == ["on-failure"]
    grace = float(environment["SHUTDOWN_GRACE"])
    assert grace == SHUTDOWN_GRACE
    timeout = settings["TimeoutStopSec"][0]
    assert float(timeout) > grace + SessionConfig().close_timeout, (timeout, grace)
    # Instance N listens on PORT_BASE + N: the first is the first port nginx.conf lists.
    first = re.search(r"^\s*server 127\.0\.0\.1:(\d+) ", NGINX_CONF.read_text(), re.MULTILINE)
    assert first is not None
    assert environment["PORT_BASE"] == first.group(1)


@pytest.mark.slow
@pytest.mark.timeout(90)
async def test_the_systemd_units_command_serves_instance_n_on_port_base_plus_n(
    tmp_path: Path,
) -> None:
    """ExecStart= run as systemd would run it for trio-vstream@2: ``%i`` is the instance,
    ``$$`` a literal ``$`` for the shell; the environment is the unit's, with the Python
    and the engine of this test. The server must come up on PORT_BASE + 2, and leave on
    SIGTERM with status 0."""
    settings, environment = _unit_settings()
    (exec_start,) = settings["ExecStart"]
    argv = shlex.split(exec_start.replace("%i", "2").replace("$$", "$"))
    port = free_port()
    environment |= {
        "PYTHON": sys.executable,
        "PORT_BASE": str(port - 2),
        "TRIO_VSTREAM_ARGS": "--engine synthetic --encode-concurrency 1",
        "NODE_NAME_PREFIX": "box2-gpu",
    }
    command = ["env", *(f"{k}={v}" for k, v in environment.items()), *argv]
    server = bench.ServerProcess(command, tmp_path / "unit.log")
    try:
        url = await server.start(timeout=SERVER_START)
        assert bench.Endpoint.parse(url).port == port, url
        status, body = await http_get(port, "/health")
        assert status == 200, body
        assert "--device cuda:2 " in argv[-1], argv
        status, body = await http_get(port, "/stats")
        assert status == 200, body
        assert json.loads(body)["node"] == "box2-gpu2"
    finally:
        returncode = await server.stop(grace=15.0)
    assert returncode == 0, server.log_tail()
