"""``python -m trio_vstream`` as a user runs it: a real process, real signals."""

from __future__ import annotations

import contextlib
import functools
import json
import logging
import os
import re
import signal
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from trio_websocket import ConnectionRejected, open_websocket_url

from tests.conftest import decode_video
from trio_vstream import cli

URL_LINE = re.compile(r"ws://127\.0\.0\.1:(\d+)/v1/realtime/video")


@contextlib.contextmanager
def serving(*args: str) -> Iterator[tuple[subprocess.Popen[str], str, str]]:
    """``python -m trio_vstream --port 0 ARGS``: the process, its URL and its first line."""
    process = subprocess.Popen(
        [sys.executable, "-m", "trio_vstream", "--port", "0", *args],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        line = process.stdout.readline()
        match = URL_LINE.search(line)
        assert match, f"no URL in {line!r}"
        yield process, match.group(0), line
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(timeout=10)


@pytest.fixture
def server_process() -> Iterator[tuple[subprocess.Popen[str], str]]:
    with serving("--engine", "synthetic", "--engine-arg", "step_delay=0.02") as (process, url, _):
        yield process, url


async def http_status(url: str, path: str) -> int:
    port = int(url.rsplit(":", 1)[1].split("/")[0])
    stream = await trio.open_tcp_stream("127.0.0.1", port)
    async with stream:
        await stream.send_all(f"GET {path} HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n".encode())
        data = b""
        while chunk := await stream.receive_some():
            data += chunk
    return int(data.split()[1])


async def read_to_terminal(ws: Any, received: list[dict[str, Any]]) -> bytes:
    video = b""
    while True:
        message = await ws.get_message()
        if isinstance(message, bytes):
            video += message
            continue
        received.append(json.loads(message))
        if received[-1]["type"] in ("session.done", "error"):
            return video


async def wait_exit(process: subprocess.Popen[str], seconds: float = 10) -> int | None:
    """The exit status, or None if the process still runs after ``seconds``."""
    try:
        return await trio.to_thread.run_sync(functools.partial(process.wait, timeout=seconds))
    except subprocess.TimeoutExpired:
        return None


async def wait_draining(url: str, seconds: float = 10) -> None:
    """Until the server process answers /health with 503. It is another process and
    tells nothing when it starts draining, so this polls what a load balancer sees."""
    with trio.fail_after(seconds):
        # Polled (ASYNC110): another process, with no event to wait on.
        while await http_status(url, "/health") != 503:  # noqa: ASYNC110
            await trio.sleep(0.02)


@pytest.mark.slow
async def test_sigterm_drains_running_sessions_lose_nothing(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    """A rolling restart: after SIGTERM the running video completes, while /health and new
    upgrades answer 503 (a balancer sends them elsewhere); then the process exits 0."""
    process, url = server_process
    received: list[dict[str, Any]] = []
    async with open_websocket_url(url, max_message_size=1 << 26) as ws:
        await ws.send_message(
            json.dumps({"type": "session.start", "prompt": "p", "size": "32x32", "num_frames": 200})
        )
        received.append(json.loads(await ws.get_message()))
        assert await http_status(url, "/health") == 200
        process.send_signal(signal.SIGTERM)
        await wait_draining(url)
        with pytest.raises(ConnectionRejected) as rejected:
            async with open_websocket_url(url):
                pass
        assert rejected.value.status_code == 503
        video = await read_to_terminal(ws, received)
    assert received[0]["type"] == "video.start"
    assert received[-1] == {
        "type": "session.done",
        "request_id": received[0]["request_id"],
        "chunks": received[-1]["chunks"],
        "stopped": False,
    }
    assert len(decode_video(video)) == 200
    assert await wait_exit(process) == 0
    assert process.stderr is not None
    log = process.stderr.read()
    assert "shutting down gracefully" in log
    assert "engine stream closed" in log


@pytest.mark.slow
async def test_sessions_still_running_when_the_grace_ends_get_server_shutdown() -> None:
    with serving(
        "--engine", "synthetic", "--engine-arg", "step_delay=0.02", "--shutdown-grace", "0.5"
    ) as (process, url, _):
        received: list[dict[str, Any]] = []
        async with open_websocket_url(url, max_message_size=1 << 26) as ws:
            await ws.send_message(
                json.dumps(
                    {"type": "session.start", "prompt": "p", "size": "32x32", "num_frames": 2000}
                )
            )
            received.append(json.loads(await ws.get_message()))
            process.send_signal(signal.SIGTERM)
            await read_to_terminal(ws, received)
        assert received[-1]["type"] == "error" and received[-1]["code"] == "server_shutdown"
        assert await wait_exit(process) == 0


@pytest.mark.slow
async def test_a_second_signal_stops_at_once() -> None:
    with serving("--engine", "synthetic", "--engine-arg", "step_delay=0.02") as (
        process,
        url,
        _,
    ):
        async with open_websocket_url(url, max_message_size=1 << 26) as ws:
            await ws.send_message(
                json.dumps(
                    {"type": "session.start", "prompt": "p", "size": "32x32", "num_frames": 2000}
                )
            )
            await ws.get_message()
            process.send_signal(signal.SIGTERM)
            await wait_draining(url)
            process.send_signal(signal.SIGTERM)
            # 2000 frames would take ~20 s; the second signal does not wait for them.
            assert await wait_exit(process, 10) == 0


def test_sigint_with_no_sessions_exits_zero(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, _ = server_process
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 0


@pytest.mark.slow
@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "nope"], "unknown engine 'nope'"),
        (["--engine", "no_such_module:factory"], "cannot import engine module 'no_such_module'"),
        (["--engine", "synthetic", "--engine-arg", "steps=zero"], "steps must be an integer"),
        (["--engine", "synthetic", "--engine-arg", "colour=red"], "unknown engine arg(s) colour"),
        (["--engine-arg", "novalue"], "expected KEY=VALUE"),
        (["--max-sessions", "0"], "must be > 0"),
        (["--max-connections", "0"], "must be > 0"),
        (["--head-timeout", "0"], "must be > 0"),
        (
            ["--allow-image-urls", "https://images.example.org"],
            "--allow-image-urls: 'https://images.example.org' is not a host name",
        ),
        (["--allow-image-urls", "*.example.org"], "'*.example.org' is not a host name"),
        (["--allow-image-urls", "example.org:0"], "'example.org:0' is not a host name"),
        (["--allow-image-urls", "example.org/x"], "'example.org/x' is not a host name"),
        (["--allow-image-urls"], "expected at least one argument"),
        (["--image-url-max-bytes", "0"], "must be > 0"),
        (["--image-url-max-redirects", "-1"], "must be >= 0"),
    ],
)
def test_bad_arguments_fail_with_a_clear_message(args: list[str], message: str) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "trio_vstream", *args],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 2
    assert message in result.stderr


