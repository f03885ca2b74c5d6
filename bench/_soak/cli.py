"""``python bench/soak.py``: start the server, warm up, take the baseline, run the
sessions, settle, check, stop the server with SIGTERM; then the shutdown rounds (a
server each, two signals); print the summary, write the JSON report, exit 1 on any
violation.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import shlex
import shutil
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from bench._harness import parse_log, read_log
from bench._output import now, progress, read_file
from bench._server import Endpoint, ServerProcess
from bench._soak.batched import run_batched
from bench._soak.health_checks import wedge_problems
from bench._soak.plans import (
    make_plans,
)
from bench._soak.report import (
    Violation,
    health_summary,
    judge_sessions,
    render_summary,
)
from bench._soak.resources import (
    Snapshot,
    idle_problems,
    resource_problems,
)
from bench._soak.runner import Soak
from bench._soak.serverlog import log_summary
from bench._soak.settings import (
    AFTER_WEDGE_SESSIONS,
    BATCHED_MAX_SESSIONS,
    DEFAULT_BATCHED_SESSIONS,
    DEFAULT_SHUTDOWN_ROUNDS,
    DEFAULT_STALL_TIMEOUT,
    DEFAULT_START_TIMEOUT,
    DEFAULT_WEDGE_ROUNDS,
    ENGINE_ARGS,
    FD_GROWTH_LIMIT,
    HELD_SESSIONS,
    KINDS,
    MAX_CONTROL_BYTES,
    MAX_START_BYTES,
    ROUND_BLOCK_S,
    ROUND_ENGINES,
    ROUND_KINDS,
    ROUND_NUM_FRAMES,
    ROUND_SHUTDOWN_GRACE,
    RSS_GROWTH_LIMIT_MIB,
    SETTLE_EXTRA_S,
    STUCK_EXTRA_S,
    STUCK_VARIANTS,
    THREAD_GROWTH_LIMIT,
    Settings,
    Timing,
    server_command,
    stuck_calls_bound,
)
from bench._soak.shutdown import run_rounds
from bench._soak.shutdown_checks import sigterm_problems
from trio_vstream.server.running import IDLE_BEFORE_TRIM


async def run_soak(s: Settings, log_path: Path) -> dict[str, Any]:
    """Start the server, run warm-up and measured sessions, check, stop; then the
    shutdown rounds (their servers' logs beside ``log_path``); the report."""
    started_wall = dt.datetime.now(dt.UTC)
    t_start = now()
    deadline = trio.current_time() + s.total_deadline_s  # Trio's clock, for move_on_at
    timing = s.timing
    # Kept back from the session phases for settling, the final checks, SIGTERM and the
    # shutdown rounds.
    reserve = IDLE_BEFORE_TRIM + SETTLE_EXTRA_S + timing.shutdown_grace + 10.0
    reserve += s.rounds_reserve_s + s.batched_reserve_s
    plans = make_plans(s.seed, s.sessions, s.warmup_sessions, timing)
    warm, measured = plans[: s.warmup_sessions], plans[s.warmup_sessions :]
    violations: list[Violation] = []
    stuck_plans = sum(1 for plan in plans if plan.kind == "engine_stuck")
    command = server_command(s, stuck_plans)
    server = ServerProcess(command, log_path)
    report: dict[str, Any] = {
        "schema": 1,
        "created": started_wall.isoformat(timespec="seconds"),
        "command": shlex.join(["python", *sys.argv]),
        "settings": {
            **attrs.asdict(s),
            "warmup_sessions": s.warmup_sessions,
            "total_deadline_s": s.total_deadline_s,
            "engine_args": dict(ENGINE_ARGS),
            "max_start_bytes": MAX_START_BYTES,
            "max_control_bytes": MAX_CONTROL_BYTES,
            "weights": KINDS,
            "engine_stuck": {
                "variants": list(STUCK_VARIANTS),
                "block_s": {
                    variant: [timing.stuck_block_s(variant, extra) for extra in STUCK_EXTRA_S]
                    for variant in STUCK_VARIANTS
                },
                "round_block_s": ROUND_BLOCK_S,
            },
            "max_stuck_calls": stuck_calls_bound(s.concurrency, stuck_plans),
            "batched": {
                "sessions": s.batched_sessions,
                "wedge_rounds": s.wedge_rounds,
                "max_sessions": BATCHED_MAX_SESSIONS,
                "held_sessions": HELD_SESSIONS,
                "after_wedge_sessions": AFTER_WEDGE_SESSIONS,
                "wedge_bound_s": timing.wedge_bound,
                "recover_bound_s": timing.recover_bound,
            },
            "shutdown_rounds": {
                "kinds": ROUND_KINDS,
                "engines": {name: dict(engine.args) for name, engine in ROUND_ENGINES.items()},
                "num_frames": ROUND_NUM_FRAMES,
                "shutdown_grace": ROUND_SHUTDOWN_GRACE,
            },
        },
        "thresholds": {
            "wedge_s": timing.wedge_bound,
            "recover_s": timing.recover_bound,
            "fd_growth": FD_GROWTH_LIMIT,
            "thread_growth": THREAD_GROWTH_LIMIT,
            "rss_growth_mib": RSS_GROWTH_LIMIT_MIB,
            "settle_s": IDLE_BEFORE_TRIM + SETTLE_EXTRA_S,
            "release_s": {
                "disconnect": timing.release_bound("fin"),
                "stopped_reader": timing.release_bound("stop_reading"),
            },
            "timeout_slack_s": timing.slack,
            "second_signal_exit_s": timing.stop_bound,
        },
        "machine": {
            "cpu_count": os.cpu_count(),
            "loadavg_at_start": read_file("/proc/loadavg").split()[:3],
            "python": sys.version.split()[0],
        },
        "server": {"command": command},
    }
    try:
        url = await server.start(timeout=30)
        endpoint = Endpoint.parse(url)
        if endpoint.host != "127.0.0.1":
            raise RuntimeError(f"the server serves {url}; the soak only talks to 127.0.0.1")
        soak = Soak(s, server, endpoint)
        report["server"].update({"url": url, "pid": server.pid})
        progress(
            f"server {server.pid} at {url}; {len(warm)} warm-up + {len(measured)} sessions, "
            f"concurrency {s.concurrency}, seed {s.seed}, deadline {s.total_deadline_s:.0f} s"
        )
        fresh = Snapshot.take(soak.pid, await soak.fetch_stats())  # nothing else runs yet
        async with trio.open_nursery() as background:
            background.start_soon(soak.poll_metrics)
            background.start_soon(soak.watch.run)
            background.start_soon(soak.report_progress)
            complete = await soak.run_phase(warm, "warm-up", deadline - reserve)
            baseline: Snapshot | None = None
            if complete:
                progress("warm-up done; waiting for the server's idle trim for the baseline")
                baseline, unsettled, waited = await soak.settle(None)
                report["baseline_wait_s"] = round(waited, 1)
                for problem in unsettled:
                    violations.append(Violation(f"after the warm-up: {problem}"))
                phase_start = now()
                complete = await soak.run_phase(measured, "sessions", deadline - reserve)
                report["sessions_s"] = round(now() - phase_start, 1)
            if not complete:
                ran = sum(1 for r in soak.results if not r.tr.cut_by_deadline)
                violations.append(
                    Violation(
                        f"the soak's deadline ({s.total_deadline_s:.0f} s) cut the run short: "
                        f"{ran} of {len(plans)} sessions ran"
                    )
                )
            progress("sessions done; waiting for the server to settle")
            final, unsettled, waited = await soak.settle(baseline)
            report["final_wait_s"] = round(waited, 1)
            background.cancel_scope.cancel()
        if baseline is not None:
            for problem in resource_problems(baseline, final):
                violations.append(Violation(f"at the end: {problem}"))
        else:
            violations += [Violation(f"at the end: {p}") for p in idle_problems(final.metrics)]
        health = soak.settled_health
        if health is None or not health.ok:
            answer = str(health) if health else "nothing"
            violations.append(
                Violation(f"at the end: GET /health answered {answer}, expected 200 ok")
            )
        bound = stuck_calls_bound(s.concurrency, stuck_plans)
        violations += [Violation(problem) for problem in wedge_problems(soak.health, bound)]
        report["health"] = health_summary(soak)
        report["resources"] = {
            "fresh": fresh.to_json(),
            "baseline": baseline.to_json() if baseline else None,
            "final": final.to_json(),
        }
        report["metrics_poll_failures"] = soak.metrics_failures
    finally:
        sigterm_at = now()
        status = await server.stop(grace=timing.shutdown_grace + 10.0)
        exit_s = now() - sigterm_at
        report["server"].update({"exit_status": status, "exit_s": round(exit_s, 2)})
    violations += [Violation(p) for p in sigterm_problems(status, exit_s, timing.shutdown_grace)]

    records = parse_log(read_log(log_path))
    session_violations, stats = judge_sessions(soak, records, timing)
    violations = session_violations + violations
    if s.batched:
        batched_deadline = deadline - s.rounds_reserve_s
        report["batched"], batched_violations = await run_batched(
            s, log_path.parent, batched_deadline
        )
        violations += batched_violations
    rounds, round_violations = await run_rounds(s, log_path.parent, deadline)
    report["shutdown_rounds"] = rounds
    violations += round_violations
    report.update(stats)
    report["server_socket_not_found"] = sum(
        1 for r in soak.results if r.tr.connected_at is not None and r.tr.server_inode is None
    )
    report["server_log"] = {"records": len(records), "warnings_and_errors": log_summary(records)}
    report["sessions"] = {"warmup": len(warm), "measured": len(measured)}
    report["duration_s"] = round(now() - t_start, 1)
    report["violations"] = [v.to_json() for v in violations]
    report["violation_count"] = len(violations)
    report["passed"] = not violations
    return report


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/soak.py",
        description="Soak test: randomized sessions against a server subprocess, checked.",
    )
    add = parser.add_argument
    add("--sessions", type=int, default=1000, help="measured sessions (default 1000)")
    add("--concurrency", type=int, default=8, help="sessions at once = --max-sessions (8)")
    add("--seed", type=int, default=1, help="seed of the mix and every random choice (1)")
    add("--warmup", type=int, default=None, help="warm-up sessions (default 2 x concurrency)")
    add(
        "--deadline",
        type=float,
        default=None,
        help="bound on the whole run in seconds (default 30 + 0.6 per session, >= 90, "
        "+ 15 per shutdown round)",
    )
    add(
        "--shutdown-rounds",
        type=int,
        default=DEFAULT_SHUTDOWN_ROUNDS,
        help=f"after the sessions, servers stopped with two signals (default "
        f"{DEFAULT_SHUTDOWN_ROUNDS}; each starts a server)",
    )
    add(
        "--batched-sessions",
        type=int,
        default=DEFAULT_BATCHED_SESSIONS,
        help=f"sessions on a second server whose engine batches 4 sessions' steps (default "
        f"{DEFAULT_BATCHED_SESSIONS}; with --wedge-rounds 0 too, no such server)",
    )
    add(
        "--wedge-rounds",
        type=int,
        default=DEFAULT_WEDGE_ROUNDS,
        help=f"on that server, rounds in which a held batched step wedges it until released "
        f"(default {DEFAULT_WEDGE_ROUNDS})",
    )
    add("--stall-timeout", type=float, default=DEFAULT_STALL_TIMEOUT, help="(default 1.5)")
    add("--start-timeout", type=float, default=DEFAULT_START_TIMEOUT, help="(default 1.0)")
    add("--json", type=Path, default=None, help="write the report here (and the server log)")
    return parser


