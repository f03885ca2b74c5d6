"""The soak's transcript and server-record checks (``bench/_soak/checks.py``,
``health_checks.py``, ``shutdown_checks.py``'s SIGTERM check), fed fake transcripts: good
sessions pass, and each broken rule (two terminal messages, an error without a code, a
wrong close, lost frames, a late timeout, input frames refused or miscounted, ...) is
flagged; so are a wedge round's broken rules (no 503, an upgrade accepted while wedged, no
recovery).
"""

from __future__ import annotations

import json
import random
from collections.abc import Sequence
from typing import Any

import attrs
from trio_websocket import ConnectionRejected

from bench._soak.checks import (
    check_server_record,
    check_server_records,
    check_transcript,
    input_totals,
)
from bench._soak.client import describe_error, refusal_message, rejected_upgrade
from bench._soak.health_checks import (
    HealthSample,
    WedgeRecord,
    check_health,
    check_wedge_round,
    peak_stuck_calls,
    wedge_problems,
)
from bench._soak.plans import Plan, make_held_plan, make_plan
from bench._soak.settings import Timing
from bench._soak.shutdown_checks import sigterm_problems
from bench._soak.transcript import Event, Transcript

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


def test_a_control_sent_once_the_engine_was_done_may_go_unanswered() -> None:
    """The server reads control messages until the last media chunk is delivered: one
    sent after its engine made the whole video (``stream_closed_at``) may reach it later
    and get ``session.done`` instead of an answer. One sent before must be answered."""
    items = [(0.0, _start()), *[(0.1, item) for item in _chunk(0)], (0.5, Out("ping", "pong"))]
    items += [(0.6, item) for item in [*_chunk(1), *_chunk(2, frames=0, size=30, kind="trailer")]]
    items.append((0.7, _done(3)))
    tr, plan = _transcript(items), _plan("chatty")
    assert check_transcript(plan, tr, TIMING, engine_done_at=0.4).problems == []
    early = check_transcript(plan, tr, TIMING, engine_done_at=0.55).problems
    assert _flagged(early, "no answer", "ping")
    assert _flagged(check_transcript(plan, tr, TIMING).problems, "no answer", "ping")
    # Only when the session then completed: an error ending it is no excuse.
    failed = _transcript([*items[:-3], (0.7, _error("generation_failed"))])
    assert _flagged(check_transcript(plan, failed, TIMING, 0.4).problems, "no answer")


def test_server_busy_is_an_admission_violation() -> None:
    tr = _transcript([_error("server_busy")])
    verdict = check_transcript(_plan("normal"), tr, TIMING)
    assert verdict.outcome == "refused"
    assert _flagged(verdict.problems, "admission")


def test_server_busy_at_the_upgrade_is_an_admission_violation() -> None:
    """A full server refuses the upgrade itself (HTTP 503, server_busy as JSON): the soak
    counts it as the same violation, not as some other client error."""
    body = b'{"type": "error", "code": "server_busy", "message": "Server busy"}\n'
    rejected = ConnectionRejected(503, (), body)
    assert refusal_message(ExceptionGroup("", [rejected])) == json.loads(body)
    tr = _transcript(
        [],
        close=None,
        connected_at=None,
        client_error=describe_error(rejected),
        upgrade_refusal=refusal_message(rejected),
    )
    verdict = check_transcript(_plan("normal"), tr, TIMING)
    assert verdict.outcome == "refused"
    assert _flagged(verdict.problems, "admission")
    # Any other refusal of the upgrade is no admission matter.
    draining = ConnectionRejected(503, (), b"draining: try another server\n")
    assert refusal_message(draining) is None


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


# --------------------------------------------------------------------------------------
# A stuck engine: the stall error while the engine is still blocked, /health degraded
# --------------------------------------------------------------------------------------


def _stuck(variant: str, block_s: float = 4.0) -> Plan:
    return _plan("engine_stuck", num_frames=16, at_chunk=1, variant=variant, block_s=block_s)


def _stalled_at(error_at: float) -> Transcript:
    """Chunk 0 at 0.11 s (the last progress), then the stall error at ``error_at``."""
    items = [(0.0, _start()), (0.1, _chunk(0)[0]), (0.11, 100), (error_at, _error("stall_timeout"))]
    return _transcript(items)


def _stalled_record(closed: float | None, ended: float = 7.0) -> dict[str, Any]:
    return {
        "request_id": "video_stream-1",
        "outcome": "stalled",
        "error_code": "stall_timeout",
        "stream_closed_at": closed,
        "ended_at": ended,
    }


