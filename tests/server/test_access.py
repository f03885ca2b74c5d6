"""Who may use the server: API keys, the Origin check and TLS, before any session starts."""

from __future__ import annotations

import json
import logging
import os
import ssl
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import trio
import trustme
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import Transcript, receive_into
from trio_vstream.server.access import AccessPolicy, key_subprotocol, normalise_origin

START = {"type": "session.start", "prompt": "x", "size": "32x32", "num_frames": 4}
KEY = "s3cret-key_0123456789"


# ------------------------------------------------------------------ the policy alone


def headers(**fields: str) -> list[tuple[bytes, bytes]]:
    return [(name.replace("_", "-").encode(), value.encode()) for name, value in fields.items()]


def test_keys_are_accepted_from_the_header_or_a_subprotocol_entry() -> None:
    policy = AccessPolicy(api_keys=("other", KEY))
    assert policy.key_accepted(headers(authorization=f"Bearer {KEY}"))
    assert policy.key_accepted(headers(authorization=f"bearer   {KEY}  "))
    assert policy.key_accepted(
        headers(sec_websocket_protocol=f"trio-vstream, {key_subprotocol(KEY)}")
    )
    assert not policy.key_accepted(headers())
    assert not policy.key_accepted(headers(authorization=f"Bearer {KEY}x"))
    assert not policy.key_accepted(headers(authorization=f"Basic {KEY}"))
    assert not policy.key_accepted(headers(sec_websocket_protocol="trio-vstream.key.!!!"))
    assert not policy.key_accepted(headers(sec_websocket_protocol=KEY))
    assert AccessPolicy().key_accepted(headers())  # no keys configured: open


def test_key_subprotocol_entries_are_valid_tokens() -> None:
    entry = key_subprotocol("a key/with+odd=chars?")
    assert all(c.isalnum() or c in "-._" for c in entry), entry


def test_origins_own_listed_or_any() -> None:
    policy = AccessPolicy(allowed_origins=("https://app.example.org",))
    own = headers(host="127.0.0.1:8000", origin="http://127.0.0.1:8000")
    assert policy.origin_allowed(own, secure=False)
    assert not policy.origin_allowed(own, secure=True)  # an http page on an https server
    assert policy.origin_allowed(headers(host="h:443", origin="https://h"), secure=True)
    assert policy.origin_allowed(headers(host="x"), secure=False)  # not a browser
    listed = headers(host="x", origin="https://APP.example.org:443")
    assert policy.origin_allowed(listed, secure=False)
    for origin in ("https://evil.example", "null", "https://app.example.org:8443", "garbage"):
        assert not policy.origin_allowed(headers(host="x", origin=origin), secure=False)
    assert AccessPolicy(allowed_origins=("*",)).origin_allowed(
        headers(host="x", origin="https://evil.example"), secure=False
    )
    assert normalise_origin("https://[::1]:9") == "https://[::1]:9"


# ----------------------------------------------------------------- through a server


async def http_get(port: int, path: str, **extra: str) -> int:
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    lines = "".join(f"{k.replace('_', '-')}: {v}\r\n" for k, v in extra.items())
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n{lines}\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    return int(data.split()[1])


async def test_without_the_key_nothing_but_the_page_and_health(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.DEBUG)
    running = await start_server(access=AccessPolicy(api_keys=(KEY,)))
    port = running.server.port
    for path in ("/v1/models", "/metrics", "/stats", "/v1/realtime/video"):
        assert await http_get(port, path) == 401, path
        assert await http_get(port, path, authorization="Bearer nope") == 401, path
        assert await http_get(port, path, authorization=f"Bearer {KEY}") != 401, path
    for path in ("/health", "/", "/static/player.js"):
        assert await http_get(port, path) == 200, path
    for attempt in ({}, {"extra_headers": [("Authorization", "Bearer wrong")]}):
        with pytest.raises(ConnectionRejected) as rejected:
            async with running.connect(**attempt):
                pass
        assert rejected.value.status_code == 401
    assert running.server.stats.sessions_total == 0  # refused before any session

    with_header = await running.run_session(
        START, extra_headers=[("Authorization", f"Bearer {KEY}")]
    )
    assert with_header.terminal[-1]["type"] == "session.done"
    transcript = Transcript()
    async with running.connect(subprotocols=["trio-vstream", key_subprotocol(KEY)]) as ws:
        assert ws.subprotocol == "trio-vstream"
        await ws.send_message(json.dumps(START))
        await receive_into(ws, transcript)
    assert transcript.terminal[-1]["type"] == "session.done"
    logged = "\n".join(f"{r.getMessage()} {r.exc_text or ''}" for r in caplog.records)
    assert KEY not in logged and key_subprotocol(KEY) not in logged


