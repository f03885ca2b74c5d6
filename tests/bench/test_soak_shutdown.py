"""The soak's shutdown rounds (``bench/_soak/shutdown.py``): their plans, the checks on
what a round saw (``bench/_soak/shutdown_checks.py``), fed made-up records (a good round
passes; each broken rule, a server that hangs or exits with a status, a client left open
or told the wrong thing, a log without the second signal or with an error, is flagged),
and the round itself against a fake server that ignores signals and against a real one.
"""

from __future__ import annotations

import json
import random
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import pytest

from bench._harness import parse_log
from bench._soak import shutdown
from bench._soak.plans import (
    ShutdownPlan,
    SignalStep,
    make_shutdown_plan,
    make_shutdown_plans,
    stuck_at,
)
from bench._soak.report import round_line
from bench._soak.serverlog import LEFT_RUNNING, signal_problems, stuck_problems
from bench._soak.settings import (
    ROUND_BLOCK_S,
    ROUND_ENGINES,
    ROUND_KINDS,
    ROUND_NUM_FRAMES,
    ROUND_SESSIONS,
    SIGNALS,
    STUCK_AT_CHUNK,
    STUCK_SESSIONS,
    Timing,
)
from bench._soak.shutdown_checks import (
    RoundRecord,
    check_round_client,
    check_round_process,
    round_ending,
)
from bench._soak.transcript import Event, Transcript

TIMING = Timing()


def _plan(first: str = "SIGTERM", second: str = "SIGINT", after: str = "taken") -> ShutdownPlan:
    plan = make_shutdown_plan(random.Random(0), 0, "double_signal", "shapes")
    signals = (
        SignalStep(name=first, after="streaming", delay_s=0.1),
        SignalStep(name=second, after=after, delay_s=0.05),
    )
    return attrs.evolve(plan, signals=signals)


def _record(**fields: Any) -> RoundRecord:
    """A round that went right: streaming at 1.0, signals at 1.1 and 1.2 (the first
    logged at 1.15), exit 0 at 1.4."""
    values: dict[str, Any] = {
        "streaming_at": 1.0,
        "sent_at": [1.1, 1.2],
        "taken_at": [1.15, None],
        "exited_at": 1.4,
        "exit_status": 0,
    }
    return RoundRecord(**{**values, **fields})


def _client(items: Sequence[Any], close: int | None = 1006, closed_at: float = 1.41) -> Transcript:
    """A round's client: ``items`` from 0.5 s on (dicts: JSON in, ints: binary sizes in),
    then its connection's end (``close`` None: still open)."""
    tr = Transcript(t0=0.0, wall0=0.0, connected_at=0.0)
    for i, item in enumerate(items):
        t = 0.5 + 0.01 * i
        if isinstance(item, int):
            tr.events.append(Event(t, "in", size=item))
        else:
            text = json.dumps(item)
            tr.events.append(Event(t, "in", text=text, size=len(text)))
    if close is not None:
        tr.close_code, tr.closed_at = close, closed_at
    return tr


START = {"type": "video.start", "request_id": "video_stream-1", "format": "m4s"}
CHUNK = [
    {
        "type": "video.chunk_metadata",
        "kind": "media",
        "num_frames": 8,
        "byte_length": 100,
        "transport_chunk_index": 0,
    },
    100,
]


def _error(code: str) -> dict[str, Any]:
    return {"type": "error", "code": code, "message": "m"}


def _flagged(problems: list[str], *fragments: str) -> bool:
    return any(all(f in p for f in fragments) for p in problems)


def _log(*messages: str) -> str:
    return "".join(
        f"2026-01-01 10:00:00,{i:03d} INFO trio_vstream: {m}\n" for i, m in enumerate(messages)
    )


# --------------------------------------------------------------------------------------
# Plans
# --------------------------------------------------------------------------------------


