"""Attack: a client writes lines of its own making into the server's log (issue 20, item 7).

Client text reaches the log inside messages (a refused ``model``, an unknown field's
name) and inside tracebacks (an engine exception that quotes the request). A newline
in it started a line the client wrote; a carriage return, an ANSI escape or a bidi
override rewrote what a terminal shows; a lone surrogate made the handler fail. Each
test attacks through a real server and reads every record the way the command line
writes it.
"""

from __future__ import annotations

import json
import logging
import re
from pathlib import Path
from typing import Any

import pytest
import trio
from trio_websocket import open_websocket_url

from tests.conftest import Transcript, is_type, receive_into, receive_until
from tests.instrumented import InstrumentedEngine
from trio_vstream import logsafe
from trio_vstream.engines.contract import GenerationRequest
from trio_vstream.engines.synthetic import SyntheticSettings

START = {"type": "session.start", "prompt": "a red circle", "size": "32x32", "fps": 8}
FORGED = "FORGED ERROR trio_vstream.server.app: connection handler failed"
"""What an attacker wants a reader of the log to see on a line of its own."""
HOSTILE = [
    f"x\n{FORGED}",
    f"x\r\n{FORGED}",
    f"x\r{FORGED}",
    f"x\u2028{FORGED}",  # line separator: a new line to many viewers and shippers
    f"x\x85{FORGED}",  # NEL, a C1 control
    "x\x1b[2J\x1b[31mred",  # clears a terminal, then colours what follows
    "x\u202egnp.exe",  # a right-to-left override
    "x\ud800y",  # a lone surrogate: valid JSON, not encodable as UTF-8
    "x\x00\x7f\x9b",
]
CLI_FORMAT = logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s")


def the_log(caplog: pytest.LogCaptureFixture) -> str:
    """Every record as the command line's handler writes it, tracebacks included."""
    return "\n".join(CLI_FORMAT.format(record) for record in caplog.records)


def assert_no_forged_line(caplog: pytest.LogCaptureFixture) -> None:
    for record in caplog.records:
        message = record.getMessage()
        assert message.isprintable(), f"raw control character in {message!r}"
    text = the_log(caplog)
    text.encode("utf-8")  # what the handler writes can be written
    for line in text.split("\n"):
        assert not line.lstrip(" |").startswith("FORGED"), f"a forged line: {line!r}"
        assert "\r" not in line and "\x1b" not in line and "\u202e" not in line, repr(line)


async def rejected(running: Any, start: dict[str, Any]) -> dict[str, Any]:
    async with running.connect() as ws:
        await ws.send_message(json.dumps(start))
        return json.loads(await ws.get_message())


