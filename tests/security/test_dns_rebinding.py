"""DNS rebinding: a web page whose DNS name is re-pointed to 127.0.0.1 must get nothing.

The attack: a page on ``rebind.attacker.example`` has its name re-pointed (short TTL) to
127.0.0.1. The browser still treats it as that page's own origin, so its requests to
``http://rebind.attacker.example:PORT`` reach a server on this machine with ``Host`` and
``Origin`` both naming the attacker, and the Origin check (Origin == Host) passes. Before
the Host check it read ``/stats`` (200) and opened sessions (101). The tests send exactly
that request, through a real server on loopback.
"""

from __future__ import annotations

import argparse
import logging
import re
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.security.raw_http import request, upgrade
from trio_vstream import cli
from trio_vstream.cli import serve
from trio_vstream.server.access import (
    AccessPolicy,
    is_loopback,
    normalise_allowed_hosts,
    parse_host,
)
from trio_vstream.server.app import ServerConfig

ATTACKER = "rebind.attacker.example"


def rebound(port: int, name: str = ATTACKER) -> list[tuple[str, str]]:
    """The headers a rebound page's request carries: its own name in Host and Origin."""
    return [("Host", f"{name}:{port}"), ("Origin", f"http://{name}:{port}")]


def host_refusals(metrics: bytes) -> float:
    for family in text_string_to_metric_families(metrics.decode()):
        if family.name == "trio_vstream_host_refused":
            return sum(s.value for s in family.samples if s.name.endswith("_total"))
    raise AssertionError("no trio_vstream_host_refused in /metrics")


