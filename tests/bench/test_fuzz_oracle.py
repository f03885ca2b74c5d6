"""The fuzz's oracle (``bench/_fuzz/oracle.py``) can fail: an error without a code, an
unknown code, ``internal_error``, a lone surrogate in a reply, a session killed by a
control message, a close without a message: each is flagged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench._fuzz.oracle import (
    Exchange,
    Problem,
    StartTranscript,
    check_reply,
    fault_injected,
    is_terminal,
    judge_control,
    judge_start,
    lone_surrogates,
)
from trio_vstream import protocol

LIMIT = protocol.DEFAULT_LIMITS.max_start_bytes
CONTROL_LIMIT = protocol.DEFAULT_LIMITS.max_control_bytes


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


def _keys(problems: list[Problem]) -> list[str]:
    return [problem.key for problem in problems]


def test_a_coded_error_with_a_message_passes() -> None:
    message, problems = check_reply(_error("invalid_json"))
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
    _, problems = check_reply(raw)
    assert key in _keys(problems)


def test_lone_surrogates_are_found_in_keys_and_nested_values() -> None:
    value = {"a": ["ok", {"b": "x\udc80"}], "\ud800": 1, "fine": "\U0001f600"}
    paths = lone_surrogates(value)
    assert len(paths) == 2
    assert "$.a[1].b" in paths


# --------------------------------------------------------------------------------------
# session.start transcripts
# --------------------------------------------------------------------------------------


def _start(
    *messages: str | bytes, close: int | None = 1000, **kwargs: Any
) -> tuple[str, list[str]]:
    transcript = StartTranscript(
        sent_bytes=kwargs.pop("sent", 100), messages=list(messages), close_code=close, **kwargs
    )
    outcome, problems = judge_start(transcript, LIMIT)
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
    exchange = Exchange(
        sent_bytes=sent,
        replies=[json.loads(reply) for reply in replies],
        terminal=json.loads(terminal) if terminal else None,
        close_code=close,
    )
    outcome, problems = judge_control(exchange, CONTROL_LIMIT, answers=answers)
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
    assert is_terminal(json.loads(DONE))
    assert is_terminal(json.loads(_error("generation_failed")))
    assert is_terminal(json.loads(_error("internal_error")))
    assert not is_terminal(json.loads(_error("invalid_json")))
    assert not is_terminal(json.loads(_error("event_id_conflict")))
    assert not is_terminal(json.loads(_error("no_such_code")))  # flagged on its own


def test_fault_injection_is_recognised_where_the_server_reads_it() -> None:
    assert fault_injected('{"prompt":"a","extra_params":{"fail_at_chunk":0}}')
    assert fault_injected(b'{"prompt":"a","sampling_params":{"hang_at_chunk":1}}')
    assert not fault_injected('{"prompt":"a","fail_at_chunk":0}')
    assert not fault_injected("[" * 5000)