@pytest.mark.parametrize("text", HOSTILE)
async def test_a_model_name_cannot_write_a_line_of_its_own(
    start_server: Any, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_vstream")
    running = await start_server()
    reply = await rejected(running, {**START, "model": text})
    assert reply["type"] == "error", reply  # model_mismatch; invalid_message for a surrogate
    await running.wait_sessions_ended(1)
    assert_no_forged_line(caplog)
    # The text is in the log, written out: an operator still sees what was sent.
    assert any(reply["code"] in record.getMessage() for record in caplog.records)


@pytest.mark.parametrize("text", HOSTILE)
async def test_an_unknown_field_name_cannot_write_a_line_of_its_own(
    start_server: Any, caplog: pytest.LogCaptureFixture, text: str
) -> None:
    caplog.set_level(logging.DEBUG, logger="trio_vstream")
    running = await start_server()
    reply = await rejected(running, {**START, text: 1, f"y{text}": {"z": [1]}})
    assert reply["type"] == "error", reply
    await running.wait_sessions_ended(1)
    assert_no_forged_line(caplog)
    assert any(reply["code"] in record.getMessage() for record in caplog.records)


async def test_the_escaped_text_reads_like_repr(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream")
    running = await start_server()
    await rejected(running, {**START, "model": f"x\n{FORGED}\x1b[0m"})
    await running.wait_sessions_ended(1)
    ended = [r.getMessage() for r in caplog.records if "ended" in r.getMessage()]
    assert len(ended) == 1
    assert f"x\\n{FORGED}\\x1b[0m" in ended[0]


async def test_a_huge_model_name_is_one_bounded_line(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream")
    running = await start_server()
    reply = await rejected(running, {**START, "model": "m" * (2 * 1024 * 1024)})
    assert reply["code"] == "model_mismatch"
    await running.wait_sessions_ended(1)
    longest = max(len(record.getMessage()) for record in caplog.records)
    assert longest < logsafe.MAX_LOGGED_CHARS + 100


class QuotingEngine(InstrumentedEngine):
    """Fails to open a stream with an exception that quotes the prompt, as a tokenizer
    or a pipeline may: the server logs it with its traceback."""

    def open_stream(self, request: GenerationRequest) -> Any:
        try:
            raise KeyError(request.prompt)
        except KeyError as cause:
            raise RuntimeError(f"cannot embed {request.prompt}") from cause


async def test_client_text_in_an_engine_traceback_stays_inside_it(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="trio_vstream")
    running = await start_server(engine_class=QuotingEngine)
    reply = await rejected(running, {**START, "prompt": f"a fox\n{FORGED}\r\n{FORGED}\x1b[2J"})
    assert reply["code"] == "generation_failed"
    await running.wait_sessions_ended(1)
    tracebacks = [r for r in caplog.records if r.exc_info]
    assert tracebacks, "the engine failure is logged with its traceback"
    assert_no_forged_line(caplog)
    text = the_log(caplog)
    # The traceback keeps its shape: its own lines, and both exceptions of the chain.
    assert "Traceback (most recent call last):" in text
    assert f"RuntimeError: cannot embed a fox\\n{FORGED}\\r\\n{FORGED}\\x1b[2J" in text
    assert "The above exception was the direct cause" in text


async def test_http_headers_and_paths_cannot_write_lines(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """h11 refuses control characters in a request line, but lets obs-text (bytes
    0x80-0xff, C1 controls once decoded) through in header values."""
    caplog.set_level(logging.DEBUG)
    running = await start_server()
    port = running.server.port
    heads = [
        b"GET /%0a" + FORGED.replace(" ", "%20").encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /a\n" + FORGED.encode() + b" HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n",
        b"GET /stats HTTP/1.1\r\nHost: 127.0.0.1\x85" + FORGED.encode() + b"\r\n"
        b"User-Agent: x\x9b2J\r\n\r\n",
        b"GET /v1/realtime/video HTTP/1.1\r\nHost: 127.0.0.1\r\nUpgrade: websocket\r\n"
        b"Connection: Upgrade\r\nSec-WebSocket-Version: 13\r\n"
        b"Sec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
        b"Origin: http://x\x85" + FORGED.encode() + b"\r\n"
        b"Sec-WebSocket-Protocol: a\x85b\r\n\r\n",
    ]
    for head in heads:
        stream = await trio.open_tcp_stream("127.0.0.1", port)
        async with stream:
            await stream.send_all(head)
            with trio.fail_after(10):
                assert await stream.receive_some(65536)  # some answer, whatever it is
    assert_no_forged_line(caplog)


@pytest.mark.slow
async def test_a_watch_token_is_never_logged(
    start_server: Any, caplog: pytest.LogCaptureFixture
) -> None:
    """The token is the capability to watch: whoever reads the log must not gain it."""
    caplog.set_level(logging.DEBUG)
    running = await start_server(SyntheticSettings(chunk_frames=4, step_delay=0.01))
    port = running.server.port
    transcript = Transcript()
    async with running.connect() as ws:
        await ws.send_message(json.dumps({**START, "num_frames": 16}))
        video_start = await receive_until(ws, transcript, is_type("video.start"))
        watch_path = video_start["watch_path"]
        async with open_websocket_url(f"ws://127.0.0.1:{port}{watch_path}") as viewer:
            await viewer.get_message()
        async with open_websocket_url(f"ws://127.0.0.1:{port}{watch_path}x") as stranger:
            assert json.loads(await stranger.get_message())["code"] == "watch_not_found"
        await receive_into(ws, transcript)
    await running.wait_sessions_ended(1)
    token = watch_path.rsplit("/", 1)[-1]
    assert len(token) >= 32
    # (trio-websocket's client, in this process, logs the URL it connects to.)
    server_side = [r for r in caplog.records if not r.getMessage().startswith("Connecting to")]
    assert server_side
    assert not [r for r in server_side if token in CLI_FORMAT.format(r)]


def test_every_logger_of_the_package_escapes() -> None:
    """A module that took its logger from `logging.getLogger` would log client text raw:
    every one goes through `logsafe.get_logger`."""
    package = Path(logsafe.__file__).parent
    raw = [
        str(path.relative_to(package))
        for path in sorted(package.rglob("*.py"))
        if path.name != "logsafe.py" and re.search(r"logging\.getLogger\([^)]", path.read_text())
    ]
    assert raw == []


def test_a_library_record_is_escaped_by_the_handler_filter() -> None:
    """The command line puts the filter on its handlers: a library's record (here one
    like trio-websocket's) that quotes a client is escaped too."""
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    handler = Keep()
    logsafe.escape_on_handlers([handler])
    logsafe.escape_on_handlers([handler])
    assert len(handler.filters) == 1
    library = logging.getLogger("test-library-logs-client-text")
    library.addHandler(handler)
    library.propagate = False
    try:
        library.warning("received %r then %s", b"x", f"y\n{FORGED}")
    finally:
        library.removeHandler(handler)
    assert [r.getMessage() for r in records] == [f"received b'x' then y\\n{FORGED}"]


def test_log_safe() -> None:
    assert logsafe.log_safe("plain text, with 'quotes' and \\ and ünïcödé 🦊") == (
        "plain text, with 'quotes' and \\ and ünïcödé 🦊"
    )
    assert logsafe.log_safe("a\nb\tc\x00\x7f\x85\u2028\u2029\u202e\ud800") == (
        "a\\nb\\tc\\x00\\x7f\\x85\\u2028\\u2029\\u202e\\ud800"
    )
    assert logsafe.log_safe("abcdef", limit=4) == "abcd... (2 more characters)"
