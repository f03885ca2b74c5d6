"""API keys under attack: a revoked key left in the key file, a thousand guesses in one
upgrade, refusals hammered at the server, and keys short enough to guess."""

from __future__ import annotations

import argparse
import hmac
import logging
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families

from tests.security.raw_http import request, upgrade
from trio_vstream import cli
from trio_vstream.server import access
from trio_vstream.server.access import AccessPolicy, Need, RateLimitedLog, Refusal, key_subprotocol

KEY = "s3cret-key_0123456789"
ADMIN = "admin-key_0123456789"


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


@pytest.fixture(autouse=True)
def no_keys_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.delenv(cli.ADMIN_API_KEY_ENV, raising=False)


# ------------------------------------------------------------------------ the key file


def test_an_indented_comment_in_the_key_file_is_not_a_key(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text(f"# live keys\n{KEY}\n   #old-revoked-key\n\t#another-old-key\n\n")
    policy = cli.access_policy(serve_args("--api-key-file", str(keys)))
    assert policy.api_keys == (KEY,)
    assert not policy.key_accepted([(b"authorization", b"Bearer #old-revoked-key")])


def test_a_key_file_of_comments_only_is_refused(tmp_path: Path) -> None:
    keys = tmp_path / "keys"
    keys.write_text("  # all revoked\n   #old-revoked-key\n")
    with pytest.raises(ValueError, match="no key in"):
        cli.access_policy(serve_args("--api-key-file", str(keys)))


# ------------------------------------------------------------ one key entry per request


def many_entries(count: int, right: str) -> list[tuple[str, str]]:
    """``count`` key entries in one Sec-WebSocket-Protocol header, the right one last:
    about 1,400 fit in the server's 64 KiB head."""
    guesses = [key_subprotocol(f"g{n:04d}") for n in range(count - 1)]
    return [
        ("Sec-WebSocket-Protocol", ", ".join(["trio-vstream", *guesses, key_subprotocol(right)]))
    ]


async def test_an_upgrade_offering_many_keys_is_refused_unread(
    start_server: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    compared: list[bytes] = []
    real = hmac.compare_digest

    def counting(a: bytes, b: bytes) -> bool:
        compared.append(a)
        return real(a, b)

    monkeypatch.setattr(access.hmac, "compare_digest", counting)
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    port = running.server.port
    host = [("Host", f"127.0.0.1:{port}")]
    # 1,400 fill the 64 KiB head; 300 fit what the WebSocket handshake itself accepts,
    # which with the right key last used to be a 101 after 300 comparisons.
    for count in (1400, 300):
        response = await upgrade(port, host + many_entries(count, KEY))
        assert compared == [], count  # not one of them was tried
        assert response.status == 400, response
        assert response.body.startswith(b"too_many:"), response.body
    # Two entries are as many too: the header and a subprotocol entry, even both right.
    both = [("Authorization", f"Bearer {KEY}"), ("Sec-WebSocket-Protocol", key_subprotocol(KEY))]
    assert (await upgrade(port, host + both)).status == 400
    twice = [("Authorization", f"Bearer {KEY}"), ("Authorization", f"Bearer {KEY}")]
    assert (await request(port, "/v1/models", host + twice)).status == 400
    assert running.server.stats.sessions_total == 0
    # One entry, compared with each configured key once: served.
    assert (await upgrade(port, host + many_entries(1, KEY))).status == 101
    assert len(compared) == 1


def test_the_policy_looks_at_exactly_one_entry() -> None:
    policy = AccessPolicy(api_keys=(KEY, "other-key-0123456789"))

    def check(*fields: tuple[str, str]) -> Refusal | None:
        return policy.check_key([(n.encode(), v.encode()) for n, v in fields], Need.KEY)

    assert check(("authorization", f"Bearer {KEY}")) is None
    assert check(("sec-websocket-protocol", f"trio-vstream, {key_subprotocol(KEY)}")) is None
    assert check() is Refusal.MISSING
    assert check(("authorization", f"Basic {KEY}")) is Refusal.MISSING
    assert check(("authorization", "Bearer nope")) is Refusal.INVALID
    assert check(("sec-websocket-protocol", "trio-vstream.key.!!!")) is Refusal.INVALID
    wrong_then_right = f"{key_subprotocol('nope')}, {key_subprotocol(KEY)}"
    assert check(("sec-websocket-protocol", wrong_then_right)) is Refusal.TOO_MANY
    assert Refusal.TOO_MANY.status == 400 and Refusal.INVALID.status == 401


# -------------------------------------------------------- refusals counted and logged


def refused_by_reason(metrics: bytes) -> dict[str, float]:
    for family in text_string_to_metric_families(metrics.decode()):
        if family.name == "trio_vstream_auth_refused":
            return {
                s.labels["reason"]: s.value for s in family.samples if s.name.endswith("_total")
            }
    raise AssertionError("no trio_vstream_auth_refused in /metrics")


async def test_refused_keys_are_counted_by_reason_and_never_logged(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    running = await start_server(access=AccessPolicy(api_keys=(KEY,), admin_keys=(ADMIN,)))
    port = running.server.port
    host = [("Host", f"127.0.0.1:{port}")]
    wrong = "wrong-key-guess-0001"
    for _ in range(3):
        assert (await request(port, "/v1/models", host)).status == 401
    for _ in range(2):
        refused = await upgrade(port, [*host, ("Authorization", f"Bearer {wrong}")])
        assert refused.status == 401
        assert refused.headers["www-authenticate"] == 'Bearer realm="trio_vstream"'
    assert (await upgrade(port, host + many_entries(3, KEY))).status == 400
    assert (
        await request(port, "/stats", [*host, ("Authorization", f"Bearer {KEY}")])
    ).status == 403
    admin = [*host, ("Authorization", f"Bearer {ADMIN}")]
    counts = refused_by_reason((await request(port, "/metrics", admin)).body)
    assert counts == {"missing": 3, "invalid": 2, "too_many": 1, "not_admin": 1}
    lines = [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING]
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert lines and all("API key" in line for line in lines), lines
    assert wrong not in logged and KEY not in logged and ADMIN not in logged
    assert key_subprotocol(KEY) not in logged


class FakeClock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_refusals_are_logged_at_most_once_per_interval_with_the_rest_counted(
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.WARNING)
    clock = FakeClock()
    log = RateLimitedLog(
        logging.getLogger("test.refusals"), "refused %s", interval=10.0, clock=clock
    )
    assert log("first")  # the first one at once
    assert not any(log("again") for _ in range(500))
    clock.now += 9.999
    assert not log("still")
    clock.now += 0.001
    assert log("later")  # 10 s after the last line: the next one, with the count between
    clock.now += 60
    assert log("quiet")  # nothing left out since
    assert [r.getMessage() for r in caplog.records] == [
        "refused first",
        "refused later (501 more since the last such line)",
        "refused quiet",
    ]


# ------------------------------------------------------------------------ short keys


def test_short_keys_are_warned_about_by_where_they_came_from(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger="trio_vstream")
    keys = tmp_path / "keys"
    keys.write_text(f"{KEY}\n# a comment\nshort-file-key\n")
    monkeypatch.setenv(cli.API_KEY_ENV, "envkey15charsxx")
    policy = cli.access_policy(
        serve_args(
            "--api-key", "a" * 16, "--api-key", "tiny", "--api-key-file", str(keys),
            "--admin-api-key", "zq9",
        )
    )  # fmt: skip
    assert len(policy.api_keys) == 5 and policy.admin_keys == ("zq9",)
    messages = [r.getMessage() for r in caplog.records]
    sources = [m.split(": a key shorter")[0] for m in messages]
    assert sources == [
        "--api-key 2",
        f"${cli.API_KEY_ENV}",
        f"--api-key-file {keys} line 3",
        "--admin-api-key 1",
    ], messages
    for secret in ("tiny", "envkey15charsxx", "short-file-key", "zq9"):
        assert not any(secret in m.replace(str(keys), "") for m in messages), secret