def test_image_urls_are_off_unless_hosts_are_listed() -> None:
    from trio_vstream.cli import build_parser, image_url_config
    from trio_vstream.media.image_fetch import ImageFetchConfig, public_addresses_only

    default = image_url_config(build_parser().parse_args(["serve"]))
    assert default == ImageFetchConfig() and not default.enabled
    args = build_parser().parse_args(
        [
            "serve",
            "--allow-image-urls",
            "Images.Example.org",
            "cdn.example.org.,[2001:db8::1]",
            "--allow-image-urls",
            "192.0.2.7,images.example.org:8443,example.org:443,[2001:db8::2]:8443",
            "--image-url-max-bytes",
            "1000",
            "--image-url-timeout",
            "2.5",
            "--image-url-max-redirects",
            "0",
        ]
    )
    config = image_url_config(args)
    assert config.allowed_hosts == {
        "images.example.org",
        "cdn.example.org",
        "[2001:db8::1]",
        "192.0.2.7",
        "images.example.org:8443",  # the port given: that one, not 443
        "example.org",  # 443 is the default
        "[2001:db8::2]:8443",
    }
    assert (config.max_bytes, config.timeout, config.max_redirects) == (1000, 2.5, 0)
    # The command line never touches the test-only injection points.
    assert config.ssl_context is None and config.address_policy is public_addresses_only