async def test_a_page_of_another_site_is_refused(start_server: Any) -> None:
    running = await start_server(access=AccessPolicy(allowed_origins=("https://ok.example",)))
    port = running.server.port
    with pytest.raises(ConnectionRejected) as rejected:
        async with running.connect(extra_headers=[("Origin", "https://evil.example")]):
            pass
    assert rejected.value.status_code == 403
    for origin in (f"http://127.0.0.1:{port}", "https://ok.example"):
        transcript = await running.run_session(START, extra_headers=[("Origin", origin)])
        assert transcript.terminal[-1]["type"] == "session.done", origin
    assert running.server.stats.sessions_total == 2


# ------------------------------------------------------------------------------ TLS


@pytest.fixture(scope="module")
def authority() -> trustme.CA:
    return trustme.CA()


def client_context(authority: trustme.CA) -> ssl.SSLContext:
    context = ssl.create_default_context()
    authority.configure_trust(context)
    return context


async def test_tls_serves_wss_and_https_on_one_port(
    start_server: Any, authority: trustme.CA
) -> None:
    server_context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    authority.issue_cert("127.0.0.1").configure_cert(server_context)
    running = await start_server(ssl_context=server_context)
    assert running.url.startswith("wss://127.0.0.1:")
    transcript = await running.run_session(START, ssl_context=client_context(authority))
    assert transcript.terminal[-1]["type"] == "session.done"
    assert transcript.close_code == 1000

    tcp = await trio.open_tcp_stream("127.0.0.1", running.server.port)
    tls = trio.SSLStream(
        tcp, client_context(authority), server_hostname="127.0.0.1", https_compatible=True
    )
    async with tls:
        await tls.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        reply = b""
        while chunk := await tls.receive_some():
            reply += chunk
    assert reply.startswith(b"HTTP/1.1 200") and reply.endswith(b"ok\n")

    # A plain-text client on the TLS port is hung up on; the server keeps serving.
    plain = await trio.open_tcp_stream("127.0.0.1", running.server.port)
    async with plain:
        await plain.send_all(b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
        assert await plain.receive_some() == b""
    again = await running.run_session(START, ssl_context=client_context(authority))
    assert again.terminal[-1]["type"] == "session.done"


# ------------------------------------------------------------------------------ CLI


@pytest.fixture
def cert_files(tmp_path: Path, authority: trustme.CA) -> tuple[Path, Path]:
    cert = authority.issue_cert("127.0.0.1")
    certfile, keyfile = tmp_path / "cert.pem", tmp_path / "key.pem"
    cert.cert_chain_pems[0].write_to_path(certfile)
    cert.private_key_pem.write_to_path(keyfile)
    return certfile, keyfile


@pytest.mark.slow
async def test_cli_serves_tls_with_a_key_from_the_environment(
    cert_files: tuple[Path, Path], authority: trustme.CA
) -> None:
    certfile, keyfile = cert_files
    env = {**os.environ, "TRIO_VSTREAM_API_KEY": KEY}
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "trio_vstream",
            "--port",
            "0",
            "--engine",
            "synthetic",
            "--ssl-certfile",
            str(certfile),
            "--ssl-keyfile",
            str(keyfile),
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        assert "serving wss://127.0.0.1:" in line, line
        url = line.split()[2]
        with pytest.raises(ConnectionRejected):
            async with open_websocket_url(url, ssl_context=client_context(authority)):
                pass
        async with open_websocket_url(
            url,
            ssl_context=client_context(authority),
            extra_headers=[("Authorization", f"Bearer {KEY}")],
        ) as ws:
            await ws.send_message(json.dumps(START))
            assert json.loads(await ws.get_message())["type"] == "video.start"
    finally:
        process.terminate()
        process.wait(timeout=30)
    assert process.stderr is not None
    assert KEY not in process.stderr.read()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--ssl-keyfile", "k.pem"], "--ssl-keyfile needs --ssl-certfile"),
        (["--ssl-certfile", "/nonexistent.pem"], "cannot load"),
        (["--api-key-file", "/nonexistent-keys"], "--api-key-file: No such file"),
        (["--api-key", ""], "a key must be non-empty"),
        (["--allowed-origins", "example.org"], "is not an origin"),
    ],
)
def test_bad_access_flags_fail_with_a_clear_message(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_vstream", "--engine", "synthetic", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr
