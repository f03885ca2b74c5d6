"""``/stats`` lists every session's request id and errors: only the operator reads it.

Before ``--admin-api-key``, any holder of an API key read every other user's sessions
there. Now: a server with admin keys shows ``/stats`` (and ``/metrics``) to admin keys
only; one with API keys but no admin key shows ``/stats`` to nobody and ``/metrics`` to
key holders (aggregate figures, what existing scrapers read); one without any key, the
local development server, shows both to its local users as before (the Host check keeps
other sites' pages out, tests/security/test_dns_rebinding.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.security.raw_http import request, upgrade
from trio_vstream import cli
from trio_vstream.server.access import AccessPolicy

KEY = "client-key_0123456789"
ADMIN = "operator-key_0123456789"
START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}


def bearer(port: int, key: str | None) -> list[tuple[str, str]]:
    host = [("Host", f"127.0.0.1:{port}")]
    return host if key is None else [*host, ("Authorization", f"Bearer {key}")]


async def statuses(port: int, path: str) -> dict[str | None, int]:
    """The status of ``path`` with no key, a client key, an admin key and a wrong key."""
    return {
        key: (await request(port, path, bearer(port, key))).status
        for key in (None, KEY, ADMIN, "wrong-key-0123456789")
    }


async def test_a_client_key_does_not_read_other_users_sessions(start_server: Any) -> None:
    """API keys, no admin key: /stats is off for everyone; /metrics for key holders."""
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    port = running.server.port
    await running.run_session(START, extra_headers=[("Authorization", f"Bearer {KEY}")])
    await running.wait_sessions_ended(1)
    refused = await request(port, "/stats", bearer(port, KEY))
    assert refused.status == 403, refused
    assert refused.body.startswith(b"not_admin:")
    assert b"video_stream" not in refused.body  # no request id
    assert await statuses(port, "/stats") == {
        None: 401,
        KEY: 403,
        ADMIN: 401,  # not configured here: just a wrong key
        "wrong-key-0123456789": 401,
    }
    assert (await statuses(port, "/metrics"))[KEY] == 200


async def test_with_admin_keys_only_they_read_stats_and_metrics(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(api_keys=(KEY,), admin_keys=(ADMIN,)))
    port = running.server.port
    await running.run_session(START, extra_headers=[("Authorization", f"Bearer {KEY}")])
    await running.wait_sessions_ended(1)
    for path in ("/stats", "/metrics"):
        assert await statuses(port, path) == {
            None: 401,
            KEY: 403,
            ADMIN: 200,
            "wrong-key-0123456789": 401,
        }, path
    stats = json.loads((await request(port, "/stats", bearer(port, ADMIN))).body)
    (session,) = stats["recent_sessions"]
    assert session["request_id"].startswith("video_stream")
    # The operator's key is a key for everything else too.
    assert (await request(port, "/v1/models", bearer(port, ADMIN))).status == 200
    assert (await upgrade(port, bearer(port, ADMIN))).status == 101


async def test_admin_keys_alone_guard_stats_on_an_open_server(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(admin_keys=(ADMIN,)))
    port = running.server.port
    assert (await request(port, "/v1/models", bearer(port, None))).status == 200
    assert (await upgrade(port, bearer(port, None))).status == 101
    for path in ("/stats", "/metrics"):
        assert (await request(port, path, bearer(port, None))).status == 401, path
        assert (await request(port, path, bearer(port, ADMIN))).status == 200, path


async def test_without_any_key_stats_stays_open_for_local_tools(start_server: Any) -> None:
    """The benchmark, the soak and the tests read /stats of servers started without keys."""
    running = await start_server()
    port = running.server.port
    assert (await request(port, "/stats", bearer(port, None))).status == 200
    assert (await request(port, "/metrics", bearer(port, None))).status == 200


# ---------------------------------------------------------------------- the flags


def serve_args(*argv: str) -> argparse.Namespace:
    return cli.build_parser().parse_args(["serve", *argv])


def test_admin_keys_from_flags_file_and_environment(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.delenv(cli.API_KEY_ENV, raising=False)
    monkeypatch.setenv(cli.ADMIN_API_KEY_ENV, "from-the-environment-01")
    keys = tmp_path / "admin-keys"
    keys.write_text("from-the-file-0123456\n  # old-admin-key\n")
    policy = cli.access_policy(
        serve_args("--admin-api-key", ADMIN, "--admin-api-key-file", str(keys))
    )
    assert policy.admin_keys == (ADMIN, "from-the-environment-01", "from-the-file-0123456")
    assert policy.api_keys == ()


def test_an_admin_key_that_is_also_an_api_key_is_refused() -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("TRIO_VSTREAM_")}
    result = subprocess.run(
        [
            sys.executable,
            "-m",
            "trio_vstream",
            "--engine",
            "synthetic",
            "--api-key",
            KEY,
            "--admin-api-key",
            KEY,
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=env,
    )
    assert result.returncode == 2
    assert "an admin key must not also be given as an API key" in result.stderr
    assert KEY not in result.stderr