async def test_the_server_refuses_image_urls_it_may_not_fetch() -> None:
    """Through a real process: a listed host that is loopback is still refused, and so
    is any host not listed, each with its reason."""

    async def error_for(url: str, image_url: str) -> dict[str, Any]:
        start = {
            "type": "session.start",
            "prompt": "a red circle",
            "size": "64x48",
            "num_frames": 2,
            "image_reference": {"image_url": image_url},
        }
        async with open_websocket_url(url) as ws:
            await ws.send_message(json.dumps(start))
            return json.loads(await ws.get_message())

    with serving("--engine", "synthetic", "--allow-image-urls", "localhost") as (_, url, _):
        with trio.fail_after(30):
            loopback = await error_for(url, "https://localhost/x.png")
            unlisted = await error_for(url, "https://example.org/x.png")
    assert loopback["code"] == unlisted["code"] == "invalid_request"
    assert "'localhost' resolves to" in loopback["message"]
    assert "a loopback address" in loopback["message"]
    assert "its host 'example.org' is not one this server fetches from" in unlisted["message"]


def test_custom_engine_factory_by_module_path() -> None:
    """``--engine package.module:factory`` loads a lab's own engine."""
    from trio_vstream.engines import load_engine

    engine = load_engine("trio_vstream.engines.synthetic:create_engine", {"steps": "2"})
    assert engine.name == "synthetic"
    assert engine.settings.steps == 2  # type: ignore[attr-defined]


@pytest.mark.slow
async def test_the_default_engine_is_the_shapes_model() -> None:
    """``python -m trio_vstream`` with no engine flag streams the built-in diffusion
    model: the video shows the colours the prompt asked for."""
    from trio_vstream.models.shapes.evaluate import analyse_clip

    with serving() as (_, url, line):
        assert "(engine: shapes)" in line, line
        start = {
            "type": "session.start",
            "prompt": "a large yellow square moving down on a navy background",
            "size": "128x128",
            "num_frames": 16,
            "seed": 5,
        }
        video = b""
        async with open_websocket_url(url, max_message_size=1 << 26) as ws:
            await ws.send_message(json.dumps(start))
            while True:
                message = await ws.get_message()
                if isinstance(message, bytes):
                    video += message
                elif json.loads(message)["type"] in ("session.done", "error"):
                    assert json.loads(message)["type"] == "session.done", message
                    break
    verdict = analyse_clip(decode_video(video))
    assert (verdict.colour, verdict.background) == ("yellow", "navy")


@pytest.mark.parametrize("signum", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_while_exiting_is_noted_and_changes_nothing(
    signum: signal.Signals, caplog: pytest.LogCaptureFixture
) -> None:
    """After the server stopped, finishing the recordings and freeing the engine must not
    be cut short by a signal (status -15, or KeyboardInterrupt half-way through)."""
    before = signal.getsignal(signum)
    with caplog.at_level(logging.WARNING, logger="trio_vstream"), cli.signals_noted_while_exiting():
        os.kill(os.getpid(), signum)  # Python runs the handler at the next bytecode
        reached = True
    assert reached
    assert f"{signum.name}: already stopping" in caplog.text
    assert signal.getsignal(signum) is before


def test_encode_concurrency_defaults_to_one_encode_per_core(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """One chunk encoding per core (measured: 1.5x the fps of cores - 1 on 2 cores, the
    control-plane targets kept); at least one where the count is unknown."""
    from trio_vstream.server.app import ServerConfig

    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert ServerConfig().encode_concurrency == 2
    assert cli.build_parser().parse_args(["serve"]).encode_concurrency == 2
    monkeypatch.setattr(os, "cpu_count", lambda: None)
    assert ServerConfig().encode_concurrency == 1