def test_rounds_are_seeded_alternate_engines_and_draw_every_case() -> None:
    plans = make_shutdown_plans(seed=3, rounds=200)
    assert plans == make_shutdown_plans(seed=3, rounds=200)
    assert plans != make_shutdown_plans(seed=4, rounds=200)
    doubles = [p for p in plans if p.kind == "double_signal"]
    assert [p.engine for p in doubles[:4]] == ["shapes", "synthetic", "shapes", "synthetic"]
    seen: set[tuple[str, str, str, bool]] = set()
    for plan in doubles:
        json.dumps(plan.to_json())  # reported as it is
        assert ROUND_SESSIONS[0] <= len(plan.starts) <= ROUND_SESSIONS[1]
        assert all(start["num_frames"] == ROUND_NUM_FRAMES for start in plan.starts)
        assert plan.stuck == 0
        first, second = plan.signals
        assert first.after == "streaming" and 0.0 <= first.delay_s <= 0.3
        if second.after == "sent":  # back to back: never one signal twice (Trio merges it)
            assert second.name != first.name and second.delay_s == 0.0
        else:
            assert second.after == "taken"
            assert 0.0 <= second.delay_s <= 2 * ROUND_ENGINES[plan.engine].step_s
        seen.add((first.name, second.name, second.after, second.delay_s == 0.0))
    # Both signals first and second, back to back, at once after the log, and later.
    assert {(a, b) for a, b, _, _ in seen} == {(a, b) for a in SIGNALS for b in SIGNALS}
    assert {(after, zero) for _, _, after, zero in seen} == {
        ("sent", True),
        ("taken", True),
        ("taken", False),
    }
    with pytest.raises(ValueError, match="unknown shutdown round kind"):
        make_shutdown_plan(random.Random(0), 0, "nope", "shapes")


def test_stuck_rounds_block_for_longer_than_any_bound_and_drain_or_stop() -> None:
    """``engine_stuck``: the synthetic engine, 1-2 sessions blocked outside a checkpoint
    for longer than the exit may take, a drain (one signal, stuck sessions only) or two
    signals; every kind comes once in a run of as many rounds as kinds."""
    plans = [p for p in make_shutdown_plans(seed=3, rounds=200) if p.kind == "engine_stuck"]
    assert 20 <= len(plans) <= 80  # a weight of 1 in 4
    signal_counts = set()
    for plan in plans:
        json.dumps(plan.to_json())
        assert plan.engine == "synthetic" and plan.to_json()["stuck"] == plan.stuck
        assert STUCK_SESSIONS[0] <= plan.stuck <= STUCK_SESSIONS[1]
        assert len(plan.starts) <= ROUND_SESSIONS[1]
        for start in plan.starts[: plan.stuck]:
            assert STUCK_AT_CHUNK[0] <= stuck_at(start) <= STUCK_AT_CHUNK[1]  # type: ignore[operator]
            assert start["extra_params"]["block_seconds"] == ROUND_BLOCK_S
        assert all(stuck_at(start) is None for start in plan.starts[plan.stuck :])
        assert ROUND_BLOCK_S > TIMING.drain_bound > TIMING.stop_bound
        signal_counts.add(len(plan.signals))
        if len(plan.signals) == 1:  # a drain: stuck sessions only
            assert plan.stuck == len(plan.starts)
    assert signal_counts == {1, 2}
    for seed in range(20):
        assert {p.kind for p in make_shutdown_plans(seed, rounds=2)} == set(ROUND_KINDS)
    with pytest.raises(ValueError, match="run the synthetic engine"):
        make_shutdown_plan(random.Random(0), 0, "engine_stuck", "shapes")


# --------------------------------------------------------------------------------------
# The process: it ran, took the signals, exited with 0 in time
# --------------------------------------------------------------------------------------


def test_a_round_that_went_right_passes() -> None:
    rec = _record(transcripts=[_client([START, *CHUNK])])
    assert check_round_process(_plan(), rec, TIMING) == []
    assert check_round_client(rec.transcripts[0], rec) == []


