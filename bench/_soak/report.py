"""Judging every session once the run is over, and the report.

The checks run again at the end, with what only the end knows (the server's records of
every session, its whole log); each violation carries what a person needs to find it in
the server: the plan, the transcript folded, the server's record and log lines.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from bench._harness import REQUEST_ID, LogRecord
from bench._output import now
from bench._soak.checks import (
    Verdict,
    check_server_record,
    check_server_records,
    check_transcript,
    input_totals,
)
from bench._soak.health_checks import check_health, peak_stuck_calls
from bench._soak.runner import SessionResult, Soak
from bench._soak.serverlog import log_excerpt, log_problems
from bench._soak.settings import KINDS, Timing
from bench._soak.transcript import Transcript, read_messages
from bench._stats import summarize


@attrs.frozen
class Violation:
    """One broken rule, with what a person needs to find it in the server."""

    what: str
    session: int | None = None
    kind: str = "server"
    request_id: str | None = None
    details: dict[str, Any] = attrs.Factory(dict)

    def to_json(self) -> dict[str, Any]:
        return attrs.asdict(self)


def transcript_summary(tr: Transcript, limit: int = 24) -> list[str]:
    """The transcript in a few lines, runs of chunks folded."""
    lines: list[str] = []
    chunks = 0
    first_chunk = 0.0

    def flush() -> None:
        nonlocal chunks
        if chunks:
            lines.append(f"+{first_chunk:.3f} {chunks} x (chunk metadata + binary)")
            chunks = 0

    for event in tr.events:
        t = event.t - tr.t0
        if event.direction == "in" and event.text is None:
            continue
        text = event.text or ""
        if event.direction == "in" and '"video.chunk_metadata"' in text and '"trailer"' not in text:
            if not chunks:
                first_chunk = t
            chunks += 1
            continue
        flush()
        if event.direction == "out":
            note = "" if event.delivered else " (not delivered: closed)"
            lines.append(f"+{t:.3f} sent {event.label} ({event.size} B){note}")
        else:
            text = event.text or ""
            lines.append(f"+{t:.3f} got {text[:160]}")
    flush()
    if tr.abandoned:
        lines.append(f"+{(tr.abandoned_at or tr.t0) - tr.t0:.3f} client abandoned: {tr.abandoned}")
    if tr.closed_at is not None:
        lines.append(f"+{tr.closed_at - tr.t0:.3f} close {tr.close_code} {tr.close_reason or ''}")
    if len(lines) > limit:
        lines = [*lines[: limit // 2], "...", *lines[-limit // 2 :]]
    return lines


def session_details(
    soak: Soak, result: SessionResult, log_records: Sequence[LogRecord]
) -> dict[str, Any]:
    """What a person needs to look into one session: its plan, transcript, the server's
    record and log lines, and for a refused one, what the soak had open at the time."""
    plan, tr = result.plan, result.tr
    details: dict[str, Any] = {
        "outcome": result.verdict.outcome if result.verdict else None,
        "plan": {"start": _short_start(plan.start), "params": _short(plan.params)},
        "transcript": transcript_summary(tr),
        "server_record": soak.record_of(result.request_id) if result.request_id else None,
        "server_log": log_excerpt(log_records, tr, result.request_id),
    }
    if result.verdict is not None and result.verdict.outcome == "refused":
        details["soak_connections_open"] = f"{tr.slots_held} of {soak.s.concurrency}"
        details["slots_released_just_before"] = soak.releases_before(tr.t0)
    return details


def attribute(
    soak: Soak, request_id: str | None, started_at: Any = None
) -> tuple[SessionResult | None, str]:
    """The soak session a server record or log line is about: by request id, else (for
    sessions whose client never learnt the id) by the connection's time, since the server
    records ``started_at`` right after the handshake, on the same clock."""
    if request_id is not None:
        for result in soak.results:
            if result.request_id == request_id:
                return result, "by request id"
        record = soak.record_of(request_id)
        started_at = record.get("started_at") if record else started_at
    if not isinstance(started_at, int | float):
        return None, ""
    candidates = [
        r
        for r in soak.results
        if r.request_id is None and r.tr.connected_at is not None and r.tr.t0 <= started_at
    ]
    best = min(candidates, key=lambda r: abs((r.tr.connected_at or 0.0) - started_at), default=None)
    if best is None or abs((best.tr.connected_at or 0.0) - started_at) > 0.5:
        return None, ""
    return best, "by connection time (the client never learnt the request id)"


def sessions_at(soak: Soak, wall: float, margin: float = 0.05, limit: int = 8) -> list[str]:
    """The soak's sessions whose connection was open at a wall-clock time (for a log
    record that names no session), those that ended nearest to it first."""
    found: list[tuple[float, str]] = []
    for result in soak.results:
        tr = result.tr
        end = tr.wall0 + ((tr.ended_at or now()) - tr.t0)
        if tr.wall0 - margin <= wall <= end + margin:
            text = f"session {result.plan.index} {result.plan.label}: "
            text += " | ".join(transcript_summary(tr, limit=6))
            found.append((abs(end - wall), text))
    return [text for _, text in sorted(found)[:limit]]


def judge_sessions(
    soak: Soak,
    log_records: Sequence[LogRecord],
    timing: Timing,
    expected_errors: Sequence[str] = (),
) -> tuple[list[Violation], dict[str, Any]]:
    """Every session's checks, the server's records and log (``expected_errors``: ERROR
    messages the run provokes, see `log_problems`): violations and per-kind counts."""
    violations: list[Violation] = []
    kinds: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    warmup: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    server_side: dict[str, Counter[str]] = {kind: Counter() for kind in KINDS}
    for result in soak.results:  # the batched part's kinds besides the mix's
        for counts in (kinds, warmup, server_side):
            counts.setdefault(result.plan.kind, Counter())
    timings: dict[str, list[float]] = {}
    inputs: Counter[str] = Counter()
    for result in soak.results:
        plan, tr = result.plan, result.tr
        if plan.kind == "input_video":
            inputs["sessions"] += 1
            inputs.update(input_totals(tr))
        record = soak.record_of(result.request_id) if result.request_id else None
        done_at = record.get("stream_closed_at") if record is not None else None
        done_at = done_at if isinstance(done_at, int | float) else None
        verdict = check_transcript(plan, tr, timing, engine_done_at=done_at)
        problems = list(verdict.problems)
        known = record is not None or soak.metrics_failures == 0
        judged = verdict.outcome not in ("refused", "incomplete") and not tr.cut_by_deadline
        if result.request_id is not None and judged and known:
            problems += check_server_record(plan, tr, record, timing)
            problems += check_health(plan, tr, record, soak.health)
        result.verdict = Verdict(verdict.outcome, problems)
        (warmup if plan.warmup else kinds)[plan.kind][verdict.outcome] += 1
        if record is not None and not plan.warmup:
            code = record.get("error_code")
            server_side[plan.kind][f"{record.get('outcome')}" + (f":{code}" if code else "")] += 1
        for name, value in session_timings(result, record).items():
            timings.setdefault(name, []).append(value)
        for problem in problems:
            violations.append(_session_violation(soak, result, problem, log_records))

    # What the server says went wrong inside, whichever session it was.
    covered: set[str] = set()
    for record in check_server_records(soak.records.values()):
        request_id = record.get("request_id")
        attributed, how = attribute(soak, request_id, record.get("started_at"))
        what = f"server recorded an internal_error: {record.get('error_message')}"
        if request_id:
            covered.add(request_id)
        violations.append(_server_violation(soak, attributed, how, what, record, log_records))
    expected_ids = {
        r.request_id for r in soak.results if r.plan.kind == "engine_fail" and r.request_id
    }
    for log_record in log_problems(log_records, expected_ids, expected_errors):
        request_ids = REQUEST_ID.findall(log_record.text)
        if request_ids and set(request_ids) <= covered:
            continue
        attributed, how = attribute(soak, request_ids[0] if request_ids else None)
        what = f"server log: {log_record.level} {log_record.lines[0].split(': ', 1)[-1][:200]}"
        violation = _server_violation(soak, attributed, how, what, None, log_records)
        violation.details["server_log"] = list(log_record.lines[:40])
        if attributed is None and log_record.wall is not None:
            violation.details["sessions_open_at_the_time"] = sessions_at(soak, log_record.wall)
        violations.append(violation)

    def table(counts: dict[str, Counter[str]]) -> dict[str, Any]:
        return {
            kind: {"count": sum(outcomes.values()), "outcomes": dict(outcomes.most_common())}
            for kind, outcomes in counts.items()
            if outcomes
        }

    per_kind = table(kinds)
    for kind, outcomes in server_side.items():
        if kind in per_kind and outcomes:
            per_kind[kind]["server_outcomes"] = dict(outcomes.most_common())
    return violations, {
        "kinds": per_kind,
        "warmup_kinds": table(warmup),
        "timings_s": {name: summarize(values) for name, values in sorted(timings.items())},
        "input_video": dict(inputs),
    }


def session_timings(result: SessionResult, record: dict[str, Any] | None) -> dict[str, float]:
    """How long the server took to react, per kind (seconds): reported, so that the
    margins of the timing checks can be judged from a run."""
    plan, tr = result.plan, result.tr
    received = tr.received()
    out: dict[str, float] = {}
    if tr.released_after is not None:
        out[f"release_after_{tr.abandoned or 'eof'}"] = tr.released_after
    last = received[-1].t if received else None
    if plan.kind == "no_start" and last is not None and tr.connected_at is not None:
        out["start_timeout_error"] = last - tr.connected_at
    if plan.kind in ("engine_hang", "held") and last is not None and len(received) > 1:
        progress = [e.t for e in received[:-1] if e.text is None or '"video.start"' in e.text]
        if progress:
            out[f"{'hang' if plan.kind == 'engine_hang' else 'held'}_stall_error"] = (
                last - progress[-1]
            )
    if plan.kind == "engine_stuck":
        messages = read_messages(tr)
        if messages.messages and messages.last_progress is not None:
            error_at = messages.messages[-1][0]
            out["stuck_stall_error"] = error_at - messages.last_progress
            closed = record.get("stream_closed_at") if record is not None else None
            if isinstance(closed, int | float):
                out["stuck_error_before_return"] = closed - error_at
    if plan.kind == "stop" and last is not None:
        stops = [e.t for e in tr.sent() if e.label == "session.stop" and e.delivered]
        if stops and last >= stops[0]:
            out["stop_to_terminal"] = last - stops[0]
    if plan.kind == "stopped_reader" and record is not None and tr.abandoned_at is not None:
        closed = record.get("stream_closed_at")
        if isinstance(closed, int | float):
            out["stopped_reader_abort"] = closed - tr.abandoned_at
            if tr.queue_full_at is not None:
                out["stopped_reader_abort_after_queue_full"] = closed - tr.queue_full_at
    if plan.kind in ("fin", "rst", "close") and record is not None and tr.abandoned_at:
        closed = record.get("stream_closed_at")
        if isinstance(closed, int | float):
            out[f"{plan.kind}_to_stream_closed"] = closed - tr.abandoned_at
    return out


def health_summary(soak: Soak) -> dict[str, Any]:
    """The ``GET /health`` answers of the run, counted (``degraded``: while engine calls
    left by their sessions still ran, an ``engine_stuck`` session's block among them),
    the most stuck calls it reported at once, and the last answer."""
    counts: Counter[str] = Counter()
    for sample in soak.health:
        if sample.status is None:
            counts["no answer"] += 1
        else:
            counts[f"{sample.status} {sample.body.split(':', 1)[0].strip()}"] += 1
    last = soak.settled_health
    return {
        "answers": dict(counts.most_common()),
        "peak_stuck_calls": peak_stuck_calls(soak.health),
        "at_the_end": None if last is None else f"{last.status} {last.body}",
    }


def _session_violation(
    soak: Soak, result: SessionResult, what: str, log_records: Sequence[LogRecord]
) -> Violation:
    plan = result.plan
    return Violation(
        what=what,
        session=plan.index,
        kind=plan.label + (" (warm-up)" if plan.warmup else ""),
        request_id=result.request_id,
        details=session_details(soak, result, log_records),
    )


def _server_violation(
    soak: Soak,
    result: SessionResult | None,
    how: str,
    what: str,
    record: dict[str, Any] | None,
    log_records: Sequence[LogRecord],
) -> Violation:
    request_id = record.get("request_id") if record else None
    if result is None:
        lines = [
            line for r in log_records if request_id and request_id in r.text for line in r.lines
        ]
        return Violation(
            what, request_id=request_id, details={"server_record": record, "server_log": lines}
        )
    violation = _session_violation(soak, result, what, log_records)
    violation.details["attributed"] = how
    if record is not None:
        violation.details["server_record"] = record
        if request_id:
            lines = [line for r in log_records if request_id in r.text for line in r.lines[:40]]
            violation.details["server_log"] = lines[:40]
    return attrs.evolve(violation, request_id=request_id or violation.request_id)


def _short(params: dict[str, Any]) -> dict[str, Any]:
    """Plan parameters for the report, long payloads cut."""
    out: dict[str, Any] = {}
    for key, value in params.items():
        if isinstance(value, str) and len(value) > 200:
            out[key] = value[:60] + f"... ({len(value)} chars)"
        elif isinstance(value, list):
            out[key] = [_short(v) if isinstance(v, dict) else v for v in value][:20]
        elif isinstance(value, dict):
            out[key] = _short(value)
        else:
            out[key] = value
    return out


def _short_start(start: dict[str, Any] | None) -> dict[str, Any] | None:
    return _short(start) if start is not None else None


def render_summary(report: dict[str, Any]) -> str:
    """The human-readable end of a run: per-kind counts, resources, violations."""
    lines = []
    kinds = report.get("kinds") or {}
    for kind, info in kinds.items():
        outcomes = ", ".join(f"{k} {v}" for k, v in info["outcomes"].items())
        lines.append(f"  {kind:18} {info['count']:5}  {outcomes}")
    inputs = report.get("input_video") or {}
    if inputs:
        lines.append(
            f"  input video: {inputs.get('sessions', 0)} sessions (warm-up included), "
            f"{inputs.get('sent', 0)} frames sent: {inputs.get('used', 0)} used, "
            f"{inputs.get('dropped', 0)} dropped; {inputs.get('reused', 0)} output frames "
            f"without a frame of their own"
        )
    lines += _resources_line("server", report)
    health = report.get("health")
    if health:
        answers = ", ".join(f"{k} x{v}" for k, v in health["answers"].items())
        lines.append(
            f"  /health: {answers}; at most {health['peak_stuck_calls']} call(s) stuck at once; "
            f"at the end {health['at_the_end']}"
        )
    server = report.get("server") or {}
    lines.append(
        f"  SIGTERM: exit status {server.get('exit_status')} after {server.get('exit_s')} s"
    )
    lines += batched_lines(report.get("batched"))
    lines += [f"  {round_line(info)}" for info in report.get("shutdown_rounds") or []]
    for violation in report.get("violations", [])[:50]:
        where = f"session {violation['session']} {violation['kind']}"
        if violation["session"] is None:
            where = violation["kind"]  # "server", or a shutdown round
        lines.append(f"  VIOLATION [{where}] {violation['what']}")
    if len(report.get("violations", [])) > 50:
        lines.append(f"  ... {len(report['violations']) - 50} more in the JSON report")
    sessions = report.get("sessions") or {}
    verdict = "PASS" if report.get("passed") else "FAIL"
    lines.append(
        f"soak {verdict}: {sessions.get('measured', 0)} sessions (+{sessions.get('warmup', 0)} "
        f"warm-up), seed {report['settings']['seed']}, concurrency "
        f"{report['settings']['concurrency']}, {report.get('duration_s')} s: "
        f"{report.get('violation_count')} violation(s)"
    )
    return "\n".join(lines)


def round_line(info: dict[str, Any]) -> str:
    """A shutdown round in one line: its engine and sessions, the signals and when they
    went, how the server exited and how the clients' sessions ended."""
    when = {"streaming": "streaming", "taken": "the last was logged", "sent": "the last was sent"}
    signals = [
        f"{step['name']} {step['delay_s']:g} s after {when[step['after']]}"
        for step in info["signals"]
    ]
    clients = ", ".join(f"{ending} x{count}" for ending, count in info["clients"].items())
    status = "killed" if info["killed"] else f"exit {info['exit_status']}"
    if info["exit_status"] is None:
        status = "no exit seen"
    count = info["sessions"]
    stuck = f", {info['stuck']} stuck" if info.get("stuck") else ""
    return (
        f"shutdown round {info['index']} {info['kind']} ({info['engine']}, {count} "
        f"session{'' if count == 1 else 's'}{stuck}): {'; '.join(signals)}: {status} after "
        f"{info['exit_s']} s; clients: {clients or 'none'}"
    )


def batched_lines(batched: dict[str, Any] | None) -> list[str]:
    """The batched part in the summary: its sessions, each wedge round, its server."""
    if not batched:
        return []
    sessions = batched.get("sessions") or {}
    kinds = batched.get("kinds") or {}
    outcomes = "; ".join(
        f"{kind} " + ", ".join(f"{k} {v}" for k, v in info["outcomes"].items())
        for kind, info in kinds.items()
    )
    batches = batched.get("batches") or {}
    rows = f"{batches.get('batch_rows')} rows in {batches.get('batches')} batched steps"
    lines = [
        f"  batched: {sessions.get('batched', 0)} sessions (+{sessions.get('warmup', 0)} warm-up) "
        f"4 at a time, {sessions.get('held', 0)} held, {sessions.get('after_wedge', 0)} after "
        f"wedges: {outcomes or 'none'}; {rows}"
    ]
    for info in batched.get("wedge_rounds") or []:
        held = ", ".join(f"{k} x{v}" for k, v in info["held"].items())
        after = ", ".join(f"{k} x{v}" for k, v in info["after"].items())
        wedged = "never 503"
        if info["health_wedged"]:
            answer = info["health_wedged"].split(":", 1)[0]
            wedged = f"{answer} {info['wedged_after_s']} s after the held sessions' end"
        upgrade = (info["upgrade"] or "not tried").split(":", 1)[0]
        recovered = "never 200 ok"
        if info["recovered_after_s"] is not None:
            recovered = f"200 ok {info['recovered_after_s']} s after the release"
        lines.append(
            f"  wedge round {info['index']}: held {held or 'none'}; /health {wedged}; "
            f"upgrade {upgrade}; {recovered}; then {after or 'none'}"
        )
    lines += _resources_line("batched server", batched)
    server = batched.get("server") or {}
    lines.append(
        f"  batched server SIGTERM: exit status {server.get('exit_status')} after "
        f"{server.get('exit_s')} s"
    )
    return lines


def _resources_line(server: str, report: dict[str, Any]) -> list[str]:
    """A summary line of ``server``'s threads, fds and RSS, baseline -> final (none when
    either was not measured)."""
    resources = report.get("resources") or {}
    base, final = resources.get("baseline"), resources.get("final")
    if not (base and final):
        return []
    return [
        f"  {server}: threads {base['threads']} -> {final['threads']}, fds {base['fds']} -> "
        f"{final['fds']}, RSS {base['rss_mib']} -> {final['rss_mib']} MiB"
    ]
