"""``python bench/fuzz.py``: generate the inputs, start the server, send, check,
shrink, stop it with SIGTERM; print the summary, write the JSON report.

Exit status: 0 no violation; 1 violations; 2 usage error; 3 the run could not finish.
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import attrs
import trio

from bench._fuzz.client import (
    HarnessError,
)
from bench._fuzz.oracle import (
    Problem,
)
from bench._fuzz.report import (
    build_report,
    print_summary,
)
from bench._fuzz.runner import (
    Minimal,
    Options,
    Run,
    Violation,
    check_released,
    control_phase,
    shrink_phase,
    start_phase,
)
from bench._fuzz.serverlog import (
    is_failure,
    log_causes,
)
from bench._fuzz.settings import (
    progress,
    server_command,
)
from bench._fuzz.strategies import (
    control_inputs,
    draw_inputs,
    start_inputs,
)
from bench._harness import read_log
from bench._server import Endpoint, ServerProcess
from trio_vstream import protocol


async def fuzz(options: Options) -> tuple[dict[str, Any], int]:
    """Generate, send, check, shrink; the report and the exit status."""
    began = trio.current_time()
    deadline = began + options.time_limit
    timings: dict[str, float] = {}
    n_start = options.inputs // 2
    start_items = draw_inputs(start_inputs(options.limits), n_start, options.seed)
    control_items = draw_inputs(
        control_inputs(options.limits), options.inputs - n_start, options.seed + 1
    )
    timings["generate"] = trio.current_time() - began
    progress(
        f"generated {len(start_items)} start and {len(control_items)} control inputs "
        f"in {timings['generate']:.1f} s"
    )

    log_path = (
        options.log_path or Path(tempfile.mkdtemp(prefix="trio-vstream-fuzz-")) / "server.log"
    )
    server = ServerProcess(server_command(options.limits, options.server_args), log_path)
    try:
        url = await server.start(timeout=60)
    except RuntimeError as exc:
        await server.stop(grace=5)
        raise HarnessError(f"the server did not start: {exc}") from None
    run = Run(options, server, url, Endpoint.parse(url), start_items, control_items)
    run.progress_every = max(100, options.inputs // 10)
    complete = False
    exit_status: int | None = None
    minimal: dict[str, Minimal] = {}
    try:
        reserve = min(options.shrink_time, options.time_limit / 4) + 10
        fuzz_began = trio.current_time()
        with run.abort_scope, trio.move_on_at(deadline - reserve) as limit:
            async with trio.open_nursery() as nursery:
                nursery.start_soon(start_phase, run)
                nursery.start_soon(control_phase, run)
        timings["send"] = trio.current_time() - fuzz_began
        complete = not limit.cancelled_caught and not run.crashed
        if limit.cancelled_caught:
            progress("time limit reached: the run is incomplete")
        if not run.crashed and await run.check_health():
            await check_released(run)
        causes = log_causes(read_log(server.log_path))
        for violation in run.violations:
            if is_failure(violation.problem.key):
                violation.cause = causes.get(violation.request_id or "")
        shrink_began = trio.current_time()
        if run.violations and not run.crashed:
            minimal = await shrink_phase(
                run, min(deadline - 10, shrink_began + options.shrink_time)
            )
        timings["shrink"] = trio.current_time() - shrink_began
    finally:
        exit_status = await server.stop(grace=5)
    if exit_status != 0 and not run.crashed:
        run.violate(Violation("server", Problem("server-exit-status", f"SIGTERM -> {exit_status}")))
    timings["total"] = trio.current_time() - began
    report = build_report(run, minimal, timings, complete, exit_status)
    status = 1 if run.violations else (0 if complete else 3)
    return report, status


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python bench/fuzz.py",
        description="Hypothesis fuzz of session.start and control messages against a real "
        "trio_vstream server (exit status: 0 clean, 1 violations, 3 incomplete).",
    )
    parser.add_argument(
        "--inputs",
        type=int,
        default=2000,
        help="inputs in all, half of them session.start (default %(default)s)",
    )
    parser.add_argument(
        "--seed",
        type=int,
        default=0,
        help="Hypothesis seed: the same seed, the same inputs (default %(default)s)",
    )
    parser.add_argument("--json", type=Path, default=None, help="write the report here as JSON")
    parser.add_argument(
        "--time-limit",
        type=float,
        default=900.0,
        help="seconds for the whole run, shrinking included (default %(default)s)",
    )
    parser.add_argument(
        "--shrink-time",
        type=float,
        default=60.0,
        help="seconds for shrinking the violations found (default %(default)s)",
    )
    parser.add_argument(
        "--workers",
        type=int,
        default=4,
        help="concurrent session.start connections (default %(default)s)",
    )
    parser.add_argument(
        "--max-start-bytes",
        type=int,
        default=protocol.DEFAULT_LIMITS.max_start_bytes,
        help="the server's limit, passed to it and aimed at (default %(default)s)",
    )
    parser.add_argument(
        "--max-control-bytes",
        type=int,
        default=protocol.DEFAULT_LIMITS.max_control_bytes,
        help="the server's limit, passed to it and aimed at (default %(default)s)",
    )
    parser.add_argument(
        "--server-log",
        type=Path,
        default=None,
        help="where the server's log goes (default: a temporary directory)",
    )
    parser.add_argument(
        "--server-arg",
        action="append",
        default=[],
        metavar="ARG",
        help="extra argument for the server command line (repeatable)",
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.inputs < 2 or args.workers < 1 or args.time_limit <= 0:
        build_parser().error("--inputs must be >= 2, --workers >= 1, --time-limit > 0")
    limits = attrs.evolve(
        protocol.DEFAULT_LIMITS,
        max_start_bytes=args.max_start_bytes,
        max_control_bytes=args.max_control_bytes,
    )
    options = Options(
        inputs=args.inputs,
        seed=args.seed,
        time_limit=args.time_limit,
        shrink_time=args.shrink_time,
        workers=args.workers,
        limits=limits,
        server_args=tuple(args.server_arg),
        log_path=args.server_log,
    )
    began = time.monotonic()
    try:
        report, status = trio.run(fuzz, options)
    except HarnessError as exc:
        print(f"fuzz: {exc}", file=sys.stderr)
        return 3
    report["timings_s"]["wall"] = round(time.monotonic() - began, 2)
    print_summary(report)
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
    return status
