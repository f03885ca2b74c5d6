"""The fuzz's report: the JSON (bounded: an oversize input is megabytes) and the
summary printed at the end, each violation with its minimal input and server log."""

from __future__ import annotations

import sys
from collections import Counter
from collections.abc import Sequence
from typing import Any

import attrs

from bench._fuzz.oracle import (
    shorten,
)
from bench._fuzz.runner import (
    LATE_REFUSALS,
    Minimal,
    Run,
    Violation,
)
from bench._fuzz.serverlog import (
    log_exceptions,
)
from bench._fuzz.wire import (
    Wire,
    wire_size,
)
from bench._harness import read_log


def describe_wire(wire: Wire, limit: int = 600) -> dict[str, Any]:
    """A message for the JSON report (bounded: an oversize input is megabytes)."""
    if isinstance(wire, bytes):
        shown = wire[:limit]
        return {
            "frame": "binary",
            "bytes": len(wire),
            "hex": shown.hex(),
            "truncated": len(wire) > limit,
        }
    return {
        "frame": "text",
        "bytes": wire_size(wire),
        "text": wire[:limit],
        "truncated": len(wire) > limit,
    }


def describe_messages(messages: Sequence[Wire], limit: int = 12) -> list[Any]:
    shown: list[Any] = []
    for raw in messages[:limit]:
        if isinstance(raw, bytes):
            shown.append(f"<binary {len(raw)} bytes>")
        else:
            shown.append(shorten(raw, 600))
    if len(messages) > limit:
        shown.append(f"... {len(messages) - limit} more")
    return shown


def build_report(
    run: Run,
    minimal: dict[str, Minimal],
    timings: dict[str, float],
    complete: bool,
    exit_status: int | None,
) -> dict[str, Any]:
    """The run as JSON: outcomes and coded errors counted, each kind of violation once
    with its first occurrence and its minimal reproduction."""
    server_log = read_log(run.server.log_path)
    groups: dict[str, list[Violation]] = {}
    for violation in run.violations:
        groups.setdefault(violation.signature, []).append(violation)
    violations = []
    for signature, group in groups.items():
        first = group[0]
        entry: dict[str, Any] = {
            "signature": signature,
            "count": len(group),
            "detail": first.problem.detail,
            "first": {
                "index": first.index,
                "input": describe_wire(first.input.wire) if first.input else None,
                "kind": first.input.kind if first.input else None,
                "replies": describe_messages(first.messages),
                "close_code": first.close_code,
                "request_id": first.request_id,
                "suspects": first.candidates,
            },
        }
        found = minimal.get(signature)
        if found is not None:
            entry["minimal"] = {
                "input": describe_wire(found.input.wire) if found.input else None,
                "tries": found.tries,
                "replies": describe_messages(found.messages),
                "close_code": found.close_code,
                "request_id": found.request_id,
                "server_log": found.log,
                "note": found.note,
            }
        violations.append(entry)
    accepted = {
        "start": run.outcomes["start"]["accepted"],
        "control": sum(run.outcomes["control"][k] for k in ("pong", "queued", "stopped")),
    }
    errors: Counter[str] = Counter()
    for counter in run.outcomes.values():
        for outcome, count in counter.items():
            if outcome.startswith("error:"):
                errors[outcome.removeprefix("error:")] += count
    return {
        "seed": run.options.seed,
        "inputs_requested": run.options.inputs,
        "inputs_run": sum(run.done.values()),
        "complete": complete,
        "timings_s": {k: round(v, 2) for k, v in timings.items()},
        "limits": attrs.asdict(run.options.limits),
        "server": {
            "command": run.server.command,
            "log": str(run.server.log_path),
            "exit_status": exit_status,
            "logged_exceptions": dict(log_exceptions(server_log).most_common(20)),
        },
        "accepted": accepted,
        "errors": dict(errors.most_common()),
        "outcomes": {phase: dict(counter.most_common()) for phase, counter in run.outcomes.items()},
        "kinds": dict(sorted(run.kinds.items())),
        "input_video_starts": dict(run.input_video_starts.most_common()),
        "frames": dict(run.frames.most_common()),
        "control_sessions": run.control_sessions,
        "control_retries": run.retries,
        "health_checks": run.health_checks,
        "violation_count": len(run.violations),
        "violations": violations,
    }