def test_a_stuck_engine_must_end_in_a_timely_stall_error() -> None:
    plan = _stuck("returns")
    assert _problems(plan, _stalled_at(1.65)) == []
    assert _flagged(_problems(plan, _stalled_at(0.5)), "stall_timeout after 0.39 s")
    # What a server that waits for the blocked call does with a long block: answers late.
    assert _flagged(_problems(plan, _stalled_at(4.2)), "stall_timeout after 4.09 s")
    done = _transcript(_video(16))
    assert _flagged(_problems(plan, done), "expected error stall_timeout", "got done")
    assert _flagged(_problems(plan, done), "4 media chunks, but the engine stopped at 1")


def test_a_stall_error_must_come_while_the_engine_is_still_blocked() -> None:
    tr = _stalled_at(1.65)
    returns = _stuck("returns")
    # The blocked call returned (and its thread closed the stream) 2.4 s after the error.
    assert check_server_record(returns, tr, _stalled_record(closed=4.05), TIMING) == []
    # The error came only as the call returned: the server waited for the stuck call.
    waited = check_server_record(returns, tr, _stalled_record(closed=1.7), TIMING)
    assert _flagged(waited, "0.05 s before the blocked call returned", "waited for the stuck call")
    late = check_server_record(returns, tr, _stalled_record(closed=1.5), TIMING)
    assert _flagged(late, "-0.15 s before")
    never = check_server_record(returns, tr, _stalled_record(closed=None), TIMING)
    assert _flagged(never, "no stream close", "should have returned")
    # Abandoned: the session ends with the stream still open (the call's thread closes
    # it later); a closed one means the session waited for the call past its close wait.
    abandoned = _stuck("abandoned", block_s=10.5)
    assert check_server_record(abandoned, tr, _stalled_record(closed=None), TIMING) == []
    kept = check_server_record(abandoned, tr, _stalled_record(closed=10.6), TIMING)
    assert _flagged(kept, "waited for the stuck call past its close timeout")
    other = check_server_record(
        abandoned, tr, {**_stalled_record(None), "outcome": "failed"}, TIMING
    )
    assert _flagged(other, "'failed'", "expected stalled")


def _health(at: float, status: int, body: str = "") -> HealthSample:
    return HealthSample(sent_at=at, received_at=at + 0.01, status=status, body=body)


def test_health_must_say_degraded_while_an_abandoned_call_is_blocked() -> None:
    """The window: from the session's end (7.0) to the earliest its block can end (the
    client connected at 0, the block lasts 10.5 s)."""
    plan, tr = _stuck("abandoned", block_s=10.5), _stalled_at(1.65)
    record = _stalled_record(closed=None, ended=7.0)
    degraded = "degraded: 1 engine call(s) stuck after their sessions ended (wedged at 19)"
    fine = [_health(6.5, 200, "ok"), _health(7.5, 200, degraded), _health(10.6, 200, "ok")]
    assert check_health(plan, tr, record, fine) == []
    lying = [*fine, _health(9.0, 200, "ok")]
    assert _flagged(check_health(plan, tr, record, lying), "/health answered 200 ok 2.00 s after")
    # Only the abandoned variant is judged: a returning call is never abandoned.
    assert check_health(_stuck("returns"), tr, record, lying) == []
    assert check_health(_plan("normal"), tr, record, lying) == []


def test_the_soak_server_must_never_count_as_wedged() -> None:
    """Its wedge bound is above what the mix leaves stuck: a 503 (or a degraded count at
    the bound) is flagged, once; ``200 degraded`` below it is right, and its count is
    the peak reported."""
    degraded = "degraded: {} engine call(s) stuck after their sessions ended (wedged at 19)"
    fine = [_health(1.0, 200, "ok"), _health(2.0, 200, degraded.format(3))]
    fine.append(_health(3.0, 200, degraded.format(1)))
    assert wedge_problems(fine, bound=19) == []
    assert peak_stuck_calls(fine) == 3
    assert fine[1].degraded and not fine[1].ok and fine[0].ok
    wedged = "engine_unavailable: Engine unavailable: 19 engine call(s) stuck"
    samples = [*fine, _health(4.0, 503, wedged), _health(5.0, 503, wedged)]
    problems = wedge_problems(samples, bound=19)
    assert len(problems) == 1
    assert _flagged(problems, "answered 503 engine_unavailable", "--max-stuck-calls (19)")
    at_bound = wedge_problems([_health(1.0, 200, degraded.format(19))], bound=19)
    assert _flagged(at_bound, "at the wedge bound 19")
    assert peak_stuck_calls([_health(1.0, 200, "ok")]) == 0


