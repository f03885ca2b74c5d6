"""The soak test (``bench/soak.py``): its short form against a real server, and its checker.

The short form (200 randomized sessions of every kind, ~40 s) runs in CI like the
benchmark's ``--quick``: as a subprocess, judged from its JSON report. It must find no
violation. The checks that decide that are plain functions of a transcript, a server
record, a log or two resource snapshots; the unit tests below feed them bad input (two
terminal messages, an error without a code, a leak, ...) to prove the checker can fail,
since a soak that never fails proves nothing.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from bench import soak

REPO = Path(__file__).resolve().parent.parent
SOAK = REPO / "bench" / "soak.py"
SHORT_FORM = ("--sessions", "200", "--concurrency", "8", "--seed", "1", "--deadline", "110")

TIMING = soak.Timing()


# --------------------------------------------------------------------------------------
# The short form, against a real server process
# --------------------------------------------------------------------------------------


@pytest.mark.timeout(200)
def test_short_soak_finds_no_violation(tmp_path: Path) -> None:
    output = tmp_path / "soak.json"
    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, str(SOAK), *SHORT_FORM, "--json", str(output)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=180,
    )
    elapsed = time.monotonic() - started
    assert output.exists(), done.stderr[-3000:]
    report = json.loads(output.read_text())
    shown = json.dumps(report["violations"][:10], indent=1)[:20000]
    assert report["violation_count"] == 0, f"{done.stdout[-3000:]}\n{shown}"
    assert done.returncode == 0, done.stderr[-3000:]
    assert report["passed"] is True
    # Every kind ran, and each ended the way it should at least once.
    assert set(report["kinds"]) == set(soak.KINDS)
    assert sum(k["count"] for k in report["kinds"].values()) == 200
    assert report["kinds"]["engine_fail"]["outcomes"] == {
        "error:generation_failed": report["kinds"]["engine_fail"]["count"]
    }
    assert report["kinds"]["oversized_frame"]["outcomes"] == {
        "close:1009": report["kinds"]["oversized_frame"]["count"]
    }
    resources = report["resources"]
    assert resources["final"]["threads"] <= resources["baseline"]["threads"]
    assert resources["final"]["fds"] <= resources["baseline"]["fds"]
    assert report["server"]["exit_status"] == 0
    assert elapsed < 110, done.stderr[-2000:]  # well under CI's patience on 2 cores
    assert "soak PASS" in done.stdout.splitlines()[-1]


# --------------------------------------------------------------------------------------
# Fake transcripts
# --------------------------------------------------------------------------------------


def _plan(kind: str, num_frames: int = 8, **params: Any) -> soak.Plan:
    plan = soak.make_plan(random.Random(0), 0, kind)
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
) -> soak.Transcript:
    """A transcript of ``items`` (dicts: JSON in, ints: binary sizes in, ``Out``: sent),
    ``step`` seconds apart, connected at 0; ``(t, item)`` pairs set the time instead."""
    tr = soak.Transcript(t0=0.0, wall0=0.0, connected_at=0.0, close_code=close, eof=True)
    t = 0.0
    for item in items:
        if isinstance(item, tuple):
            t, item = item
        else:
            t += step
        if isinstance(item, Out):
            tr.events.append(
                soak.Event(t, "out", label=item.label, expect=item.expect, delivered=item.delivered)
            )
        elif isinstance(item, int):
            tr.events.append(soak.Event(t, "in", size=item))
        else:
            text = json.dumps(item)
            tr.events.append(soak.Event(t, "in", text=text, size=len(text)))
    tr.closed_at = t
    return attrs.evolve(tr, **fields)


def _problems(plan: soak.Plan, tr: soak.Transcript) -> list[str]:
    return soak.check_transcript(plan, tr, TIMING).problems


def _flagged(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


# --------------------------------------------------------------------------------------
# The checker passes good sessions...
# --------------------------------------------------------------------------------------


def test_a_complete_session_passes() -> None:
    verdict = soak.check_transcript(_plan("normal"), _transcript(_video(8)), TIMING)
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
    verdict = soak.check_transcript(_plan("rst"), tr, TIMING)
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
    verdict = soak.check_transcript(_plan("normal"), tr, TIMING)
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
    assert soak.check_server_record(_plan("normal"), tr, record, TIMING) == []
    failed = {**record, "outcome": "failed", "error_code": "internal_error"}
    assert _flagged(soak.check_server_record(_plan("fin"), tr, failed, TIMING), "'failed'")
    assert soak.check_server_record(_plan("normal"), tr, None, TIMING) != []
    assert soak.check_server_records([record, failed]) == [failed]
    stalled = {"outcome": "stalled", "error_code": "stall_timeout", "stream_closed_at": 10.0}
    reader = attrs.evolve(tr, abandoned="stop_reading", abandoned_at=1.0, queue_full_at=2.0)
    assert _flagged(
        soak.check_server_record(_plan("stopped_reader"), reader, stalled, TIMING), "8.00 s after"
    )


# --------------------------------------------------------------------------------------
# Log, resources, plans
# --------------------------------------------------------------------------------------

_ID = "video_stream-" + "a" * 32
_OTHER = "video_stream-" + "b" * 32
LOG = f"""trio_vstream serving ws://127.0.0.1:1/v1/realtime/video (engine: synthetic)
2026-01-01 10:00:00,000 INFO trio_vstream.session: session {_ID} started
2026-01-01 10:00:00,100 ERROR trio_vstream.session: session {_ID}: engine failed while generating
Traceback (most recent call last):
  File "x.py", line 1, in f