def test_a_server_that_did_not_stop_at_once_is_flagged() -> None:
    plan = _plan()
    killed = _record(killed=True, exit_status=-9, exited_at=1.2 + TIMING.stop_bound)
    assert _flagged(check_round_process(plan, killed, TIMING), "did not exit within", "killed")
    late = _record(exited_at=1.2 + TIMING.stop_bound + 0.5)
    assert _flagged(check_round_process(plan, late, TIMING), "to exit after the second signal")
    unseen = _record(exited_at=None, exit_status=None)
    assert _flagged(check_round_process(plan, unseen, TIMING), "exit after the second signal")


def test_an_exit_status_other_than_zero_is_flagged() -> None:
    for status in (1, -15, 130):
        problems = check_round_process(_plan(), _record(exit_status=status), TIMING)
        assert _flagged(problems, f"exited with status {status}")


def test_a_round_that_could_not_run_as_planned_is_flagged() -> None:
    plan = _plan()
    failed = RoundRecord(error="the round's server did not start: boom")
    assert check_round_process(plan, failed, TIMING) == ["the round's server did not start: boom"]
    assert _flagged(check_round_process(plan, _record(streaming_at=None), TIMING), "media chunk")
    not_taken = _record(taken_at=[None, None])
    assert _flagged(check_round_process(plan, not_taken, TIMING), "did not log signal 1")
    back_to_back = _plan(after="sent")  # nothing waited for: nothing to see
    assert check_round_process(back_to_back, not_taken, TIMING) == []
    one_sent = _record(sent_at=[1.1], taken_at=[1.15])
    assert _flagged(check_round_process(plan, one_sent, TIMING), "only 1 of 2 signals")


# --------------------------------------------------------------------------------------
# The clients: closed, with server_shutdown or nothing
# --------------------------------------------------------------------------------------


def test_a_client_may_end_with_server_shutdown_or_a_cut() -> None:
    rec = _record()
    told = _client([START, *CHUNK, _error("server_shutdown")], close=1000)
    assert check_round_client(told, rec) == []
    assert round_ending(told) == "error:server_shutdown, close 1000"
    cut = _client([START, *CHUNK, _error("server_shutdown")], close=1006)
    assert check_round_client(cut, rec) == []
    assert round_ending(_client([START, *CHUNK])) == "close 1006"


def test_a_client_told_anything_else_is_flagged() -> None:
    rec = _record()
    failed = _client([START, *CHUNK, _error("generation_failed")], close=1000)
    assert _flagged(check_round_client(failed, rec), "ended with error generation_failed")
    done = _client([START, *CHUNK, {"type": "session.done", "chunks": 1, "stopped": True}])
    assert _flagged(check_round_client(done, rec), "ended with session.done")
    two = _client([START, _error("server_shutdown"), *CHUNK])
    assert _flagged(check_round_client(two, rec), "after the terminal message")
    no_start = _client([*CHUNK])
    assert _flagged(check_round_client(no_start, rec), "expected video.start")
    torn = _client([START, CHUNK[0]])  # metadata, then the connection cut before its data
    assert _flagged(check_round_client(torn, rec), "no binary message")


def test_a_client_left_open_or_closed_oddly_is_flagged() -> None:
    rec = _record()
    still_open = _client([START, *CHUNK], close=None)
    assert _flagged(check_round_client(still_open, rec), "still open", "after the server exited")
    early = _client([START, *CHUNK], closed_at=1.05)
    assert _flagged(check_round_client(early, rec), "before the first signal")
    internal = _client([START, *CHUNK], close=1011)
    assert _flagged(check_round_client(internal, rec), "close code 1011")
    silent = _client([START, *CHUNK], close=1000)
    assert _flagged(check_round_client(silent, rec), "close 1000 without a terminal message")
    errored = attrs.evolve(_client([START]), client_error="OSError: refused")
    assert _flagged(check_round_client(errored, rec), "client: OSError")
    never = attrs.evolve(_client([], close=None), connected_at=None, client_error="OSError: x")
    assert check_round_client(never, rec) == [
        "client: OSError: x",
        "first message no message, expected video.start",
    ]


