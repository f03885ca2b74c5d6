"""Idle connections must not hold the server (issue 20, item 6).

The attacks: WebSocket upgrades that never send ``session.start`` took every session
slot (``server_busy`` for everyone else, for as long as the start timeout, again and
again; now each claims one for two seconds at most); idle TCP connections used up the
descriptors until ``accept()`` failed with EMFILE and ``/health`` went unanswered; a
request head sent slowly held its connection for the start timeout. Each test goes
through a real server on loopback.
"""

from __future__ import annotations

import contextlib
import json
import re
import resource
import subprocess
import sys
import textwrap
from collections.abc import Callable
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected

from tests.conftest import Transcript, is_type, receive_into, receive_until
from trio_vstream.engines.synthetic import SyntheticEngine, SyntheticSettings
from trio_vstream.server import connections
from trio_vstream.server.app import ServerConfig, VideoServer
from trio_vstream.server.slots import CLAIM_SECONDS

START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}


async def http_request(port: int, head: bytes) -> tuple[int, dict[str, str], bytes]:
    """Send one request head, read the response to the server's close."""
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(head)
        return parse_response(await read_to_close(stream))


async def read_to_close(stream: trio.SocketStream) -> bytes:
    data = b""
    while chunk := await stream.receive_some():
        data += chunk
    return data


def parse_response(data: bytes) -> tuple[int, dict[str, str], bytes]:
    head, _, body = data.partition(b"\r\n\r\n")
    status_line, *lines = head.decode("latin-1").split("\r\n")
    headers = {}
    for line in lines:
        name, _, value = line.partition(":")
        headers[name.strip().lower()] = value.strip()
    return int(status_line.split()[1]), headers, body


def get(path: str) -> bytes:
    return f"GET {path} HTTP/1.1\r\nHost: localhost\r\n\r\n".encode()


async def health(port: int) -> tuple[int, bytes]:
    status, _, body = await http_request(port, get("/health"))
    return status, body


async def until(done: Callable[[], bool]) -> None:
    """Until the server's state is ``done``. Each round lets every task run until all
    wait, so the server handles what the kernel has reported (a connection to accept, a
    close to notice); no timer, the caller's ``fail_after`` bounds it."""
    while not done():
        await trio.testing.wait_all_tasks_blocked()


def seen(server: VideoServer) -> int:
    """Connections the server has taken in or turned away (each adds one)."""
    return server.connections.open + server.connections.refused


async def open_idle(
    port: int, count: int, stack: contextlib.AsyncExitStack, server: VideoServer | None = None
) -> list[trio.SocketStream]:
    """``count`` TCP connections that never send a byte, kept open by ``stack``; with
    ``server`` (in this process), each one is opened once it has handled the last, so
    they reach it in order."""
    idle = []
    for _ in range(count):
        # Settled first: a connection the server is still closing would give back its
        # slot as this one takes one, and the count would not move.
        await trio.testing.wait_all_tasks_blocked()
        before = 0 if server is None else seen(server)
        idle.append(await stack.enter_async_context(await trio.open_tcp_stream("127.0.0.1", port)))
        if server is not None:
            await until(lambda: seen(server) > before)  # noqa: B023 - awaited right here
    return idle


# ----------------------------------------------------------- session slots


async def test_idle_upgrades_do_not_keep_a_real_client_out(
    mock_clock: trio.testing.MockClock, start_server: Any
) -> None:
    """As many upgrades as session slots, none sending session.start: each claims a slot
    for the claim's window only (an upgrade beyond them is refused meanwhile); after it
    they hold connections, not sessions, and a real client is served at once. On a clock
    that moves only when the test moves it."""
    running = await start_server(max_sessions=2, start_timeout=60.0)
    async with contextlib.AsyncExitStack() as stack:
        for _ in range(2):
            await stack.enter_async_context(running.connect())
        with pytest.raises(ConnectionRejected) as refused:
            async with running.connect():
                pass
        assert refused.value.status_code == 503
        assert json.loads(refused.value.body or b"")["code"] == "server_busy"
        mock_clock.jump(CLAIM_SECONDS)
        await trio.testing.wait_all_tasks_blocked()
        assert running.server.running_sessions == 0
        assert running.server.claimed_sessions == 0
        transcript = await running.run_session(START)
    assert transcript.types[0] == "video.start"
    assert transcript.terminal == [transcript.of_type("session.done")[0]]
    assert transcript.close_code == 1000


