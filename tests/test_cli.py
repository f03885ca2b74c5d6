"""``python -m trio_vstream`` as a user runs it: a real process, real signals."""

from __future__ import annotations

import contextlib
import json
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
import trio
from trio_websocket import open_websocket_url

from tests.conftest import decode_video

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


async def test_serves_and_shuts_down_gracefully_on_sigterm(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, url = server_process
    received: list[dict[str, object]] = []
    async with open_websocket_url(url, max_message_size=1 << 26) as ws:
        await ws.send_message(
            json.dumps({"type": "session.start", "prompt": "p", "size": "32x32", "num_frames": 500})
        )
        received.append(json.loads(await ws.get_message()))
        process.send_signal(signal.SIGTERM)
        while True:
            message = await ws.get_message()
            if isinstance(message, str):
                received.append(json.loads(message))
                if received[-1]["type"] in ("session.done", "error"):
                    break
    assert received[0]["type"] == "video.start"
    assert received[-1]["type"] == "error" and received[-1]["code"] == "server_shutdown"
    deadline = time.monotonic() + 10
    while process.poll() is None and time.monotonic() < deadline:
        await trio.sleep(0.05)
    assert process.returncode == 0
    assert process.stderr is not None
    log = process.stderr.read()
    assert "shutting down gracefully" in log
    assert "engine stream closed" in log


def test_sigint_with_no_sessions_exits_zero(
    server_process: tuple[subprocess.Popen[str], str],
) -> None:
    process, _ = server_process
    process.send_signal(signal.SIGINT)
    assert process.wait(timeout=10) == 0


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--engine", "nope"], "unknown engine 'nope'"),
        (["--engine", "no_such_module:factory"], "cannot import engine module 'no_such_module'"),
        (["--engine", "synthetic", "--engine-arg", "steps=zero"], "steps must be an integer"),
        (["--engine", "synthetic", "--engine-arg", "colour=red"], "unknown engine arg(s) colour"),
        (["--engine-arg", "novalue"], "expected KEY=VALUE"),
        (["--max-sessions", "0"], "must be > 0"),
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


def test_custom_engine_factory_by_module_path() -> None:
    """``--engine package.module:factory`` loads a lab's own engine."""
    from trio_vstream.engines import load_engine

    engine = load_engine("trio_vstream.engines.synthetic:create_engine", {"steps": "2"})
    assert engine.name == "synthetic"
    assert engine.settings.steps == 2  # type: ignore[attr-defined]


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