def settings_from(args: argparse.Namespace) -> Settings:
    if args.sessions < 1 or args.concurrency < 1:
        raise SystemExit("--sessions and --concurrency must be >= 1")
    if args.shutdown_rounds < 0:
        raise SystemExit("--shutdown-rounds must be >= 0")
    if args.batched_sessions < 0 or args.wedge_rounds < 0:
        raise SystemExit("--batched-sessions and --wedge-rounds must be >= 0")
    timing = Timing(stall_timeout=args.stall_timeout, start_timeout=args.start_timeout)
    return Settings(
        sessions=args.sessions,
        concurrency=args.concurrency,
        seed=args.seed,
        warmup=args.warmup,
        deadline_s=args.deadline,
        shutdown_rounds=args.shutdown_rounds,
        batched_sessions=args.batched_sessions,
        wedge_rounds=args.wedge_rounds,
        timing=timing,
    )


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    settings = settings_from(args)
    with tempfile.TemporaryDirectory(prefix="trio_vstream-soak-") as tmp:
        log_path = Path(tmp) / "server.log"
        try:
            report = trio.run(run_soak, settings, log_path)
        except (KeyboardInterrupt, BaseExceptionGroup) as exc:
            # Inside nurseries, Ctrl-C arrives wrapped in exception groups.
            if isinstance(exc, BaseExceptionGroup):
                interrupts, others = exc.split(KeyboardInterrupt)
                if interrupts is None or others is not None:
                    raise
            progress("interrupted; the server was stopped")
            return 130
        if args.json is not None:
            args.json.parent.mkdir(parents=True, exist_ok=True)
            args.json.write_text(json.dumps(report, indent=1) + "\n")
            kept = args.json.with_suffix(".server.log")
            shutil.copyfile(log_path, kept)
            written = [args.json, kept]
            batched_log = Path(tmp) / "batched.server.log"
            if batched_log.exists():
                written.append(args.json.with_suffix(".batched.server.log"))
                shutil.copyfile(batched_log, written[-1])
            if report.get("shutdown_rounds"):
                written.append(
                    keep_round_logs(Path(tmp), args.json.with_suffix(".rounds.server.log"))
                )
            progress(f"wrote {', '.join(str(path) for path in written)}")
    print(render_summary(report), flush=True)
    return 0 if report["passed"] else 1


def keep_round_logs(log_dir: Path, kept: Path) -> Path:
    """The shutdown rounds' server logs, one after another under a header each."""
    with kept.open("w") as out:
        for path in sorted(log_dir.glob("round-*.server.log"), key=_round_number):
            out.write(f"===== {path.name}\n{read_log(path)}")
    return kept


def _round_number(path: Path) -> int:
    return int(path.name.split("-")[1].split(".")[0])
