"""The fuzz's oracle (``bench/_fuzz/oracle.py``) can fail: an error without a code, an
unknown code, ``internal_error``, a lone surrogate in a reply, a session killed by a
control message, a close without a message, an input frame refused that must be taken
(or taken that must be refused, or refused twice, or used once refused): each is flagged.
"""

from __future__ import annotations

import json
from typing import Any

import pytest

from bench._fuzz.oracle import (
    Exchange,
    Problem,
    SentFrame,
    StartTranscript,
    asks_input_video,
    check_reply,
    fault_injected,
    frame_error_problems,
    frame_expectation,
    frame_number,
    input_count_problems,
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
    assert not is_terminal(json.loads(_error("invalid_input_frame")))  # the session goes on
    assert not is_terminal(json.loads(_error("no_such_code")))  # flagged on its own


def test_fault_injection_is_recognised_where_the_server_reads_it() -> None:
    assert fault_injected('{"prompt":"a","extra_params":{"fail_at_chunk":0}}')
    assert fault_injected(b'{"prompt":"a","sampling_params":{"hang_at_chunk":1}}')
    assert not fault_injected('{"prompt":"a","fail_at_chunk":0}')
    assert not fault_injected("[" * 5000)


def test_a_start_asks_for_input_video_where_the_server_reads_it() -> None:
    assert asks_input_video('{"prompt":"a","input_video":{}}')
    assert asks_input_video('{"prompt":"a","sampling_params":{"input_video":{"fps":8}}}')
    assert not asks_input_video('{"prompt":"a","input_video":5}')
    # The top level's wins: sampling_params' is not lifted over it.
    assert not asks_input_video('{"input_video":null,"sampling_params":{"input_video":{}}}')
    assert not asks_input_video("[" * 5000)


# --------------------------------------------------------------------------------------
# Input video frames
# --------------------------------------------------------------------------------------

CAP = protocol.DEFAULT_LIMITS.max_input_frame_bytes


def _refusal(number: int, code: str = "invalid_input_frame") -> str:
    return _error(code, f"input frame {number} refused: the frame is PNG, not JPEG")


def _frame(
    *replies: str,
    refused: tuple[tuple[int, str], ...] = (),
    expect: str = "taken",
    size: int = 500,
    number: int = 3,
    close: int | None = None,
) -> tuple[str, list[str]]:
    frame = SentFrame(number=number, input_index=7, size=size, expect=expect)
    exchange = Exchange(
        sent_bytes=size,
        replies=[json.loads(reply) for reply in replies],
        close_code=close,
        answers=1,
        frame=frame,
        frame_errors=list(refused),
    )
    outcome, problems = judge_control(exchange, CONTROL_LIMIT)
    return outcome, _keys(problems)


def test_frame_expectations_follow_the_variant_and_the_session_format() -> None:
    assert frame_expectation("control.frame-valid.jpeg", "jpeg") == "taken"
    assert frame_expectation("control.frame-padded.png", "png") == "taken"
    assert frame_expectation("control.frame-valid.png", "jpeg") == "refused"
    assert frame_expectation("control.frame-wrong-size.webp", "webp") == "refused"
    assert frame_expectation("control.frame-truncated.jpeg", "jpeg") == "refused"
    assert frame_expectation("control.frame-garbage", "png") == "refused"
    assert frame_expectation("control.frame-corrupt.png", "png") == "any"
    assert frame_expectation("control.frame-oversize.jpeg", "jpeg") == "any"  # by its size
    assert frame_expectation("control.binary", "jpeg") == "any"


def test_the_frame_a_refusal_names_is_read_from_its_message() -> None:
    assert frame_number(json.loads(_refusal(12))) == 12
    too_large = _error("message_too_large", "input frame 4 is 1048577 bytes, more than ...")
    assert frame_number(json.loads(too_large)) == 4
    control = _error("message_too_large", "control message too large")
    assert frame_number(json.loads(control)) is None
    assert frame_number(json.loads(_error("invalid_message", "input frame 4"))) is None


def test_frame_outcomes_that_are_fine() -> None:
    assert _frame(PONG) == ("taken", [])
    refused = ((3, "invalid_input_frame"),)
    assert _frame(PONG, refused=refused, expect="refused") == ("error:invalid_input_frame", [])
    assert _frame(PONG, refused=refused, expect="any") == ("error:invalid_input_frame", [])
    assert _frame(PONG, expect="any") == ("taken", [])
    too_large = ((3, "message_too_large"),)
    assert _frame(PONG, refused=too_large, size=CAP + 1, expect="any") == (
        "error:message_too_large",
        [],
    )
    # Another frame's refusal (the decoder's, late) is not this one's outcome.
    assert _frame(PONG, refused=((1, "invalid_input_frame"),)) == ("taken", [])


@pytest.mark.parametrize(
    ("replies", "kwargs", "key"),
    [
        ((PONG,), {"expect": "refused"}, "bad-frame-taken"),
        (
            (PONG,),
            {"refused": ((2, "invalid_input_frame"),), "expect": "refused"},
            "bad-frame-taken",
        ),
        ((PONG,), {"size": CAP + 1}, "oversize-frame-not-refused"),
        (
            (PONG,),
            {"size": CAP + 1, "refused": ((3, "invalid_input_frame"),)},
            "oversize-frame-not-refused",
        ),
        ((PONG,), {"size": CAP, "refused": ((3, "message_too_large"),)}, "refused-within-limit"),
        ((_error("invalid_message"), PONG), {}, "unexpected-reply"),
        ((), {}, "no-reply"),
        ((), {"close": 1009, "size": CAP + 1}, "closed-without-terminal"),
    ],
)
def test_the_oracle_flags_a_bad_frame_exchange(
    replies: tuple[str, ...], kwargs: dict[str, Any], key: str
) -> None:
    outcome, keys = _frame(*replies, **kwargs)
    assert key in keys
    assert outcome == "violation"


def test_input_video_end_gets_only_the_pong() -> None:
    exchange = Exchange(sent_bytes=26, replies=[json.loads(PONG)], answers=1)
    assert judge_control(exchange, CONTROL_LIMIT) == ("input-end", [])
    exchange = Exchange(sent_bytes=26, replies=[json.loads(_error("invalid_json"))], answers=1)
    outcome, problems = judge_control(exchange, CONTROL_LIMIT)
    assert outcome == "violation" and _keys(problems) == ["unexpected-reply"]


def test_a_binary_message_without_input_video_is_refused_whatever_its_size() -> None:
    def binary(*replies: str, sent: int) -> tuple[str, list[str]]:
        loaded = [json.loads(reply) for reply in replies]
        exchange = Exchange(sent_bytes=sent, replies=loaded, binary=True)
        outcome, problems = judge_control(exchange, CONTROL_LIMIT)
        return outcome, _keys(problems)

    refused = _error("invalid_message", "Binary messages are input video frames")
    assert binary(refused, PONG, sent=10) == ("error:invalid_message", [])
    assert binary(refused, PONG, sent=CONTROL_LIMIT + 1) == ("error:invalid_message", [])
    big = (_error("message_too_large"), PONG)
    assert binary(*big, sent=CONTROL_LIMIT + 1) == ("error:message_too_large", [])
    assert "refused-within-limit" in binary(*big, sent=10)[1]
    assert "binary-not-refused" in binary(PONG, PONG, sent=10)[1]
    assert "binary-not-refused" in binary(_error("invalid_input_frame"), PONG, sent=10)[1]


FRAMES = {
    0: SentFrame(number=0, input_index=10, size=500, expect="taken"),
    1: SentFrame(number=1, input_index=11, size=500, expect="refused"),
    2: SentFrame(number=2, input_index=12, size=CAP + 1, expect="any"),
    3: SentFrame(number=3, input_index=13, size=500, expect="any"),
}


def _late(number: int, code: str = "invalid_input_frame", **kwargs: Any) -> list[str]:
    options: dict[str, Any] = {"earlier": 0, "current": None, "shown": ()} | kwargs
    return _keys(frame_error_problems(number, code, FRAMES, **options))


def test_refusals_that_are_fine_whenever_they_come() -> None:
    assert _late(3) == []  # a frame that may fail to decode, refused by the decoder
    assert _late(1, current=1) == []
    assert _late(2, "message_too_large", current=2) == []


@pytest.mark.parametrize(
    ("number", "code", "kwargs", "key"),
    [
        (0, "invalid_input_frame", {}, "valid-frame-refused"),
        (0, "invalid_input_frame", {"current": 0}, "valid-frame-refused"),
        (4, "invalid_input_frame", {}, "frame-error-unknown-frame"),
        (1, "invalid_input_frame", {"earlier": 1}, "frame-refused-twice"),
        (2, "message_too_large", {"current": 3}, "frame-too-large-late"),
        (3, "invalid_input_frame", {"shown": {3}}, "refused-frame-shown"),
    ],
)
def test_the_oracle_flags_a_bad_refusal(
    number: int, code: str, kwargs: dict[str, Any], key: str
) -> None:
    assert key in _late(number, code, **kwargs)


def test_chunk_input_counts_are_checked_against_the_frames_sent() -> None:
    def counts(**fields: Any) -> dict[str, Any]:
        return {"used": 1, "dropped": 0, "reused": 3, "first": 0, "last": 0} | fields

    assert input_count_problems(counts(), 1, 1, set()) == []
    assert input_count_problems(counts(used=0, last=None), 0, 0, set()) == []
    assert _keys(input_count_problems(counts(), 2, 1, set())) == ["input-frames-overcounted"]
    assert _keys(input_count_problems(counts(last=1), 1, 1, set())) == ["input-frames-bad-last"]
    assert _keys(input_count_problems(counts(), 1, 1, {0})) == ["refused-frame-shown"]
    assert _keys(input_count_problems(counts(used=-1), 0, 1, set())) == ["input-frames-malformed"]
    assert _keys(input_count_problems(None, 0, 1, set())) == ["input-frames-missing"]