async def test_a_start_that_finds_every_session_slot_taken_gets_server_busy(
    mock_clock: trio.testing.MockClock, start_server: Any
) -> None:
    """The slot goes to the first session.start, not to the first upgrade, once the
    upgrade's claim has run out: an earlier idle upgrade that starts later gets
    server_busy in the session, and an upgrade while the slot is taken is refused with
    a 503 before it is accepted."""
    # Long enough to hold the slot throughout (a minute of steps), stopped at the end. Not
    # a hung engine: its stop would wait a close timeout, which this clock never reaches.
    running = await start_server(
        SyntheticSettings(step_delay=0.1), max_sessions=1, start_timeout=60.0
    )
    async with running.connect() as early:
        mock_clock.jump(CLAIM_SECONDS)  # its claim runs out
        async with running.connect() as first:
            await first.send_message(json.dumps({**START, "num_frames": 1200}))
            await receive_until(first, Transcript(), is_type("video.start"))
            late = Transcript()
            await early.send_message(json.dumps(START))
            await receive_into(early, late)
            assert late.json == [
                {
                    "type": "error",
                    "code": "server_busy",
                    "message": "Server busy: 1 sessions running; try again later",
                }
            ]
            assert late.close_code == 1000
            with pytest.raises(ConnectionRejected) as refused:
                async with running.connect():
                    pass
            assert refused.value.status_code == 503
            assert json.loads(refused.value.body or b"")["code"] == "server_busy"
            await first.send_message('{"type": "session.stop"}')
            done = Transcript()
            await receive_into(first, done)
    assert done.terminal[0]["type"] == "session.done"
    mock_clock.rate = 1.0  # time flows from here: each close's linger runs out (http.py)
    await running.wait_sessions_ended(2)
    busy = [s for s in running.summaries if s.error_code == "server_busy"]
    assert [(s.outcome.value, s.request_id) for s in busy] == [("rejected", None)]


# ------------------------------------------------------- connection slots