# --------------------------------------------------------------------------------------
# The batched part: held sessions and wedge rounds
# --------------------------------------------------------------------------------------


def _held() -> Plan:
    return make_held_plan(random.Random(0), 0, "wedge-0-abc")


def test_a_held_session_must_end_in_a_timely_stall_error() -> None:
    plan = _held()
    assert plan.start is not None and plan.start["extra_params"] == {"hold": "wedge-0-abc"}
    assert _problems(plan, _stalled_at(1.65)) == []
    assert _flagged(_problems(plan, _stalled_at(4.2)), "stall_timeout after 4.09 s")
    done = _transcript(_video(16))
    assert _flagged(_problems(plan, done), "expected error stall_timeout", "got done")
    assert check_server_record(plan, _stalled_at(1.65), _stalled_record(None), TIMING) == []
    failed = {**_stalled_record(None), "outcome": "failed", "error_code": "generation_failed"}
    assert _flagged(check_server_record(plan, _stalled_at(1.65), failed, TIMING), "'failed'")


WEDGED = "engine_unavailable: Engine unavailable: its batched step is stuck (a forward ...)"


def _wedge(**fields: Any) -> WedgeRecord:
    """A round that went right: clients done at 10, ok until 14.9, wedged at 15 (503,
    the upgrade refused), released at 16, ok at 16.1."""
    health = [_health(14.9, 200, "ok"), _health(15.0, 503, WEDGED), _health(15.1, 503, WEDGED)]
    health.append(_health(16.1, 200, "ok"))
    values: dict[str, Any] = {
        "clients_done_at": 10.0,
        "health": health,
        "wedged": health[1],
        "upgrade": (503, WEDGED),
        "released_at": 16.0,
        "recovered": health[3],
    }
    return WedgeRecord(index=0, token="wedge-0-abc", **{**values, **fields})


def test_a_wedge_round_that_went_right_passes() -> None:
    assert check_wedge_round(_wedge(), TIMING) == []


def test_a_wedge_that_never_came_or_came_late_or_wrong_is_flagged() -> None:
    never = check_wedge_round(_wedge(wedged=None, upgrade=None), TIMING)
    assert _flagged(never, "did not answer 503 within 8.0 s", "answers: 200 ok, 503")
    late = _health(18.5, 503, WEDGED)
    assert _flagged(check_wedge_round(_wedge(wedged=late), TIMING), "8.50 s after")
    busy = _health(15.0, 503, "engine_unavailable: Engine unavailable: 9 engine call(s) stuck")
    assert _flagged(check_wedge_round(_wedge(wedged=busy), TIMING), "naming the stuck batched")
    draining = _health(15.0, 503, "draining")
    assert _flagged(check_wedge_round(_wedge(wedged=draining), TIMING), "503 draining")
    assert check_wedge_round(attrs.evolve(_wedge(), clients_done_at=None), TIMING) == [
        "the held sessions' clients did not end (the soak's deadline?)"
    ]


def test_an_upgrade_accepted_while_wedged_is_flagged() -> None:
    accepted = check_wedge_round(_wedge(upgrade=(101, "accepted")), TIMING)
    assert _flagged(accepted, "upgrade while wedged got HTTP 101")
    busy = check_wedge_round(_wedge(upgrade=(503, "too many connections")), TIMING)
    assert _flagged(busy, "got HTTP 503 'too many connections'")
    assert _flagged(check_wedge_round(_wedge(upgrade=None), TIMING), "no WebSocket upgrade")


def test_a_wedge_that_ended_before_the_release_or_never_ended_is_flagged() -> None:
    record = _wedge()
    record.health.insert(2, _health(15.05, 200, "ok"))
    assert _flagged(check_wedge_round(record, TIMING), "200 ok 0.05 s after the wedge")
    stuck = check_wedge_round(_wedge(recovered=None), TIMING)
    assert _flagged(stuck, "did not answer 200 ok within 1.5 s of the release")
    late = check_wedge_round(_wedge(recovered=_health(17.8, 200, "ok")), TIMING)
    assert _flagged(late, "200 ok 1.80 s after the release")
    assert _flagged(check_wedge_round(_wedge(released_at=None), TIMING), "never released")


def test_a_client_error_says_why_an_upgrade_was_refused() -> None:
    rejected = ConnectionRejected(503, (), b"engine_unavailable: Engine unavailable\n")
    group = ExceptionGroup("Exceptions from Trio nursery (1 sub-exception)", [rejected])
    assert describe_error(group) == (
        "WebSocket upgrade refused: HTTP 503: engine_unavailable: Engine unavailable"
    )
    assert rejected_upgrade(group) is rejected
    assert rejected_upgrade(ValueError("x")) is None
    assert describe_error(ValueError("x")) == "ValueError: x"