def _wire_text(described: dict[str, Any]) -> str:
    if described["frame"] == "binary":
        return f"<binary {described['bytes']} bytes> {described['hex']}"
    return described["text"]


def print_summary(report: dict[str, Any]) -> None:
    out = sys.stdout
    start, control = report["outcomes"]["start"], report["outcomes"]["control"]
    print(
        f"fuzz: seed {report['seed']}: {report['inputs_run']} of "
        f"{report['inputs_requested']} inputs "
        f"({sum(start.values())} session.start, {sum(control.values())} control) in "
        f"{report['timings_s']['total']:.1f} s"
        + ("" if report["complete"] else "  ** INCOMPLETE **"),
        file=out,
    )
    accepted = report["accepted"]
    print(
        f"  accepted: {accepted['start'] + accepted['control']} "
        f"(start: {accepted['start']} video.start; "
        f"control: {control.get('pong', 0)} pong, {control.get('queued', 0)} queued, "
        f"{control.get('stopped', 0)} stopped)",
        file=out,
    )
    errors = ", ".join(f"{code} {count}" for code, count in report["errors"].items()) or "none"
    print(f"  coded errors: {errors}", file=out)
    other = {k: v for phase in (start, control) for k, v in phase.items() if k == "closed-1009"}
    if other:
        print(
            f"  closed 1009 (over twice the size limit, documented): {other['closed-1009']}",
            file=out,
        )
    logged = report["server"]["logged_exceptions"]
    if logged:
        print(f"  server logged {sum(logged.values())} tracebacks:", file=out)
        for line, count in list(logged.items())[:8]:
            print(f"    {count:5d} x {line}", file=out)
    starts = report.get("input_video_starts") or {}
    if starts:
        outcomes = ", ".join(f"{outcome} {count}" for outcome, count in starts.items())
        print(f"  starts with input_video: {sum(starts.values())} ({outcomes})", file=out)
    frames = report.get("frames") or {}
    if frames:
        outcomes = ", ".join(f"{outcome} {count}" for outcome, count in frames.items())
        sent = sum(count for outcome, count in frames.items() if outcome != LATE_REFUSALS)
        print(f"  input frames: {sent} ({outcomes})", file=out)
    print(
        f"  health checks: {report['health_checks']}; "
        f"control sessions: {report['control_sessions']}",
        file=out,
    )
    if not report["violations"]:
        print("  violations: none", file=out)
        return
    print(
        f"  VIOLATIONS: {report['violation_count']} ({len(report['violations'])} kinds)", file=out
    )
    for entry in report["violations"]:
        print(f"  - {entry['signature']} x{entry['count']}: {entry['detail']}", file=out)
        first = entry["first"]
        if first["input"] is not None:
            shown = shorten(ascii(_wire_text(first["input"])), 240)
            print(f"      first: {first['kind']} #{first['index']}: {shown}", file=out)
        found = entry.get("minimal")
        if found is None:
            continue
        if found["note"]:
            print(f"      {found['note']}", file=out)
        if found["input"] is not None:
            shown = found["input"].get("text", found["input"].get("hex"))
            print(f"      minimal ({found['tries']} tries): {shorten(ascii(shown), 400)}", file=out)
            for reply in found["replies"][:4]:
                print(f"        <- {shorten(ascii(reply), 300)}", file=out)
            print(f"        close {found['close_code']}", file=out)
            log = found["server_log"]
            for line in log if len(log) <= 14 else [*log[:1], "...", *log[-12:]]:
                print(f"        log| {line}", file=out)