async def test_a_rebound_page_reads_nothing_and_opens_no_session(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_vstream.server.routing")
    running = await start_server()  # no key: the default, most exposed server
    port = running.server.port
    for path in ("/stats", "/metrics", "/v1/models", "/health", "/", "/static/player.js"):
        response = await request(port, path, rebound(port))
        assert response.status == 421, (path, response)
        assert response.body.startswith(b"misdirected_request"), response
    refused = await upgrade(port, rebound(port))
    assert refused.status == 421, refused
    # A watch link is refused the same way, before its token is even looked at.
    watch = await upgrade(port, rebound(port), path="/v1/realtime/video/watch/x")
    assert watch.status == 421, watch
    assert running.server.stats.sessions_total == 0
    assert running.server.stats.sessions_active == 0

    # The server's own names still get everything.
    own = [("Host", f"127.0.0.1:{port}"), ("Origin", f"http://127.0.0.1:{port}")]
    assert (await request(port, "/stats", own)).status == 200
    assert (await upgrade(port, own)).status == 101
    metrics = await request(port, "/metrics", own)
    assert host_refusals(metrics.body) == 8  # six paths, two upgrades
    # Logged, the forged name escaped; rate-limited (one line per 10 s, so fewer lines
    # than refusals; the limiter itself is tested with a fake clock in test_keys.py).
    lines = [r.getMessage() for r in caplog.records if "refused a request for Host" in r.message]
    assert lines and ATTACKER in lines[0] and len(lines) < 8, lines


@pytest.mark.parametrize(
    "host",
    [
        "127.0.0.1",
        "127.0.0.1:{port}",
        "127.8.9.10:{port}",
        "localhost",
        "localhost:{port}",
        "LocalHost.:{port}",
        "[::1]",
        "[::1]:{port}",
    ],
)
async def test_loopback_names_and_addresses_are_served(start_server: Any, host: str) -> None:
    running = await start_server()
    port = running.server.port
    name = host.format(port=port)
    assert (await request(port, "/stats", [("Host", name)])).status == 200, name
    own_origin = [("Host", name), ("Origin", f"http://{name}")]
    assert (await upgrade(port, own_origin)).status == 101, name


@pytest.mark.parametrize(
    "headers",
    [
        [],  # HTTP/1.0 allows no Host; this server does not
        [("Host", "")],
        [("Host", "127.0.0.1"), ("Host", ATTACKER)],
        [("Host", "127.0.0.1:80:80")],
        [("Host", "127.0.0.1:http")],
        [("Host", "::1")],  # an IPv6 address needs its brackets
        [("Host", "user@127.0.0.1")],
        [("Host", "127.0.0.1.nip.io")],  # a public name that resolves to 127.0.0.1
        [("Host", "localhost.attacker.example")],
        [("Host", "2130706433")],  # 127.0.0.1 as one number: a name, not an address
    ],
)
async def test_missing_repeated_or_other_hosts_are_refused(
    start_server: Any, headers: list[tuple[str, str]]
) -> None:
    running = await start_server()
    port = running.server.port
    response = await request(port, "/health", headers, version="HTTP/1.0")
    assert response.status in (400, 421), (headers, response)  # h11 may refuse it first
    response = await request(port, "/stats", headers)
    assert response.status in (400, 421), (headers, response)
    assert (await upgrade(port, headers)).status in (400, 421), headers


async def test_allowed_hosts_are_served_and_their_subdomains_when_asked(
    start_server: Any,
) -> None:
    running = await start_server(
        access=AccessPolicy(allowed_hosts=("video.example.org", ".apps.example.org"))
    )
    port = running.server.port
    for name in (
        "video.example.org",
        "VIDEO.example.org.",
        "apps.example.org",
        "a.apps.example.org",
    ):
        assert (await request(port, "/stats", rebound(port, name))).status == 200, name
        assert (await upgrade(port, rebound(port, name))).status == 101, name
    for name in ("example.org", "x.video.example.org", "badapps.example.org", ATTACKER):
        assert (await request(port, "/stats", rebound(port, name))).status == 421, name
        assert (await upgrade(port, rebound(port, name))).status == 421, name


async def test_a_star_serves_any_host_but_the_origin_check_still_holds(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(allowed_hosts=("*",)))
    port = running.server.port
    assert (await request(port, "/health", rebound(port))).status == 200
    other_site = [("Host", f"{ATTACKER}:{port}"), ("Origin", "https://evil.example")]
    assert (await upgrade(port, other_site)).status == 403


# ------------------------------------------------------------- the rule, bind by bind


def allowed(policy: AccessPolicy, host: str, bind: str) -> bool:
    return policy.host_allowed([(b"host", host.encode())], bind=bind)


def test_a_wildcard_bind_serves_any_address_but_only_listed_names() -> None:
    """0.0.0.0 or ::: reached by whichever address the box has; an address cannot be
    re-pointed by someone's DNS, so any address is served, names only when listed."""
    policy = AccessPolicy()
    for bind in ("0.0.0.0", "::", "[::]", ""):
        for host in ("10.0.0.12:8001", "192.0.2.7", "[2001:db8::1]:8001", "localhost:8001"):
            assert allowed(policy, host, bind), (host, bind)
        for host in ("gpu-box.lan:8001", ATTACKER):
            assert not allowed(policy, host, bind), (host, bind)
    assert allowed(AccessPolicy(allowed_hosts=("gpu-box.lan",)), "gpu-box.lan:8001", "0.0.0.0")


def test_a_specific_bind_serves_its_own_address_or_name() -> None:
    policy = AccessPolicy()
    assert allowed(policy, "10.0.0.12:8001", "10.0.0.12")
    assert allowed(policy, "127.0.0.1:8001", "10.0.0.12")  # a tool on the box itself
    assert not allowed(policy, "10.0.0.13:8001", "10.0.0.12")
    assert allowed(policy, "[2001:db8::1]", "2001:db8::1")
    assert allowed(policy, "gpu-box.lan", "gpu-box.lan")  # bound by name: that name
    assert not allowed(policy, ATTACKER, "gpu-box.lan")
    assert not allowed(policy, "10.0.0.12", "127.0.0.1")


def test_host_parsing_and_the_flag_entries() -> None:
    assert parse_host("Example.ORG.:443") == "example.org"
    assert parse_host("[::FFFF:1]:9") == "::ffff:1"
    for bad in ("", ":80", "a b", "a:", "[::1", "[::1]x", "[nothost]", "a:99999999", "a/b"):
        assert parse_host(bad) is None, bad
    assert normalise_allowed_hosts(["Video.Example.org", ".Example.com", "[::1]", "*"]) == (
        "video.example.org",
        ".example.com",
        "::1",
        "*",
    )
    for bad in ("https://video.example.org", "video.example.org:443", ".10.0.0.1", "a b", "*.x"):
        with pytest.raises(ValueError, match="--allowed-hosts"):
            normalise_allowed_hosts([bad])
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("10.0.0.12")


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def test_the_allowed_hosts_flag(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    policy = cli.access_policy(
        serve_args(
            "--allowed-hosts", "video.example.org, .apps.example.org", "--allowed-hosts", "*"
        )
    )
    assert policy.allowed_hosts == ("video.example.org", ".apps.example.org", "*")
    with pytest.raises(ValueError, match=re.escape("'video.example.org:443' is not a host name")):
        cli.access_policy(serve_args("--allowed-hosts", "video.example.org:443"))


def test_a_public_bind_without_allowed_hosts_says_what_to_add(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream")
    serve._log_hosts(ServerConfig(host="0.0.0.0"))
    (hint,) = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert "--allowed-hosts" in hint.getMessage() and "421" in hint.getMessage()
    caplog.clear()
    serve._log_hosts(ServerConfig(host="127.0.0.1"))
    assert not caplog.records
    serve._log_hosts(
        ServerConfig(host="0.0.0.0", access=AccessPolicy(allowed_hosts=("v.example",)))
    )
    assert [r.levelno for r in caplog.records] == [logging.INFO]