def test_a_stuck_client_may_also_end_by_its_stall_timeout_at_any_time() -> None:
    rec = _record()
    stalled = _client([START, *CHUNK, _error("stall_timeout")], close=1000, closed_at=1.05)
    assert check_round_client(stalled, rec, stuck=True) == []
    assert _flagged(check_round_client(stalled, rec), "ended with error stall_timeout")
    assert _flagged(check_round_client(stalled, rec), "before the first signal")
    # Anything else still counts: a stuck session's engine failure, or an early close.
    failed = _client([START, _error("generation_failed")], close=1000)
    assert _flagged(check_round_client(failed, rec, stuck=True), "generation_failed")
    cut = _client([START], close=1006, closed_at=1.05)
    assert _flagged(check_round_client(cut, rec, stuck=True), "before the first signal")


# --------------------------------------------------------------------------------------
# The log: each signal taken, no error
# --------------------------------------------------------------------------------------


def test_the_log_must_show_both_signals_taken_in_order() -> None:
    plan = _plan("SIGTERM", "SIGINT")
    good = _log("SIGTERM: shutting down gracefully", "draining", "SIGINT again: stopping now")
    assert signal_problems(plan, parse_log(good)) == []
    drained = _log("SIGTERM: shutting down gracefully", "draining")
    assert _flagged(signal_problems(plan, parse_log(drained)), "taken: SIGTERM")
    reversed_ = _log("SIGINT: shutting down gracefully", "SIGTERM again: stopping now")
    assert _flagged(signal_problems(plan, parse_log(reversed_)), "in this order")
    # Sent back to back, the kernel delivers the lower-numbered signal first.
    assert signal_problems(_plan(after="sent"), parse_log(reversed_)) == []
    twice = _log("SIGTERM: shutting down gracefully", "SIGINT: shutting down gracefully")
    assert _flagged(signal_problems(plan, parse_log(twice)), "2 drain(s)")
    assert _flagged(signal_problems(plan, parse_log("")), "0 drain(s)", "taken: none")


def _stuck_plan() -> ShutdownPlan:
    """A drain with two stuck sessions (seed 1's rounds have some)."""
    plans = make_shutdown_plans(seed=1, rounds=8)
    return next(p for p in plans if p.kind == "engine_stuck" and len(p.signals) == 1)


def test_a_stuck_round_must_show_its_calls_left_running_in_the_log() -> None:
    plan = _stuck_plan()
    transcripts = [_client([{**START, "request_id": f"r{i}"}]) for i in range(len(plan.starts))]
    left = [
        f"session r{i}: SyntheticStream.next_chunk {LEFT_RUNNING} (1 engine call(s) outstanding)"
        for i in range(plan.stuck)
    ]
    assert stuck_problems(plan, transcripts, parse_log(_log(*left))) == []
    # The process exited, but not with a stuck thread: the round proved nothing.
    missing = stuck_problems(plan, transcripts, parse_log(_log(*left[1:])))
    assert _flagged(missing, "session 0 (stuck)", "does not show its blocked engine call")
    assert len(missing) == 1
    silent = [_client([]), *transcripts[1:]]
    assert _flagged(stuck_problems(plan, silent, parse_log(_log(*left))), "no request id")
    # Other rounds have nothing to show.
    assert stuck_problems(_plan(), [_client([START])] * len(_plan().starts), []) == []


def test_a_round_is_one_line_in_the_summary() -> None:
    rec = _record(transcripts=[_client([START, *CHUNK]), _client([START, *CHUNK])])
    plan = attrs.evolve(_plan(), starts=_plan().starts[:2])
    line = round_line(shutdown.round_summary(plan, rec, []))
    assert line == (
        "shutdown round 0 double_signal (shapes, 2 sessions): SIGTERM 0.1 s after streaming; "
        "SIGINT 0.05 s after the last was logged: exit 0 after 0.2 s; clients: close 1006 x2"
    )
    stuck = _stuck_plan()
    drained = _record(sent_at=[1.1], taken_at=[None], exited_at=8.0)
    drained.transcripts = [_client([START, _error("stall_timeout")], close=1000)] * stuck.stuck
    line = round_line(shutdown.round_summary(stuck, drained, []))
    assert line.startswith(
        f"shutdown round {stuck.index} engine_stuck (synthetic, 2 sessions, 2 stuck): "
    )
    assert line.endswith("exit 0 after 6.9 s; clients: error:stall_timeout, close 1000 x2")


