"""The protocol fuzz (``bench/fuzz.py``): its short form against a real server process, and
proof that its oracle can fail.

The short form is what CI runs: 2,000 inputs, half ``session.start`` and half control
messages, with zero violations allowed. A fuzz whose oracle never fires proves nothing, so
the other tests feed the oracle the failures it exists to catch (an error without a code,
an unknown code, ``internal_error``, a lone surrogate in a reply, a session killed by a
control message, a close without a message) and check that each is flagged, and drive a
real server that fails after accepting a session through the fuzz's own client code.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import trio

from bench import fuzz
from trio_vstream import protocol
from trio_vstream.engines.synthetic import SyntheticSettings

REPO = Path(__file__).resolve().parent.parent
FUZZ = REPO / "bench" / "fuzz.py"
LIMIT = protocol.DEFAULT_LIMITS.max_start_bytes
CONTROL_LIMIT = protocol.DEFAULT_LIMITS.max_control_bytes
SMALL_LIMITS = protocol.Limits(max_start_bytes=4096, max_control_bytes=1024)


def _error(code: str | None, message: str = "something was wrong") -> str:
    payload: dict[str, Any] = {"type": "error", "message": message}
    if code is not None:
        payload["code"] = code
    return json.dumps(payload)


VIDEO_START = json.dumps(
    {"type": "video.start", "request_id": "r", "format": "m4s", "config": {"prompt": "a"}}
)
CHUNK = json.dumps({"type": "video.chunk_metadata", "kind": "media", "byte_length": 3})
DONE = json.dumps({"type": "session.done", "request_id": "r", "chunks": 1, "stopped": True})
PONG = '{"type":"session.pong"}'
QUEUED = '{"type":"session.interaction.queued","request_id":"r","event_id":"e1"}'


def _keys(problems: list[fuzz.Problem]) -> list[str]:
    return [problem.key for problem in problems]


# --------------------------------------------------------------------------------------
# The short form, as CI runs it
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_short_form_finds_no_violation(tmp_path: Path) -> None:
    output = tmp_path / "fuzz.json"
    started = time.monotonic()
    done = subprocess.run(
        [
            sys.executable,
            str(FUZZ),
            "--inputs",
            "2000",
            "--seed",
            "1",
            "--json",
            str(output),
            "--time-limit",
            "170",
            "--shrink-time",
            "40",
            "--server-log",
            str(tmp_path / "server.log"),
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=190,
    )
    elapsed = time.monotonic() - started
    assert output.exists(), done.stderr[-3000:]
    report = json.loads(output.read_text())
    # The summary names each violation with its minimal input and the server's log.
    assert report["violations"] == [], done.stdout[-8000:]
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert report["complete"] and report["inputs_run"] == 2000
    assert report["server"]["exit_status"] == 0
    # Both phases got past the first check: some inputs accepted, many refused.
    assert report["accepted"]["start"] > 50 and report["accepted"]["control"] > 50
    assert {"invalid_json", "invalid_message", "invalid_request", "message_too_large"} <= set(
        report["errors"]
    )
    assert elapsed < 90, f"the short form took {elapsed:.0f} s"


# --------------------------------------------------------------------------------------
# One server message
# --------------------------------------------------------------------------------------


def test_a_coded_error_with_a_message_passes() -> None:
    message, problems = fuzz.check_reply(_error("invalid_json"))
    assert message is not None and message["code"] == "invalid_json"
    assert problems == []


@pytest.mark.parametrize(
    ("raw", "key"),
    [
        (_error(None), "error-without-code"),
        (_error(""), "error-without-code"),
        (json.dumps({"type": "error", "message": "x", "code": 7}), "error-without-code"),
        (_error("no_such_code"), "unknown-code"),
        (_error("internal_error"), "internal-error"),
        (_error("invalid_json", ""), "error-without-message"),
        (json.dumps({"type": "error", "code": "invalid_json"}), "error-without-message"),
        (_error("invalid_json", "bad \udc80 text"), "reply-lone-surrogate"),
        ('{"type":"video.start","config":{"prompt":"\\ud83d"}}', "reply-lone-surrogate"),
        ('{"type":"video.start","config":{"\\udfff":1}}', "reply-lone-surrogate"),
        ('{"type":"video.start","config":{"guidance_scale":NaN}}', "reply-not-json"),
        ("not json", "reply-not-json"),
        ('["error"]', "reply-without-type"),
    ],
)
def test_the_oracle_flags_a_bad_server_message(raw: str, key: str) -> None:
    _, problems = fuzz.check_reply(raw)
    assert key in _keys(problems)


def test_lone_surrogates_are_found_in_keys_and_nested_values() -> None:
    value = {"a": ["ok", {"b": "x\udc80"}], "\ud800": 1, "fine": "\U0001f600"}
    paths = fuzz.lone_surrogates(value)
    assert len(paths) == 2
    assert "$.a[1].b" in paths


# --------------------------------------------------------------------------------------
# session.start transcripts
# --------------------------------------------------------------------------------------


def _start(
    *messages: str | bytes, close: int | None = 1000, **kwargs: Any
) -> tuple[str, list[str]]:
    transcript = fuzz.StartTranscript(
        sent_bytes=kwargs.pop("sent", 100), messages=list(messages), close_code=close, **kwargs
    )
    outcome, problems = fuzz.judge_start(transcript, LIMIT)
    return outcome, _keys(problems)


def test_start_outcomes_that_are_fine() -> None:
    assert _start(_error("invalid_request")) == ("error:invalid_request", [])
    assert _start(VIDEO_START, CHUNK, b"abc", DONE) == ("accepted", [])
    assert _start(_error("message_too_large"), sent=LIMIT + 1) == ("error:message_too_large", [])
    # Beyond twice the limit trio-websocket closes with 1009, as documented.
    assert _start(close=1009, sent=2 * LIMIT + 1) == ("closed-1009", [])
    # A session that asked the synthetic engine to fail may fail.
    failed = _error("generation_failed")
    assert _start(VIDEO_START, failed, fault_injected=True) == ("accepted", [])


@pytest.mark.parametrize(
    ("kwargs", "messages", "key"),
    [
        ({"close": 1000}, (), "closed-without-message"),
        ({"close": 1011}, (), "closed-without-message"),
        ({"close": 1009, "sent": 100}, (), "closed-without-message"),
        ({"close": 1011}, (_error("invalid_json"),), "abnormal-close"),
        ({"close": 1006}, (VIDEO_START, DONE), "abnormal-close"),
        ({"close": None, "timed_out": True}, (), "no-reply"),
        ({"close": None, "timed_out": True}, (VIDEO_START,), "no-terminal"),
        ({"close": 1000}, (VIDEO_START, CHUNK, b"abc"), "no-terminal"),
        ({}, (VIDEO_START, _error("generation_failed")), "accepted-then-generation_failed"),
        ({}, (VIDEO_START, _error("encoding_failed")), "accepted-then-encoding_failed"),
        ({}, (VIDEO_START, _error("internal_error")), "internal-error"),
        ({}, (_error("invalid_json"), _error("invalid_json")), "message-after-terminal"),
        ({}, (VIDEO_START, DONE, PONG), "message-after-terminal"),
        ({}, (QUEUED,), "unexpected-first-reply"),
        ({}, (b"\x00",), "unexpected-first-reply"),
        ({"sent": LIMIT + 1}, (VIDEO_START, DONE), "oversize-not-refused"),
        ({"sent": LIMIT + 1}, (_error("invalid_json"),), "oversize-not-refused"),
        ({"sent": LIMIT}, (_error("message_too_large"),), "refused-within-limit"),
        ({"connect_error": "OSError: refused"}, (), "connect-failed"),
    ],
)
def test_the_oracle_flags_a_bad_start_transcript(
    kwargs: dict[str, Any], messages: tuple[str | bytes, ...], key: str
) -> None:
    outcome, keys = _start(*messages, **kwargs)
    assert key in keys
    assert outcome == "violation"


# --------------------------------------------------------------------------------------
# Control exchanges
# --------------------------------------------------------------------------------------


def _control(
    *replies: str,
    terminal: str | None = None,
    close: int | None = None,
    sent: int = 50,
    answers: int = 2,
) -> tuple[str, list[str]]:
    exchange = fuzz.Exchange(
        sent_bytes=sent,
        replies=[json.loads(reply) for reply in replies],
        terminal=json.loads(terminal) if terminal else None,
        close_code=close,
    )
    outcome, problems = fuzz.judge_control(exchange, CONTROL_LIMIT, answers=answers)
    return outcome, _keys(problems)


def test_control_outcomes_that_are_fine() -> None:
    assert _control(QUEUED, PONG) == ("queued", [])
    assert _control(PONG, PONG) == ("pong", [])
    assert _control(_error("event_id_conflict"), PONG) == ("error:event_id_conflict", [])
    assert _control(PONG, terminal=DONE, close=1000) == ("stopped", [])
    assert _control(close=1009, sent=2 * CONTROL_LIMIT + 1) == ("closed-1009", [])
    assert _control(answers=0) == ("running", [])


@pytest.mark.parametrize(
    ("replies", "kwargs", "key"),
    [
        (
            (QUEUED,),
            {"terminal": _error("generation_failed"), "close": 1000},
            "session-ended-generation_failed",
        ),
        ((), {"terminal": _error("internal_error"), "close": 1000}, "session-ended-internal_error"),
        ((), {"terminal": _error("stall_timeout"), "close": 1000}, "session-ended-stall_timeout"),
        ((), {"terminal": DONE, "close": 1011}, "abnormal-close"),
        ((), {"terminal": DONE}, "no-close"),
        ((PONG,), {"close": 1000}, "closed-without-terminal"),
        ((), {"close": 1009}, "closed-without-terminal"),
        ((PONG,), {}, "no-reply"),
        ((), {}, "no-reply"),
        ((PONG, QUEUED), {}, "reply-order"),
        ((_error("model_mismatch"), PONG), {}, "unexpected-code"),
        ((VIDEO_START, PONG), {}, "unexpected-reply"),
        ((QUEUED, PONG), {"sent": CONTROL_LIMIT + 1}, "oversize-not-refused"),
        ((_error("message_too_large"), PONG), {"sent": 10}, "refused-within-limit"),
        (
            (),
            {"terminal": _error("generation_failed"), "close": 1000, "answers": 0},
            "session-ended-generation_failed",
        ),
        ((QUEUED,), {"answers": 0}, "unexpected-reply"),
    ],
)
def test_the_oracle_flags_a_bad_control_exchange(
    replies: tuple[str, ...], kwargs: dict[str, Any], key: str
) -> None:
    outcome, keys = _control(*replies, **kwargs)
    assert key in keys
    assert outcome == "violation"


def test_terminal_codes_are_the_ones_that_end_a_session() -> None:
    assert fuzz.is_terminal(json.loads(DONE))
    assert fuzz.is_terminal(json.loads(_error("generation_failed")))
    assert fuzz.is_terminal(json.loads(_error("internal_error")))
    assert not fuzz.is_terminal(json.loads(_error("invalid_json")))
    assert not fuzz.is_terminal(json.loads(_error("event_id_conflict")))
    assert not fuzz.is_terminal(json.loads(_error("no_such_code")))  # flagged on its own


def test_fault_injection_is_recognised_where_the_server_reads_it() -> None:
    assert fuzz.fault_injected('{"prompt":"a","extra_params":{"fail_at_chunk":0}}')
    assert fuzz.fault_injected(b'{"prompt":"a","sampling_params":{"hang_at_chunk":1}}')
    assert not fuzz.fault_injected('{"prompt":"a","fail_at_chunk":0}')
    assert not fuzz.fault_injected("[" * 5000)


# --------------------------------------------------------------------------------------
# Against a real server, through the fuzz's own client code
# --------------------------------------------------------------------------------------


async def test_an_accepted_session_that_fails_is_flagged(start_server: Any) -> None:
    server = await start_server(SyntheticSettings(fail_at_chunk=0))
    transcript = await fuzz.run_start(server.url, protocol.start_message("a", size="64x64"))
    outcome, problems = fuzz.judge_start(transcript, LIMIT)
    assert outcome == "violation"
    assert _keys(problems) == ["accepted-then-generation_failed"]


async def test_a_healthy_server_passes_start_and_control(start_server: Any) -> None:
    server = await start_server(SyntheticSettings(steps=1, step_delay=0.005, chunk_frames=2))
    transcript = await fuzz.run_start(server.url, protocol.start_message("a", size="64x64"))
    assert fuzz.judge_start(transcript, LIMIT) == ("accepted", [])
    transcript = await fuzz.run_start(server.url, '{"type":"session.start","prompt":"\\udc80"}')
    outcome, problems = fuzz.judge_start(transcript, LIMIT)
    assert outcome.startswith("error:") and problems == []
    message = protocol.interaction_message("a green circle", event_id="e1")
    problems, messages, close_code, request_id = await fuzz.control_alone(
        server.url, message, CONTROL_LIMIT
    )
    assert problems == []
    assert close_code == 1000 and request_id is not None
    assert any('"session.interaction.queued"' in m for m in messages if isinstance(m, str))


async def test_a_session_killed_after_a_control_message_is_flagged(start_server: Any) -> None:
    # The engine fails at its second chunk: the replay waits for chunks, so it sees it.
    server = await start_server(SyntheticSettings(steps=1, step_delay=0.005, fail_at_chunk=1))
    problems, *_ = await fuzz.control_alone(server.url, protocol.PING_MESSAGE, CONTROL_LIMIT)
    assert "session-ended-generation_failed" in _keys(problems)


# --------------------------------------------------------------------------------------
# Inputs and shrinking
# --------------------------------------------------------------------------------------


def test_inputs_are_sendable_varied_and_reproducible() -> None:
    inputs = fuzz.draw_inputs(fuzz.start_inputs(SMALL_LIMITS), 300, seed=3)
    assert len(inputs) == 300 and len({item.wire for item in inputs}) == 300
    assert inputs == fuzz.draw_inputs(fuzz.start_inputs(SMALL_LIMITS), 300, seed=3)
    assert inputs != fuzz.draw_inputs(fuzz.start_inputs(SMALL_LIMITS), 300, seed=4)
    kinds = {item.kind for item in inputs}
    assert {"start.object", "start.binary", "start.oversize", "start.mutated"} <= kinds
    for item in inputs:
        if isinstance(item.wire, str):
            item.wire.encode("utf-8")  # a text frame must be UTF-8: surrogates as escapes
        if item.kind == "start.oversize":
            assert fuzz.wire_size(item.wire) > SMALL_LIMITS.max_start_bytes
        if item.kind == "start.near-limit":
            assert fuzz.wire_size(item.wire) <= SMALL_LIMITS.max_start_bytes
    assert any(isinstance(item.wire, bytes) for item in inputs)
    assert any("\\ud" in item.wire for item in inputs if isinstance(item.wire, str))


def test_control_inputs_cover_interactions_pings_and_stops() -> None:
    inputs = fuzz.draw_inputs(fuzz.control_inputs(SMALL_LIMITS), 300, seed=5)
    kinds = {item.kind for item in inputs}
    assert {"control.interaction", "control.ping", "control.binary", "control.oversize"} <= kinds
    valid = 0
    for item in inputs:
        try:
            message = protocol.parse_control(item.wire, limits=SMALL_LIMITS)
        except protocol.ProtocolError:
            continue
        valid += isinstance(message, protocol.Interaction)
    assert valid > 30  # enough reach the engine


def test_to_json_escapes_lone_surrogates_and_splices_raw_text() -> None:
    text = fuzz.to_json({"p": "a\udc80", "n": fuzz.Raw("NaN"), "e": "\u00e9"}, ascii=False)
    assert text == '{"p":"a\\udc80","n":NaN,"e":"\u00e9"}'
    text.encode("utf-8")


async def test_shrink_finds_the_small_input_that_still_fails() -> None:
    async def has_lone_surrogate_prompt(wire: fuzz.Wire) -> bool:
        try:
            value = json.loads(wire)
        except ValueError:
            return False
        prompt = value.get("prompt") if isinstance(value, dict) else None
        return isinstance(prompt, str) and bool(fuzz.lone_surrogates(prompt))

    wire = fuzz.to_json(
        {"type": "session.start", "prompt": "ab\udc80cd", "width": 64, "lora": {"x": [1, 2]}}
    )
    small, tries = await fuzz.shrink(
        wire, has_lone_surrogate_prompt, deadline=trio.current_time() + 30
    )
    assert small == '{"prompt":"\\udc80"}'
    assert 0 < tries < 300


async def test_shrink_cuts_text_that_is_not_json() -> None:
    async def says_bad(wire: fuzz.Wire) -> bool:
        return "BAD" in wire

    small, _ = await fuzz.shrink("xxxxxxxx{BAD]]]]", says_bad, deadline=trio.current_time() + 30)
    assert small == "BAD"


def test_log_excerpt_keeps_the_records_frames_and_exception() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,000 INFO trio_vstream.session: session r1 started",
            "2026-01-01 00:00:00,001 ERROR trio_vstream.session: session r1: internal error",
            "Traceback (most recent call last):",
            '  File "/x/site-packages/trio/_threads.py", line 1, in run',
            "    noise()",
            '  File "/x/trio_vstream/encoding.py", line 214, in __init__',
            "    ctx.time_base = Fraction(1, fps)",
            "    ^^^^^^^^^^^^^",
            "OverflowError: value too large to convert to int",
            "2026-01-01 00:00:00,002 INFO trio_vstream.session: session r2 started",
        ]
    )
    excerpt = fuzz.log_excerpt(log, "r1")
    assert excerpt[0].endswith("session r1 started")
    assert any("encoding.py" in line for line in excerpt)
    assert any("Fraction(1, fps)" in line for line in excerpt)
    assert excerpt[-1].strip() == "OverflowError: value too large to convert to int"
    assert not any("noise" in line or "r2" in line for line in excerpt)
    assert fuzz.log_exceptions(log) == {"OverflowError: value too large to convert to int": 1}


def test_log_causes_tell_two_internal_errors_apart() -> None:
    log = "\n".join(
        [
            "2026-01-01 00:00:00,001 ERROR x: session video_stream-aa: internal error",
            "  | ExceptionGroup:  (1 sub-exception)",
            "    | Traceback (most recent call last):",
            "    | AttributeError: 'NoneType' object has no attribute 'width'",
            "2026-01-01 00:00:00,002 ERROR x: session video_stream-bb: internal error",
            "Traceback (most recent call last):",
            "OverflowError: value too large to convert to int",
            "2026-01-01 00:00:00,003 INFO trio_vstream.session: session video_stream-cc ended",
        ]
    )
    assert fuzz.log_causes(log) == {
        "video_stream-aa": "AttributeError",
        "video_stream-bb": "OverflowError",
    }
    violation = fuzz.Violation("start", fuzz.Problem("internal-error", "x"), cause="OverflowError")
    assert violation.signature == "start:internal-error[OverflowError]"