async def test_connections_over_the_cap_get_503_while_health_answers(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Three idle connections fill a cap of three. Beyond it a request is answered 503
    at once (not held for the head timeout), /health still gets 200, an upgrade gets
    503; a reserve filled with idle sockets gives way to a health check; a closed
    connection frees its slot."""
    monkeypatch.setattr(connections, "RESERVED_HEAD_TIMEOUT", 60.0)  # evicted, not timed out
    running = await start_server(max_connections=3, head_timeout=60.0, start_timeout=60.0)
    server = running.server
    port = server.port
    async with contextlib.AsyncExitStack() as stack:
        with trio.fail_after(10):  # well within the head timeout
            held = await open_idle(port, 3, stack, server)
            assert server.connections.open == 3
            status, headers, body = await http_request(port, get("/v1/models"))
            assert (status, headers["retry-after"], body) == (
                503,
                "1",
                b"too many connections: try again later\n",
            )
            assert await health(port) == (200, b"ok\n")
            with pytest.raises(ConnectionRejected) as rejected:
                async with running.connect():
                    pass
            assert rejected.value.status_code == 503

            # The reserve full of idle sockets, and two more: the oldest give way.
            reserve = await open_idle(port, connections.RESERVED_SLOTS + 2, stack, server)
            assert server.connections.open == 3 + connections.RESERVED_SLOTS
            assert server.connections.refused == 4  # the two 503s, two evicted
            assert await read_to_close(reserve[0]) == b""  # evicted
            assert await read_to_close(reserve[1]) == b""
            assert await health(port) == (200, b"ok\n")  # evicting the third

            # A connection that closes gives its slot back.
            await held[0].aclose()
            await until(lambda: server.connections.ordinary_open == 2)
            status, _, metrics = await http_request(port, get("/metrics"))
    assert status == 200
    refused = re.search(
        rb'^trio_vstream_connections_refused_total\{model="synthetic"\} (\S+)$', metrics, re.M
    )
    assert refused is not None and float(refused.group(1)) == 5


async def test_with_no_slot_left_a_connection_is_turned_away_unread(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    """No reserve at all: the connection over the cap gets its 503 before it sends a
    byte, and is closed; it never waits for a head."""
    monkeypatch.setattr(connections, "RESERVED_SLOTS", 0)
    running = await start_server(max_connections=1, head_timeout=60.0)
    port = running.server.port
    async with contextlib.AsyncExitStack() as stack:
        with trio.fail_after(10):
            await open_idle(port, 1, stack, running.server)
            over = await trio.open_tcp_stream("127.0.0.1", port)
            async with over:
                status, headers, _ = parse_response(await read_to_close(over))
    assert (status, headers["retry-after"]) == (503, "1")
    assert running.server.connections.refused == 1


@pytest.mark.parametrize("sent", [b"", b"GET /health HTTP/1.1\r\nHost: localhost\r\n"])
async def test_a_head_not_finished_in_time_loses_its_connection(
    start_server: Any, sent: bytes
) -> None:
    """Nothing sent, or a head without its blank line (slowloris): the server closes the
    connection once the head timeout is over, long before the start timeout."""
    running = await start_server(head_timeout=0.5, start_timeout=60.0)
    stream = await trio.open_tcp_stream("127.0.0.1", running.server.port)
    async with stream:
        await stream.send_all(sent)
        with trio.fail_after(30):  # waits for the server's close, an event
            assert await read_to_close(stream) == b""
    assert running.server.connections.head_timeouts == 1
    await trio.testing.wait_all_tasks_blocked()
    assert running.server.connections.open == 0


# ----------------------------------------------------------- the default cap


def test_the_default_cap_derives_from_the_descriptor_limit(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Soft limit less 64 for the process, 8 reserved for /health and 4 per session."""
    limits = {"soft": 256}
    monkeypatch.setattr(
        resource, "getrlimit", lambda which: (limits["soft"], resource.RLIM_INFINITY)
    )

    def cap(**config: Any) -> int:
        return VideoServer(SyntheticEngine(), ServerConfig(**config)).max_connections

    assert cap(max_sessions=16) == 256 - 64 - 8 - 4 * 16 == 120
    assert cap(max_sessions=4) == 256 - 64 - 8 - 16
    limits["soft"] = 1024
    assert cap(max_sessions=16) == 888
    limits["soft"] = resource.RLIM_INFINITY
    assert cap(max_sessions=16) == connections.UNLIMITED_DESCRIPTORS - 136
    limits["soft"] = 100
    assert cap(max_sessions=16) == 1  # never 0 or less: the server warns instead
    assert cap(max_sessions=16, max_connections=50) == 50  # what the operator says wins


async def test_a_reserved_slot_is_taken_from_the_oldest_head_still_awaited() -> None:
    """Unit rules of the slots: ordinary first, then reserved, then evict the oldest
    reserved connection still reading its head, else nothing."""
    slots = connections.ConnectionSlots(1, reserved=2)
    ordinary = slots.take()
    assert ordinary is not None and not ordinary.reserved
    a, b = slots.take(), slots.take()
    assert a is not None and b is not None and a.reserved and b.reserved
    assert slots.take() is None  # neither reads a head: nothing to evict
    with a.reading_head(60.0) as reading_a, b.reading_head(60.0):
        c = slots.take()
        assert c is not None and c.reserved and a.evicted and not b.evicted
        assert reading_a.cancel_called
    assert slots.open == 3 and slots.refused == 2 and slots.head_timeouts == 0
    a.release()  # evicted: its count went to c
    assert slots.open == 3
    for slot in (b, c, ordinary, ordinary):
        slot.release()
    assert slots.open == 0


# ----------------------------------------------------- a real descriptor limit

_LOWERED_LIMIT = textwrap.dedent(
    """
    import resource, runpy, sys
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, 256))
    sys.argv = ["trio_vstream", *sys.argv[1:]]
    runpy.run_module("trio_vstream", run_name="__main__")
    """
)


@pytest.mark.slow
async def test_300_idle_connections_at_256_descriptors_leave_health_answering() -> None:
    """The reproduction: ``python -m trio_vstream`` under ``ulimit -n 256``, 300 idle
    connections held (timeouts long, so only the cap saves it), then /health: 200, and
    the listener never met EMFILE."""
    process = subprocess.Popen(
        [
            sys.executable,
            "-c",
            _LOWERED_LIMIT,
            "--engine",
            "synthetic",
            "--port",
            "0",
            "--head-timeout",
            "60",
            "--start-timeout",
            "60",
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = await trio.to_thread.run_sync(process.stdout.readline)
        match = re.search(r"ws://127\.0\.0\.1:(\d+)/", line)
        assert match, f"no URL in {line!r}"
        port = int(match.group(1))
        async with contextlib.AsyncExitStack() as stack:
            await open_idle(port, 300, stack)
            with trio.fail_after(30):
                assert await health(port) == (200, b"ok\n")
    finally:
        process.kill()
        _, log = await trio.to_thread.run_sync(process.communicate)
    assert "at most 120 connections (+8 for /health; descriptor limit 256)" in log
    assert "EMFILE" not in log and "accept returned" not in log
