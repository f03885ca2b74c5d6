"""One client address cannot take every connection (``--max-connections-per-ip``).

The attack: a single host opens connections (idle sockets, upgrades that never start,
sessions) until the server's connection slots are gone, and everyone else gets 503.
With the cap, that host's connections beyond it get a 429 at once, before they take a
slot, and other addresses are served as before. Loopback has a whole /8, so a second
"host" is a client bound to 127.0.0.2.
"""

from __future__ import annotations

import contextlib
from typing import Any

import pytest
import trio
import trio.testing
from trio_websocket import ConnectionRejected

from tests.security.test_idle_connections import get, parse_response, read_to_close, until
from trio_vstream.server import connections
from trio_vstream.server.http import SECURITY_HEADERS


async def request_from(local: str, port: int, head: bytes) -> tuple[int, dict[str, str], bytes]:
    stream = await trio.open_tcp_stream("127.0.0.1", port, local_address=local)
    async with stream:
        await stream.send_all(head)
        return parse_response(await read_to_close(stream))


async def test_an_address_past_its_cap_gets_429_and_others_are_served(
    start_server: Any,
) -> None:
    running = await start_server(max_connections_per_ip=2, head_timeout=60.0, start_timeout=60.0)
    server = running.server
    port = server.port
    async with contextlib.AsyncExitStack() as stack:
        with trio.fail_after(10):
            held = []
            for count in (1, 2):  # two idle sockets from 127.0.0.1: its share
                held.append(
                    await stack.enter_async_context(await trio.open_tcp_stream("127.0.0.1", port))
                )
                await until(lambda: server.per_address.open_from("127.0.0.1") == count)  # noqa: B023
            status, headers, body = await request_from("127.0.0.1", port, get("/health"))
            assert (status, headers["retry-after"], body) == (
                429,
                "1",
                b"too many connections from this address: try again later\n",
            )
            for name, value in SECURITY_HEADERS.items():
                assert headers[name] == value
            with pytest.raises(ConnectionRejected) as rejected:  # an upgrade too
                async with running.connect():
                    pass
            assert rejected.value.status_code == 429
            assert server.per_address.refused == 2
            assert server.connections.open == 2  # the refused ones took no slot
            # Another address is served, sessions included.
            assert (await request_from("127.0.0.2", port, get("/health")))[0] == 200
            # A closed connection gives its address's place back.
            await held[0].aclose()
            await until(lambda: server.per_address.open_from("127.0.0.1") == 1)
            transcript = await running.run_session(
                {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}
            )
            assert transcript.terminal[0]["type"] == "session.done"
            status, _, metrics = await request_from("127.0.0.2", port, get("/metrics"))
    assert status == 200
    assert b'trio_vstream_connections_refused_per_ip_total{model="synthetic"} 2.0' in metrics
    await until(lambda: server.per_address.open_from("127.0.0.1") == 0)
    assert server.per_address._open == {}  # nothing kept per address once it is gone


async def test_without_a_cap_one_address_may_hold_many(start_server: Any) -> None:
    running = await start_server(head_timeout=60.0)
    server = running.server
    async with contextlib.AsyncExitStack() as stack:
        with trio.fail_after(10):
            for count in range(1, 11):
                await stack.enter_async_context(
                    await trio.open_tcp_stream("127.0.0.1", server.port)
                )
                await until(lambda: server.per_address.open_from("127.0.0.1") == count)  # noqa: B023
            assert server.per_address.refused == 0


@pytest.mark.parametrize(
    ("address", "key"),
    [
        ("203.0.113.7", "203.0.113.7"),
        ("::ffff:203.0.113.7", "203.0.113.7"),  # a dual-stack socket's IPv4 client
        ("2001:db8:1:2:aaaa::1", "2001:db8:1:2::/64"),
        ("2001:db8:1:2:ffff:ffff:ffff:ffff", "2001:db8:1:2::/64"),  # the same host's block
        ("2001:db8:1:3::1", "2001:db8:1:3::/64"),
        ("fe80::1%eth0", "fe80::/64"),
        ("?", "?"),  # no address (the socket is gone): counted together
    ],
)
def test_what_counts_as_one_address(address: str, key: str) -> None:
    assert connections.address_key(address) == key


def test_the_cap_counts_and_forgets() -> None:
    per = connections.PerAddress(2)
    assert per.take("a") and per.take("a") and not per.take("a")
    assert per.take("b")
    per.release("a")
    assert per.take("a")
    assert (per.open_from("a"), per.open_from("b"), per.refused) == (2, 1, 1)
    for key in ("a", "a", "b"):
        per.release(key)
    assert per._open == {}