# --------------------------------------------------------------------------------------
# Rounds against processes
# --------------------------------------------------------------------------------------

DEAF_SERVER = """
import signal, sys, time
signal.signal(signal.SIGTERM, signal.SIG_IGN)
signal.signal(signal.SIGINT, signal.SIG_IGN)
print("trio_vstream serving ws://127.0.0.1:9/v1/realtime/video (engine: deaf)", flush=True)
time.sleep(60)
"""


async def test_a_server_deaf_to_signals_is_killed_and_judged(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The round's own failure path, quickly: a "server" that ignores both signals (and
    serves nothing: its client cannot connect) is killed at the bound, and the round
    says so, and that it never logged the signals."""
    monkeypatch.setattr(shutdown, "SIGNAL_TAKEN_WAIT_S", 0.2)
    monkeypatch.setattr(shutdown, "STREAMING_WAIT_S", 0.2)
    timing = Timing(close_timeout=0.2, slack=0.1)
    plan = _plan("SIGINT", "SIGTERM")
    plan = attrs.evolve(plan, starts=plan.starts[:1])
    log = tmp_path / "deaf.log"
    rec = await shutdown.run_round(plan, timing, log, [sys.executable, "-c", DEAF_SERVER])
    assert rec.killed and rec.exit_status == -9
    assert rec.taken_at == [None, None]
    problems = shutdown.judge_round(plan, rec, log.read_text(), timing)
    assert _flagged(problems, "did not exit within 0.4 s of the second signal: killed")
    assert _flagged(problems, "did not log signal 1 (SIGINT)")
    assert _flagged(problems, "0 drain(s)")
    assert _flagged(problems, "not every session had a media chunk")
    assert _flagged(problems, "session 0: client: OSError: all attempts to connect")
    assert not _flagged(problems, "still open")  # it never connected


@pytest.mark.timeout(60)
async def test_a_real_round_passes(tmp_path: Path) -> None:
    """One round against ``python -m trio_vstream`` with the synthetic engine: both
    signals taken, exit 0 at once, the clients' connections cut."""
    plan = make_shutdown_plan(random.Random(1), 0, "double_signal", "synthetic")
    plan = attrs.evolve(plan, starts=plan.starts[:1] * 2)
    log = tmp_path / "round.log"
    rec = await shutdown.run_round(plan, TIMING, log)
    problems = shutdown.judge_round(plan, rec, log.read_text(), TIMING)
    assert problems == [], log.read_text()[-3000:]
    assert rec.exit_status == 0 and not rec.killed
    assert all(tr.closed_at is not None for tr in rec.transcripts)


@pytest.mark.timeout(60)
async def test_a_real_drain_with_stuck_engines_exits(tmp_path: Path) -> None:
    """A drain (one signal) against ``python -m trio_vstream`` while two sessions' engines
    are blocked for 60 s: each ends by its stall timeout (0.5 s here), its call is left
    to its thread, and the process exits with status 0 well within its bound, the
    threads still blocked."""
    plan = _stuck_plan()
    timing = Timing(stall_timeout=0.5)
    log = tmp_path / "round.log"
    rec = await shutdown.run_round(plan, timing, log)
    problems = shutdown.judge_round(plan, rec, log.read_text(), timing)
    assert problems == [], log.read_text()[-3000:]
    assert rec.exit_status == 0 and not rec.killed
    assert [round_ending(tr) for tr in rec.transcripts] == ["error:stall_timeout, close 1000"] * 2