trio_vstream.engines.base.EngineError: synthetic engine failure at chunk 1 (fail_at_chunk)
2026-01-01 10:00:00,200 ERROR trio_vstream.session: session {_OTHER}: internal error
Traceback (most recent call last):
trio_websocket._impl.ConnectionClosed: CloseReason<code=1006>
2026-01-01 10:00:00,300 INFO trio_vstream.server: something
Traceback (most recent call last):
ValueError: printed, not logged
2026-01-01 10:00:00,400 WARNING trio_vstream.session: session {_ID}: stall timeout for 1.5 s
"""


def test_log_errors_other_than_injected_failures_are_flagged() -> None:
    records = soak.parse_log(LOG)
    assert [r.level for r in records] == ["OTHER", "INFO", "ERROR", "ERROR", "INFO", "WARNING"]
    assert len(records[2].lines) == 4  # the traceback belongs to its record
    bad = soak.log_problems(records, expected_ids={_ID})
    assert [r.lines[0][24:] for r in bad] == [
        f"ERROR trio_vstream.session: session {_OTHER}: internal error",
        "INFO trio_vstream.server: something",
    ]
    assert len(soak.log_problems(records, expected_ids=set())) == 3
    summary = soak.log_summary(records)
    assert summary["WARNING session <id>: stall timeout for N s"] == 1


def _snapshot(
    threads: int = 3, fds: int = 10, rss_mib: float = 80.0, active: int = 0
) -> soak.Snapshot:
    metrics = {"sessions_active": active, "streams_open": 0, "worker_threads": 0}
    return soak.Snapshot(0.0, threads, fds, int(rss_mib * 1024), metrics)


def test_leaks_are_flagged_against_the_baseline() -> None:
    base = _snapshot()
    assert soak.resource_problems(base, _snapshot(rss_mib=90.0)) == []
    assert _flagged(soak.resource_problems(base, _snapshot(fds=11)), "file descriptors 10 -> 11")
    assert _flagged(soak.resource_problems(base, _snapshot(threads=4)), "threads 3 -> 4")
    grown = 80.0 + soak.RSS_GROWTH_LIMIT_MIB + 1
    assert _flagged(soak.resource_problems(base, _snapshot(rss_mib=grown)), "RSS grew")
    assert _flagged(soak.resource_problems(base, _snapshot(active=1)), "sessions_active is 1")


def test_plans_are_seeded_and_cover_every_kind() -> None:
    first = soak.make_plans(seed=7, sessions=40, warmup=4)
    assert first == soak.make_plans(seed=7, sessions=40, warmup=4)
    assert first != soak.make_plans(seed=8, sessions=40, warmup=4)
    measured = [p for p in first if not p.warmup]
    assert len(measured) == 40 and len(first) == 44
    assert {p.kind for p in measured} == set(soak.KINDS)
    for plan in first:
        json.dumps(plan.params)  # reported as they are
        if plan.kind in ("engine_fail", "engine_hang"):
            assert plan.params["at_chunk"] < plan.num_frames // 4  # the fault is reached
        if plan.kind == "oversized_start":
            assert len(plan.params["text"]) > soak.MAX_START_BYTES


def test_oversized_payloads_have_the_sizes_they_claim() -> None:
    start = {"prompt": "x", "width": 64, "height": 64}
    assert len(soak._padded_start(start, 40_000)) == 40_000
    assert len(soak._padded_interaction(9_000, "big")) == 9_000
    json.loads(soak._padded_interaction(9_000, "big"))


def test_the_server_command_only_listens_on_loopback() -> None:
    command = soak.server_command(soak.Settings(concurrency=5))
    assert command[command.index("--host") + 1] == "127.0.0.1"
    assert command[command.index("--max-sessions") + 1] == "5"
    assert soak.Settings(sessions=200).total_deadline_s < soak.Settings().total_deadline_s
