"""The soak's transcript and server-record checks (``bench/_soak/checks.py``), fed fake
transcripts: good sessions pass, and each broken rule (two terminal messages, an error
without a code, a wrong close, lost frames, a late timeout, ...) is flagged.
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import attrs

from bench._soak.checks import (
    Event,
    Transcript,
    check_server_record,
    check_server_records,
    check_transcript,
)
from bench._soak.plans import Plan, make_plan
from bench._soak.settings import Timing

TIMING = Timing()


def _plan(kind: str, num_frames: int = 8, **params: Any) -> Plan:
    plan = make_plan(random.Random(0), 0, kind)
    start = dict(plan.start) if plan.start is not None else None
    if start is not None:
        start["num_frames"] = num_frames
    return attrs.evolve(plan, start=start, params={**plan.params, **params})


def _start() -> dict[str, Any]:
    return {"type": "video.start", "request_id": "video_stream-1", "format": "m4s", "config": {}}


def _chunk(index: int, frames: int = 4, size: int = 100, kind: str = "media") -> list[Any]:
    """A chunk as it arrives: its metadata, then its binary message (given by its size)."""
    metadata = {
        "type": "video.chunk_metadata",
        "kind": kind,
        "num_frames": frames,
        "byte_length": size,
        "transport_chunk_index": index,
    }
    return [metadata, size]


def _done(chunks: int, stopped: bool = False) -> dict[str, Any]:
    return {
        "type": "session.done",
        "request_id": "video_stream-1",
        "chunks": chunks,
        "stopped": stopped,
    }


def _error(code: str | None, message: str = "bad") -> dict[str, Any]:
    error: dict[str, Any] = {"type": "error", "message": message}
    if code is not None:
        error["code"] = code
    return error


def _video(frames: int = 8, stopped: bool = False) -> list[Any]:
    """video.start, media chunks of 4 frames, the trailer, session.done."""
    items: list[Any] = [_start()]
    count = frames // 4
    for i in range(count):
        items += _chunk(i)
    items += _chunk(count, frames=0, size=30, kind="trailer")
    return [*items, _done(count + 1, stopped)]


@attrs.frozen
class Out:
    """A message the fake client sent."""

    label: str
    expect: str | None = None
    delivered: bool = True


def _transcript(
    items: Sequence[Any], *, close: int | None = 1000, step: float = 0.01, **fields: Any
) -> Transcript:
    """A transcript of ``items`` (dicts: JSON in, ints: binary sizes in, ``Out``: sent),
    ``step`` seconds apart, connected at 0; ``(t, item)`` pairs set the time instead."""
    tr = Transcript(t0=0.0, wall0=0.0, connected_at=0.0, close_code=close, eof=True)
    t = 0.0
    for item in items:
        if isinstance(item, tuple):
            t, item = item
        else:
            t += step
        if isinstance(item, Out):
            tr.events.append(
                Event(t, "out", label=item.label, expect=item.expect, delivered=item.delivered)
            )
        elif isinstance(item, int):
            tr.events.append(Event(t, "in", size=item))
        else:
            text = json.dumps(item)
            tr.events.append(Event(t, "in", text=text, size=len(text)))
    tr.closed_at = t
    return attrs.evolve(tr, **fields)


def _problems(plan: Plan, tr: Transcript) -> list[str]:
    return check_transcript(plan, tr, TIMING).problems


def _flagged(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


# The checker passes good sessions...
# --------------------------------------------------------------------------------------


def test_a_complete_session_passes() -> None:
    verdict = check_transcript(_plan("normal"), _transcript(_video(8)), TIMING)
    assert verdict.problems == []
    assert verdict.outcome == "done"


def test_a_stop_may_end_stopped_or_complete() -> None:
    plan = _plan("stop", num_frames=8)
    stopped = [_start(), *_chunk(0), Out("session.stop"), _done(1, stopped=True)]
    assert _problems(plan, _transcript(stopped)) == []
    assert _problems(plan, _transcript([Out("session.stop"), *_video(8)])) == []


def test_answers_in_order_pass() -> None:
    items = [
        _start(),
        Out("ping", "pong"),
        {"type": "session.pong"},
        Out("garbage:non_json", "error:invalid_json"),
        _error("invalid_json"),
        Out("interaction:ev-1", "queued:ev-1"),
        {"type": "session.interaction.queued", "request_id": "r", "event_id": "ev-1"},
        *_chunk(0),
        *_chunk(1),
        *_chunk(2, frames=0, size=30, kind="trailer"),
        _done(3),
    ]
    assert _problems(_plan("chatty"), _transcript(items)) == []


def test_expected_terminal_errors_pass() -> None:
    garbage = _plan("garbage_start", garbage={"label": "x", "expect": "error:invalid_json"})
    assert _problems(garbage, _transcript([Out("x"), _error("invalid_json")])) == []
    fail = _plan("engine_fail", num_frames=16, at_chunk=2)
    items = [_start(), *_chunk(0), *_chunk(1), _error("generation_failed")]
    assert _problems(fail, _transcript(items)) == []
    frame = _plan("oversized_frame", where="mid")
    assert _problems(frame, _transcript([_start(), *_chunk(0)], close=1009)) == []


def test_an_abandoned_session_needs_no_ending() -> None:
    tr = _transcript([_start(), *_chunk(0), _chunk(1)[0]], close=None, abandoned="rst")
    verdict = check_transcript(_plan("rst"), tr, TIMING)
    assert verdict.problems == [] and verdict.outcome == "abandoned:rst"


# --------------------------------------------------------------------------------------
# ...and flags bad ones
# --------------------------------------------------------------------------------------


def test_two_terminal_messages_are_flagged() -> None:
    after_done = _transcript([*_video(8), _error("server_shutdown")])
    assert _flagged(_problems(_plan("normal"), after_done), "after session.done")
    twice = _transcript([*_video(8), _done(3)])
    assert _flagged(_problems(_plan("normal"), twice), "2 session.done")
    # An error mid-session that answers nothing the client sent is a terminal error
    # followed by a second terminal message.
    error_then_done = _transcript([_start(), *_chunk(0), _error("generation_failed"), _done(1)])
    assert _flagged(_problems(_plan("normal", 4), error_then_done), "mid-session", "generation")


def test_an_error_without_a_code_is_flagged_even_when_abandoned() -> None:
    tr = _transcript([_start(), _error(None)], close=None, abandoned="fin")
    assert _flagged(_problems(_plan("fin"), tr), "without a code")


def test_a_missing_or_wrong_close_is_flagged() -> None:
    assert _flagged(_problems(_plan("normal"), _transcript(_video(8), close=None)), "close code")
    assert _flagged(_problems(_plan("normal"), _transcript(_video(8), close=1011)), "1011")
    no_eof = _transcript(_video(8), eof=False)
    assert _flagged(_problems(_plan("normal"), no_eof), "did not close TCP")


def test_a_missing_terminal_message_is_flagged() -> None:
    tr = _transcript([_start(), *_chunk(0), *_chunk(1)])
    assert _flagged(_problems(_plan("normal"), tr), "expected session.done")


def test_broken_chunk_framing_is_flagged() -> None:
    wrong_size = _transcript([_start(), _chunk(0)[0], 99, *_chunk(1), _done(2)])
    assert _flagged(_problems(_plan("normal"), wrong_size), "byte_length 100 but 99")
    orphan = _transcript([_start(), 50, *_chunk(0), *_chunk(1), _done(2)])
    assert _flagged(_problems(_plan("normal"), orphan), "without chunk metadata")
    skipped = _transcript([_start(), *_chunk(0), *_chunk(2), _done(2)])
    assert _flagged(_problems(_plan("normal"), skipped), "transport_chunk_index")


def test_lost_frames_and_wrong_counts_are_flagged() -> None:
    assert _flagged(_problems(_plan("normal", 12), _transcript(_video(8))), "8 frames arrived")
    miscounted = _transcript([_start(), *_chunk(0), *_chunk(1), _done(5)])
    assert _flagged(_problems(_plan("normal"), miscounted), "session.done says 5")


def test_an_unanswered_or_wrong_answer_is_flagged() -> None:
    unanswered = _transcript([_start(), Out("ping", "pong"), *_video(8)[1:]])
    assert _flagged(_problems(_plan("chatty"), unanswered), "no answer", "ping")
    bad = Out("garbage:json_array", "error:invalid_message")
    wrong = _transcript([_start(), bad, _error("invalid_json"), *_video(8)[1:]])
    assert _flagged(_problems(_plan("garbage_mid"), wrong), "expected error:invalid_message")


def test_a_wrong_ending_is_flagged() -> None:
    fail = _plan("engine_fail", num_frames=16, at_chunk=1)
    assert _flagged(_problems(fail, _transcript(_video(16))), "expected error generation_failed")
    too_many = _transcript([_start(), *_chunk(0), *_chunk(1), _error("generation_failed")])
    assert _flagged(_problems(fail, too_many), "2 media chunks")
    garbage = _plan("garbage_start", garbage={"label": "x", "expect": "error:invalid_json"})
    two = _transcript([Out("x"), _error("invalid_message"), _error("invalid_json")])
    assert _flagged(_problems(garbage, two), "exactly one message")


def test_server_busy_is_an_admission_violation() -> None:
    tr = _transcript([_error("server_busy")])
    verdict = check_transcript(_plan("normal"), tr, TIMING)
    assert verdict.outcome == "refused"
    assert _flagged(verdict.problems, "admission")


def test_timeouts_out_of_their_window_are_flagged() -> None:
    plan = _plan("engine_hang", num_frames=16, at_chunk=1)
    early = _transcript(
        [(0.0, _start()), (0.1, _chunk(0)[0]), (0.11, 100), (0.5, _error("stall_timeout"))]
    )
    assert _flagged(_problems(plan, early), "stall_timeout after 0.39 s")
    on_time = [(0.0, _start()), (0.1, _chunk(0)[0]), (0.11, 100), (1.65, _error("stall_timeout"))]
    assert _problems(plan, _transcript(on_time)) == []
    late = _transcript([(5.0, _error("start_timeout"))])
    assert _flagged(_problems(_plan("no_start"), late), "start_timeout after 5.00 s")


def test_the_server_record_must_match_the_kind() -> None:
    tr = _transcript(_video(8))
    record = {"request_id": "r", "outcome": "completed", "error_code": None}
    assert check_server_record(_plan("normal"), tr, record, TIMING) == []
    failed = {**record, "outcome": "failed", "error_code": "internal_error"}
    assert _flagged(check_server_record(_plan("fin"), tr, failed, TIMING), "'failed'")
    assert check_server_record(_plan("normal"), tr, None, TIMING) != []
    assert check_server_records([record, failed]) == [failed]
    stalled = {"outcome": "stalled", "error_code": "stall_timeout", "stream_closed_at": 10.0}
    reader = attrs.evolve(tr, abandoned="stop_reading", abandoned_at=1.0, queue_full_at=2.0)
    assert _flagged(
        check_server_record(_plan("stopped_reader"), reader, stalled, TIMING), "8.00 s after"
    )