def test_a_soak_server_must_end_on_sigterm_with_status_0_within_its_grace() -> None:
    assert sigterm_problems(0, 0.2, grace=30.0) == []
    assert sigterm_problems(1, 0.2, grace=30.0) == ["after SIGTERM the server exited with status 1"]
    assert sigterm_problems(None, 40.0, grace=30.0) == [
        "after SIGTERM the server exited with status None"
    ]
    assert sigterm_problems(0, 31.0, grace=30.0) == [
        "the server took 31.0 s to exit after SIGTERM, more than its --shutdown-grace of 30 s"
    ]


# --------------------------------------------------------------------------------------
# Sessions that follow an input video
# --------------------------------------------------------------------------------------


def _input_plan(on_end: str, num_frames: int = 8) -> Plan:
    plan = _plan("input_video", num_frames=num_frames)
    assert plan.start is not None
    start = {**plan.start, "input_video": {**plan.start["input_video"], "on_end": on_end}}
    return attrs.evolve(plan, start=start)


def _input_chunk(index: int, used: int, dropped: int = 0, last: int | None = 0) -> list[Any]:
    metadata, size = _chunk(index)
    counts = {"used": used, "dropped": dropped, "reused": 4 - used, "first": 0, "last": last}
    return [{**metadata, "input_frames": counts}, size]


def _input_video(sent: int, *chunks: tuple[int, int, int | None], ended: bool = True) -> list[Any]:
    """video.start, ``sent`` frames, then input_video.end, and media chunks of 4 frames
    with (used, dropped, last) each; the trailer, session.done."""
    items: list[Any] = [_start(), *(Out(f"frame {n}") for n in range(sent))]
    if ended:
        items.append(Out("input_video.end"))
    for i, (used, dropped, last) in enumerate(chunks):
        items += _input_chunk(i, used, dropped, last)
    items += _chunk(len(chunks), frames=0, size=30, kind="trailer")
    return [*items, _done(len(chunks) + 1)]


def test_an_input_video_session_that_accounts_for_its_frames_passes() -> None:
    held = _input_video(6, (4, 0, 3), (2, 0, 5))  # 8 output frames, the last 2 held
    assert _problems(_input_plan("hold"), _transcript(held)) == []
    assert input_totals(_transcript(held)) == {"sent": 6, "used": 6, "dropped": 0, "reused": 2}
    # Ended with its input (on_end "end"), shorter than asked: every frame counted once.
    short = _input_video(5, (4, 1, 3))
    assert _problems(_input_plan("end", num_frames=16), _transcript(short)) == []


def test_input_video_miscounts_and_refusals_are_flagged() -> None:
    hold, end = _input_plan("hold"), _input_plan("end", num_frames=16)
    over = _input_video(5, (4, 1, 3), (2, 0, 4))
    assert _flagged(_problems(hold, _transcript(over)), "6 used + 1 dropped, only 5 sent")
    lost = _input_video(6, (4, 0, 3))  # ended with its input, 2 frames never counted
    assert _flagged(_problems(end, _transcript(lost)), "every frame counts exactly once")
    backwards = _input_video(8, (4, 0, 3), (2, 0, 1))
    assert _flagged(_problems(hold, _transcript(backwards)), "input_frames.last 1 after 3")
    unsent = _input_video(2, (2, 0, 1), (0, 0, 2))
    assert _flagged(_problems(hold, _transcript(unsent)), "input_frames.last 2")
    unused = _input_video(3, (0, 0, None), (0, 0, None))
    assert _flagged(_problems(hold, _transcript(unused)), "none of the 3 input frames was used")
    bare = [
        _start(),
        Out("frame 0"),
        *_chunk(0),
        *_chunk(1),
        *_chunk(2, 0, 30, "trailer"),
        _done(3),
    ]
    assert _flagged(_problems(hold, _transcript(bare)), "without input_frames counts")
    refused = _input_video(4, (4, 0, 3), (0, 0, 3))
    refused.insert(5, _error("invalid_input_frame", "input frame 3 refused: the frame is PNG"))
    assert _flagged(_problems(hold, _transcript(refused)), "valid input frame(s) refused")
    # Shorter than asked is only right for a video that ends with its input.
    assert _flagged(_problems(hold, _transcript(_input_video(4, (4, 0, 3)))), "4 frames arrived")
